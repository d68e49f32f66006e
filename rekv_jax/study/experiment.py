"""`rekv handoff`: timed ReKV handoffs between a prefill and a decode process (paper §3).

Each process runs `run_session`: one experiment (`run_role`), or, for a sweep's pair, one after
another over the same transport and weights. On one machine `launch_pair` starts both over
loopback; on a multi-host allocation the scheduler starts one process per role (see the README).
Both sides
build the same weights (same seed, or the same checkpoint), agree on the experiment, then run
`warmup + reps` handoffs per action and schedule. The decode side checks every timed rep's first
token and complete cache against its own single-process prefill (`References`), and emits one
JSON object per rep (`kind: "rep"`) and per action and schedule (`kind: "summary"`). Under
`fallback="recompute"` a lost prefix costs one rep its transfer, not the run: the decode side
rebuilds that cache from the token ids and both sides go on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
from collections.abc import Callable, Iterable, Iterator
from typing import TextIO

import jax
import jax.numpy as jnp
import numpy as np

from rekv_jax.action import Action, ActionKind
from rekv_jax.config import ModelConfig
from rekv_jax.handoff import chunked
from rekv_jax.handoff.check import HostReference, check_cache, split_reference
from rekv_jax.handoff.core import (
    check_schedule,
    prepare,
    receive_handoff,
    send_handoff,
    send_prompt,
)
from rekv_jax.handoff.outcome import Handoff
from rekv_jax.handoff.prefix_format import KeyBias
from rekv_jax.model.loader import load_model
from rekv_jax.model.transformer import Params, attention_backend, prefill
from rekv_jax.phases import (
    FALLBACKS,
    PAPER_SCHEDULES,
    PROMPT_PHASES,
    SCHEDULES,
    Fallback,
    Interval,
    Phases,
    PrefillMode,
    Schedule,
    check_modes,
)
from rekv_jax.sharding import shard_params
from rekv_jax.sizes import action_bytes
from rekv_jax.study.device import Device
from rekv_jax.study.records import Rep, Summary, record_schedule, serializes
from rekv_jax.transport import Transport, TransportError, checksums
from rekv_jax.transport.base import Role
from rekv_jax.transport.cores import PINNING_ENV, usable_cpus
from rekv_jax.transport.job import PairJob
from rekv_jax.transport.launch import agree_runtime, pair_environments, visible_gpus
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
        if self.fallback not in FALLBACKS:
            raise ValueError(f"fallback must be one of {FALLBACKS}, got {self.fallback!r}")
        check_modes(self.interval, self.prefill)
        for s in self.schedules:  # the chunks are the chunked schedule's
            chunks = self.chunks if s == Schedule.CHUNKED else 1
            check_schedule(s, self.prefill, chunks, self.seq_len)
        if self.chunks > 1 and self.prefill_devices * self.decode_devices > 1:
            raise ValueError("token chunks run on one device per side")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Experiment:
        return cls(**json.loads(text))

    def schedules_of(self, action: Action) -> tuple[str, ...]:
        """The schedules an action runs under: only a joint action has anything to overlap."""
        return self.schedules if action.kind == ActionKind.JOINT else self.schedules[:1]

    def chunks_of(self, action: Action, schedule: str) -> int:
        """Token chunks of `action` under `schedule` (1: unchunked)."""
        chunked = schedule == Schedule.CHUNKED and (action.kind == ActionKind.JOINT
                                                   or self.prefill != PrefillMode.FULL)
        return self.chunks if chunked else 1


def fingerprint(cfg: ModelConfig, params: Params) -> str:
    """Config plus an on-device checksum of every byte of every weight (the transports'
    position-weighted sum): two sides whose fingerprints agree hold the same model, barring a
    checksum collision."""
    sums = checksums(jax.tree.leaves(params))
    text = json.dumps([cfg.to_dict(), sums], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# The decode side of a sweep's pair (`rekv handoff --session`) prints this line after the
# records of each experiment
SESSION_DONE = json.dumps({"kind": "experiment_done"})


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


def session_experiments(lines: TextIO, out: TextIO) -> Iterator[Experiment]:
    """The experiments after the first of `rekv handoff --session` (a sweep's pair), as
    `run_session` consumes them: once the last one's records are out, SESSION_DONE goes to `out`,
    then the next is read from `lines` (JSON, one a line), until they end."""
    while True:
        print(SESSION_DONE, file=out, flush=True)
        line = lines.readline()
        if not line.strip():
            return
        yield Experiment.from_json(line)


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
    transport.set_link(exp.link_gbps)
    # different attention backends, versions, XLA flags or devices give different bits
    agree_runtime(transport, attention_backend(cfg, params["embed"].dtype), exp.timeout,
                  f"{name}runtime")
    transport.agree(f"{name}experiment", {**dataclasses.asdict(exp), "model": model_fingerprint},
                    exp.timeout)
    tokens = jax.random.randint(jax.random.key(exp.seed + 1), (exp.batch, exp.seq_len), 0,
                                cfg.vocab_size, jnp.int32)
    if exp.prefill_devices * exp.decode_devices > 1:  # a mesh per side
        transport = MeshTransport(transport, cfg, exp.prefill_devices, exp.decode_devices)
        params = shard_params(cfg, params, transport.mesh)
    references = References(cfg, params, tokens, exp) if role == "decode" else None
    for action in exp.actions:
        ready = role == "prefill" and exp.interval == Interval.READY
        states = {}  # the prefill state per token chunks
        schedules = exp.schedules_of(action)
        results: dict[str, list[Rep]] = {s: [] for s in schedules}
        for schedule, rep in handoff_order(exp, schedules):
            tag = f"{name}{action}/{schedule}/{rep}"
            chunks, runs_in = exp.chunks if schedule == Schedule.CHUNKED else 1, exp.chunks_of(
                action, schedule)  # what the sides are given, what the action runs in
            if ready and chunks not in states:
                # its own suffix is checked on every rep (same mesh shapes: across, bits differ)
                states[chunks] = prepare(cfg, params, tokens, action, exp.prefill_devices
                                         == exp.decode_devices, runs_in)
            if role == "prefill":
                try:
                    if ready:
                        send_handoff(transport, states[chunks], action, tag, exp.backend,
                                     exp.timeout, chunks)
                    else:
                        send_prompt(transport, cfg, params, tokens, action, tag, exp.prefill,
                                    exp.backend, exp.timeout, chunks)
                except TransportError:
                    if exp.fallback != Fallback.RECOMPUTE:
                        raise
                    # the decode side rebuilds this cache from the token ids and goes on
                continue
            result = receive_handoff(transport, cfg, params, action, exp.batch, exp.seq_len,
                                     tag, schedule, exp.fallback, exp.backend, exp.timeout,
                                     exp.prefill, chunks)
            progress(1)
            if rep >= exp.warmup:  # every timed rep is checked, then its cache is dropped
                first_ok, cache_check = references.check(action, result, runs_in)
                stated = record_schedule(action, schedule)
                record = Rep(action, stated, rep - exp.warmup,
                             result.total_ms, result.phases_ms, result.fallback,
                             result.timeline_ms, result.sent_bytes, first_ok, cache_check,
                             serializes(exp.transport, stated, jax.default_backend()), runs_in)
                results[schedule].append(record)
                emit(record)
        if role == "decode":
            for schedule in schedules:
                emit(summarize(cfg, exp, action, schedule, results[schedule], model.weights))


class References:
    """The single-process caches and first tokens a handoff is checked against, one per cut,
    each computed once, and kept on the host with their error bounds (`HostReference`): a
    `prefill`, or, between sharded sides, the same split in this process (`split_reference`:
    bits differ across meshes)."""

    def __init__(self, cfg: ModelConfig, params: Params, tokens: jax.Array, exp: Experiment
                 ) -> None:
        self._cfg, self._params, self._tokens = cfg, params, tokens
        self._devices = (exp.prefill_devices, exp.decode_devices)
        self._sharded = self._devices != (1, 1)
        self._pipelined = exp.prefill == PrefillMode.PIPELINED
        self._cache: dict[tuple[int, int], tuple[HostReference, np.ndarray, str]] = {}
        if not self._sharded:  # compile the model's programs now, beside the prefill side's
            self._reference(0, exp.chunks if self._pipelined else 1)

    def _reference(self, cut: int, chunks: int) -> tuple[HostReference, np.ndarray, str]:
        """(the reference cache of `cut` in `chunks`, its first token, its name), once."""
        # one (chunked) prefill serves every cut of one-device sides
        key = (cut if self._sharded or (chunks > 1 and not self._pipelined) else -1, chunks)
        if key not in self._cache:
            args = self._cfg, self._params, self._tokens
            reference, logits, name = (
                chunked.reference(*args, cut, chunks, self._pipelined) if chunks > 1
                else (*split_reference(*args, cut, *self._devices), "") if self._sharded
                else (*prefill(*args), ""))
            self._cache[key] = (HostReference(reference, KeyBias.of(self._cfg, self._params)),
                                np.asarray(jnp.argmax(logits, axis=-1)), name)
        return self._cache[key]

    def check(self, action: Action, result: Handoff, chunks: int = 1) -> tuple[bool, str]:
        """(first token matches, what held of the cache: `check_cache`, plus for sharded sides
        what the cache was compared with); `chunks` > 1: against the chunked reference."""
        cut = 0 if result.fallback else action.cut  # a fallback rebuilt the cache from the ids
        reference, first, name = self._reference(cut, 1 if result.fallback else chunks)
        text = check_cache(reference, action, result, name)
        if self._sharded:
            text += _reference_text(self._cfg, cut, *self._devices)
        return bool(np.array_equal(result.first_token, first)), text


def handoff_order(exp: Experiment, schedules: tuple[str, ...]) -> list[tuple[str, int]]:
    """(schedule, rep) of one action's handoffs in run order (warmups first): every rep of one
    schedule, then the next; or, `paired`, the schedules alternating within each rep."""
    reps = range(exp.warmup + exp.reps)
    if exp.paired:
        return [(s, rep) for rep in reps for s in schedules]
    return [(s, rep) for s in schedules for rep in reps]


def summarize(cfg: ModelConfig, exp: Experiment, action: Action, schedule: str,
              reps: list[Rep], weights: str = "") -> Summary:
    """One summary of checked reps: median and bootstrap CI, phase medians, payload, bytes sent,
    and the checks of every rep."""
    checks = [r.cache_check for r in reps]
    distinct = dict.fromkeys(checks)
    cache_check = checks[0] if len(distinct) == 1 else "; ".join(
        f"{c} ({checks.count(c)} of {len(checks)} reps)" for c in distinct)
    return Summary(
        model=cfg.name, seq_len=exp.seq_len, batch=exp.batch, action=action,
        transport=exp.transport, schedule=record_schedule(action, schedule),
        link_gbps=exp.link_gbps, hardware=Device.here().hardware,
        reps_ms=tuple(r.total_ms for r in reps),
        phases_ms=Phases(**{p: float(np.median([getattr(r.phases_ms, p) for r in reps]))
                            for p in PROMPT_PHASES}),
        payload_bytes=action_bytes(cfg, action, exp.seq_len, exp.batch).total_bytes,
        first_token_match=all(r.first_token_match for r in reps), cache_check=cache_check,
        fallbacks=sum(r.fallback for r in reps), weights=weights,
        interval=exp.interval, prefill=exp.prefill, prefill_devices=exp.prefill_devices,
        decode_devices=exp.decode_devices, paired=exp.paired and len(exp.schedules_of(action)) > 1,
        sent_bytes=max(r.sent_bytes for r in reps), serialized=any(r.serialized for r in reps),
        pinning=os.environ.get(PINNING_ENV, ""), chunks=exp.chunks_of(action, schedule))


def _reference_text(cfg: ModelConfig, cut: int, prefill_devices: int, decode_devices: int
                    ) -> str:
    """What the sharded sides' cache was compared with (see `split_reference`)."""
    if cut == 0:
        return f" to a prefill on {decode_devices} devices"
    if cut == cfg.num_layers:
        return f" to a prefill on {prefill_devices} devices"
    return f" to a prefix on {prefill_devices} devices and a suffix on {decode_devices}"


def pair_job(exp: Experiment, emit: Emit, progress: Callable[[int], None] = lambda n: None,
             more: Iterable[Experiment] = ()) -> PairJob[None]:
    """`exp`, then `more` (`run_session`), as the job of both sides; as a process of its own,
    the prefill side runs in a supervised worker (`PairJob.side`)."""
    return PairJob(lambda role, t: run_session(role, exp, t, emit, progress, more),
                   exp.transport, exp.link_gbps, exp.timeout,
                   ("handoff", "--experiment", exp.to_json()), supervised=True)


def run_local(exp: Experiment, emit: Emit, progress: Callable[[int], None] = lambda n: None,
              more: Iterable[Experiment] = ()) -> None:
    """Both sides in this process (the `local` transport): prefill on a thread; `exp`, then
    `more` (`run_session`)."""
    pair_job(exp, emit, progress, more).here()


def run_process(role: Role, exp: Experiment, coordinator: str | None, emit: Emit) -> None:
    """This process's side over a real transport (jax.distributed is initialized here)."""
    pair_job(exp, emit).side(role, coordinator)


def launch_pair(exp: Experiment, emit: Emit, progress: Callable[[int], None] = lambda n: None,
                more: Iterable[Experiment] = (), pin: bool = True) -> None:
    """Run both sides on this machine over loopback, `exp` then `more` (`run_session`), each
    side one process for all of them: this process decodes, a child prefills
    (`transport.launch.with_prefill_child`: a GPU or a fair share per side, bounded, and a dead
    child is named by its exit). The decode side builds the prefill mesh too, for its reference
    (`References`), so it needs max(N, M) devices. On CPU each side runs on its own cores
    unless not `pin`."""
    pair_job(exp, emit, progress, more).launch(side_environments(exp, pin))


def side_environments(exp: Experiment, pin: bool = True) -> dict[Role, dict[str, str]]:
    """Each side's environment when `launch_pair` runs `exp` on this machine
    (`transport.launch.pair_environments`: on CPU, with `pin`, each side on its own cores); a
    ValueError for a refused set-up, e.g. the collective transport on one GPU."""
    devices = {"prefill": exp.prefill_devices,
               "decode": max(exp.prefill_devices, exp.decode_devices)}
    return pair_environments(visible_gpus(), os.environ, devices, exp.transport,
                             cpus=usable_cpus() if pin else None)


def total_handoffs(exp: Experiment) -> int:
    """Handoffs the decode side will run (for the progress bar)."""
    return sum((exp.warmup + exp.reps) * len(exp.schedules_of(a)) for a in exp.actions)
