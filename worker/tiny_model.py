"""Write a tiny random-weight Llama checkpoint that vLLM can serve.

Nothing can be downloaded on the test machines, so tests and benchmarks use a
model generated locally.  ``write_tiny_model(dir)`` writes an ordinary
Hugging Face checkpoint directory:

* ``tokenizer.json`` / ``tokenizer_config.json`` - a byte-level BPE (about
  1.5k tokens) trained with ``tokenizers`` on ``tiny_model_corpus.txt``, with
  a ChatML chat template that knows about tools, tool calls, tool results and
  Qwen3-style ``enable_thinking``.
* ``config.json`` / ``generation_config.json`` / ``model.safetensors`` - a
  2-layer ``LlamaForCausalLM`` with random weights from a fixed seed.

The output is byte-for-byte reproducible: fixed seed, no timestamps, fixed
safetensors metadata, deterministic BPE training and sorted JSON keys.

Model shape.  hidden 128 with 2 heads gives head_dim 64; vLLM's CPU attention
kernel rejects small head sizes such as 16.  Weights are stored as float32,
but vLLM's ``dtype="auto"`` downcasts float32 checkpoints to bfloat16 on CPU;
on AVX2-only CPUs (no AVX512-BF16) bf16 decodes about 2x slower in batches, so
engines serving this model should pass ``dtype="float32"``.  The weights use
fan-in scaling (not the usual std 0.02) so attention actually mixes the
context: with tiny weights the residual stream is just the current token's
embedding, the model degenerates into a bigram table and every chat prompt
(which always ends in ``<|im_start|>assistant\\n``) yields the same output.
The lm_head rows of all added tokens and of byte tokens that do not decode
to printable ASCII are zero, so their logit is 0 while ordinary tokens'
logits have a std of about 4: greedy decoding never emits EOS, special tokens,
control characters or partial UTF-8 (generations run to ``max_tokens``), and
sampling at temperature 1 rarely does.

Special tokens and vLLM's parsers.  Layout (ids are fixed, first in vocab)::

    0 <pad>  1 <s>  2 </s>  3 <|im_start|>  4 <|im_end|>        special=True
    5 <tool_call>  6 </tool_call>  7 <think>  8 </think>      special=False

All nine are added tokens, so each always encodes to a single id.  The four
tag tokens are ``special=False``, as in Qwen2.5/Qwen3 and DeepSeek-R1:

* The hermes tool parser (``vllm/tool_parsers/hermes_tool_parser.py``) works
  purely on the decoded *text* (it searches for "<tool_call>"), so the tags
  must survive detokenization.  vLLM's detokenizer uses
  ``tokenizers.decoders.DecodeStream(skip_special_tokens=...)``, which drops
  added tokens flagged special.  The parser's ``adjust_request`` forces
  ``skip_special_tokens=False`` for requests with tools (for models whose
  tags are special); with special=False the tags survive either way.
* The deepseek_r1 reasoning parser looks ``<think>``/``</think>`` up in
  ``tokenizer.get_vocab()`` (the constructor raises if missing) and matches
  their token ids while streaming, but non-streaming ``extract_reasoning``
  partitions the *text* on "</think>", which also needs special=False because
  nothing turns off ``skip_special_tokens`` for reasoning.
* deepseek_r1 semantics: output without "</think>" is all reasoning.  In
  streaming mode vLLM first checks the prompt (``is_reasoning_end``), so
  ``enable_thinking=False`` (the prompt ends in an empty think block) streams
  content; non-streaming responses are parsed from the output text only, so
  this random model's answers come back entirely as ``reasoning``.  Forced
  tool calls (``tool_choice`` required/named) are grammar-constrained only
  after reasoning ends, so test tool calling on a server without a reasoning
  parser.  (Without ``"strict": true`` on a tool, vLLM leaves its arguments
  unconstrained and the random model may emit e.g. ``"arguments": false``.)

``<|im_end|>`` ends a chat turn, so generation_config lists both ``</s>`` and
``<|im_end|>`` as EOS ids; it has no sampling defaults on purpose.

Run ``python -m worker.tiny_model DIR`` (or ``llmfleet tiny-model DIR``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CORPUS = Path(__file__).with_name("tiny_model_corpus.txt")
SEED = 1234
VOCAB_SIZE = 1536

SPECIAL = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]  # special=True
TAGS = ["<tool_call>", "</tool_call>", "<think>", "</think>"]  # special=False

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "initializer_range": 0.02,
    "use_cache": True,
    # As a classifier (`--convert classify`), vLLM builds the score head from the language model head's
    # rows of two of its tokens (as for bge-reranker-v2-gemma); without them the head it adds has no
    # weights in the checkpoint, and two processes classify with different uninitialized memory.
    "classifier_from_token": ["Ġnot", "Ġis"],
    "method": "no_post_processing",
}

CHAT_TEMPLATE = r"""
{%- macro text(content) -%}
  {%- if content is string -%}{{- content -}}
  {%- elif content is mapping -%}{{- content.text if content.text is defined else '' -}}
  {%- elif content is iterable -%}
    {%- for part in content -%}
      {%- if part is string -%}{{- part -}}
      {%- elif part.text is defined and part.text is not none -%}{{- part.text -}}
      {%- endif -%}
    {%- endfor -%}
  {%- elif content is not none and content is defined -%}{{- content -}}
  {%- endif -%}
{%- endmacro -%}
{%- set first_is_system = messages and messages[0].role in ['system', 'developer'] -%}
{%- if tools -%}
  {{- '<|im_start|>system\n' -}}
  {%- if first_is_system -%}{{- text(messages[0].content) + '\n\n' -}}{%- endif -%}
  {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
  {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
  {%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
  {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif first_is_system -%}
  {{- '<|im_start|>system\n' + text(messages[0].content) + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
  {%- set content = text(message.content) -%}
  {%- if loop.first and first_is_system -%}
  {%- elif message.role in ['system', 'developer'] -%}
    {{- '<|im_start|>system\n' + content + '<|im_end|>\n' -}}
  {%- elif message.role == 'assistant' -%}
    {{- '<|im_start|>assistant\n' + content -}}
    {%- for tc in (message.tool_calls or []) -%}
      {%- set call = tc.function if tc.function is defined else tc -%}
      {%- if content or not loop.first -%}{{- '\n' -}}{%- endif -%}
      {{- '<tool_call>\n{"name": ' + (call.name | tojson) + ', "arguments": ' -}}
      {%- if call.arguments is string -%}{{- call.arguments -}}
      {%- else -%}{{- (call.arguments if call.arguments is defined and call.arguments is not none else {}) | tojson -}}
      {%- endif -%}
      {{- '}\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\n' -}}
  {%- elif message.role == 'tool' -%}
    {%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
    {{- '\n<tool_response>\n' + content + '\n</tool_response>' -}}
    {%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
  {%- else -%}
    {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
  {%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}
{%- endif -%}
""".strip()


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL + TAGS,  # ids 0..8, in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(CORPUS)], trainer)
    # Re-declare the tags as non-special added tokens (see module docstring).
    data = json.loads(tok.to_str())
    for entry in data["added_tokens"]:
        entry["special"] = entry["content"] in SPECIAL
    return Tokenizer.from_str(json.dumps(data))


def _tokenizer_config(tok) -> dict:
    added = {}
    for name in SPECIAL + TAGS:
        added[str(tok.token_to_id(name))] = {
            "content": name,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": name in SPECIAL,
        }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": CONFIG["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }


def _masked_ids(tok) -> list[int]:
    """Added tokens plus byte tokens that do not decode to printable ASCII."""
    added = {tok.token_to_id(name) for name in SPECIAL + TAGS}
    for i in range(tok.get_vocab_size(with_added_tokens=True)):
        text = tok.decode([i], skip_special_tokens=False)
        if not all(c == "\n" or " " <= c <= "~" for c in text):
            added.add(i)
    return sorted(added)


def _weights(vocab_size: int, masked_ids: list[int]) -> dict:
    import torch

    c = CONFIG
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    q_dim = c["num_attention_heads"] * c["head_dim"]
    kv_dim = c["num_key_value_heads"] * c["head_dim"]
    gen = torch.Generator().manual_seed(SEED)

    def randn(*shape, std):
        return (torch.randn(*shape, generator=gen) * std).contiguous()

    def linear(out_f, in_f):  # fan-in scaling keeps every layer's output O(1)
        return randn(out_f, in_f, std=in_f**-0.5)

    w = {"model.embed_tokens.weight": randn(vocab_size, hidden, std=1.0)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(hidden)
        w[p + "self_attn.q_proj.weight"] = linear(q_dim, hidden)
        w[p + "self_attn.k_proj.weight"] = linear(kv_dim, hidden)
        w[p + "self_attn.v_proj.weight"] = linear(kv_dim, hidden)
        w[p + "self_attn.o_proj.weight"] = linear(hidden, q_dim)
        w[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
        w[p + "mlp.gate_proj.weight"] = linear(inter, hidden)
        w[p + "mlp.up_proj.weight"] = linear(inter, hidden)
        w[p + "mlp.down_proj.weight"] = linear(hidden, inter)
    w["model.norm.weight"] = torch.ones(hidden)
    lm_head = randn(vocab_size, hidden, std=4.0 * hidden**-0.5)
    lm_head[masked_ids] = 0.0  # logit 0: never the greedy choice
    w["lm_head.weight"] = lm_head
    return w


def write_tiny_model(out_dir: str | Path) -> Path:
    """Write the tiny model into ``out_dir`` (created if needed); return it."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tok = _train_tokenizer()
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n")
    _write_json(out / "tokenizer_config.json", _tokenizer_config(tok))

    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    ids = {name: tok.token_to_id(name) for name in SPECIAL + TAGS}
    _write_json(
        out / "config.json",
        {
            **CONFIG,
            "vocab_size": vocab_size,
            "bos_token_id": ids["<s>"],
            "eos_token_id": ids["</s>"],
            "pad_token_id": ids["<pad>"],
        },
    )
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": ids["<s>"],
            "eos_token_id": [ids["</s>"], ids["<|im_end|>"]],
            "pad_token_id": ids["<pad>"],
        },
    )
    weights = _weights(vocab_size, _masked_ids(tok))
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m worker.tiny_model DIR", file=sys.stderr)
        return 2
    print(write_tiny_model(args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
