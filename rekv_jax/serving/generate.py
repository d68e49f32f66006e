"""`rekv generate`: a ReKV prefill/decode pair that generates text on the reconstructed cache.

The prefill worker runs the prompt (split: layers 0..c-1 only, each layer's quantized KV streamed
as it is computed; full: all L layers first), the decode worker receives `h_c`, recomputes the
suffix, restores the prefix, and then decodes greedily on that cache (quantized prefix + exact
suffix) — the decoding the paper leaves out. Both run the serving workers: the decode side is a
`DecodeEngine` whose batch holds this one request (its cache in pages, its steps the batched
step's, so its tokens are what it would get beside any others), the prefill side a
`PrefillWorker`. `ttft_ms` is the handoff's prompt interval (the decode side's admission, when
the prefill worker starts on the prompt, to the first token), after one untimed warm-up request
that compiles every program. `compare` decodes the same prompt on a single-process cache
of the same dtype (no quantization) and reports where the two token streams first differ.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np

from rekv_jax.action import Action
from rekv_jax.config import ModelConfig
from rekv_jax.errors import TransportError
from rekv_jax.launch.child import Member
from rekv_jax.launch.environments import pair_environments, visible_gpus
from rekv_jax.launch.group import loopback, run_pair
from rekv_jax.launch.runtime import agree_runtime
from rekv_jax.mode import Fallback, Interval, Mode, PrefillMode, Schedule
from rekv_jax.model.loader import SHIPPED_MODEL, load_config
from rekv_jax.model.transformer import Params, attention_backend, greedy_decode, prefill
from rekv_jax.serving.engine import DecodeEngine
from rekv_jax.serving.member import TIMEOUT_S, MemberSetup
from rekv_jax.serving.pages import PoolConfig
from rekv_jax.serving.prefill_worker import PrefillWorker
from rekv_jax.serving.requests import Admit, Finished, Prefill, Token
from rekv_jax.sizes import action_bytes
from rekv_jax.transport import JobKey, Transport
from rekv_jax.transport.base import Role

if TYPE_CHECKING:
    from tokenizers import Tokenizer

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
    timeout: float = TIMEOUT_S

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


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run_role(role: Role, req: Request, transport: Transport, on_token: OnToken = lambda t: None
             ) -> Generation | None:
    """One worker: the prefill side sends; the decode side receives, decodes and reports."""
    setup = MemberSetup(req.model, PoolConfig.holding(len(req.token_ids) + req.max_new_tokens),
                        req.dtype, req.transport, req.link_gbps, req.fallback, None, req.timeout)
    model = setup.load()
    cfg, params, tok = model.cfg, model.params, model.tokenizer
    mode = req.mode(cfg.num_layers)
    agree_runtime(transport, attention_backend(cfg, params["embed"].dtype), req.timeout)
    transport.agree("request", dataclasses.asdict(req), req.timeout)
    S = len(req.token_ids)
    # the warm-up request (id 0) compiles the steps of the first width bucket
    asked = [(0, min(2, req.max_new_tokens)), (1, req.max_new_tokens)]
    if role == "prefill":
        worker = PrefillWorker(cfg, params, [transport], timeout=req.timeout)
        for request_id, _ in asked:
            done = worker.prefill(Prefill(request_id, req.token_ids, mode, 0))
            if done.error is not None:
                raise TransportError(done.error)
        return None
    engine = DecodeEngine(cfg, params, [transport], setup.engine_config())
    for request_id, steps in asked:
        finished, times = _decode(engine, Admit(request_id, S, steps, mode, 0, 0.0),
                                  on_token if request_id else lambda t: None)
    return _generation(req, cfg, params, tok, mode, finished, times)


def _decode(engine: DecodeEngine, admit: Admit, on_token: OnToken
            ) -> tuple[Finished, list[float]]:
    """Run one request alone on the engine: its record and when each token was known."""
    engine.admit(admit)
    times: list[float] = []
    while True:
        for item in engine.step():
            if isinstance(item, Token):
                times.append(item.t_s)
                on_token(item.token)
            elif isinstance(item, Finished):
                if item.error is not None:
                    raise TransportError(item.error)
                return item, times


def _generation(req: Request, cfg: ModelConfig, params: Params, tok: Tokenizer | None,
                mode: Mode, out: Finished, times: list[float]) -> Generation:
    """The record of the timed request (`compare`: against single-process greedy decoding)."""
    ids, gaps = list(out.tokens), np.diff(times)
    divergence = None
    if req.compare:
        tokens = jnp.asarray([req.token_ids], jnp.int32)
        reference = greedy_decode(cfg, params, *prefill(cfg, params, tokens), req.max_new_tokens)
        divergence = first_divergence(ids, np.asarray(reference)[0].tolist())
    return Generation(
        tokens=ids, text=tok.decode(ids) if tok else None, ttft_ms=out.handoff_ms,
        tpot_ms=1e3 * float(np.median(gaps)) if gaps.size else 0.0,
        tokens_per_s=len(ids) / (out.handoff_ms / 1e3 + times[-1] - times[0]),
        payload_bytes=action_bytes(cfg, mode.action, len(req.token_ids)).total_bytes,
        action=str(mode.action), prefill=req.prefill, chunks=req.chunks,
        fallback=out.fell_back, first_divergence=divergence)


def run_side(side: Member, req: Request) -> Generation | None:
    """One worker's process (`generate`); over the `local` transport, both workers in one.
    Tokens reach the launching process as they come (`Member.emit`)."""
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
