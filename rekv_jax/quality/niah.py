"""Passkey needle-in-a-haystack prompts: for the quality gate and as synthetic training data.

A prompt is `filler[:p] + needle + filler[p:] + question`, built on token ids so the needle
starts exactly at `p = round(depth * len(filler))`. The answer is the passkey with its leading
space (`" 48213"` -> `Ġ 4 8 2 1 3`: the tokenizer gives every digit its own token).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from tokenizers import Tokenizer

from rekv_jax.quality.data import encode

NEEDLE = " The pass key is {key} . Remember it . {key} is the pass key ."
QUESTION = " What is the pass key ? The pass key is"
KEY_DIGITS = 5


@dataclasses.dataclass(frozen=True)
class NiahPrompt:
    """One prompt: `tokens` [S] int32, the expected greedy `answer` [A], where the needle sits."""

    tokens: np.ndarray  # [S] int32, ends with the question
    answer: np.ndarray  # [A] int32, the passkey tokens the model must decode
    key: str
    depth: float
    needle_start: int  # index of the needle's first token in `tokens`
    needle_len: int


def random_key(rng: np.random.Generator, digits: int = KEY_DIGITS) -> str:
    """A passkey of `digits` distinct decimal digits, the first non-zero.

    Distinct digits keep the copy unambiguous: in `76559` the token after a `5` is `5` once and
    `9` once, an order the small shipped model confused often enough to fail BF16 itself.
    """
    if not 1 <= digits <= 10:
        raise ValueError(f"a key of distinct digits has 1..10 of them, got {digits}")
    first = int(rng.integers(1, 10))
    rest = rng.permutation([d for d in range(10) if d != first])[:digits - 1]
    return str(first) + "".join(str(d) for d in rest)


def niah_prompt(tok: Tokenizer, filler: np.ndarray, seq_len: int, depth: float, key: str
                ) -> NiahPrompt:
    """A `seq_len`-token prompt with the needle for `key` at `depth` (0..1) of the filler.

    `filler` supplies the haystack: its first `seq_len - len(needle) - len(question)` tokens.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    if not key.isdigit():
        raise ValueError(f"passkey must be decimal digits, got {key!r}")
    needle = encode(tok, NEEDLE.format(key=key))
    question = encode(tok, QUESTION)
    n_fill = seq_len - needle.size - question.size
    if n_fill < 0:
        raise ValueError(f"seq_len {seq_len} is shorter than needle + question "
                         f"({needle.size + question.size} tokens)")
    if filler.size < n_fill:
        raise ValueError(f"filler has {filler.size} tokens, the prompt needs {n_fill}")
    p = round(depth * n_fill)
    tokens = np.concatenate([filler[:p], needle, filler[p:n_fill], question]).astype(np.int32)
    return NiahPrompt(tokens, encode(tok, " " + key), key, depth, p, needle.size)


def niah_set(tok: Tokenizer, haystack: np.ndarray, seq_len: int, depths: tuple[float, ...],
             seed: int = 0) -> list[NiahPrompt]:
    """One prompt per depth, each with its own random key and its own haystack window.

    Windows are taken in order from `haystack` (e.g. WikiText-2 test tokens), so a set is fixed
    by `seed`, `seq_len` and `depths`.
    """
    rng = np.random.default_rng(seed)
    if haystack.size < len(depths) * seq_len:
        raise ValueError(f"haystack has {haystack.size} tokens; {len(depths)} prompts of "
                         f"{seq_len} need {len(depths) * seq_len}")
    return [niah_prompt(tok, haystack[i * seq_len:(i + 1) * seq_len], seq_len, d,
                        random_key(rng)) for i, d in enumerate(depths)]


def passkey_example(tok: Tokenizer, text: np.ndarray, length: int, rng: np.random.Generator
                    ) -> tuple[np.ndarray, np.ndarray]:
    """A training sequence of `length` tokens, a prompt at a random depth followed by its answer.

    Returns (tokens [length] int32, answer mask [length] bool marking the answer tokens), with
    the haystack a random window of `text` (the training split).
    """
    key = random_key(rng)
    answer_len = encode(tok, " " + key).size
    start = rng.integers(0, text.size - length)
    prompt = niah_prompt(tok, text[start:start + length], length - answer_len, rng.random(), key)
    tokens = np.concatenate([prompt.tokens, prompt.answer])
    mask = np.zeros(length, dtype=bool)
    mask[-answer_len:] = True
    return tokens, mask
