"""What decoding one envelope costs: the typed wire (`shared.codec`) against its alternatives.

Every chunk a worker sends is decoded once by a gateway, and every request once by a worker, so
the decoder is on the hot path of every token. Issue #24 chose how envelopes are checked by this
measurement. Each sample envelope (a one-token stream delta, the last chunk of a stream with its
usage, a chat request) is encoded by this tree's codec and decoded, in the same process and run:

- msgpack only: `msgpack.unpackb` into dicts, nothing checked (the floor);
- msgspec, typed (this tree's `shared.codec.decode`): straight into the Struct, every field checked;
- pydantic: `msgpack.unpackb`, then pydantic models mirrored field by field from the same Structs
  (types, bounds, literals) validate the dict: the other way the issue allowed;
- with `--before REF`, the decoder of git revision REF on the same bytes, in a process of its own
  (`git archive`; before issue #24 that was a hand-written `from_wire` checking three fields).

Each figure is the best of `--repeat` timings of `--number` decodes (the least disturbed by
this noisy machine), in microseconds per envelope; the rounds alternate which decoder goes first.

    python -m bench.wire_decode [--number 20000] [--repeat 7] [--before REF]

Progress on stderr; a markdown table on stdout; bench/results/wire_decode.json and .png.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import timeit
from contextlib import ExitStack
from typing import Annotated, Any, Literal, Union

import msgpack
import msgspec
import msgspec.inspect as mi
import pydantic

from bench.common import RESULTS, plot_bars, progress, save, source_tree
from shared import codec
from shared.envelopes import (
    ChunkEnvelope,
    GenerationChunk,
    RequestEnvelope,
    SamplingOptions,
    Usage,
)


def samples() -> dict[str, tuple[type, bytes]]:
    now = time.time()
    delta = ChunkEnvelope("req-0123456789abcdef", 17, [GenerationChunk(text=" token", token_count=1)])
    last = ChunkEnvelope("req-0123456789abcdef", 129, [GenerationChunk(
        text="", finish_reason="stop", done=True, usage=Usage(prompt_tokens=42, completion_tokens=128),
        system_fingerprint="fp-llmfleet", timings={"queued_s": 0.002, "first_token_at": now})])
    request = RequestEnvelope(
        request_id="req-0123456789abcdef", model="tiny", kind="chat", reply_to="replies:gw-1", arrival=now,
        deadline=now + 600, stream=True, tenant="team-a",
        body={"model": "tiny", "messages": [{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "What is a Redis stream?"}],
              "max_tokens": 128, "temperature": 0.7, "stream": True},
        params=SamplingOptions(max_tokens=128, temperature=0.7))
    return {"one-token delta": (ChunkEnvelope, codec.encode(delta)),
            "last chunk with usage": (ChunkEnvelope, codec.encode(last)),
            "chat request": (RequestEnvelope, codec.encode(request))}


# --- pydantic models mirrored from the Structs (msgspec.inspect gives every type and bound) ---

def _bounds(info: mi.Type) -> dict[str, Any]:
    names = ("ge", "le", "gt", "lt", "min_length", "max_length", "pattern")
    return {name: getattr(info, name) for name in names if getattr(info, name, None) is not None}


def _annotation(info: mi.Type, models: dict[type, type[pydantic.BaseModel]]) -> Any:
    simple = {mi.IntType: int, mi.FloatType: float, mi.StrType: str, mi.BoolType: bool, mi.BytesType: bytes}
    if type(info) in simple:
        base = simple[type(info)]
        return Annotated[base, pydantic.Field(**bounds)] if (bounds := _bounds(info)) else base
    if isinstance(info, mi.NoneType):
        return None
    if isinstance(info, mi.AnyType):
        return Any
    if isinstance(info, mi.LiteralType):
        return Literal[info.values]
    if isinstance(info, mi.ListType):
        return list[_annotation(info.item_type, models)]
    if isinstance(info, mi.DictType):
        return dict[_annotation(info.key_type, models), _annotation(info.value_type, models)]
    if isinstance(info, mi.UnionType):
        return Union[tuple(_annotation(t, models) for t in info.types)]  # noqa: UP007 - built at run time
    if isinstance(info, mi.StructType):
        return _model(info, models)
    raise TypeError(f"no pydantic mirror for {info!r}")


def _model(info: mi.StructType, models: dict[type, type[pydantic.BaseModel]]) -> type[pydantic.BaseModel]:
    if info.cls not in models:
        fields = {}
        for field in info.fields:
            annotation = _annotation(field.type, models)
            if field.required:
                fields[field.name] = (annotation, ...)
            elif field.default_factory is not msgspec.NODEFAULT:
                fields[field.name] = (annotation, pydantic.Field(default_factory=field.default_factory))
            else:
                fields[field.name] = (annotation, field.default)
        models[info.cls] = pydantic.create_model(f"Mirror{info.cls.__name__}", **fields)
    return models[info.cls]


def pydantic_mirror(kind: type) -> type[pydantic.BaseModel]:
    return _model(mi.type_info(kind), {})


# --- the decoder of an earlier revision, in a process of its own ---

_BEFORE = """
import json, sys, timeit, msgpack
from shared import codec, envelopes
cases, number, repeat = msgpack.unpackb(sys.stdin.buffer.read())
out = {}
for name, kind, data in cases:
    kind = getattr(envelopes, kind)
    codec.decode(kind, data)  # decodes at all
    out[name] = min(timeit.repeat(lambda: codec.decode(kind, data), number=number, repeat=repeat)) / number * 1e6
