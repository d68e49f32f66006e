"""The handoff end to end: both schedules, every action kind, through the real links, faults."""

import dataclasses
import json
import os
import pickle
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rekv_jax import (
    Action,
    KVCache,
    ModelConfig,
    greedy_decode,
    init_params,
    parse_actions,
    prefill,
    sizes,
)
from rekv_jax.handoff.check import SUFFIX_ACROSS, HostReference, check_cache
from rekv_jax.handoff.outcome import Handoff, PrefillTimes
from rekv_jax.handoff.payload import round_trip
from rekv_jax.handoff.prefix_format import PrefixCodec
from rekv_jax.handoff.receiver import receive_handoff
from rekv_jax.handoff.sender import prepare, send_handoff, send_prompt
from rekv_jax.launch.environments import pair_environments, visible_gpus
from rekv_jax.launch.group import loopback
from rekv_jax.mode import PAPER_SCHEDULES, Mode
from rekv_jax.model.loader import SHIPPED_MODEL, load_config
from rekv_jax.phases import TIMELINE, Phases
from rekv_jax.planning.planner import analytic_profile
from rekv_jax.sizes import action_bytes
from rekv_jax.study.experiment import Experiment, handoff_order, run_local
from rekv_jax.study.records import Rep, Summary
from rekv_jax.study.sweep_plan import prompt_experiment
from rekv_jax.study.tables import fig3_rows
from rekv_jax.transport import LocalTransport, TransportError
from rekv_jax.transport.cores import PINNING_ENV, usable_cpus

ACTIONS = "bf16:full,q8:full,bf16:r=2,q8:r=2,q4:r=3,bf16:recompute"
ID_BYTES = 4  # int32 token ids and first token


def expected_sent_bytes(cfg, action, seq_len, batch=1, prefill="full", chunks=1):
    """What a handoff must put on the wire, from the paper's formulas: the prefix (Eq. 5 in
    BF16, Eq. 7 in b bits, in its format; a pipelined prefill's chunk by chunk) and `h_c` of a
    joint action (Eq. 1), plus what carries the request: the token ids (always) and the first
    token (beside the ids, unless a split prefill's boundary message is `h_c`)."""
    joint = action.kind == "joint"
    spans = sizes.token_chunks(seq_len, chunks) if prefill == "pipelined" else [(0, seq_len)]
    paper = (sum(sizes.prefix_bytes(cfg, b - a, action.cut, action.bits, batch, action.format)
                 for a, b in spans)
             + joint * sizes.boundary_bytes(cfg, seq_len, batch))
    token_ids = batch * seq_len * ID_BYTES
    first_token = batch * ID_BYTES if prefill == "full" or action.kind == "transfer" else 0
    return paper + token_ids + first_token


def check_summaries(records: list[dict], actions: str, seq_len: int, reps: int = 2,
                    prefill: str = "full") -> None:
    cfg = ModelConfig.preset("tiny")
    summaries = [r for r in records if r["kind"] == "summary"]
    assert [s["action"] for s in summaries if s["schedule"] != "sequential"] == actions.split(",")
    for s in summaries:
        action = Action.parse(s["action"], cfg.num_layers)
        assert s["first_token_match"] is True, s
        want = "bitwise" if action.bits == 16 or action.cut == 0 else (
            f"suffix bitwise, prefix within the {action.precision} error bound")
        if action.kind == "joint" and s["interval"] == "ready":  # the prefill process's own
            want += SUFFIX_ACROSS  # suffix, computed before the interval, checked on every rep
        assert s["cache_check"] == want, s
        assert s["payload_bytes"] == action_bytes(cfg, action, seq_len).total_bytes
        assert s["sent_bytes"] == expected_sent_bytes(cfg, action, seq_len, prefill=prefill), s
        assert len(s["reps_ms"]) == reps and s["fallbacks"] == 0
        assert set(s["phases_ms"]) == {"prefill", "quantize", "boundary", "prefix", "suffix",
                                       "join"}
        if action.kind == "joint":
            assert s["phases_ms"]["suffix"] > 0 and s["phases_ms"]["prefix"] > 0
        if action.bits != 16:
            assert s["phases_ms"]["quantize"] > 0
    for r in records:  # every rep is checked on its own
        if r["kind"] == "rep":
            assert r["first_token_match"] and not r["cache_check"].startswith("MISMATCH"), r
            assert set(r["timeline_ms"]) == set(TIMELINE)


