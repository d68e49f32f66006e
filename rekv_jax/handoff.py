"""`rekv handoff`: timed ReKV handoffs between a prefill and a decode process (paper §3).

Each process runs `run_role`. On one machine `launch_pair` starts both over loopback; on a
multi-host allocation the scheduler starts one process per role (see the README). Both sides
build the same weights (same seed, or the same checkpoint), agree on the experiment, then run
`warmup + reps` handoffs per action and schedule. The decode side checks every first token and
the last rep's complete cache against its own single-process prefill, and emits one JSON object
per rep (`kind: "rep"`) and per action and schedule (`kind: "summary"`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import platform
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from rekv_jax import stats
from rekv_jax.action import Action, parse_actions
from rekv_jax.config import ModelConfig
from rekv_jax.costmodel import PHASES
from rekv_jax.model import Params, init_params, prefill
from rekv_jax.params import load_hf
from rekv_jax.schedule import (
    SCHEDULES,
    Handoff,
    check_cache,
    prepare,
    receive_handoff,
    send_handoff,
)
from rekv_jax.sharding import MeshTransport, shard_params, split_reference
from rekv_jax.sizes import action_bytes
from rekv_jax.transport import LocalTransport, Transport, connect
from rekv_jax.transport.base import Role
from rekv_jax.transport.launch import free_port

Emit = Callable[[dict], None]


@dataclasses.dataclass(frozen=True)
class Experiment:
    """Everything both processes must agree on."""

    model: str = "tiny"  # preset name or hf:PATH
    seq_len: int = 256
    batch: int = 1
    actions: str = "bf16:full,q8:full,bf16:r=2,q8:r=2,bf16:recompute"
    schedules: tuple[str, ...] = SCHEDULES
    transport: str = "transfer-server"
    link_gbps: float | None = None
    warmup: int = 3
    reps: int = 30
    fallback: str = "error"
    backend: str | None = None  # quantization backend (None: Pallas on GPU, XLA elsewhere)
    seed: int = 0
    timeout: float = 120.0
    prefill_devices: int = 1  # tensor-parallel devices per side (rekv_jax.sharding)
    decode_devices: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedules", tuple(self.schedules))  # from JSON: a list
        if self.seq_len < 1 or self.batch < 1 or self.reps < 1 or self.warmup < 0:
            raise ValueError("seq_len, batch and reps must be positive and warmup >= 0")
        if self.prefill_devices < 1 or self.decode_devices < 1:
            raise ValueError("each side needs at least one device")
        bad = [s for s in self.schedules if s not in SCHEDULES]
        if bad or not self.schedules:
            raise ValueError(f"schedules must be a non-empty subset of {SCHEDULES}, got {bad}")


def load_model(spec: str, seed: int = 0, dtype: jnp.dtype = jnp.bfloat16
               ) -> tuple[ModelConfig, Params]:
    """A preset with synthetic weights (shared layers for presets too big to materialize here)
    or an HF checkpoint (`hf:PATH`)."""
    if spec.startswith("hf:"):
        return load_hf(spec[3:], dtype)
    cfg = ModelConfig.preset(spec)
    return cfg, init_params(cfg, jax.random.key(seed), dtype, repeat_layers=spec != "tiny")


def hardware() -> str:
    """A label for the device the decode side computes on."""
    device = jax.local_devices()[0]
    kind = getattr(device, "device_kind", device.platform)
    return f"{device.platform}:{kind} ({platform.machine()}, {jax.local_device_count()} dev)"


def _digest(cfg: ModelConfig, params: Params) -> str:
    """Config plus a fingerprint of the weights, so both sides provably hold the same model."""
    leaves = [np.asarray(x[(0,) * x.ndim]).item() for x in jax.tree.leaves(params)]
    text = json.dumps([cfg.to_dict(), [float(v) for v in leaves]], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def run_role(role: Role, exp: Experiment, transport: Transport, emit: Emit,
             progress: Callable[[int], None] = lambda n: None) -> None:
    """One side of the whole experiment; the decode side emits the records."""
    cfg, params = load_model(exp.model, exp.seed)
    actions = parse_actions(exp.actions, cfg.num_layers)
    transport.agree("experiment", {**dataclasses.asdict(exp), "model": _digest(cfg, params),
                                   "actions": [str(a) for a in actions]}, exp.timeout)
    tokens = jax.random.randint(jax.random.key(exp.seed + 1), (exp.batch, exp.seq_len), 0,
                                cfg.vocab_size, jnp.int32)
    if exp.prefill_devices * exp.decode_devices > 1:  # a mesh per side
        transport = MeshTransport(transport, cfg, exp.prefill_devices, exp.decode_devices)
        params = shard_params(cfg, params, transport.mesh)
    for action in actions:
        state = prepare(cfg, params, tokens, action) if role == "prefill" else None
        # the schedule only matters when there is both a prefix and a suffix
        schedules = exp.schedules if action.kind == "joint" else exp.schedules[:1]
        for schedule in schedules:
            results = []
            for rep in range(exp.warmup + exp.reps):
                tag = f"{action}/{schedule}/{rep}"
                if role == "prefill":
                    send_handoff(transport, state, action, tag, exp.backend, exp.timeout)
                    continue
                result = receive_handoff(transport, cfg, params, action, exp.batch, exp.seq_len,
                                         tag, schedule, exp.fallback, exp.backend, exp.timeout)
                progress(1)
                if rep >= exp.warmup:
                    results.append(result)
                    emit({"kind": "rep", "action": str(action), "schedule": schedule,
                          "rep": rep - exp.warmup, "total_ms": result.total_ms,
                          "phases_ms": result.phases_ms, "fallback": result.fallback})
            if role == "decode":
                emit(summarize(cfg, params, tokens, exp, action, schedule, results))


def summarize(cfg: ModelConfig, params: Params, tokens: jax.Array, exp: Experiment,
              action: Action, schedule: str, results: list[Handoff]) -> dict:
    """One summary record: median and bootstrap CI, phase medians, payload, and the checks."""
    devices = (exp.prefill_devices, exp.decode_devices)
    sharded = devices != (1, 1)
    cut = 0 if results[-1].fallback else action.cut  # the cache was rebuilt from the tokens
    if sharded:  # bits differ across meshes: the reference is the same split, in this process
        reference, logits = split_reference(cfg, params, tokens, cut, *devices)
    else:
        reference, logits = prefill(cfg, params, tokens)
    first = np.asarray(jnp.argmax(logits, axis=-1))
    cache_check = check_cache(reference, action, results[-1], exp.backend)
    totals = [r.total_ms for r in results]
    return {
        "kind": "summary", "model": cfg.name, "seq_len": exp.seq_len, "batch": exp.batch,
        "action": str(action), "bits": action.bits, "cut": action.cut,
        "suffix_len": action.suffix_len, "transport": exp.transport,
        "schedule": schedule if action.kind == "joint" else "n/a",
        "link_gbps": exp.link_gbps, "hardware": hardware(),
        "median_ms": stats.median(totals), "ci95_ms": list(stats.median_ci(totals, seed=exp.seed)),
        "reps_ms": totals,
        "phases_ms": {p: stats.median([r.phases_ms[p] for r in results]) for p in PHASES},
        "payload_bytes": action_bytes(cfg, action, exp.seq_len, exp.batch)["total_bytes"],
        "first_token_match": all(np.array_equal(r.first_token, first) for r in results),
        "cache_check": cache_check + (_reference_text(cfg, cut, *devices) if sharded else ""),
        "prefill_devices": devices[0], "decode_devices": devices[1],
        "fallbacks": sum(r.fallback for r in results),
    }


def _reference_text(cfg: ModelConfig, cut: int, prefill_devices: int, decode_devices: int
                    ) -> str:
    """What the sharded sides' cache was compared with (see `split_reference`)."""
    if cut == 0:
        return f" to a prefill on {decode_devices} devices"
    if cut == cfg.num_layers:
        return f" to a prefill on {prefill_devices} devices"
    return f" to a prefix on {prefill_devices} devices and a suffix on {decode_devices}"


