"""The handoff end to end: both schedules, every action kind, through the real links, faults."""

import dataclasses
import json
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rekv_jax import Action, ModelConfig, greedy_decode, init_params, parse_actions, prefill
from rekv_jax.experiment import Experiment, handoff_order, run_local
from rekv_jax.handoff import (
    check_cache,
    prepare,
    receive_handoff,
    send_handoff,
    send_prompt,
)
from rekv_jax.planner import analytic_profile
from rekv_jax.report import fig3_rows
from rekv_jax.sizes import action_bytes
from rekv_jax.summary import Rep, Summary
from rekv_jax.sweep import prompt_experiment
from rekv_jax.transport import LocalTransport, TransportError
from rekv_jax.transport.launch import run_pair

ACTIONS = "bf16:full,q8:full,bf16:r=2,q8:r=2,q4:r=3,bf16:recompute"


def check_summaries(summaries: list[dict], actions: str, seq_len: int) -> None:
    cfg = ModelConfig.preset("tiny")
    assert [s["action"] for s in summaries if s["schedule"] != "sequential"] == actions.split(",")
    for s in summaries:
        action = Action.parse(s["action"], cfg.num_layers)
        assert s["first_token_match"] is True, s
        want = "bitwise" if action.bits == 16 or action.cut == 0 else (
            f"suffix bitwise, prefix = {action.precision} round trip")
        assert s["cache_check"] == want, s
        assert s["payload_bytes"] == action_bytes(cfg, action, seq_len)["total_bytes"]
        assert len(s["reps_ms"]) == 2 and s["ci95_ms"][0] <= s["median_ms"] <= s["ci95_ms"][1]
        assert set(s["phases_ms"]) == {"prefill", "quantize", "boundary", "prefix", "suffix",
                                       "join"}
        if action.kind == "joint":
            assert s["phases_ms"]["suffix"] > 0 and s["phases_ms"]["prefix"] > 0
        assert (s["phases_ms"]["quantize"] > 0) == (action.bits != 16)


def test_local_transport_all_action_kinds():
    records: list[dict] = []
    exp = Experiment(seq_len=64, actions=tuple(parse_actions(ACTIONS, 6)), warmup=1, reps=2)
    assert Experiment.from_json(exp.to_json()) == exp  # what the prefill child receives
    run_local(exp, lambda r: records.append(r.to_json()))
    summaries = [r for r in records if r["kind"] == "summary"]
    check_summaries(summaries, ACTIONS, 64)
    joint = [s["schedule"] for s in summaries if s["action"] == "q8:r=2"]
    assert joint == ["overlapped", "sequential"]
    assert sum(r["kind"] == "rep" for r in records) == 2 * (len(ACTIONS.split(",")) + 3)


@pytest.mark.parametrize("transport", ["transfer-server", "collective"])
def test_two_processes(transport):
    actions = "bf16:full,q8:full,bf16:r=2,q8:r=2,bf16:recompute"
    out = subprocess.run(
        [sys.executable, "-m", "rekv_jax.cli", "handoff", "--seq-len", "64", "--actions", actions,
         "--transport", transport, "--warmup", "1", "--reps", "2", "--json", "--timeout", "60",
         "--link-gbps", "unpaced"],
        capture_output=True, text=True, timeout=420)  # 2 shared cores: margin
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in out.stdout.splitlines()]
    check_summaries([r for r in records if r["kind"] == "summary"], actions, 64)
    assert {r["transport"] for r in records if r["kind"] == "summary"} == {transport}


def test_sides_that_disagree_both_fail():
    def argv(role, coordinator):
        seq = "64" if role == "prefill" else "32"
        return [sys.executable, "-m", "rekv_jax.cli", "handoff", "--seq-len", seq, "--actions",
                "bf16:r=2", "--reps", "1", "--warmup", "0", "--json", "--timeout", "30",
                "--role", role, "--coordinator", coordinator]

    done = run_pair(argv, timeout=120)
    for role, proc in done.items():
        assert proc.returncode != 0, role
        assert "disagree on" in proc.stderr and "seq_len" in proc.stderr, proc.stderr[-2000:]


