"""The emulation's fidelity: every record with a recomputed suffix carries it, `rekv handoff`
warns when a suffix ran slower than alone, and a pinned side's host threads leave its core."""

import json
import os
import statistics
import subprocess
import sys
import textwrap

import pytest

from rekv_jax import Action
from rekv_jax.launch.environments import pair_environments
from rekv_jax.launch.group import run_pair
from rekv_jax.phases import Phases
from rekv_jax.study.experiment import Experiment, run_local
from rekv_jax.study.records import FIDELITY_LIMIT, Fidelity, Rep, Summary
from rekv_jax.transport import cores
from rekv_jax.transport.cores import CoreUse, core_use, usable_cpus

L = 6


def _summary(ratio: float, schedule: str = "overlapped", prefill: str = "full") -> Summary:
    fidelity = Fidelity(10.0, ratio, 2.0, 3.0)
    chunks = 2 if "chunked" in (schedule, prefill) or prefill == "pipelined" else 1
    return Summary("tiny", 64, 1, Action.parse("q8:r=2", L), "local", schedule, None, "cpu",
                   (1.0, 2.0), Phases(0, 0, 0, 10 * ratio, 0), 100, prefill=prefill,
                   interval="ready" if prefill == "full" else "prompt", chunks=chunks,
                   fidelity=fidelity)


def test_every_record_with_a_suffix_carries_its_fidelity():
    got = []
    exp = Experiment(model="tiny", seq_len=32, actions=tuple(
        Action.parse(a, L) for a in ("bf16:full", "q8:r=2", "bf16:recompute")),
        transport="local", warmup=1, reps=3, schedules=("overlapped", "chunked"), chunks=2)
    run_local(exp, got.append)
    reps: dict[tuple, list[float]] = {}
    for record in got:
        line = json.loads(json.dumps(record.to_json()))
        key = (str(record.action), record.schedule)
        if record.action.kind == "transfer":
            assert record.fidelity is None and line["fidelity"] is None
            continue
        f = record.fidelity
        assert f.suffix_alone_ms > 0
        if isinstance(record, Rep):
            assert f.ratio == pytest.approx(record.phases_ms.suffix / f.suffix_alone_ms)
            reps.setdefault(key, []).append(f.ratio)
            assert Rep.from_json(line, L).fidelity == Fidelity(**line["fidelity"])
        else:  # a summary's figures are its reps' medians
            assert f.ratio == pytest.approx(statistics.median(reps[key]))
            assert Summary.from_json(line).fidelity == Fidelity(**line["fidelity"])
    assert set(reps) == {("q8:r=2", "overlapped"), ("q8:r=2", "chunked"),
                         ("bf16:recompute", "n/a")}


@pytest.mark.parametrize("ratio, schedule, prefill, warned", [
    (FIDELITY_LIMIT + 0.01, "overlapped", "full", True),
    (FIDELITY_LIMIT, "overlapped", "full", False),
    (1.0, "sequential", "full", False),
    (2.0, "chunked", "full", False),  # waits for its chunks: recorded, not judged
    (2.0, "chunked", "pipelined", False),
    (2.0, "sequential", "split", True),
])
def test_the_warning_judges_only_a_suffix_that_waits_for_nothing(ratio, schedule, prefill,
                                                                warned):
    text = _summary(ratio, schedule, prefill).fidelity_warning()
    assert (text is not None) == warned
    if warned:
        assert f"{ratio:.2f}×" in text and "waited 2.0 ms" in text


SLOWED = textwrap.dedent("""
    import os, sys, threading
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core for every thread
    from rekv_jax.study import experiment

    def busy(stop):  # takes the core from the suffix while a handoff runs, and only then
        while not stop.is_set():
            sum(range(1000))

    received = experiment.receive_handoff
    def slowed(*args, **kwargs):
        stop = threading.Event()
        thread = threading.Thread(target=busy, args=(stop,))
        thread.start()
        try:
            return received(*args, **kwargs)
        finally:
            stop.set()
            thread.join()
    experiment.receive_handoff = slowed
""")


def test_rekv_handoff_warns_when_the_suffix_is_slowed_on_purpose(tmp_path):
    """`SLOWED` runs at the start of every process of the command (`sitecustomize`), so in the
    side the launcher spawns too."""
    (tmp_path / "sitecustomize.py").write_text(SLOWED)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)}
    argv = ["handoff", "--model", "tiny", "--seq-len", "128", "--actions", "q8:r=4",
            "--schedule", "overlapped", "--transport", "local", "--link-gbps", "unpaced",
            "--warmup", "1", "--reps", "3"]
    out = subprocess.run([sys.executable, "-m", "rekv_jax.cli", *argv], capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    warnings = [line for line in out.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and "q8:r=4 (overlapped)" in warnings[0], out.stderr[-2000:]


def test_core_use_splits_device_and_host_threads():
    before = {1: (0, 0, True), 2: (0, 0, False)}
    after = {1: (5_000_000, 1_000_000, True), 2: (2_000_000, 0, False), 3: (1_000_000, 0, False)}
    assert core_use(before, after) == CoreUse(device_ms=5.0, device_wait_ms=1.0, host_ms=3.0)
    assert core_use(None, after) is None


def split_side(side) -> dict | None:
    """A launched side that starts its device as `connect` does, then times its programs."""
    if side.role == "prefill":
        return None
    cores.start_device(os.environ)
    import jax

    f = jax.jit(lambda a: a @ a)
    a = jax.numpy.ones((512, 512))
    f(a).block_until_ready()
    before = cores.thread_times()
    for _ in range(20):
        f(a).block_until_ready()
    after = cores.thread_times()
    ran = {t: after[t][0] - before.get(t, (0, 0, 0))[0] for t in after}
    busiest = max(ran, key=ran.get)
    return {"main": sorted(os.sched_getaffinity(0)), "busiest_on_device": after[busiest][2],
            "busiest": sorted(os.sched_getaffinity(busiest))}


@pytest.mark.skipif(len(usable_cpus()) < 2, reason="pinning needs two cores")
def test_a_pinned_side_runs_programs_on_its_core_and_everything_else_on_any():
    envs = pair_environments([], {**os.environ, "JAX_PLATFORMS": "cpu"}, cpus=usable_cpus())
    got = run_pair(split_side, envs=envs, key=None, timeout=120)
    cpus = usable_cpus()
    assert got["main"] == cpus  # the host's thread may take any core of the pair
    assert got["busiest_on_device"] and got["busiest"] == cpus[len(cpus) // 2:]