def test_local_transport_all_action_kinds():
    records: list[dict] = []
    exp = Experiment(seq_len=64, actions=tuple(parse_actions(ACTIONS, 6)), warmup=1, reps=2)
    assert pickle.loads(pickle.dumps(exp)) == exp  # what a launched side receives
    run_local(exp, lambda r: records.append(r.to_json()))
    check_summaries(records, ACTIONS, 64)
    joint = [s["schedule"] for s in records if s["kind"] == "summary"
             and s["action"] == "q8:r=2"]
    assert joint == ["overlapped", "sequential"]
    assert sum(r["kind"] == "rep" for r in records) == 2 * (len(ACTIONS.split(",")) + 3)


def check_overlap(records: list[dict], action: str) -> None:
    """The overlapped schedule overlaps: in every rep the suffix starts before the prefix has
    arrived (the sequential one waits for it), and the overlapped median is below the
    sequential one by at least half the suffix's time."""
    reps = {s: [r for r in records if r["kind"] == "rep" and r["action"] == action
                and r["schedule"] == s] for s in PAPER_SCHEDULES}
    for r in reps["overlapped"]:
        assert r["timeline_ms"]["suffix_start"] < r["timeline_ms"]["prefix"], r["timeline_ms"]
    for r in reps["sequential"]:
        assert r["timeline_ms"]["suffix_start"] >= r["timeline_ms"]["prefix"], r["timeline_ms"]
    ov, seq = ({k: np.median([r[k] if k == "total_ms" else r["phases_ms"][k] for r in reps[s]])
                for k in ("total_ms", "prefix", "suffix")} for s in PAPER_SCHEDULES)
    assert seq["prefix"] > 2 * seq["suffix"], (seq, "the link must be the bottleneck here")
    assert ov["total_ms"] < seq["total_ms"] - seq["suffix"] / 2, (ov, seq)


def test_overlap_happens_on_a_paced_local_link():
    """bf16:r=2 of tiny at 256 tokens on a link where the 4-layer prefix takes ~8x the 2-layer
    suffix (about 16 ms on an idle CPU core; the margin leaves room for load): overlapped saves
    about the whole suffix."""
    cfg = ModelConfig.preset("tiny")
    action = Action.parse("bf16:r=2", cfg.num_layers)
    prefix_ms = 8 * 16.0  # 8x the measured 2-layer suffix
    link = sizes.prefix_bytes(cfg, 256, action.cut, 16) / (prefix_ms * 1e6)
    exp = Experiment(seq_len=256, actions=(action,), link_gbps=link, transport="local",
                     warmup=1, reps=3)
    records: list[dict] = []
    run_local(exp, lambda r: records.append(r.to_json()))
    check_summaries(records, "bf16:r=2", 256, reps=3)
    check_overlap(records, "bf16:r=2")


# Two processes: a paced link with each side compiling its own programs (no shared compilation
# cache, so the cross-process bitwise checks compare independently compiled executables), the
# collective transport unpaced, and the split, streamed prefill over the collective (whose
# receives must stay in order while a worker pulls the layers).
PAIRS = {
    "transfer-server-paced": ("transfer-server", "bf16:full,q8:full,bf16:r=4,q8:r=4,bf16:recompute",
                              128, ["--link-gbps", "0.001"], "full"),
    "collective": ("collective", "bf16:full,q8:full,bf16:r=2,q8:r=2,bf16:recompute", 64,
                   ["--link-gbps", "unpaced"], "full"),
    "collective-split": ("collective", "q8:full,bf16:r=2,q8:r=2,bf16:recompute", 64,
                         ["--link-gbps", "unpaced", "--interval", "prompt", "--prefill", "split",
                          "--no-pin"], "split"),
}
CACHE_VARS = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
              "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")


