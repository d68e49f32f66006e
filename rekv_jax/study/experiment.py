"""`rekv handoff`: timed ReKV handoffs between a prefill and a decode process (paper §3).

Each side's process runs `run_side`: one experiment (`run_role`), or, for a sweep's pair, one
after another over the same transport and weights (`run_session`). On one machine `launch_pair`
(or `open_session`) spawns both over loopback; on a multi-host allocation the scheduler starts
one process per role, which runs its side in a spawned process (`run_process`, see the README).
Records reach the launching process as objects, an action's once its handoffs are done (not while
the next is timed). Both sides build the same weights (same seed, or the same checkpoint), agree on
the experiment, then run `warmup + reps` handoffs per action and schedule. The decode side checks
every timed rep's first token and complete cache against its own single-process prefill
(`References`), and emits one JSON object per rep (`kind: "rep"`) and per action and schedule
(`kind: "summary"`). Under `fallback="recompute"` a lost prefix costs one rep its transfer, not the
run: the decode side rebuilds that cache from the token ids and both sides go on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from rekv_jax.action import Action
from rekv_jax.config import ModelConfig
from rekv_jax.handoff.receiver import receive_handoff
from rekv_jax.handoff.sender import prepare, send_handoff, send_prompt
from rekv_jax.launch.child import Member
from rekv_jax.launch.environments import (
    pair_environments,
    scheduled_environment,
    visible_gpus,
    with_host_devices,
)
from rekv_jax.launch.group import Job, loopback, run_pair
from rekv_jax.launch.runtime import agree_runtime
from rekv_jax.mode import (
    PAPER_SCHEDULES,
    SCHEDULES,
    Fallback,
    Interval,
    Mode,
    PrefillMode,
    check_fallback,
)
from rekv_jax.model.loader import load_model
from rekv_jax.model.transformer import Params, attention_backend
from rekv_jax.phases import PROMPT_PHASES, Phases
from rekv_jax.sharding import shard_params
from rekv_jax.sizes import action_bytes
from rekv_jax.study.device import Device
from rekv_jax.study.records import Fidelity, Rep, Summary, serializes
from rekv_jax.study.references import References
from rekv_jax.transport import (
    JobKey,
    LocalTransport,
    Transport,
    TransportError,
    checksums,
    cores,
    paced,
)
from rekv_jax.transport.base import ROLES, Role
from rekv_jax.transport.cores import PINNING_ENV, usable_cpus
from rekv_jax.transport.mesh import MeshTransport

Emit = Callable[[Rep | Summary], None]
DEFAULT_ACTIONS = "bf16:full,q8:full,bf16:r=2,q8:r=2,bf16:recompute"


@dataclasses.dataclass(frozen=True)
class Experiment:
    """Everything both processes must agree on (JSON-serializable: `dataclasses.asdict`)."""

    model: str = "tiny"  # a loader spec: preset name, hf:PATH or trained-model folder
    seq_len: int = 256
    batch: int = 1
    actions: tuple[Action, ...] = ()  # for the model's layer count
    schedules: tuple[str, ...] = PAPER_SCHEDULES
    transport: str = "transfer-server"
    link_gbps: float | None = None  # pace every receive to this link (None: unpaced)
    warmup: int = 3
    reps: int = 30
    fallback: str = Fallback.ERROR
    backend: str | None = None  # quantization backend (None: Pallas on GPU, XLA elsewhere)
    seed: int = 0
    timeout: float = 120.0
    interval: str = Interval.READY  # timed from the prefill state, or the prompt
    prefill: str = PrefillMode.FULL  # prefill all L layers, or 0..c-1, streamed
    prefill_devices: int = 1  # tensor-parallel devices per side (rekv_jax.sharding)
    decode_devices: int = 1
    paired: bool = False  # alternate the schedules rep by rep: rep i of each is a pair
    chunks: int = 1  # token chunks of the chunked schedule and the pipelined prefill

    def __post_init__(self) -> None:
        # from JSON: lists, and actions as {bits, cut, num_layers} dicts
        object.__setattr__(self, "schedules", tuple(self.schedules))
        object.__setattr__(self, "actions", tuple(
            a if isinstance(a, Action) else Action(**a) for a in self.actions))
        for name in ("seq_len", "batch", "reps", "timeout", "prefill_devices",
                     "decode_devices") + ("link_gbps",) * (self.link_gbps is not None):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if not self.actions:
            raise ValueError("an experiment needs at least one action")
        bad = [s for s in self.schedules if s not in SCHEDULES]
        if bad or not self.schedules:
            raise ValueError(f"schedules must be a non-empty subset of {SCHEDULES}, got {bad}")
        check_fallback(self.fallback)
        for action in self.actions:  # every mode is checked before any process starts
            for mode in self.modes(action):
                if mode.chunks > self.seq_len:
                    raise ValueError(f"{mode.chunks} chunks need at least as many tokens, "
                                     f"got seq_len {self.seq_len}")
        if self.chunks > 1 and self.prefill_devices * self.decode_devices > 1:
            raise ValueError("token chunks run on one device per side")

    def modes(self, action: Action) -> list[Mode]:
        """How `action`'s handoffs run, once per distinct mode (a non-joint action has no
        schedule: it runs once); the chunks are the chunked schedule's."""
        modes = [Mode.of(action, s, self.prefill, self.chunks, self.interval)
                 for s in self.schedules]
        return list(dict.fromkeys(modes))


