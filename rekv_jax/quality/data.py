"""WikiText-2 text and the byte-level BPE tokenizer of the shipped model.

The two splits ship inside the package (`rekv_jax/assets/wikitext-2`, CC BY-SA 3.0, attribution
beside them); `path` if given, else `$REKV_WIKITEXT`, overrides that folder. `valid.txt` is the
training text; `test.txt` is for evaluation only (continuation perplexity, NIAH filler).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

WIKITEXT_ENV = "REKV_WIKITEXT"
DEFAULT_WIKITEXT = Path(__file__).resolve().parents[1] / "assets" / "wikitext-2"  # package data
SPLITS = ("valid", "test")
EOS = "<|endoftext|>"


def wikitext_dir(path: str | Path | None = None) -> Path:
    """The WikiText-2 folder: `path`, else `$REKV_WIKITEXT`, else the copy in the package."""
    return Path(path or os.environ.get(WIKITEXT_ENV) or DEFAULT_WIKITEXT)


def read_split(split: str, path: str | Path | None = None) -> str:
    """The text of `valid.txt` or `test.txt`; ValueError naming the folder if it is missing."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    file = wikitext_dir(path) / f"{split}.txt"
    if not file.is_file():
        raise ValueError(f"WikiText-2 {split} split not found at {file}; pass its folder or set "
                         f"${WIKITEXT_ENV}")
    return file.read_text(encoding="utf-8")


def train_tokenizer(text: str, vocab_size: int) -> Tokenizer:
    """A byte-level BPE fitted to `text`; every digit is its own token (passkeys copy cleanly)."""
    if vocab_size < 300:
        raise ValueError(f"vocab_size must be >= 300 (256 bytes + merges), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(text.splitlines(keepends=True), trainer)
    return tok


def encode(tok: Tokenizer, text: str) -> np.ndarray:
    """Token ids of `text` as int32 [N]."""
    return np.asarray(tok.encode(text).ids, dtype=np.int32)


def windows(ids: np.ndarray, length: int, count: int) -> np.ndarray:
    """The first `count` non-overlapping windows of `length` tokens: int32 [count, length]."""
    if length <= 0 or count <= 0:
        raise ValueError(f"window length and count must be positive, got {length}, {count}")
    if count * length > ids.size:
        raise ValueError(f"{count} windows of {length} tokens need {count * length} tokens; "
                         f"the text has {ids.size}")
    return ids[: count * length].reshape(count, length)
