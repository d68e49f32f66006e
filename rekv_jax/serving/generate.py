"""`rekv generate`: a ReKV prefill/decode pair that generates text on the reconstructed cache.

The prefill worker runs the prompt (split: layers 0..c-1 only, each layer's quantized KV streamed
as it is computed; full: all L layers first), the decode worker receives `h_c`, recomputes the
suffix, restores the prefix, and then decodes greedily on that cache (quantized prefix + exact
suffix) — the decoding the paper leaves out. Both run the serving workers: the decode side is a
`DecodeEngine` whose batch holds this one request (its cache in pages, its steps the batched
step's, so its tokens are what it would get beside any others), the prefill side a
`PrefillWorker`, and the router's loop drives them, as every serving frontend's
(`scripted.Pair`). `ttft_ms` is the handoff's prompt interval (the decode side's admission, when
the prefill worker starts on the prompt, to the first token), after one untimed warm-up request
that compiles every program. `compare` decodes the same prompt on a single-process cache
of the same dtype (no quantization) and reports where the two token streams first differ.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from rekv_jax.action import Action
from rekv_jax.config import ModelConfig
from rekv_jax.errors import TransportError
from rekv_jax.launch.group import run_child
from rekv_jax.mode import DEFAULT_SCHEDULE, Fallback, Interval, Mode, PrefillMode
from rekv_jax.model.loader import SHIPPED_MODEL, LoadedModel, load_config, load_model, tokenizer_of
from rekv_jax.model.transformer import greedy_decode, prefill
from rekv_jax.serving.member import TIMEOUT_S, MemberSetup
from rekv_jax.serving.pages import PoolConfig
from rekv_jax.serving.requests import Finished, ServeRequest, Token
from rekv_jax.serving.sampling import Stops
from rekv_jax.serving.scripted import Pair
from rekv_jax.sizes import action_bytes

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
    schedule: str = DEFAULT_SCHEDULE
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


def generate(req: Request, on_token: OnToken = lambda t: None) -> Generation:
    """Serve the request on a prefill worker and a decode engine through the router's loop
    (`scripted.Pair`): two processes on this machine, each in its environment (a GPU or a fair
    share of the cores each; for `local`, threads of this process), after one warm-up request.
    Each token reaches `on_token` as the decode worker produces it. TransportError in one line if
    the request failed."""
    cfg = load_config(req.model)
    mode, S = req.mode(cfg.num_layers), len(req.token_ids)
    setup = MemberSetup(req.model, PoolConfig.holding(S + req.max_new_tokens), req.dtype,
                        req.transport, req.link_gbps, req.fallback, None, req.timeout)
    model = setup.load() if req.transport == "local" else None
    with Pair(setup, model) as pair:
        for request_id, steps in ((0, min(2, req.max_new_tokens)), (1, req.max_new_tokens)):
            # a greedy decode of `steps` tokens, EOS or not, as the reference's
            request = ServeRequest(request_id, req.token_ids, steps, stops=Stops(ignore_eos=True))
            (served,), items = pair.serve([request], {request_id: mode}, _tokens_to(
                on_token if request_id else lambda t: None))
            if served.failure is not None:
                raise TransportError(served.failure)
        pair.close()
    times = [i.t_s for i in items if isinstance(i, Token) and i.request_id == 1]
    reference = None
    if req.compare:
        reference = (greedy_reference(req, model) if model is not None else run_child(
            greedy_reference, req, None, env=os.environ, what="the reference decode",
            timeout=req.timeout))
    return _generation(req, cfg, mode, served.finished, times, reference)


def _tokens_to(on_token: OnToken) -> Callable[[object], None]:
    return lambda item: on_token(item.token) if isinstance(item, Token) else None


def greedy_reference(req: Request, model: LoadedModel | None) -> list[int]:
    """Greedy decoding of the prompt on a single-process cache of the request's dtype (`model`:
    already loaded, else loaded here)."""
    model = model or load_model(req.model, dtype=jnp.dtype(req.dtype), orbax=False)
    cfg, params = model.cfg, model.params
    tokens = jnp.asarray([req.token_ids], jnp.int32)
    out = greedy_decode(cfg, params, *prefill(cfg, params, tokens), req.max_new_tokens)
    return np.asarray(out)[0].tolist()


def _generation(req: Request, cfg: ModelConfig, mode: Mode, out: Finished, times: list[float],
                reference: list[int] | None) -> Generation:
    """The record of the timed request (`reference`: single-process greedy decoding)."""
    ids, gaps, tok = list(out.tokens), np.diff(times), tokenizer_of(req.model)
    return Generation(
        tokens=ids, text=tok.decode(ids) if tok else None, ttft_ms=out.handoff_ms,
        tpot_ms=1e3 * float(np.median(gaps)) if gaps.size else 0.0,
        tokens_per_s=len(ids) / (out.handoff_ms / 1e3 + times[-1] - times[0]),
        payload_bytes=action_bytes(cfg, mode.action, len(req.token_ids)).total_bytes,
        action=str(mode.action), prefill=req.prefill, chunks=req.chunks,
        fallback=out.fell_back,
        first_divergence=None if reference is None else first_divergence(ids, reference))