def fingerprint(cfg: ModelConfig, params: Params) -> str:
    """Config plus an on-device checksum of every byte of every weight (the transports'
    position-weighted sum): two sides whose fingerprints agree hold the same model, barring a
    checksum collision."""
    sums = checksums(jax.tree.leaves(params))
    text = json.dumps([cfg.to_dict(), sums], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class Progress:
    """Handoffs the decode side ran since its last `Progress` (for a progress bar)."""

    handoffs: int


class Weights:
    """The weights of the last (model, seed) a process ran, with their fingerprint: a pair that
    runs many experiments of one model builds its weights once."""

    def __init__(self) -> None:
        self._key: tuple[str, int] | None = None
        self._held = None

    def get(self, spec: str, seed: int):
        """(the loaded model, its `fingerprint`)."""
        if self._key != (spec, seed):
            self._key, self._held = None, None  # the old weights go before the new ones come
            # a trained-model folder from its safetensors: an orbax restore under
            # jax.distributed refuses a checkpoint saved by one process
            model = load_model(spec, seed, orbax=False)
            self._held = model, fingerprint(model.cfg, model.params)
            self._key = (spec, seed)
        return self._held


def run_session(role: Role, first: Experiment, transport: Transport, emit: Emit,
                progress: Callable[[int], None] = lambda n: None,
                more: Iterable[Experiment] = ()) -> None:
    """One side of a pair's experiments over one transport: `first` (which both sides were
    started with), then each of `more`, which only the decode side is given: it posts each to the
    prefill side through the transport's metadata, then a stop. Each experiment is agreed on as
    one alone, its tags are its own (`_tag_prefix`), its link is its own, and each model's weights
    are built once (`Weights`). `more` is consumed lazily: the next experiment may be decided
    from the records of the last (the sweep's start profiles decide its grid)."""
    weights = Weights()
    if role == "decode":
        n = 0
        for n, exp in enumerate(itertools.chain([first], more)):
            if n:
                _check_same_pair(first, exp)
                transport.send_meta(f"session/{n}", {"experiment": dataclasses.asdict(exp)})
            run_role(role, exp, transport, emit, progress, _tag_prefix(n), weights)
        transport.send_meta(f"session/{n + 1}", {"experiment": None})
        return
    exp, n = first, 0
    while exp is not None:
        run_role(role, exp, transport, emit, progress, _tag_prefix(n), weights)
        n += 1
        given = transport.recv_meta(f"session/{n}", exp.timeout)["experiment"]
        exp = None if given is None else Experiment(**given)


def _tag_prefix(n: int) -> str:
    """The prefix of experiment `n`'s tags in a session: none for the first, so a single run's
    tags (and its messages, e.g. "runtime: prefill and decode disagree ...") are a plain run's;
    the index for the others (no action's tag starts with a digit)."""
    return f"{n}/" if n else ""


def _check_same_pair(first: Experiment, exp: Experiment) -> None:
    """A pair's processes were started for `first`'s transport and devices: later experiments
    must share them (a ValueError names what differs)."""
    fields = ("transport", "prefill_devices", "decode_devices")
    diff = [f"{f} {getattr(exp, f)!r} (the pair's: {getattr(first, f)!r})" for f in fields
            if getattr(exp, f) != getattr(first, f)]
    if diff:
        raise ValueError(f"an experiment of this pair differs in {', '.join(diff)}")


def run_role(role: Role, exp: Experiment, transport: Transport, emit: Emit,
             progress: Callable[[int], None] = lambda n: None, name: str = "",
             weights: Weights | None = None) -> None:
    """One side of the whole experiment; the decode side emits the records. `name` prefixes
    every tag (unique per experiment of a session); `weights` holds the session's model."""
    model, model_fingerprint = (weights or Weights()).get(exp.model, exp.seed)
    cfg, params = model.cfg, model.params
    wrong = [str(a) for a in exp.actions if a.num_layers != cfg.num_layers]
    if wrong:
        raise ValueError(f"actions {wrong} are not for {cfg.name} ({cfg.num_layers} layers)")
    # different attention backends, versions, XLA flags or devices give different bits
    agree_runtime(transport, attention_backend(cfg, params["embed"].dtype), exp.timeout,
                  f"{name}runtime")
    transport.agree(f"{name}experiment", {**dataclasses.asdict(exp), "model": model_fingerprint},
                    exp.timeout)
    tokens = jax.random.randint(jax.random.key(exp.seed + 1), (exp.batch, exp.seq_len), 0,
                                cfg.vocab_size, jnp.int32)
    link = paced(transport, exp.link_gbps)  # this experiment's link
    if exp.prefill_devices * exp.decode_devices > 1:  # a mesh per side
        link = MeshTransport(link, cfg, exp.prefill_devices, exp.decode_devices)
        params = shard_params(cfg, params, link.mesh)
    run = _Run(role, exp, link, cfg, params, tokens, name, emit, progress)
    try:
        for action in exp.actions:
            run.action(action, model.weights)
    finally:
        if link is not transport and hasattr(link, "stop"):
            link.stop()


class _Run:
    """One side's handoffs of one experiment: per action, every rep of each of its modes; the
    decode side checks and records them. It hands its records and progress on once the action's
    handoffs are done (or one failed): the process that takes them would otherwise run while the
    next handoff is timed, on the cores the pair computes on."""

    def __init__(self, role: Role, exp: Experiment, link: Transport, cfg: ModelConfig,
                 params: Params, tokens: jax.Array, name: str, emit: Emit,
                 progress: Callable[[int], None]) -> None:
        self.role, self.exp, self.link, self.cfg, self.params = role, exp, link, cfg, params
        self.tokens, self.name, self.emit, self.progress = tokens, name, emit, progress
        first = exp.modes(exp.actions[0])[0].reference if exp.actions else None
        self.references = (References(cfg, params, tokens,
                                      (exp.prefill_devices, exp.decode_devices), first)
                           if role == "decode" else None)

    def action(self, action: Action, weights: str) -> None:
        modes = self.exp.modes(action)
        states: dict[int, object] = {}  # the prefill state per token chunks of its suffix
        results: dict[Mode, list[Rep]] = {m: [] for m in modes}
        records: list[Rep] = []  # in run order, handed on after the action's last handoff
        handoffs = 0
        try:
            for mode, rep in handoff_order(self.exp, modes):
                tag = f"{self.name}{action}/{mode.schedule_text}/{rep}"
                if self.role == "prefill":
                    self._send(mode, tag, states)
                    continue
                record = self._receive(mode, tag, rep)
                handoffs += 1
                if record is not None:
                    results[mode].append(record)
                    records.append(record)
        finally:
            if handoffs:
                self.progress(handoffs)
            for record in records:
                self.emit(record)
        if self.role == "decode":
            for mode in modes:
                self.emit(summarize(self.cfg, self.exp, mode, results[mode], weights))

    def _send(self, mode: Mode, tag: str, states: dict[int, object]) -> None:
        exp = self.exp
        try:
            if mode.from_prompt:
                send_prompt(self.link, self.cfg, self.params, self.tokens, mode, tag,
                            exp.backend, exp.timeout)
                return
            if mode.suffix_chunks not in states:
                # its own suffix is checked on every rep (same mesh shapes: across, bits differ)
                states[mode.suffix_chunks] = prepare(
                    self.cfg, self.params, self.tokens, mode,
                    exp.prefill_devices == exp.decode_devices)
            send_handoff(self.link, states[mode.suffix_chunks], mode, tag, exp.backend,
                         exp.timeout)
        except TransportError:
            if exp.fallback != Fallback.RECOMPUTE:
                raise
            # the decode side rebuilds this cache from the token ids and goes on

    def _receive(self, mode: Mode, tag: str, rep: int) -> Rep | None:
        """One handoff, timed; a timed rep's checked record (None for a warm-up)."""
        exp = self.exp
        before = cores.thread_times()
        result = receive_handoff(self.link, self.cfg, self.params, mode, exp.batch,
                                 exp.seq_len, tag, exp.fallback, exp.backend, exp.timeout)
        use = cores.core_use(before, cores.thread_times())
        if rep < exp.warmup:
            return None
        serialized = serializes(exp.transport, mode, jax.default_backend())
        return self.references.rep(mode, rep - exp.warmup, result, serialized, use)


def handoff_order(exp: Experiment, modes: list[Mode]) -> list[tuple[Mode, int]]:
    """(mode, rep) of one action's handoffs in run order (warmups first): every rep of one
    mode, then the next; or, `paired`, the modes alternating within each rep."""
    reps = range(exp.warmup + exp.reps)
    if exp.paired:
        return [(m, rep) for rep in reps for m in modes]
    return [(m, rep) for m in modes for rep in reps]


def summarize(cfg: ModelConfig, exp: Experiment, mode: Mode, reps: list[Rep], weights: str = ""
              ) -> Summary:
    """One summary of checked reps: median and bootstrap CI, phase medians, payload, bytes sent,
    and the checks of every rep."""
    checks = [r.cache_check for r in reps]
    distinct = dict.fromkeys(checks)
    cache_check = checks[0] if len(distinct) == 1 else "; ".join(
        f"{c} ({checks.count(c)} of {len(checks)} reps)" for c in distinct)
    action = mode.action
    return Summary(
        model=cfg.name, seq_len=exp.seq_len, batch=exp.batch, action=action,
        transport=exp.transport, schedule=mode.schedule_text,
        link_gbps=exp.link_gbps, hardware=Device.here().hardware,
        reps_ms=tuple(r.total_ms for r in reps),
        phases_ms=Phases(**{p: float(np.median([getattr(r.phases_ms, p) for r in reps]))
                            for p in PROMPT_PHASES}),
        payload_bytes=action_bytes(cfg, action, exp.seq_len, exp.batch).total_bytes,
        first_token_match=all(r.first_token_match for r in reps), cache_check=cache_check,
        fallbacks=sum(r.fallback for r in reps), weights=weights,
        interval=mode.interval, prefill=mode.prefill, prefill_devices=exp.prefill_devices,
        decode_devices=exp.decode_devices, paired=exp.paired and len(exp.modes(action)) > 1,
        sent_bytes=max(r.sent_bytes for r in reps), serialized=any(r.serialized for r in reps),
        pinning=os.environ.get(PINNING_ENV, ""), chunks=mode.chunks,
        fidelity=Fidelity.median(r.fidelity for r in reps))


def run_side(side: Member, exp: Experiment, session: bool = False) -> None:
    """One side's process of a launched pair (its member: decode-0 or prefill-0): `exp`, then,
    in a `session`, each experiment the launching process hands the decode side (`run_session`);
    records and `Progress` go to the launching process after each action. Over the `local`
    transport the one process runs both sides. Each experiment paces its own link (`run_role`),
    so the transport is unpaced."""
    more = side.requests() if session and side.role == "decode" else ()

    def progress(n: int) -> None:
        side.emit(Progress(n))

    side.on_link(exp.transport, None, exp.timeout, lambda role, transport: run_session(
        role, exp, transport, side.emit, progress, more if role == "decode" else ()))


def run_local(exp: Experiment, emit: Emit, progress: Callable[[int], None] = lambda n: None,
              more: Iterable[Experiment] = ()) -> None:
    """Both sides in this process (the `local` transport): prefill on a thread; `exp`, then
    `more` (`run_session`)."""
    LocalTransport.run_pair(lambda t: run_session("prefill", exp, t, emit, progress),
                            lambda t: run_session("decode", exp, t, emit, progress, more),
                            None, exp.timeout)  # each experiment paces its own link


def launch_pair(exp: Experiment, on_item: Callable[[object], None], pin: bool = True) -> None:
    """Run `exp` on this machine, each side spawned in its environment (`side_environments`:
    a GPU or a fair share each, or on CPU its own cores unless not `pin`) over loopback, under
    a key made for it; records and `Progress` reach `on_item` after each action. A failed side is
    one line naming it and how it ended (`launch.group.run_pair`)."""
    run_pair(run_side, exp, envs=side_environments(exp, pin), key=JobKey.new(),
             coordinator=loopback(), grace=exp.timeout, on_item=on_item)


def open_session(exp: Experiment, envs: dict[Role, dict[str, str]]) -> Job[None]:
    """A pair spawned for `exp` and kept running for more (a sweep's): `Job.wait_ready` returns
    `exp`'s records, `Job.ask(next, timeout)` runs the next experiment on the same processes,
    transport and weights, `Job.close` ends it."""
    return Job.pair(run_side, (exp, True), envs, key=JobKey.new(), coordinator=loopback(),
                    grace=exp.timeout)


def run_process(role: Role, exp: Experiment, coordinator: str | None, key: JobKey | None,
                on_item: Callable[[object], None]) -> None:
    """This process's side of a multi-host pair, spawned in a supervised process of its own
    (`coordinator`: the decode side's host:port; None: JAX detects the cluster)."""
    devices = exp.prefill_devices if role == "prefill" else max(exp.prefill_devices,
                                                                exp.decode_devices)
    env = scheduled_environment(with_host_devices(os.environ, devices))
    run_pair(run_side, exp, envs={role: env}, key=key, coordinator=coordinator,
             grace=exp.timeout, on_item=on_item)


def side_environments(exp: Experiment, pin: bool = True) -> dict[Role, dict[str, str]]:
    """Each side's environment when `launch_pair` runs `exp` on this machine
    (`launch.environments.pair_environments`: on CPU, with `pin`, each side on its own cores;
    a sharded CPU side with its host devices), or the one process's of the `local` transport;
    a ValueError for a refused set-up, e.g. the collective transport on one GPU. The decode
    side builds the prefill mesh too, for its reference (`References`): max(N, M) devices."""
    devices = {"prefill": exp.prefill_devices,
               "decode": max(exp.prefill_devices, exp.decode_devices)}
    if exp.transport == "local":
        return {"decode": with_host_devices(os.environ, devices["decode"])}
    envs = pair_environments(visible_gpus(), os.environ, devices, exp.transport,
                             cpus=usable_cpus() if pin else None)
    return {role: with_host_devices(envs[role], devices[role]) for role in ROLES}


def total_handoffs(exp: Experiment) -> int:
    """Handoffs the decode side will run (for the progress bar)."""
    return sum((exp.warmup + exp.reps) * len(exp.modes(a)) for a in exp.actions)