@pytest.mark.parametrize("pair", list(PAIRS))
def test_two_processes(pair):
    transport, actions, seq_len, flags, prefill_mode = PAIRS[pair]
    paced = "unpaced" not in flags
    env = {k: v for k, v in os.environ.items() if not (paced and k in CACHE_VARS)}
    out = subprocess.run(
        [sys.executable, "-m", "rekv_jax.cli", "handoff", "--seq-len", str(seq_len), "--actions",
         actions, "--transport", transport, "--warmup", "1", "--reps", "3" if paced else "2",
         "--json", "--timeout", "60", *flags],
        capture_output=True, text=True, timeout=420, env=env)  # 2 shared cores: margin
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in out.stdout.splitlines()]
    check_summaries(records, actions, seq_len, reps=3 if paced else 2, prefill=prefill_mode)
    summaries = [r for r in records if r["kind"] == "summary"]
    assert {r["transport"] for r in summaries} == {transport}
    # on CPU each side on its own cores unless --no-pin, and every record says which
    cpus = None if "--no-pin" in flags else usable_cpus()
    pinning = pair_environments(visible_gpus(), os.environ, cpus=cpus)["decode"].get(PINNING_ENV)
    assert {r["pinning"] for r in summaries} == {pinning or ""}
    if pinning and pinning.startswith("pinned"):  # each launched side split its device's threads
        suffixed = [r for r in summaries if r["fidelity"] is not None]  # from its host threads
        assert suffixed and all(r["fidelity"]["device_wait_ms"] is not None for r in suffixed)
    if not paced:
        return
    # the pacer holds a transfer of n bytes to n / W: not faster, and not much slower
    cfg, gbps = ModelConfig.preset("tiny"), float(flags[1])
    (bf16,) = [s for s in summaries if s["action"] == "bf16:full"]
    link_ms = sizes.prefix_bytes(cfg, seq_len, cfg.num_layers, 16) / (gbps * 1e6)  # 393 ms
    assert 0.9 * link_ms <= bf16["phases_ms"]["prefix"] <= 1.3 * link_ms + 20, (bf16, link_ms)
    check_overlap(records, "bf16:r=4")


def test_sides_started_apart_that_disagree_both_fail(tmp_path):
    """Two processes started as a scheduler starts them (`--role`, one key file for both): each
    runs its side, and both fail in one line naming what differs."""
    key = tmp_path / "job.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    coordinator = loopback()
    sides = {role: subprocess.Popen(
        [sys.executable, "-m", "rekv_jax.cli", "handoff", "--seq-len",
         "64" if role == "prefill" else "32", "--actions", "bf16:r=2", "--reps", "1", "--warmup",
         "0", "--json", "--timeout", "30", "--role", role, "--coordinator", coordinator,
         "--secret-file", str(key)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for role in ("decode", "prefill")}
    for role, proc in sides.items():
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 2, (role, err[-2000:])  # a disagreement: ValueError
        (line,) = err.strip().splitlines()
        assert "disagree on" in line and "seq_len" in line, line


class FailingPrefix(LocalTransport):
    """A link that loses the prefix payload (the peer 'dies' mid-transfer)."""

    def _take(self, arrival, specs):
        if arrival.tag.endswith("/prefix"):
            self._settle(arrival, error=TransportError(f"{arrival.tag}: connection reset"))
            return
        super()._take(arrival, specs)


@pytest.mark.parametrize("fallback", ["error", "recompute"])
def test_failed_prefix_transfer(fallback):
    cfg = ModelConfig.preset("tiny")
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 64), 0, cfg.vocab_size, jnp.int32)
    action = Action.parse("q8:r=2", cfg.num_layers)
    mode = Mode.of(action)
    sender, decode = LocalTransport.pair()
    receiver = FailingPrefix("decode", decode._channel)
    errors = []

    def send():
        try:
            send_handoff(sender, prepare(cfg, params, tokens, mode), mode, "t", timeout=10)
        except Exception as e:
            errors.append(e)

    thread = threading.Thread(target=send)
    thread.start()
    try:
        if fallback == "error":
            with pytest.raises(TransportError, match="connection reset"):
                receive_handoff(receiver, cfg, params, mode, 1, 64, "t", timeout=10)
        else:
            result = receive_handoff(receiver, cfg, params, mode, 1, 64, "t",
                                     fallback="recompute", timeout=10)
            assert result.fallback
            reference, logits = prefill(cfg, params, tokens)
            assert check_cache(reference, action, result) == "bitwise"
            assert np.array_equal(result.first_token, jnp.argmax(logits, axis=-1))
    finally:
        thread.join(20)
    assert not thread.is_alive()
    assert errors and "connection reset" in str(errors[0])  # the prefill side hears of it too


