"""A model-free adapter that generates deterministic text, for tests and gateway benchmarks.

The script: the words of the prompt (the last user message for chat) repeated in order, one
word per token, until `max_tokens` (16 when unset) or a stop string. Prompt tokens are the
words of every message. With n > 1 every choice gets the same words, prefixed by its number
among its prompt's choices ("1:hello") when that is not 0, so choices are told apart. A
completion with several prompts answers each, its n choices at indexes prompt * n + choice.

Continuations, as a takeover asks for them: as vLLM's worker does, it sends with each delta of a
stream a takeover continues the engine's tokens (`output_ids`; a word's token is its place in the
script), and goes on after such tokens (`prefix_ids`). A chat request that continues a final
assistant message (`continue_final_message`) goes on with the script after that message's words.
With `engine_tokens` off it sends no tokens, so that its streams are continued from their text or
replayed, as those of an engine that cannot give them. A continued choice's words come without
its number.
Media content parts (images, audio) are not read. Pacing options make a run slow
to start or slow to stream, so tests can cancel or kill it at a chosen point. With a
`stream_interval` of N, as vLLM's `--stream-interval`, a choice's first token is sent at once and
then N tokens at a time (and whatever is left when it finishes), each when its last token is due
(a stop string ends its group when the group is generated, at the start of its interval).

With `prefill_per_token`, the engine simulates a prefix cache: it remembers the blocks of 16
tokens (words) it has seen, of the prompt and of the first choice's answer once it ends, as
vLLM's prefix caching keeps a sequence's full blocks, and before the first token waits that long
for each prompt token not found there, one prefill at a time (prefill is the engine's compute,
which its requests share); usage reports the cached tokens. The cache holds `cache_blocks` blocks,
the least recently used going first, as a KV cache of that size would. So the benefit of sending a
conversation back to its worker can be measured without an engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from shared.envelopes import GenerationChunk, RequestEnvelope, Usage
from shared.errors import InvalidRequest
from worker.adapters.base import GenerationAdapter

DEFAULT_MAX_TOKENS = 16
BLOCK_TOKENS = 16  # vLLM's default block size
CACHE_BLOCKS = 100_000  # blocks the simulated cache holds; the least recently used go first


class PrefixCache:
    """Blocks of prompt tokens seen before, each named by a digest of every token up to its end."""

    def __init__(self, max_blocks: int = CACHE_BLOCKS):
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def lookup_and_insert(self, tokens: list[str]) -> int:
        """How many leading tokens were cached; the prompt's whole blocks are cached from now on."""
        cached, digest, hit = 0, b"", True
        for start in range(0, len(tokens) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
            digest = hashlib.blake2b(digest + " ".join(tokens[start:start + BLOCK_TOKENS]).encode(),
                                     digest_size=16).digest()
            if hit and digest in self._blocks:
                cached += BLOCK_TOKENS
                self._blocks.move_to_end(digest)
            else:
                hit = False
                self._blocks[digest] = None
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)
        return cached


def every_prompt_word(request: RequestEnvelope) -> list[str]:
    """Every word of the prompt, in order: of every message for chat, of every prompt for completion."""
    if request.kind == "chat":
        return [word for m in request.body.get("messages") or () for word in message_text(m).split()]
    return [word for prompt in request.prompts for word in _prompt_words(prompt)[0]]


def script_words(request: RequestEnvelope) -> list[tuple[list[str], int]]:
    """For each prompt, the words to repeat and the prompt's token count."""
    if request.kind == "chat":
        messages = request.body.get("messages") or ()
        texts = [message_text(m) for m in messages]
        user_texts = [message_text(m) for m in messages if m.get("role") == "user"]
        words = (user_texts[-1] if user_texts else "").split()
        prompt_tokens = sum(len(t.split()) for t in texts)
        return [(words or ["ok"], prompt_tokens)]
    return [_prompt_words(prompt) for prompt in request.prompts]


def words_written(request: RequestEnvelope) -> int:
    """The script's words a chat request's final assistant message already holds, when the request
    continues it (vLLM's `continue_final_message`); 0 otherwise."""
    messages = request.body.get("messages") or ()
    if request.kind != "chat" or not request.body.get("continue_final_message") or not messages \
            or messages[-1].get("role") != "assistant":
        return 0
    return len(message_text(messages[-1]).split())


def _prompt_words(prompt: str | list[int] | None) -> tuple[list[str], int]:
    if isinstance(prompt, list):
        return [str(token) for token in prompt] or ["ok"], len(prompt)
    words = (prompt or "").split()
    return words or ["ok"], len(words)