def run_local(exp: Experiment, emit: Emit, progress: Callable[[int], None] = lambda n: None
              ) -> None:
    """Both sides in this process (the `local` transport): prefill on a thread."""
    prefill_end, decode_end = LocalTransport.pair(exp.link_gbps)
    errors: list[BaseException] = []

    def prefill_side() -> None:
        try:
            run_role("prefill", exp, prefill_end, emit)
        except BaseException as e:  # surfaced below, after the decode side stops
            errors.append(e)

    thread = threading.Thread(target=prefill_side, name="rekv-prefill", daemon=True)
    thread.start()
    try:
        run_role("decode", exp, decode_end, emit, progress)
    finally:
        thread.join(exp.timeout)
        prefill_end.close(), decode_end.close()
    if errors:
        raise errors[0]


def run_process(role: Role, exp: Experiment, coordinator: str | None, emit: Emit,
                progress: Callable[[int], None] = lambda n: None) -> None:
    """This process's side over a real transport (jax.distributed is initialized here)."""
    with connect(exp.transport, role, coordinator, link_gbps=exp.link_gbps,
                 timeout=exp.timeout) as transport:
        run_role(role, exp, transport, emit, progress)


def launch_pair(exp: Experiment, emit: Emit, progress: Callable[[int], None] = lambda n: None
                ) -> None:
    """Run both sides on this machine over loopback: this process decodes, a child prefills.

    The child is killed if it outlives the decode side by more than `exp.timeout`; its output
    is attached to any error."""
    coordinator = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "rekv_jax.cli", "handoff", "--experiment",
           json.dumps(dataclasses.asdict(exp)), "--role", "prefill", "--coordinator", coordinator]
    with tempfile.TemporaryFile("w+") as log:
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            run_process("decode", exp, coordinator, emit, progress)
            child.wait(timeout=exp.timeout)
        except BaseException as e:
            if child.poll() is None:
                child.kill()
            child.wait()
            log.seek(0)
            e.add_note(f"prefill process output (tail):\n{log.read()[-3000:]}")
            raise
        if child.returncode:
            log.seek(0)
            raise RuntimeError(f"prefill process exited with {child.returncode}:\n"
                               f"{log.read()[-3000:]}")


def total_handoffs(exp: Experiment, num_layers: int) -> int:
    """Handoffs the decode side will run (for the progress bar)."""
    actions = parse_actions(exp.actions, num_layers)
    per = exp.warmup + exp.reps
    return sum(per * (len(exp.schedules) if a.kind == "joint" else 1) for a in actions)


def print_table(records: list[dict], file=sys.stdout) -> None:
    """The readable form of the summaries."""
    header = f"{'action':<16}{'schedule':<12}{'median ms':>10}{'95% CI':>18}" + "".join(
        f"{p[:8]:>10}" for p in PHASES) + f"{'MiB':>9}  first  cache"
    print(header, file=file)
    for r in records:
        ci = f"[{r['ci95_ms'][0]:.2f}, {r['ci95_ms'][1]:.2f}]"
        phases = "".join(f"{r['phases_ms'][p]:>10.2f}" for p in PHASES)
        print(f"{r['action']:<16}{r['schedule']:<12}{r['median_ms']:>10.2f}{ci:>18}{phases}"
              f"{r['payload_bytes'] / 2**20:>9.2f}  {str(r['first_token_match']):<6} "
              f"{r['cache_check']}", file=file)
