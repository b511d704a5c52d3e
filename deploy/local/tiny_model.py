"""A tiny deterministic Llama with a byte-level BPE tokenizer, built offline.

No small causal LM can be downloaded here (no model hub), so the local stack builds its own. Two builds
with the same seed give identical files (weights, tokenizer, configs): a baseline recorded once stays
valid, and a KV cache computed by one process can be checked token for token against another.

Weights use std 1/sqrt(fan_in) instead of Llama's 0.02: with the default init the logits are nearly
flat and greedy decoding repeats one token, so a corrupted KV cache would go unnoticed. With this init
the greedy continuation depends on every prompt token, and a wrong KV block changes the argmax.

usage: python -m pdgate.deploy.local.tiny_model OUT_DIR   (needs torch, transformers, tokenizers: the vLLM venv)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["MODEL_NAME", "ModelShape", "build_tiny_model", "is_built"]

MODEL_NAME = "pdgate-tiny"
# Written last by build_tiny_model: its presence means the folder is complete.
_STAMP = "pdgate-tiny.json"
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")

_WORDS = (
    "the quick brown fox jumps over lazy dog prefill decode cache block token layer head attention "
    "model server request response hello world alpha beta gamma delta one two three four five six "
    "seven eight nine ten red green blue cat sat on mat river mountain ocean forest city road bridge "
    "tower light dark user assistant system"
).split()
_SYLLABLES = "ka lo mi ne ru sa ti vo ze qu an er in on th st pr gl ch sh".split()

# A minimal chat format: vLLM's /v1/chat/completions needs a template, and the tokenizer has no
# role tokens, so roles are plain words. `bos_token` keeps prompts starting with a known id.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


class ModelShape:
    """The architecture; head_dim 32 is one the vLLM CPU attention backend supports."""

    vocab_size = 2048
    hidden_size = 128
    intermediate_size = 256
    num_layers = 2
    num_heads = 4
    num_kv_heads = 2
    head_dim = 32
    # RoPE positions the model accepts; the stack serves --max-model-len up to this.
    max_positions = 4096
    seed = 1234


def _corpus(n_lines: int, seed: int) -> Iterator[str]:
    """English-ish words plus random pseudo-words, so BPE finds enough merges for the vocab."""
    rng = random.Random(seed)
    pseudo = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    vocab = _WORDS + pseudo
    for _ in range(n_lines):
        words = " ".join(rng.choice(vocab) for _ in range(rng.randint(4, 20)))
        yield words + rng.choice([".", "!", "?", ","])


def _build_tokenizer(shape: type[ModelShape]) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=shape.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(_corpus(20000, shape.seed)), trainer=trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call, unused-ignore]  # transformers leaves this constructor untyped
        tokenizer_object=tok,
        bos_token=SPECIAL_TOKENS[0],
        eos_token=SPECIAL_TOKENS[1],
        pad_token=SPECIAL_TOKENS[2],
        model_max_length=shape.max_positions,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _build_weights(config: Any, seed: int) -> dict[str, Any]:
    """Seeded weights by parameter name, drawn in a fixed order from a private generator."""
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)  # type: ignore[no-untyped-call, unused-ignore]  # transformers leaves this constructor untyped
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {}
    for name, param in sorted(skeleton.named_parameters()):
        if param.dim() >= 2:
            value = torch.randn(tuple(param.shape), generator=gen) / param.shape[-1] ** 0.5
        else:  # RMSNorm weights
            value = torch.ones(tuple(param.shape))
        state[name] = value.to(torch.bfloat16).contiguous()
    return state


def _put_template_in_config(path: Path) -> None:
    """Also keep the chat template in tokenizer_config.json, where older loaders look for it."""
    data = json.loads(path.read_text())
    data["chat_template"] = CHAT_TEMPLATE
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def is_built(out_dir: str | os.PathLike[str]) -> bool:
    """True when `out_dir` holds a complete model written by `build_tiny_model`."""
    return (Path(out_dir) / _STAMP).is_file()


def build_tiny_model(out_dir: str | os.PathLike[str], *, force: bool = False) -> Path:
    """Build the model into `out_dir` (or keep a complete one already there) and return its path."""
    out = Path(out_dir).resolve()
    if is_built(out) and not force:
        return out
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    shape = ModelShape
    out.mkdir(parents=True, exist_ok=True)
    (out / _STAMP).unlink(missing_ok=True)
    tokenizer = _build_tokenizer(shape)
    if len(tokenizer) != shape.vocab_size:
        raise RuntimeError(f"tokenizer has {len(tokenizer)} tokens, expected {shape.vocab_size}")
    config = LlamaConfig(  # type: ignore[call-arg]  # torch_dtype is read from **kwargs; the checkpoint records it
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    config.architectures = ["LlamaForCausalLM"]
    weights = _build_weights(config, shape.seed)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _put_template_in_config(out / "tokenizer_config.json")
    digest = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    stamp = {
        "name": MODEL_NAME,
        "params": sum(int(w.numel()) for w in weights.values()),
        "max_positions": shape.max_positions,
        "model_sha256": digest,
    }
    (out / _STAMP).write_text(json.dumps(stamp, indent=1, sort_keys=True) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build the pdgate-tiny model offline.")
    ap.add_argument("out_dir")
    ap.add_argument("--force", action="store_true", help="rebuild even when the folder is complete")
    args = ap.parse_args(argv)
    out = build_tiny_model(args.out_dir, force=args.force)
    print(json.loads((out / _STAMP).read_text()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