def test_lost_prefix_on_one_rep_falls_back_through_the_runner(monkeypatch):
    """A link that loses the prefix of one timed rep: under `fallback="recompute"` that rep's
    cache is rebuilt from the token ids and counted, both sides go on, and every rep checks."""
    lost = "q8:r=2/overlapped/2/prefix"  # the second of three timed reps (one warm-up)
    take = LocalTransport._take

    def losing(self, arrival, specs):
        if arrival.tag == lost:
            self._settle(arrival, error=TransportError(f"{arrival.tag}: connection reset"))
            return
        take(self, arrival, specs)

    monkeypatch.setattr(LocalTransport, "_take", losing)
    exp = Experiment(seq_len=32, actions=(Action.parse("q8:r=2", 6),), schedules=("overlapped",),
                     transport="local", warmup=1, reps=3, fallback="recompute")
    out = []
    run_local(exp, out.append)
    reps = [r for r in out if isinstance(r, Rep)]
    assert [r.fallback for r in reps] == [False, True, False]
    assert all(r.first_token_match for r in reps)
    assert reps[1].cache_check == "bitwise"  # rebuilt from the ids: a full prefill's cache
    (summary,) = [r for r in out if isinstance(r, Summary)]
    assert summary.fallbacks == 1 and summary.first_token_match
    assert summary.cache_check == (f"suffix bitwise, prefix within the q8 error bound"
                                   f"{SUFFIX_ACROSS} (2 of 3 reps); bitwise (1 of 3 reps)")
    with pytest.raises(TransportError, match="connection reset"):  # fallback "error": it fails
        run_local(dataclasses.replace(exp, fallback="error"), lambda r: None)


def test_prefill_times_wire_format():
    """The prefill side's `TAG/prefill` message keeps its keys: suffix_sums only when computed."""
    plain = PrefillTimes(1.5, 0.25, 2.0, 4096)
    assert plain.to_json() == {"prefill_ms": 1.5, "quantize_ms": 0.25, "boundary_at_ms": 2.0,
                               "sent_bytes": 4096}
    summed = PrefillTimes(1.5, 0.25, 2.0, 4096, (7, 9))
    assert json.loads(json.dumps(summed.to_json()))["suffix_sums"] == [7, 9]
    for sent in (plain, summed):
        assert PrefillTimes.from_json(json.loads(json.dumps(sent.to_json()))) == sent


def test_cache_check_does_not_trust_the_payload_code():
    """check_cache bounds a restored Q8 prefix by the quantizer's error bound computed from the
    prefill's KV alone: a 1% scale error, swapped K/V, a Q4 restore or the wrong dtype fail."""
    cfg = ModelConfig.preset("tiny")
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 32), 0, cfg.vocab_size, jnp.int32)
    reference, logits = prefill(cfg, params, tokens)
    action, first = Action.parse("q8:r=2", cfg.num_layers), jnp.argmax(logits, axis=-1)
    suffix = reference.layers(4, 6)

    def check(prefix: KVCache, against: KVCache | HostReference = reference) -> str:
        return check_cache(against, action, Handoff(KVCache.concat(prefix, suffix), first,
                                                    0.0, Phases(0.0, 0.0, 0.0, 0.0, 0.0)))

    def restored(bits: int) -> KVCache:
        return round_trip(reference.layers(0, 4), PrefixCodec(bits))

    q8 = restored(8)
    assert check(q8) == "suffix bitwise, prefix within the q8 error bound"
    assert check(reference.layers(0, 4)) == "suffix bitwise, prefix within the q8 error bound"
    bads = (KVCache.stacked(q8.k * 1.01, q8.v), KVCache.stacked(q8.v, q8.k), restored(4),
            KVCache.stacked(q8.k.astype(jnp.float32), q8.v.astype(jnp.float32)))
    for bad in bads:
        assert check(bad) == "MISMATCH in prefix"
    # one host reference for many checks (a sweep's): its stored bounds pass and fail the same
    host = HostReference(reference)
    assert [check(p, host) for p in (q8, *bads, q8)] == [check(p) for p in (q8, *bads, q8)]


