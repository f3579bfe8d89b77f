"""Build the embedded default model: a tiny, deterministic, random-weight Qwen3.

It is a real Hugging Face checkpoint (config, safetensors, tokenizer, chat template) of a
few MB, built offline in seconds, so `make run` and the tests need no model hub. Its
answers are noise, but greedy decoding is deterministic, which is what the tests compare.
Two variants share every weight but one row of the output head:

* `brief` (`make run`'s default, `models/default/tiny-qwen3`): answers end with the chat
  template's end token after a few to a few hundred tokens, as a real model's do, and
  never calls a tool unasked, so an agent CLI's turn is one plain answer that completes
  (its own output head: the end token's row favoured, the markup tokens' rows zero; and
  a frequency penalty in its `generation_config.json`).
* `open` (`models/tiny-qwen3`, the test suite's): answers rarely end before
  `max_tokens`, so a test fixes each answer's length.

    python -m app.engines.default_model --out models/default/tiny-qwen3            # brief
    python -m app.engines.default_model --out models/tiny-qwen3 --answers open
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Markup tokens of Qwen3's tool calls and reasoning: single tokens, as in Qwen3, but not
# "special" (they stay in decoded text, where the tool and reasoning parsers read them).
MARKUP_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"]

# Qwen3's format (ChatML): tools listed in the system block, assistant tool calls as
# hermes-style `<tool_call>` JSON blocks, tool results as `<tool_response>` blocks in a
# user turn, reasoning in `<think>` (kept for assistant turns after the last user query).
# Thinking is off unless `chat_template_kwargs={"enable_thinking": true}`; then the
# generation prompt opens `<think>`. Tool call arguments that arrive as a JSON string
# (the OpenAI wire form) are written verbatim, so an answer renders as it was generated.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] in ('system', 'developer') %}"
    "{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] in ('system', 'developer') %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for message in messages %}{%- if message['role'] == 'user' %}"
    "{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set content = message['content'] if message['content'] is string else '' %}"
    "{%- if message['role'] in ('system', 'developer') and loop.first %}"
    "{%- elif message['role'] in ('user', 'system', 'developer') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.get('reasoning_content') and loop.index0 > ns.last_query %}"
    "{{- '<think>\\n' + message['reasoning_content'] + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{{- content }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{%- set fn = call['function'] if call.get('function') else call %}"
    "{%- if content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{{- fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson) }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}"
)

_CORPUS = """\
You are a helpful assistant. Use the tools when they help, and answer briefly.
The user asks about the weather in Paris, the build status of the repository and the logs.
Tool result: {"status": "ok", "items": [1, 2, 3], "path": "/var/log/syslog", "lines": 42}
def handler(event, context): return {"statusCode": 200, "body": json.dumps(event)}
Agents call tools many times; every turn re-sends the whole conversation to the model.
The quick brown fox jumps over the lazy dog. 0123456789 ABCDEFGHIJKLMNOPQRSTUVWXYZ
SELECT id, name FROM users WHERE created_at > now() - interval '1 day' ORDER BY id;
error: file not found; warning: deprecated option; info: retrying in 5 seconds
"""


def build_tokenizer(vocab_size: int):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines() * 4, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


BRIEF_EOS_SCALE = 3.0
"""The `brief` variant's end-token output row: this multiple of the token's embedding..."""
BRIEF_EOS_DRIFT = 0.3
"""...plus this share (of the embedding's norm) of the direction the network's hidden
states take over a long context, where they align: without it, answers to prompts of
tens of thousands of tokens never end."""
BRIEF_FREQUENCY_PENALTY = 1.0
"""The `brief` variant's `generation_config.json` default (the app applies a model's
defaults as vLLM does): each use of a token lowers its logit, which breaks greedy loops,
so the end token wins within a few hundred tokens (3 to 364, median 11, over prompts
of 20 to 60k tokens cut from Codex's and Claude Code's requests)."""

BRIEF_MIN_TOKENS = 8
"""...and `min_new_tokens`: over a long prompt the end token may win at once; an answer
has at least this many tokens."""

MAX_POSITIONS = 131072
"""Positions the model takes: room for agent CLIs' prompts (Claude Code's first request is
~52k tokens in this vocabulary) under the app's `max_model_len` (65,536 by default). The
weights do not depend on it (rotary positions), so answers stay the same."""


def _complete(out: Path, answers: str) -> bool:
    """Whether `out` holds this version of the model (an older build is rebuilt)."""
    try:
        config = json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (
        (out / "tokenizer.json").exists()
        and config.get("max_position_embeddings") == MAX_POSITIONS
        and config.get("kvturn_answers", "open") == answers
    )


def build(out: Path, *, answers: str = "brief", layers: int = 4, hidden: int = 256, seed: int = 0) -> Path:
    """Write the model to `out` (idempotent: an existing complete model is kept).
    `answers`: "brief" or "open" (see the module docstring)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if answers not in ("brief", "open"):
        raise ValueError(f"answers must be 'brief' or 'open', not {answers!r}")
    if _complete(out, answers):
        return out
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size=1024)
    # The weights are drawn for the trained vocabulary first, then rows for the markup
    # tokens are appended: every other weight stays what the same seed always gave, a
    # model whose greedy answers are known to keep clear of near-ties.
    config = Qwen3Config(
        vocab_size=len(tokenizer) - len(MARKUP_TOKENS),
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        # Larger weights than a trained model's init: peaked logits keep greedy decoding
        # away from near-ties, so the P/D path and a single engine agree token for token.
        initializer_range=0.2,
        torch_dtype="float32",
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    if answers == "brief":
        # An output head of its own (a copy of the embeddings) whose end-token row is
        # scaled: the end token wins some steps it lost, every other logit is unchanged.
        head = model.model.embed_tokens.weight.detach().clone()
        eos = head[config.eos_token_id].clone()
        drift = _long_context_direction(model, tokenizer)
        head[config.eos_token_id] = BRIEF_EOS_SCALE * eos + BRIEF_EOS_DRIFT * eos.norm() * drift
        # Nor does it write tool-call or reasoning markup of its own accord (a zero logit
        # never beats its peaked ones): an agent's turn is one plain answer, while forced
        # tool calls and structured output still work through guided decoding.
        for token in MARKUP_TOKENS:
            head[tokenizer.convert_tokens_to_ids(token)] = 0.0
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(head)
    model.config.kvturn_answers = answers
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    generation = {"eos_token_id": config.eos_token_id, "do_sample": False}
    if answers == "brief":
        # Greedy unless a request asks otherwise (vLLM's default temperature is 1).
        generation.update(
            temperature=0.0, frequency_penalty=BRIEF_FREQUENCY_PENALTY, min_new_tokens=BRIEF_MIN_TOKENS
        )
    (out / "generation_config.json").write_text(json.dumps(generation))
    return out


def _long_context_direction(model, tokenizer):
    """The unit direction of the final hidden states over the last 1,000 positions of
    ~5,000 tokens of English prose (the Zen of Python, which every Python carries,
    repeated): agents' prompts are mostly such text, and over a long context the states
    align with it. Deterministic for the seed."""
    import codecs
    import contextlib
    import importlib
    import io

    import torch

    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen
        zen = codecs.decode(importlib.import_module("this").s, "rot13")
    ids = tokenizer.encode(zen * 10)[:5000]
    with torch.no_grad():
        states = model.model(torch.tensor([ids])).last_hidden_state[0, -1000:]
    mean = states.mean(0)
    return mean / mean.norm()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("models/default/tiny-qwen3"))
    parser.add_argument("--answers", choices=("brief", "open"), default="brief")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    path = build(args.out, answers=args.answers, layers=args.layers, hidden=args.hidden)
    print(f"model ready at {path}")


if __name__ == "__main__":
    main()
