"""A tiny Llama checkpoint built locally, for running a real vLLM engine without a model hub.

No model can be downloaded on the project's machines, so the live engine (tests, calibration,
fidelity) serves a Llama built here: a ``transformers`` ``LlamaConfig`` with random bf16
weights and a byte-level BPE tokenizer trained with ``tokenizers`` on generated text, both
written with ``save_pretrained``. Everything derives from the seed, so two builds with the
same :class:`TinyModelSpec` hold the same tokenizer and the same weights.

The checkpoint is built on first use into a cache directory named after a hash of the spec
(``$RLBATCH_CACHE_DIR`` or ``~/.cache/rlbatch``), written to a temporary folder first and
renamed into place, so concurrent builders and interrupted builds never leave a half-written
model behind.

The default shape (hidden 128, 2 layers, 4 query heads / 2 KV heads of head_dim 32) keeps a
decode step at a few milliseconds on CPU; vLLM's CPU attention backend wants head sizes
divisible by 32 for an FP8 KV cache.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["TinyModelSpec", "cache_dir", "ensure_tiny_model", "model_profile_dict"]

_FORMAT_VERSION = 1
"""Bumped when the build procedure changes (part of the cache hash)."""

_WORDS = ("the", "a", "request", "token", "batch", "queue", "engine", "model", "serve",
          "cache", "prefill", "decode", "latency", "memory", "block", "policy", "reward",
          "time", "user", "report", "long", "short", "fast", "slow", "one", "two", "three",
          "and", "of", "to", "in", "is", "it", "for", "on", "with", "as", "at", "by", "from")


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape and seed of the tiny Llama.

    :param hidden_size: model width.
    :param num_layers: transformer layers.
    :param num_heads: query heads.
    :param num_kv_heads: key/value heads (GQA when fewer than ``num_heads``).
    :param head_dim: per-head dimension (a multiple of 32 for vLLM's CPU FP8 KV cache).
    :param intermediate_size: MLP width (SwiGLU).
    :param vocab_size: tokenizer (and embedding) size.
    :param max_position_embeddings: longest context the model accepts.
    :param seed: seed of the weights and of the tokenizer's training text.
    """

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    vocab_size: int = 512
    max_position_embeddings: int = 8192
    seed: int = 0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if name != "seed" and value < 1:
                raise ValueError(f"TinyModelSpec.{name} must be >= 1, got {value}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_kv_heads ({self.num_kv_heads}) must divide num_heads "
                             f"({self.num_heads})")
        if self.vocab_size < 300:
            raise ValueError(f"vocab_size must be >= 300 (256 byte tokens + merges + "
                             f"specials), got {self.vocab_size}")

    def digest(self) -> str:
        """Short hash naming the cache folder of this spec."""
        text = json.dumps({"v": _FORMAT_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def cache_dir() -> Path:
    """Where built models live: ``$RLBATCH_CACHE_DIR`` or ``~/.cache/rlbatch``."""
    env = os.environ.get("RLBATCH_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "rlbatch"


def ensure_tiny_model(spec: TinyModelSpec | None = None, root: Path | None = None) -> Path:
    """Path of the tiny model's folder, building it first if it is not cached.

    :param spec: model shape and seed (default :class:`TinyModelSpec`).
    :param root: cache folder (default :func:`cache_dir`).
    :returns: a folder ``vllm`` / ``transformers`` load with ``model=<path>``.
    """
    spec = spec or TinyModelSpec()
    root = root or cache_dir()
    target = root / f"tiny-llama-{spec.digest()}"
    if (target / "config.json").is_file() and (target / "tokenizer.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-llama-", dir=root))
    try:
        _build(spec, tmp)
        try:
            tmp.rename(target)
        except OSError:
            # Another process finished the same build first: keep theirs.
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def model_profile_dict(spec: TinyModelSpec, name: str = "tiny-llama") -> dict[str, object]:
    """The tiny model as an rlbatch model profile (``rlbatch.profiles.load_model`` format).

    :param spec: model shape.
    :param name: profile name.
    """
    return {
        "name": name,
        "description": "Tiny random-weight Llama built by rlbatch.engine.tiny_model "
                       f"(hash {spec.digest()}), for live-engine tests on CPU.",
        "num_layers": spec.num_layers,
        "hidden_size": spec.hidden_size,
        "num_heads": spec.num_heads,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.intermediate_size,
        "vocab_size": spec.vocab_size,
        "gated_mlp": True,
        "tie_word_embeddings": False,
        "max_model_len": spec.max_position_embeddings,
        "default_tp": 1,
        "weight_bytes_per_param": 2,
    }


def _training_text(seed: int, lines: int = 2000) -> list[str]:
    rng = np.random.default_rng(seed)
    words = np.array(_WORDS)
    out: list[str] = []
    for _ in range(lines):
        n = int(rng.integers(4, 16))
        picks = words[rng.integers(0, len(words), n)].tolist()
        number = int(rng.integers(0, 10_000))
        out.append(" ".join(picks) + f" {number}.")
    return out


def _build(spec: TinyModelSpec, folder: Path) -> None:
    """Write config, weights and tokenizer of ``spec`` into ``folder``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    # transformers' stubs fight mypy --strict (untyped constructors, dtype overloads): use it
    # as an untyped module.
    transformers: Any = importlib.import_module("transformers")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size, special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_training_text(spec.seed), trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                                eos_token="</s>", unk_token="<unk>")
    vocab = len(fast)
    if vocab > spec.vocab_size:
        raise RuntimeError(f"tokenizer has {vocab} tokens, more than vocab_size "
                           f"{spec.vocab_size}")
    fast.save_pretrained(folder)

    config = transformers.LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(spec.seed)
        model = transformers.LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    model = model.to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "rlbatch_tiny_model.json").write_text(
        json.dumps({"format_version": _FORMAT_VERSION, **asdict(spec)}, indent=2) + "\n",
        encoding="utf-8")