class FailingPrefix(LocalTransport):
    """A link that loses the prefix payload (the peer 'dies' mid-transfer)."""

    def _pull(self, tag, specs, deadline):
        if tag.endswith("/prefix"):
            raise TransportError(f"{tag}: connection reset")
        return super()._pull(tag, specs, deadline)


@pytest.mark.parametrize("fallback", ["error", "recompute"])
def test_failed_prefix_transfer(fallback):
    cfg = ModelConfig.preset("tiny")
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 64), 0, cfg.vocab_size, jnp.int32)
    action = Action.parse("q8:r=2", cfg.num_layers)
    board_pair = LocalTransport.pair()
    sender, receiver = board_pair[0], FailingPrefix("decode", board_pair[1]._channel)
    errors = []

    def send():
        try:
            send_handoff(sender, prepare(cfg, params, tokens, action), action, "t", timeout=10)
        except Exception as e:
            errors.append(e)

    thread = threading.Thread(target=send)
    thread.start()
    try:
        if fallback == "error":
            with pytest.raises(TransportError, match="connection reset"):
                receive_handoff(receiver, cfg, params, action, 1, 64, "t", timeout=10)
        else:
            result = receive_handoff(receiver, cfg, params, action, 1, 64, "t",
                                     fallback="recompute", timeout=10)
            assert result.fallback
            reference, logits = prefill(cfg, params, tokens)
            assert check_cache(reference, action, result) == "bitwise"
            assert np.array_equal(result.first_token, jnp.argmax(logits, axis=-1))
    finally:
        thread.join(20)
    assert not thread.is_alive()
    assert errors and "connection reset" in str(errors[0])  # the prefill side hears of it too


def run_one(cfg, params, tokens, action, prefill_mode, schedule="overlapped", receiver=None,
            fallback="error"):
    """One prompt-interval handoff over a local link: (decode side's Handoff, prefill's errors).
    Timeouts are generous: the first call compiles every per-layer step on a loaded machine."""
    sender, decode = LocalTransport.pair()
    receiver = receiver(decode._channel) if receiver else decode
    errors = []

    def send():
        try:
            send_prompt(sender, cfg, params, tokens, action, "t", prefill_mode, timeout=120)
        except Exception as e:
            errors.append(e)

    thread = threading.Thread(target=send)
    thread.start()
    try:
        result = receive_handoff(receiver, cfg, params, action, *tokens.shape, "t", schedule,
                                 fallback, timeout=120, prefill_mode=prefill_mode)
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
        assert split.phases_ms["prefill"] > 0 or action.cut == 0


def lose_layer(k):
    class LosesLayer(LocalTransport):
        """A prefill peer that dies after streaming k prefix layers."""

        def _pull(self, tag, specs, deadline):
            if tag.endswith(f"/layer{k}"):
                raise TransportError(f"{tag}: the peer process is gone")
            return super()._pull(tag, specs, deadline)

    return lambda channel: LosesLayer("decode", channel)


@pytest.mark.parametrize("fallback", ["error", "recompute"])
def test_peer_dies_mid_stream(fallback):
    cfg = ModelConfig.preset("tiny")
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 32), 0, cfg.vocab_size, jnp.int32)
    action = Action.parse("q8:r=2", cfg.num_layers)  # c = 4 streamed layers; the 3rd is lost
    if fallback == "error":
        with pytest.raises(TransportError, match="prefix layer 2 lost after 2 of 4 arrived"):
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
    assert handoff_order(exp, exp.schedules) == [
        ("sequential", 0), ("overlapped", 0), ("sequential", 1), ("overlapped", 1),
        ("sequential", 2), ("overlapped", 2)]
    blocks = dataclasses.replace(exp, paired=False)
    assert handoff_order(blocks, exp.schedules) == [
        ("sequential", 0), ("sequential", 1), ("sequential", 2),
        ("overlapped", 0), ("overlapped", 1), ("overlapped", 2)]


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
               and s.phases_ms["prefill"] > 0 for s in summaries)
    (row,) = fig3_rows(summaries)
    assert row["paired"] and row["reps"] == 3 and row["ci95"][0] <= row["speedup"]

