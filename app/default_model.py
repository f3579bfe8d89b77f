"""Build the embedded default model: a tiny, deterministic, random-weight Qwen3.

It is a real Hugging Face checkpoint (config, safetensors, tokenizer, chat template) of a
few MB, built offline in seconds, so `make run` and the tests need no model hub. Its
answers are noise, but greedy decoding is deterministic, which is what the tests compare.

    python -m app.default_model --out models/tiny-qwen3
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, the format of the Qwen family: one block per message, then the assistant header.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
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
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
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
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build(out: Path, *, layers: int = 4, hidden: int = 256, seed: int = 0) -> Path:
    """Write the model to `out` (idempotent: an existing complete model is kept)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size=1024)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=8192,
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
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": config.eos_token_id, "do_sample": False})
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("models/tiny-qwen3"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    path = build(args.out, layers=args.layers, hidden=args.hidden)
    print(f"model ready at {path}")


if __name__ == "__main__":
    main()
