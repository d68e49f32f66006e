"""How a served request's tokens are drawn (`Sampling`) and when it ends before its
`max_new_tokens` (`Stops`): frozen records that cross the launcher's pipes with the request.
"""

from __future__ import annotations

import dataclasses

TOP_LOGPROBS = 20  # the most top log probabilities a token reports (the OpenAI API's bound)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How a request's tokens are drawn: greedy at temperature 0, else from the softmax of the
    logits over `temperature`, cut to the `top_k` most likely and the smallest set holding
    `top_p` of the probability, with the random draw of token i keyed by (`seed`, i) alone."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: every token
    seed: int = 0
    logprobs: int | None = None  # None: none reported; n: the chosen token's and the n likeliest

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: every token), got {self.top_k}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in 0..2**63-1, got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in 0..{TOP_LOGPROBS}, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclasses.dataclass(frozen=True)
class Stops:
    """What ends a request before its `max_new_tokens`: the model's EOS token (unless
    `ignore_eos`), a token of `stop_token_ids`, or generated text holding a string of `stop`;
    none of them before `min_tokens` tokens."""

    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if any(not s for s in self.stop):
            raise ValueError("a stop string must not be empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop token ids must be >= 0, got {self.stop_token_ids}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
