"""The worker's plain streams (no parser, logprobs, echo or token ids) are made from the engine's
outputs without vLLM's OpenAI JSON (`_Plain`, worker/adapters/vllm.py): they must say what vLLM's
own stream handler says: each choice's text and tokens, finish and stop reasons, one first token,
the prompt's size on the first delta, the ending's usage (with the prefix cache's counts) and the
fingerprint."""

from __future__ import annotations

import json

import pytest

from tests.plain_streams import CASES

pytestmark = pytest.mark.vllm


def _answer(chunks: list) -> dict:
    """What a stream says, whatever its chunk boundaries (the engine merges the outputs its reader
    has not taken yet, so one run's deltas may be cut otherwise than another's)."""
    *deltas, terminal = chunks
    choices = {}
    for index, text, reasoning, finish, stop, tokens, first, usage, fingerprint, _done, _error, ids in deltas:
        choice = choices.setdefault(index, {"text": "", "reasoning": "", "tokens": 0, "ends": [], "fingerprints": [],
                                            "ids": [], "with_ids": set()})
        choice["text"] += text or ""
        choice["reasoning"] += reasoning
        choice["tokens"] += tokens
        choice["ids"] += ids or []
        choice["with_ids"].add(ids is not None)
        if finish or stop or fingerprint:
            choice["ends"].append([finish, stop, fingerprint])
    firsts = [chunk for chunk in deltas if chunk[6]]
    return {"choices": choices, "terminal": terminal, "first_usage": deltas[0][7] if deltas else None,
            "first_tokens": len(firsts), "usage_once": sum(chunk[7] is not None for chunk in deltas) == 1}


def test_plain_streams_are_what_vllms_stream_handler_gives(plain_streams_run):
    ran = plain_streams_run.result(timeout=480)
    assert ran.returncode == 0, ran.stderr[-3000:]
    result = json.loads(ran.stdout.strip().splitlines()[-1])
    assert result["plain_used"] == len(CASES)  # every case took the plain path
    for (kind, body), plain, handled in zip(CASES, result["plain"], result["handled"], strict=True):
        assert _answer(plain) == _answer(handled), (kind, body)
        assert plain[-1][9] and plain[-1][10] is None, (kind, body)  # it ended, without an error
        # A stream another worker can continue sends the engine's tokens of each delta: all of them
        # (the same tokens both ways, above); a seeded sample (replayed instead) and a completion of
        # token ids (not continued) send none.
        continues = "seed" not in body and (kind == "chat" or isinstance(body["prompt"], str))
        for choice in _answer(plain)["choices"].values():
            if not continues:
                assert choice["with_ids"] == {False}, (kind, body)
            else:
                assert len(choice["ids"]) == choice["tokens"] > 0 and choice["with_ids"] == {True}, (kind, body)