def message_text(message: Any) -> str:
    """A chat message's text: its content, or its text parts joined; "" for anything else."""
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, list):
        return " ".join(str(part.get("text") or "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


class ScriptedAdapter(GenerationAdapter):
    """Generation only: it has no tokenizer, so a worker running it answers no tokenize, detokenize."""

    engine_name = "scripted"

    def __init__(
        self,
        served_model_name: str,
        max_model_len: int = 4096,
        tokens_per_second: float = 0.0,
        first_token_delay: float = 0.0,
        prefill_per_token: float = 0.0,
        cache_blocks: int = CACHE_BLOCKS,
        stream_interval: int = 1,
        loop_stall: float = 0.0,
        engine_tokens: bool = True,
    ):
        super().__init__(served_model_name, max_model_len)
        self.engine_tokens = engine_tokens
        self.token_interval = 1.0 / tokens_per_second if tokens_per_second > 0 else 0.0
        self.stream_interval = stream_interval
        self.first_token_delay = first_token_delay
        self.loop_stall = loop_stall  # seconds of blocking before each request's first token
        self.prefill_per_token = prefill_per_token
        self.cache = PrefixCache(cache_blocks) if prefill_per_token > 0 else None
        self._prefill = asyncio.Lock()
        self._aborts: dict[str, asyncio.Event] = {}

    async def abort(self, request_id: str) -> None:
        event = self._aborts.get(request_id)
        if event is not None:
            event.set()

    async def generate(self, request: RequestEnvelope,
                       prefix_ids: list[int] | None = None) -> AsyncIterator[GenerationChunk]:
        if prefix_ids is not None and not self.engine_tokens:
            raise ValueError("This engine does not continue from tokens (--no-scripted-engine-tokens).")
        send_ids = self.engine_tokens and (prefix_ids is not None or request.continues)
        prompts = script_words(request)
        params = request.params
        if (prompt_tokens := max(tokens for _words, tokens in prompts)) > self.max_model_len:
            raise InvalidRequest(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"prompt contains at least {prompt_tokens} input tokens.",
                param="input_tokens",
            )
        max_tokens = (params.max_tokens or DEFAULT_MAX_TOKENS) - len(prefix_ids or ())
        aborted = self._aborts[request.request_id] = asyncio.Event()
        cached = None
        answer: list[str] = []  # the first choice's text, cached with the prompt once it ends
        try:
            if self.cache is not None:
                tokens = every_prompt_word(request)
                cached = self.cache.lookup_and_insert(tokens)
                async with self._prefill:
                    await self._pause((len(tokens) - cached) * self.prefill_per_token, aborted)
            async for chunk in self._run(prompts, max_tokens, params.n, params.stop or [], aborted,
                                         params.logprobs, request.kind, words_written(request) + len(prefix_ids or ()),
                                         send_ids):
                if chunk.done:
                    chunk.usage.cached_tokens = cached
                    if self.cache is not None and len(prompts) == 1:
                        self.cache.lookup_and_insert(tokens + "".join(answer).split())
                elif self.cache is not None and chunk.choice_index == 0 and chunk.text:
                    answer.append(chunk.text)
                yield chunk
        finally:
            del self._aborts[request.request_id]

    async def _pause(self, seconds: float, aborted: asyncio.Event) -> None:
        if seconds > 0:
            with contextlib.suppress(TimeoutError):  # the pause ran its course: no abort
                await asyncio.wait_for(aborted.wait(), seconds)
        else:
            await asyncio.sleep(0)  # let cancels and other requests in between tokens

    async def _run(self, prompts, max_tokens, n, stops, aborted, logprobs, kind, written=0, send_ids=False):
        await self._pause(self.first_token_delay, aborted)
        if self.loop_stall:
            time.sleep(self.loop_stall)  # blocking on purpose: nothing else on the loop runs meanwhile
        choices = len(prompts) * n
        texts = [""] * choices
        finish: list[str | None] = [None] * choices
        held: list[GenerationChunk | None] = [None] * choices  # tokens generated, not yet sent
        generated = 0
        for step in range(max_tokens):
            if aborted.is_set():
                break
            due = step % self.stream_interval == 0  # the first token, then every stream_interval
            for index in range(choices):
                if finish[index] is not None:
                    continue
                (words, prompt_tokens), choice = prompts[index // n], index % n
                at = written + step  # the script's word to write
                word = words[at % len(words)]
                piece = (word if at == 0 else " " + word) if choice == 0 else f"{' ' if at else ''}{choice}:{word}"
                generated += 1
                chunk = _delta(index, piece, generated == 1, logprobs, kind, len(texts[index]))
                if send_ids:
                    chunk.output_ids = [at]
                if texts[index] == "":  # the prompt's size, for running usage
                    chunk.usage = Usage(prompt_tokens=prompt_tokens)
                texts[index] += piece
                hit = next((s for s in stops if s in texts[index]), None)
                if hit is not None:
                    cut = len(texts[index]) - texts[index].index(hit)
                    chunk.text = piece[: max(0, len(piece) - cut)]
                    chunk.finish_reason, chunk.stop_reason = "stop", hit
                    finish[index] = "stop"
                elif step == max_tokens - 1:
                    chunk.finish_reason = finish[index] = "length"
                if (earlier := held[index]) is not None:
                    earlier.absorb(chunk)
                    earlier.finish_reason, earlier.stop_reason = chunk.finish_reason, chunk.stop_reason
                    chunk = earlier
                held[index] = None
                if due or chunk.finish_reason:
                    yield chunk
                else:
                    held[index] = chunk
            if all(finish):
                break
            if due:  # until the next group's last token, or the last token max_tokens allows
                await self._pause(self.token_interval * (min(step + self.stream_interval, max_tokens - 1) - step),
                                  aborted)
        for chunk in held:  # cut short by an abort: what was generated is sent, as usage counts it
            if chunk is not None:
                yield chunk
        reason = "cancelled" if aborted.is_set() else None
        yield GenerationChunk(
            done=True,
            finish_reason=reason or finish[0],
            usage=Usage(prompt_tokens=sum(tokens for _words, tokens in prompts), completion_tokens=generated),
        )


def _delta(index: int, piece: str, first: bool, logprobs: int | None, kind: str, offset: int) -> GenerationChunk:
    """One token's delta; every token gets logprob -1, in the shape of the request's API."""
    entries = None
    if logprobs is not None and kind == "chat":
        entry = {"token": piece, "logprob": -1.0, "bytes": list(piece.encode())}
        entries = [{**entry, "top_logprobs": [entry] * min(logprobs, 1)}]
    elif logprobs is not None:
        entries = {"text_offset": [offset], "token_logprobs": [-1.0], "tokens": [piece],
                   "top_logprobs": [{piece: -1.0}]}
    return GenerationChunk(choice_index=index, text=piece, first_token=first, logprobs=entries, token_count=1)