def run_one(cfg, params, tokens, action, prefill_mode, schedule="overlapped", receiver=None,
            fallback="error"):
    """One prompt-interval handoff over a local link: (decode side's Handoff, prefill's errors).
    Timeouts are generous: the first call compiles every per-layer step on a loaded machine."""
    sender, decode = LocalTransport.pair()
    receiver = receiver(decode._channel) if receiver else decode
    mode = Mode.of(action, schedule, prefill_mode, interval="prompt")
    errors = []

    def send():
        try:
            send_prompt(sender, cfg, params, tokens, mode, "t", timeout=120)
        except Exception as e:
            errors.append(e)

    thread = threading.Thread(target=send)
    thread.start()
    try:
        result = receive_handoff(receiver, cfg, params, mode, *tokens.shape, "t", fallback,
                                 timeout=120)
    finally:
        thread.join(120)
    assert not thread.is_alive()
    return result, errors


@pytest.mark.parametrize("action", ["q8:r=2", "bf16:r=3", "q4:full", "bf16:recompute"])
def test_streamed_equals_non_streamed_bitwise(action):
    cfg = ModelConfig.preset("tiny")
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 32), 0, cfg.vocab_size, jnp.int32)
    action = Action.parse(action, cfg.num_layers)
    reference, logits = prefill(cfg, params, tokens)
    full, _ = run_one(cfg, params, tokens, action, "full")
    for schedule in ("overlapped", "sequential"):
        split, errors = run_one(cfg, params, tokens, action, "split", schedule)
        assert not errors and not split.fallback
        assert np.array_equal(split.kv.k, full.kv.k) and np.array_equal(split.kv.v, full.kv.v)
        assert np.array_equal(split.first_token, full.first_token)
        assert np.array_equal(split.first_token, jnp.argmax(logits, axis=-1))
        assert check_cache(reference, action, split) == check_cache(reference, action, full)
        assert not check_cache(reference, action, split).startswith("MISMATCH")
        assert split.phases_ms.prefill > 0 or action.cut == 0


def lose_layer(k):
    class LosesLayer(LocalTransport):
        """A prefill peer that dies after streaming k prefix layers."""

        def _take(self, arrival, specs):
            if arrival.tag.endswith(f"/layer{k}"):
                self._settle(arrival, error=TransportError(
                    f"{arrival.tag}: the peer process is gone"))
                return
            super()._take(arrival, specs)

    return lambda channel: LosesLayer("decode", channel)


@pytest.mark.parametrize("fallback", ["error", "recompute"])
def test_peer_dies_mid_stream(fallback):
    cfg = ModelConfig.preset("tiny")
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 32), 0, cfg.vocab_size, jnp.int32)
    action = Action.parse("q8:r=2", cfg.num_layers)  # c = 4 streamed layers; the 3rd is lost
    if fallback == "error":
        with pytest.raises(TransportError, match="prefix part layer2 lost after 2 of 4 arrived"):
            run_one(cfg, params, tokens, action, "split", receiver=lose_layer(2))
        return
    result, errors = run_one(cfg, params, tokens, action, "split", receiver=lose_layer(2),
                             fallback="recompute")
    reference, logits = prefill(cfg, params, tokens)
    assert result.fallback and check_cache(reference, action, result) == "bitwise"
    assert np.array_equal(greedy_decode(cfg, params, result.kv, logits, 4),
                          greedy_decode(cfg, params, reference, logits, 4))
    assert errors and "gone" in str(errors[0])  # the prefill side hears of it too


def test_paired_reps_alternate_the_schedules():
    exp = Experiment(actions=(Action(16, 4, 6),), schedules=("sequential", "overlapped"),
                     warmup=1, reps=2, paired=True)
    seq, ov = exp.modes(exp.actions[0])
    assert (seq.schedule, ov.schedule) == ("sequential", "overlapped")
    assert handoff_order(exp, [seq, ov]) == [
        (seq, 0), (ov, 0), (seq, 1), (ov, 1), (seq, 2), (ov, 2)]
    blocks = dataclasses.replace(exp, paired=False)
    assert handoff_order(blocks, [seq, ov]) == [
        (seq, 0), (seq, 1), (seq, 2), (ov, 0), (ov, 1), (ov, 2)]