print(json.dumps(out))
"""


def before_times(ref: str, cases: dict[str, tuple[type, bytes]], number: int, repeat: int) -> dict[str, float]:
    with ExitStack() as stack:
        directory = stack.enter_context(source_tree(ref))
        payload = msgpack.packb([[[name, kind.__name__, data] for name, (kind, data) in cases.items()], number, repeat],
                                use_bin_type=True)
        done = subprocess.run([sys.executable, "-c", _BEFORE], input=payload, cwd=directory, capture_output=True,
                              env={"PYTHONPATH": directory, "PATH": "/usr/bin:/bin"}, check=True)
        return json.loads(done.stdout)


def _within(part: Any, whole: Any) -> bool:
    """`part` (defaults left out) agrees with `whole` (every field)."""
    if isinstance(part, dict):
        return isinstance(whole, dict) and all(k in whole and _within(v, whole[k]) for k, v in part.items())
    if isinstance(part, list):
        return isinstance(whole, list) and len(part) == len(whole) and all(map(_within, part, whole))
    return part == whole


def run(number: int, repeat: int, rounds: int, before: str | None) -> dict:
    cases = samples()
    mirrors = {kind: pydantic_mirror(kind) for kind, _ in cases.values()}
    decoders = {
        "msgpack only": lambda kind, data: msgpack.unpackb(data, raw=False, strict_map_key=False),
        "msgspec typed": codec.decode,
        "pydantic": lambda kind, data: mirrors[kind].model_validate(
            msgpack.unpackb(data, raw=False, strict_map_key=False)),
    }
    for name, (kind, data) in cases.items():  # the mirror reads what the codec reads
        typed = msgspec.to_builtins(codec.decode(kind, data))
        assert _within(typed, decoders["pydantic"](kind, data).model_dump(mode="json")), name
    best: dict[str, dict[str, float]] = {decoder: {} for decoder in decoders}
    steps = rounds * len(decoders) * len(cases)
    done = 0
    for round_ in range(rounds):
        order = list(decoders) if round_ % 2 == 0 else list(decoders)[::-1]
        for decoder in order:
            for name, (kind, data) in cases.items():
                seconds = min(timeit.repeat(lambda: decoders[decoder](kind, data), number=number, repeat=repeat))
                micros = seconds / number * 1e6
                best[decoder][name] = min(best[decoder].get(name, micros), micros)
                done += 1
                progress("wire decode", done, steps)
    if before:
        progress(f"decoder of {before}", 0, 1)
        best[f"before ({before})"] = before_times(before, cases, number, repeat)
        progress(f"decoder of {before}", 1, 1)
    return {"number": number, "repeat": repeat, "rounds": rounds, "before": before,
            "bytes": {name: len(data) for name, (_, data) in cases.items()}, "micros": best}


def table(result: dict) -> str:
    decoders = list(result["micros"])
    typed = result["micros"]["msgspec typed"]
    lines = ["| envelope | bytes | " + " | ".join(f"{d} (µs)" for d in decoders) + " |",
             "|---|---:|" + "---:|" * len(decoders)]
    for name, size in result["bytes"].items():
        cells = []
        for decoder in decoders:
            micros = result["micros"][decoder][name]
            ratio = "" if decoder == "msgspec typed" else f" ({micros / typed[name]:.1f}x)"
            cells.append(f"{micros:.2f}{ratio}")
        lines.append(f"| {name} | {size} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: dict) -> None:
    decoders = list(result["micros"])
    panels = {f"{name} (µs)": [result["micros"][d][name] for d in decoders] for name in result["bytes"]}
    plot_bars(RESULTS.parent.parent / "docs" / "wire_decode.png", decoders, panels)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--number", type=int, default=20000, help="decodes per timing")
    parser.add_argument("--repeat", type=int, default=7, help="timings per round; the best counts")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, alternating the decoders' order")
    parser.add_argument("--before", help="also time the decoder of this git revision on the same bytes")
    parser.add_argument("--quick", action="store_true", help="a smoke run (fewer decodes)")
    args = parser.parse_args(argv)
    if args.quick:
        args.number, args.repeat, args.rounds = 2000, 3, 1
    return save("wire_decode", run(args.number, args.repeat, args.rounds, args.before), plot, table)


if __name__ == "__main__":
    main()
