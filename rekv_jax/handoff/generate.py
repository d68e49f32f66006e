"""`rekv generate`: a ReKV prefill/decode pair that generates text on the reconstructed cache.

The prefill worker runs the prompt (split: layers 0..c-1 only, each layer's quantized KV streamed
as it is computed; full: all L layers first), the decode worker receives `h_c`, recomputes the
suffix, restores the prefix, and then decodes greedily on that cache (quantized prefix + exact
suffix) — the decoding the paper leaves out. `ttft_ms` is the handoff's prompt interval (prompt
at the prefill worker to the first token at the decode worker), after one untimed warm-up
handoff that compiles every program. `compare` decodes the same prompt on a single-process cache
of the same dtype (no quantization) and reports where the two token streams first differ.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from rekv_jax.action import Action
from rekv_jax.handoff.receiver import receive_handoff
from rekv_jax.handoff.sender import send_prompt
from rekv_jax.launch.child import Side
from rekv_jax.launch.environments import pair_environments, visible_gpus
from rekv_jax.launch.pair import loopback, run_pair
from rekv_jax.launch.runtime import agree_runtime
from rekv_jax.mode import Fallback, Interval, Mode, PrefillMode, Schedule
from rekv_jax.model.loader import SHIPPED_MODEL, load_config, load_model
from rekv_jax.model.transformer import (
    attention_backend,
    greedy_decode,
    greedy_tokens,
    prefill,
)
from rekv_jax.sizes import action_bytes
from rekv_jax.transport import JobKey, Transport
from rekv_jax.transport.base import Role

OnToken = Callable[[int], None]
DTYPES = ("bfloat16", "float32")


@dataclasses.dataclass(frozen=True)
class Request:
    """Everything both workers must agree on."""

    token_ids: tuple[int, ...]
    model: str = str(SHIPPED_MODEL)  # trained-model folder or hf:PATH
    action: str = "q8:r=2"
    max_new_tokens: int = 32
    dtype: str = "bfloat16"
    prefill: str = PrefillMode.SPLIT
    schedule: str = Schedule.OVERLAPPED
    chunks: int = 1  # token chunks of the chunked schedule / pipelined prefill
    transport: str = "transfer-server"
    link_gbps: float | None = None
    fallback: str = Fallback.ERROR
    compare: bool = False
    timeout: float = 120.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))
        if not self.token_ids:
            raise ValueError("the prompt holds no tokens")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        self.mode(load_config(self.model).num_layers)  # the mode's ValueError, if any

    def mode(self, num_layers: int) -> Mode:
        """How its handoff runs, timed from the prompt."""
        mode = Mode.of(Action.parse(self.action, num_layers), self.schedule, self.prefill,
                       self.chunks, Interval.PROMPT)
        if mode.chunks > len(self.token_ids):
            raise ValueError(f"{mode.chunks} chunks need at least as many prompt tokens, "
                             f"got {len(self.token_ids)}")
        return mode


@dataclasses.dataclass(frozen=True)
class Generation:
    """What the decode worker produced, and how fast."""

    tokens: list[int]  # generated ids, the handoff's first token first
    text: str | None  # their text (None without a tokenizer)
    ttft_ms: float  # prompt arrival at the prefill worker -> first token at the decode worker
    tpot_ms: float  # median time per further token
    tokens_per_s: float  # generated tokens / (ttft + decoding)
    payload_bytes: int  # what the handoff sent (sizes.action_bytes)
    action: str
    prefill: str
    chunks: int  # token chunks (1: unchunked)
    fallback: bool  # the prefix transfer failed and the cache was recomputed from the ids
    first_divergence: int | None = None  # with compare: first index differing from the reference

    def to_json(self, compare: bool) -> dict:
        d = dataclasses.asdict(self)
        if not compare:
            del d["first_divergence"]
        return d


def timed(tokens: Iterable[jax.Array], on_token: OnToken = lambda t: None
          ) -> tuple[list[int], list[float]]:
    """The ids of greedy tokens [1] (`greedy_tokens`), each passed to `on_token` as it becomes
    known, and when each did (perf_counter)."""
    ids, times = [], []
    for token in tokens:
        ids.append(int(token[0]))
        times.append(time.perf_counter())
        on_token(ids[-1])
    return ids, times


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run_role(role: Role, req: Request, transport: Transport, on_token: OnToken = lambda t: None
             ) -> Generation | None:
    """One worker: the prefill side sends; the decode side receives, decodes and reports."""
    model = load_model(req.model, dtype=jnp.dtype(req.dtype), orbax=False)
    cfg, params, tok = model.cfg, model.params, model.tokenizer
    mode = req.mode(cfg.num_layers)
    agree_runtime(transport, attention_backend(cfg, params["embed"].dtype), req.timeout)
    transport.agree("request", dataclasses.asdict(req), req.timeout)
    tokens = jnp.asarray([req.token_ids], jnp.int32)  # [1, S]
    S = tokens.shape[1]
    result = None
    for tag in ("warmup", "timed"):
        if role == "prefill":
            send_prompt(transport, cfg, params, tokens, mode, tag, timeout=req.timeout)
            continue
        result = receive_handoff(transport, cfg, params, mode, 1, S, tag, req.fallback,
                                 timeout=req.timeout)
        t_first = time.perf_counter()
        if tag == "warmup":  # compile the decode step on the padded cache too
            timed(greedy_tokens(cfg, params, result.kv, result.first_token, 2,
                                S + req.max_new_tokens))
    if role == "prefill":
        return None
    ids, times = timed(greedy_tokens(cfg, params, result.kv, result.first_token,
                                     req.max_new_tokens), on_token)
    decode_s = times[-1] - t_first
    gaps = np.diff(times)
    divergence = None
    if req.compare:
        reference = greedy_decode(cfg, params, *prefill(cfg, params, tokens), req.max_new_tokens)
        divergence = first_divergence(ids, np.asarray(reference)[0].tolist())
    return Generation(
        tokens=ids, text=tok.decode(ids) if tok else None, ttft_ms=result.total_ms,
        tpot_ms=1e3 * float(np.median(gaps)) if gaps.size else 0.0,
        tokens_per_s=len(ids) / (result.total_ms / 1e3 + decode_s),
        payload_bytes=action_bytes(cfg, mode.action, S).total_bytes, action=str(mode.action),
        prefill=req.prefill, chunks=req.chunks, fallback=result.fallback,
        first_divergence=divergence)


def run_side(side: Side, req: Request) -> Generation | None:
    """One worker's process (`generate`); over the `local` transport, both workers in one.
    Tokens reach the launching process as they come (`Side.emit`)."""
    return side.on_link(req.transport, req.link_gbps, req.timeout,
                        lambda role, transport: run_role(role, req, transport, side.emit))


def generate(req: Request, on_token: OnToken = lambda t: None) -> Generation:
    """Run both workers on this machine, each spawned in its environment (a GPU or a fair share
    each, or the cores they share) over loopback, under a key made for them; one process for
    `local`. Each token reaches `on_token` as the decode worker produces it."""
    envs = ({"decode": dict(os.environ)} if req.transport == "local" else
            pair_environments(visible_gpus(), os.environ, None, req.transport))
    return run_pair(run_side, req, envs=envs, key=JobKey.new(), coordinator=loopback(),
                    grace=req.timeout, on_item=on_token)
