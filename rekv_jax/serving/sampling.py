"""How a served request's tokens are drawn (`Sampling`) and when it ends before its
`max_new_tokens` (`Stops`): frozen records that cross the launcher's pipes with the request.
And the drawing itself: `draw`, one batched program from a decode step's logits to each row's
token and log probabilities, whose bits for a row never depend on the rest of its batch; the
prefill side draws a transfer-only handoff's first token with it too (`first_draw`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rekv_jax.model.layers import row_blocks

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


# ------------------------------------------------------------------------------ drawing tokens

KEY_IMPL = "threefry2x32"  # the draws' random bits, whatever JAX's default implementation


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rows:
    """The per-row parameters of one `draw` (host arrays): how each row's token is drawn."""

    temperature: np.ndarray  # [B] f32; 0: greedy
    top_p: np.ndarray  # [B] f32
    top_k: np.ndarray  # [B] int32; 0: every token
    seed: np.ndarray  # [B, 2] uint32: the seed's high and low 32-bit words
    index: np.ndarray  # [B] int32: which token of its request the row draws (0: the first)


def rows_of(rows: Sequence[tuple[Sampling, int] | None]) -> Rows:
    """The `Rows` of a batch, slot by slot: (a request's `Sampling`, the index of the token it
    draws), or None for a padding row (greedy)."""
    real = [r or (Sampling(), 0) for r in rows]
    return Rows(np.array([s.temperature for s, _ in real], np.float32),
                np.array([s.top_p for s, _ in real], np.float32),
                np.array([s.top_k for s, _ in real], np.int32),
                np.array([(s.seed >> 32, s.seed & 0xFFFFFFFF) for s, _ in real],
                         np.uint32).reshape(len(real), 2),
                np.array([i for _, i in real], np.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Drawn:
    """What `draw` gives each row: its token and the model's log probabilities (the
    log-softmax of the raw logits, whatever the temperature, as the OpenAI API reports; None
    where they were left behind, `buffers`)."""

    token: jax.Array  # [B] int32
    logprob: jax.Array | None = None  # [B] f32: the token's
    top_ids: jax.Array | None = None  # [B, TOP_LOGPROBS] int32: the likeliest, likeliest first
    top_logprobs: jax.Array | None = None  # [B, TOP_LOGPROBS] f32: theirs

    def buffers(self, logprobs: bool) -> tuple[jax.Array, ...]:
        """Its arrays in order (`Drawn(*buffers)` gives it back): the token alone unless
        `logprobs`."""
        every = (self.token, self.logprob, self.top_ids, self.top_logprobs)
        return every if logprobs else every[:1]

    def reported(self, sampling: Sampling, row: int
                 ) -> tuple[float | None, tuple[tuple[int, float], ...]]:
        """(row's logprob, its `sampling.logprobs` likeliest (id, logprob)) as a `Token`
        carries them: (None, ()) unless the request asked. Host arrays only."""
        if sampling.logprobs is None:
            return None, ()
        top = zip(self.top_ids[row, :sampling.logprobs].tolist(),
                  self.top_logprobs[row, :sampling.logprobs].tolist(), strict=True)
        return float(self.logprob[row]), tuple(top)


@jax.jit
def draw(logits: jax.Array, rows: Rows) -> Drawn:
    """Each row's token from its logits [B, V] f32, as `Sampling` says: one program for the
    batch. Computed on blocks of ROW_BLOCK rows (`row_blocks`), so a row's bits depend on its
    logits and parameters alone, never on its batch or slot. At temperature 0 the token is
    `jnp.argmax` of the logits (bitwise greedy)."""
    return Drawn(*row_blocks(_draw_block, logits, rows.temperature, rows.top_p, rows.top_k,
                             rows.seed, rows.index))


def _draw_block(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, top_k: jax.Array,
                seed: jax.Array, index: jax.Array) -> tuple[jax.Array, ...]:
    """`draw` on one block [R, V] (the sampling skipped when every row is greedy)."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)  # [R, V]
    top_logprobs, top_ids = jax.lax.top_k(logprobs, TOP_LOGPROBS)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled = temperature > 0
    token = jnp.where(sampled, jax.lax.cond(
        jnp.any(sampled), _sampled, lambda *_: greedy, logits, temperature, top_p, top_k, seed,
        index), greedy)
    logprob = jnp.take_along_axis(logprobs, token[:, None], axis=-1)[:, 0]
    return token, logprob, top_ids.astype(jnp.int32), top_logprobs


def _sampled(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, top_k: jax.Array,
             seed: jax.Array, index: jax.Array) -> jax.Array:
    """Rows [R, V] drawn from the softmax at their temperatures, cut to the `top_k` likeliest
    tokens, then to the smallest set of the likeliest whose renormalized probability reaches
    `top_p` (top_p 1: no cut): a Gumbel-max draw whose noise for token v of the row's token i
    is keyed by (seed, i) alone (threefry's `jax.random.key(seed)`, the seed's two 32-bit
    words, folded with i) -> tokens [R]."""
    R, V = logits.shape
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    order = jnp.argsort(scaled, axis=-1, descending=True, stable=True)  # [R, V] ids
    ranked = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(V)[None]
    keep = (top_k[:, None] == 0) | (rank < top_k[:, None])
    probs = jax.nn.softmax(jnp.where(keep, ranked, -jnp.inf), axis=-1)
    before = jnp.pad(jnp.cumsum(probs, axis=-1)[:, :-1], ((0, 0), (1, 0)))  # ahead of a rank
    keep &= (before < top_p[:, None]) | (top_p[:, None] >= 1.0)

    def noise(seed: jax.Array, index: jax.Array) -> jax.Array:  # [V], in vocabulary order
        key = jax.random.wrap_key_data(seed, impl=KEY_IMPL)
        return jax.random.gumbel(jax.random.fold_in(key, index), (V,), jnp.float32)

    noisy = ranked + jnp.take_along_axis(jax.vmap(noise)(seed, index), order, axis=-1)
    best = jnp.argmax(jnp.where(keep, noisy, -jnp.inf), axis=-1)
    return jnp.take_along_axis(order, best[:, None], axis=-1)[:, 0].astype(jnp.int32)


def first_specs(sampling: Sampling, batch: int = 1) -> tuple[jax.ShapeDtypeStruct, ...]:
    """What a handoff's first-token part carries (`first_draw`'s `Drawn.buffers`): the token
    [B] int32, then, when the request asked for log probabilities, the rest of its `Drawn`."""
    token = (jax.ShapeDtypeStruct((batch,), jnp.int32),)
    if sampling.logprobs is None:
        return token
    return token + (jax.ShapeDtypeStruct((batch,), jnp.float32),
                    jax.ShapeDtypeStruct((batch, TOP_LOGPROBS), jnp.int32),
                    jax.ShapeDtypeStruct((batch, TOP_LOGPROBS), jnp.float32))


def first_draw(sampling: Sampling) -> Callable[[jax.Array], tuple[jax.Array, ...]]:
    """How a prefill side that computes a handoff's first token (transfer-only: the decode side
    has no logits) draws it: logits [B, V] -> the buffers of `first_specs`, by `draw`, so the
    token and its log probabilities are those the decode side would draw from the same logits."""

    def first(logits: jax.Array) -> tuple[jax.Array, ...]:
        drawn = draw(logits, rows_of([(sampling, 0)] * logits.shape[0]))
        return drawn.buffers(sampling.logprobs is not None)

    return first