def test_fig3_twin_prompt_interval_paired_reps():
    """The sweep's Fig. 3 experiment on tiny shapes: prompt to first token, BF16 joint action,
    both schedules as paired reps; the paired speedup CI comes out of the report."""
    prof = analytic_profile(ModelConfig.preset("tiny"), 32, link_gbps=0.01)
    exp = dataclasses.replace(prompt_experiment("tiny", 32, prof, "local", None, reps=3,
                                                warmup=1), timeout=300)
    assert exp.paired and exp.interval == "prompt" and exp.prefill == "full"
    assert [a.kind for a in exp.actions] == ["joint"] and exp.actions[0].bits == 16
    out = []
    run_local(exp, out.append)
    reps = [(r.schedule, r.rep) for r in out if isinstance(r, Rep)]
    assert reps == [(s, i) for i in range(3) for s in ("sequential", "overlapped")]
    summaries = [r for r in out if isinstance(r, Summary)]
    assert [s.schedule for s in summaries] == ["sequential", "overlapped"]
    assert all(s.paired and s.interval == "prompt" and s.first_token_match
               and s.phases_ms.prefill > 0 for s in summaries)
    (row,) = fig3_rows(summaries)
    assert row.paired and row.reps == 3 and row.ci95[0] <= row.speedup



STAND_IN = str(SHIPPED_MODEL.parent / "wt2-tiny-kbias")  # k_proj biases with outliers
FORMAT_ACTIONS = ("q4:r=2/debias,q4:full/hadamard,q8:r=3/per-channel,q4:r=1/debias+hadamard,"
                  "q4:r=2/debias+per-channel")


def check_formats(records: list, actions: str, seq_len: int, prefill: str, chunks: int = 1
                  ) -> None:
    """Every action's cache within its format's own error bound, its first token the prefill's,
    and exactly the format's bytes on the wire."""
    cfg = load_config(STAND_IN)
    summaries = [r for r in records if r["kind"] == "summary"]
    assert [s["action"] for s in summaries] == actions.split(",")
    for s in summaries:
        action = Action.parse(s["action"], cfg.num_layers)
        check = s["cache_check"]
        assert check.startswith("suffix bitwise") and (
            f"prefix within the {action.precision}/{action.format} error bound" in check), s
        assert s["first_token_match"] is True
        assert s["sent_bytes"] == expected_sent_bytes(cfg, action, seq_len, prefill=prefill,
                                                      chunks=chunks)


def test_two_processes_carry_every_prefix_format():
    """One prefill and one decode process, the stand-in with Qwen2.5-like k_proj biases (the
    `tiny` preset's synthetic biases are zero), 100 tokens (per-channel keys pad their last
    group): each format's whole prefix passes its cache check."""
    out = subprocess.run(
        [sys.executable, "-m", "rekv_jax.cli", "handoff", "--model", STAND_IN, "--seq-len", "100",
         "--actions", FORMAT_ACTIONS, "--transport", "transfer-server", "--link-gbps", "unpaced",
         "--schedule", "overlapped", "--warmup", "0", "--reps", "1", "--json", "--timeout", "60"],
        capture_output=True, text=True, timeout=420)
    assert out.returncode == 0, out.stderr[-3000:]
    check_formats([json.loads(line) for line in out.stdout.splitlines()], FORMAT_ACTIONS, 100,
                  "full")


@pytest.mark.parametrize("prefill", ["split", "pipelined"])
def test_streamed_layers_and_token_chunks_carry_the_format(prefill):
    """The split prefill's per-layer messages (a debiased layer needs its own bias) and the
    pipelined prefill's token chunks (their positions; per-channel groups of a ragged chunk)."""
    actions = "q4:r=2/debias+per-channel,q8:r=1/debias+hadamard"
    exp = Experiment(model=STAND_IN, seq_len=100, transport="local", warmup=0, reps=1,
                     actions=tuple(parse_actions(actions, 4)), interval="prompt", prefill=prefill,
                     schedules=("chunked" if prefill == "pipelined" else "overlapped",),
                     chunks=3 if prefill == "pipelined" else 1)
    records: list[dict] = []
    run_local(exp, lambda r: records.append(r.to_json()))
    check_formats(records, actions, 100, prefill, exp.chunks)
