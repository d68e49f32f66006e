"""The request stream of a serving run: Poisson arrivals at a rate, prompt lengths from a list or a
range, and prompts of synthetic ids or windows of a tokenized text, all drawn from one seed.

Pure and deterministic: the same `LoadSpec` (and corpus) gives the same requests, so every
policy of a sweep serves the same stream at each rate. The arrivals, the lengths and the tokens
draw from separate streams of the seed, so changing how prompts are drawn does not move the
arrivals.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rekv_jax.serving.requests import ServeRequest

RANGE = ".."  # --prompt-lens LO..HI: every length from LO to HI, equally likely


@dataclasses.dataclass(frozen=True)
class PromptLens:
    """Where each prompt's length comes from: `values`, each equally likely (a repeated value
    twice as likely), or every integer of `low..high`."""

    values: tuple[int, ...] = ()
    low: int = 0
    high: int = 0

    def __post_init__(self) -> None:
        if bool(self.values) == bool(self.low or self.high):
            raise ValueError("prompt lengths are a list or a range, not both or neither")
        if self.values and min(self.values) < 1:
            raise ValueError(f"prompt lengths must be positive, got {list(self.values)}")
        if not self.values and not 1 <= self.low <= self.high:
            raise ValueError(f"a prompt length range needs 1 <= LO <= HI, got "
                             f"{self.low}{RANGE}{self.high}")

    @classmethod
    def parse(cls, text: str) -> PromptLens:
        """`256,512` (a list) or `128..1024` (a range, both ends included)."""
        try:
            if RANGE in text:
                low, high = text.split(RANGE)
                return cls(low=int(low), high=int(high))
            return cls(values=tuple(int(v) for v in text.split(",")))
        except ValueError as e:
            if "prompt length" in str(e):
                raise
            raise ValueError(f"--prompt-lens {text!r}: expected lengths like 256,512 or a range "
                             f"like 128{RANGE}1024") from None

    @property
    def longest(self) -> int:
        return max(self.values) if self.values else self.high

    @property
    def lengths(self) -> tuple[int, ...]:
        """Every length it can draw, ascending."""
        return tuple(sorted(set(self.values))) if self.values else tuple(
            range(self.low, self.high + 1))

    def draw(self, rng: np.random.Generator, n: int) -> list[int]:
        """`n` lengths."""
        if self.values:
            return [int(v) for v in rng.choice(np.asarray(self.values), size=n)]
        return [int(v) for v in rng.integers(self.low, self.high + 1, size=n)]

    def __str__(self) -> str:
        return ",".join(map(str, self.values)) if self.values else f"{self.low}{RANGE}{self.high}"


@dataclasses.dataclass(frozen=True)
class LoadSpec:
    """A request stream: Poisson arrivals at `rate` per second for `requests` requests or for
    `duration_s` seconds of arrivals (exactly one of the two), from `seed`."""

    rate: float  # requests per second
    prompt_lens: PromptLens
    max_new_tokens: int
    seed: int = 0
    requests: int | None = None
    duration_s: float | None = None

    def __post_init__(self) -> None:
        if not (self.rate > 0 and np.isfinite(self.rate)):
            raise ValueError(f"the arrival rate must be a positive number of requests per "
                             f"second, got {self.rate}")
        if (self.requests is None) == (self.duration_s is None):
            raise ValueError("give the number of requests or the duration of arrivals, not both")
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"the number of requests must be >= 1, got {self.requests}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"the duration must be positive seconds, got {self.duration_s}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


def arrivals(spec: LoadSpec) -> list[float]:
    """The arrival times (seconds from the start, ascending): exponential gaps of mean 1 / rate,
    the first after one gap."""
    rng = np.random.default_rng([spec.seed, 0])
    if spec.requests is not None:
        return [float(t) for t in np.cumsum(rng.exponential(1 / spec.rate, spec.requests))]
    out, t = [], 0.0
    while True:
        t += float(rng.exponential(1 / spec.rate))
        if t > spec.duration_s:
            return out
        out.append(t)


def generate(spec: LoadSpec, vocab_size: int, corpus: np.ndarray | None = None
             ) -> list[ServeRequest]:
    """The requests of `spec`, numbered 0.. in arrival order. Prompts are uniform ids in
    `0..vocab_size-1`, or, with `corpus` (token ids of a text [N]), windows of it starting at
    uniform offsets."""
    times = arrivals(spec)
    lengths = spec.prompt_lens.draw(np.random.default_rng([spec.seed, 1]), len(times))
    tokens = np.random.default_rng([spec.seed, 2])
    if corpus is not None:
        corpus = np.asarray(corpus)
        if corpus.ndim != 1 or corpus.size < spec.prompt_lens.longest:
            raise ValueError(f"a corpus of {corpus.size} tokens cannot give prompts of "
                             f"{spec.prompt_lens.longest}")
        if corpus.size and int(corpus.max()) >= vocab_size:
            raise ValueError(f"the corpus holds id {int(corpus.max())}, past the model's "
                             f"vocabulary of {vocab_size}")
    out = []
    for i, (t, n) in enumerate(zip(times, lengths, strict=True)):
        if corpus is None:
            ids = tokens.integers(0, vocab_size, size=n)
        else:
            start = int(tokens.integers(0, corpus.size - n + 1))
            ids = corpus[start:start + n]
        out.append(ServeRequest(i, tuple(int(x) for x in ids), spec.max_new_tokens, t))
    return out
