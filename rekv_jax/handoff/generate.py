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
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer

from rekv_jax.action import Action
from rekv_jax.config import ModelConfig
from rekv_jax.handoff.core import check_schedule, receive_handoff, send_prompt
from rekv_jax.kv import KVCache
from rekv_jax.model.loader import SHIPPED_MODEL, load_tokenizer
from rekv_jax.model.params import load_hf
from rekv_jax.model.transformer import Params, attention_backend, decode_step, prefill
from rekv_jax.sizes import action_bytes
from rekv_jax.transport import LocalTransport, Transport, connect
from rekv_jax.transport.base import Role
from rekv_jax.transport.launch import (
    agree_runtime,
    pair_environments,
    start_side,
    visible_gpus,
    with_prefill_child,
)

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
    prefill: str = "split"  # costmodel.PREFILL_MODES
    schedule: str = "overlapped"
    chunks: int = 1  # token chunks of the chunked schedule / pipelined prefill
    transport: str = "transfer-server"
    link_gbps: float | None = None
    fallback: str = "error"
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
        check_schedule(self.schedule, self.prefill, self.chunks, len(self.token_ids))


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


def tokenizer_of(spec: str) -> Tokenizer | None:
    """The tokenizer beside a trained-model folder or `hf:PATH` checkpoint, if it has one
    (reads files only: no JAX call, so it may run before jax.distributed starts)."""
    folder = Path(spec.removeprefix("hf:"))
    return load_tokenizer(folder) if (folder / "tokenizer.json").is_file() else None


def load(spec: str, dtype: str) -> tuple[ModelConfig, Params, Tokenizer | None]:
    """A trained-model folder or `hf:PATH`, read from its HF safetensors in `dtype` (an orbax
    restore would synchronize with the peer process), with its tokenizer when it has one."""
    cfg, params = load_hf(spec.removeprefix("hf:"), jnp.dtype(dtype))
    return cfg, params, tokenizer_of(spec)


def decode_greedy(cfg: ModelConfig, params: Params, kv: KVCache, first: jax.Array, steps: int,
                  on_token: OnToken = lambda t: None, capacity: int | None = None
                  ) -> tuple[list[int], list[float]]:
    """Greedy ids [steps] continuing a prompt cache [L, 1, S, K, H] whose next token is `first`
    [1], and the time each became known (perf_counter). The cache is padded to `capacity`
    (default S + steps), so every step runs one compiled program."""
    S, token = kv.seq_len, first
    kv = kv.pad(capacity or S + steps)
    ids, times = [], []
    for i in range(steps):
        ids.append(int(token[0]))
        times.append(time.perf_counter())
        on_token(ids[-1])
        if i + 1 < steps:
            logits, kv = decode_step(cfg, params, kv, token, S + i)
            token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
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
    cfg, params, tok = load(req.model, req.dtype)
    action = Action.parse(req.action, cfg.num_layers)
    agree_runtime(transport, attention_backend(cfg, params["embed"].dtype), req.timeout)
    transport.agree("request", dataclasses.asdict(req), req.timeout)
    tokens = jnp.asarray([req.token_ids], jnp.int32)  # [1, S]
    S = tokens.shape[1]
    result = None
    for tag in ("warmup", "timed"):
        if role == "prefill":
            send_prompt(transport, cfg, params, tokens, action, tag, req.prefill,
                        timeout=req.timeout, chunks=req.chunks)
            continue
        result = receive_handoff(transport, cfg, params, action, 1, S, tag, req.schedule,
                                 req.fallback, timeout=req.timeout, prefill_mode=req.prefill,
                                 chunks=req.chunks)
        t_first = time.perf_counter()
        if tag == "warmup":  # compile the decode step on the padded cache too
            decode_greedy(cfg, params, result.kv, result.first_token, 2,
                          capacity=S + req.max_new_tokens)
    if role == "prefill":
        return None
    ids, times = decode_greedy(cfg, params, result.kv, result.first_token, req.max_new_tokens,
                               on_token)
    decode_s = times[-1] - t_first
    gaps = np.diff(times)
    divergence = None
    if req.compare:
        kv, logits = prefill(cfg, params, tokens)
        first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        reference, _ = decode_greedy(cfg, params, kv, first, req.max_new_tokens)
        divergence = first_divergence(ids, reference)
    return Generation(
        tokens=ids, text=tok.decode(ids) if tok else None, ttft_ms=result.total_ms,
        tpot_ms=1e3 * float(np.median(gaps)) if gaps.size else 0.0,
        tokens_per_s=len(ids) / (result.total_ms / 1e3 + decode_s),
        payload_bytes=action_bytes(cfg, action, S).total_bytes, action=str(action),
        prefill=req.prefill, chunks=req.chunks, fallback=result.fallback,
        first_divergence=divergence)


def run_local(req: Request, on_token: OnToken = lambda t: None) -> Generation:
    """Both workers in this process (the `local` transport): prefill on a thread."""
    return LocalTransport.run_pair(lambda t: run_role("prefill", req, t),
                                   lambda t: run_role("decode", req, t, on_token),
                                   req.link_gbps, req.timeout)


def run_process(role: Role, req: Request, coordinator: str | None,
                on_token: OnToken = lambda t: None) -> Generation | None:
    """This worker over a real transport (jax.distributed is initialized here)."""
    start_side()
    with connect(req.transport, role, coordinator, link_gbps=req.link_gbps,
                 timeout=req.timeout) as transport:
        return run_role(role, req, transport, on_token)


def generate(req: Request, on_token: OnToken = lambda t: None) -> Generation:
    """Run both workers: in-process for `local`, else this process decodes and a child
    process (`rekv generate --role prefill`) prefills over loopback."""
    if req.transport == "local":
        return run_local(req, on_token)
    cmd = [sys.executable, "-m", "rekv_jax.cli", "generate", "--request",
           json.dumps(dataclasses.asdict(req)), "--role", "prefill"]
    return with_prefill_child(cmd, lambda coordinator: run_process("decode", req, coordinator,
                                                                   on_token), req.timeout,
                              pair_environments(visible_gpus(), os.environ, None, req.transport))
