"""One command, two processes on one machine: the GPUs and environment each side gets, the
runtime the sides must share, the suffix checked across processes on every rep, the labelling
of records that cannot overlap on a GPU, and the transfer server's unguessable pull ids; how the
launcher tells a side's end, and the job's key."""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
import types

import jax
import pytest

from rekv_jax.action import Action
from rekv_jax.cli import main as cli
from rekv_jax.errors import RuntimeMismatch, describe
from rekv_jax.launch import runtime as launched_runtime
from rekv_jax.launch.child import member_names, role_of
from rekv_jax.launch.environments import (
    GPU_XLA_FLAGS,
    PAIR_SHARE,
    pair_environments,
    visible_gpus,
    with_gpu_flags,
)
from rekv_jax.launch.group import Group, Job, run_child, run_pair
from rekv_jax.launch.processes import Ended
from rekv_jax.mode import Mode
from rekv_jax.study import experiment
from rekv_jax.study.experiment import Experiment, run_local
from rekv_jax.study.records import Rep, Summary, serializes
from rekv_jax.transport import ROLES, JobKey, TransportError
from rekv_jax.transport.cores import (
    CPUS_ENV,
    PINNING_ENV,
    THREADS_ENV,
    children_on,
    usable_cpus,
)
from rekv_jax.transport.secret import key_of
from rekv_jax.transport.transfer_server import _uuid, pull_key

PARENT = {"PATH": "/usr/bin", "XLA_FLAGS": "--xla_dump_to=/tmp/d"}
SHARE_VARS = ("CUDA_VISIBLE_DEVICES", "XLA_PYTHON_CLIENT_MEM_FRACTION")


def gpus(n: int) -> list[str]:
    return [str(i) for i in range(n)]


def test_no_gpu_and_no_pinning_leave_both_environments_as_the_parents():
    shared = {**PARENT, PINNING_ENV: "cores shared"}
    envs = pair_environments([], {**PARENT, CPUS_ENV: "3"})  # an outer pair's cores: dropped
    assert envs == {"prefill": shared, "decode": shared}
    assert envs["prefill"] is not envs["decode"]  # each side its own copy
    envs = pair_environments([], PARENT, cpus=[5])
    assert envs["decode"] == envs["prefill"] == {
        **PARENT, PINNING_ENV: "cores shared (one core: nothing to pin)"}


@pytest.mark.parametrize("cpus, prefill, decode, words", [
    ([0, 1], "0", "1", "pinned: prefill cpu 0, decode cpu 1"),
    ([0, 1, 2], "0", "1,2", "pinned: prefill cpu 0, decode cpus 1,2"),
    (list(range(8)), "0,1,2,3", "4,5,6,7", "pinned: prefill cpus 0-3, decode cpus 4-7"),
    ([2, 5, 7, 9], "2,5", "7,9", "pinned: prefill cpus 2,5, decode cpus 7,9"),
])
def test_cpu_sides_get_disjoint_halves_of_the_cores(cpus, prefill, decode, words):
    envs = pair_environments([], PARENT, cpus=cpus)
    assert (envs["prefill"][CPUS_ENV], envs["decode"][CPUS_ENV]) == (prefill, decode)
    for env in envs.values():
        assert env[PINNING_ENV] == words and env["PATH"] == "/usr/bin"
        # XLA's threads: one more than the side's cores, so a copy runs beside a program
        assert env[THREADS_ENV] == str(len(env[CPUS_ENV].split(",")) + 1)


@pytest.mark.parametrize("own", [{THREADS_ENV: "7"}, {"NPROC": "5"}])
def test_a_users_own_xla_thread_count_wins(own):
    for env in pair_environments([], {**PARENT, **own}, cpus=[0, 1]).values():
        assert {k: env[k] for k in own} == own  # kept
        assert env.get(THREADS_ENV) == own.get(THREADS_ENV)  # none added beside NPROC


def test_gpu_sides_are_not_pinned():
    for n in (1, 2):
        for env in pair_environments(gpus(n), PARENT, cpus=[0, 1]).values():
            assert CPUS_ENV not in env and PINNING_ENV not in env


@pytest.mark.parametrize("transport", ["transfer-server", "collective", "local"])
@pytest.mark.parametrize("n, decode, prefill", [(2, "0", "1"), (8, "0", "1")])
def test_two_or_more_gpus_give_each_side_its_own(n, decode, prefill, transport):
    envs = pair_environments(gpus(n), PARENT, transport=transport)
    assert envs["decode"]["CUDA_VISIBLE_DEVICES"] == decode
    assert envs["prefill"]["CUDA_VISIBLE_DEVICES"] == prefill
    for env in envs.values():  # a whole GPU each: no memory share
        assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in env
        assert env["XLA_FLAGS"].split() == ["--xla_dump_to=/tmp/d", *GPU_XLA_FLAGS]
        assert env["PATH"] == "/usr/bin"


def test_sharded_sides_get_disjoint_gpu_sets_by_uuid_too():
    uuids = [f"GPU-{i:04x}" for i in range(8)]
    envs = pair_environments(uuids, PARENT, {"decode": 4, "prefill": 4})
    assert envs["decode"]["CUDA_VISIBLE_DEVICES"] == ",".join(uuids[:4])
    assert envs["prefill"]["CUDA_VISIBLE_DEVICES"] == ",".join(uuids[4:])
    envs = pair_environments(gpus(8), PARENT, {"decode": 4, "prefill": 2})
    assert envs["decode"]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert envs["prefill"]["CUDA_VISIBLE_DEVICES"] == "4,5"


@pytest.mark.parametrize("n, devices", [(1, None), (2, {"decode": 2, "prefill": 1}),
                                        (8, {"decode": 5, "prefill": 4})])
def test_too_few_gpus_are_shared_with_a_memory_share_each(n, devices):
    parent = {**PARENT, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}  # would be the race
    envs = pair_environments(gpus(n), parent, devices)
    assert envs["decode"] == envs["prefill"]
    env = envs["decode"]
    assert env["CUDA_VISIBLE_DEVICES"] == ",".join(gpus(n))
    assert float(env["XLA_PYTHON_CLIENT_MEM_FRACTION"]) == PAIR_SHARE
    assert 0 < 2 * PAIR_SHARE <= 0.9  # both reserve up front, with room for the CUDA contexts
    assert env["XLA_FLAGS"].split()[-len(GPU_XLA_FLAGS):] == list(GPU_XLA_FLAGS)
    with pytest.raises(ValueError, match="collective needs a GPU per side") as e:
        pair_environments(gpus(n), parent, devices, "collective")
    assert "\n" not in str(e.value)


def test_a_users_own_xla_flag_wins():
    flags = with_gpu_flags("--xla_gpu_autotune_level=4")
    assert flags.split() == ["--xla_gpu_autotune_level=4", "--xla_gpu_enable_triton_gemm=false",
                             "--xla_gpu_shard_autotuning=false"]
    assert with_gpu_flags(flags) == flags  # idempotent: each process may add them again


@pytest.mark.parametrize("env, want", [
    ({"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, gpus(8)),
    ({"CUDA_VISIBLE_DEVICES": "3, 5"}, ["3", "5"]),
    ({"CUDA_VISIBLE_DEVICES": "2,-1,3"}, ["2"]),  # CUDA stops at an invalid entry
    ({"CUDA_VISIBLE_DEVICES": ""}, []),
    ({"CUDA_VISIBLE_DEVICES": "0", "JAX_PLATFORMS": "cpu"}, []),
    ({"CUDA_VISIBLE_DEVICES": "0", "JAX_PLATFORMS": "cuda,cpu"}, ["0"]),
])
def test_visible_gpus_are_counted_without_jax(env, want):
    assert visible_gpus(env) == want


ENV_KEYS = ("CUDA_VISIBLE_DEVICES", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_FLAGS")


def environment_side(side) -> dict:
    """What a launched side's JAX starts with (it starts after the side's environment is set)."""
    import jax

    jax.devices()
    return {k: os.environ.get(k) for k in ENV_KEYS}


@pytest.mark.parametrize("visible, decode, prefill, share", [
    ("3,5", "3", "5", None), ("3", "3", "3", f"{PAIR_SHARE:g}")])
def test_each_process_of_a_pair_gets_its_environment(visible, decode, prefill, share):
    """Each side is spawned in its own environment (on CPU JAX ignores CUDA_VISIBLE_DEVICES,
    so the variables themselves are checked)."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env |= {"CUDA_VISIBLE_DEVICES": visible, "XLA_FLAGS": ""}
    envs = pair_environments(visible_gpus(env), env, None, "transfer-server")
    with Job.pair(environment_side, (), envs, key=None) as pair:
        ended = {role_of(name): e for name, e in pair.wait(timeout=120).items()}
    flags = " ".join(GPU_XLA_FLAGS)
    assert ended["decode"].value == {"CUDA_VISIBLE_DEVICES": decode,
                                     "XLA_PYTHON_CLIENT_MEM_FRACTION": share, "XLA_FLAGS": flags}
    assert ended["prefill"].value == {"CUDA_VISIBLE_DEVICES": prefill,
                                      "XLA_PYTHON_CLIENT_MEM_FRACTION": share, "XLA_FLAGS": flags}
    assert os.environ.get("CUDA_VISIBLE_DEVICES") != visible  # the launcher's own is unchanged


def affinity_side(side) -> dict:
    """The cores of a launched side's threads once JAX's have started."""
    import jax

    jax.numpy.ones(4).block_until_ready()
    threads = {int(t): sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
    return {"cpus": sorted(os.sched_getaffinity(0)), "threads": threads,
            "words": os.environ.get(PINNING_ENV)}


@pytest.mark.parametrize("pin", [True, False])
def test_each_cpu_process_of_a_pair_runs_on_its_cores(pin):
    """Pinned (the default), the prefill side runs on the first half of this machine's cores and
    the decode side, every thread of it, on the rest; with --no-pin (or one core) both run on
    all of them. Both sides' environments say which."""
    env = {k: v for k, v in os.environ.items() if k not in (CPUS_ENV, PINNING_ENV)}
    envs = pair_environments([], {**env, "JAX_PLATFORMS": "cpu"},
                             cpus=usable_cpus() if pin else None)
    mine = os.sched_getaffinity(0)
    with Job.pair(affinity_side, (), envs, key=None) as pair:
        got = {role_of(name): e.value for name, e in pair.wait(timeout=120).items()}
    cpus = usable_cpus()
    assert got["decode"]["words"] == got["prefill"]["words"]
    assert os.sched_getaffinity(0) == mine  # the launcher's cores are as they were
    if pin and len(cpus) >= 2:
        half = len(cpus) // 2
        assert (got["prefill"]["cpus"], got["decode"]["cpus"]) == (cpus[:half], cpus[half:])
        for role, own in (("prefill", cpus[:half]), ("decode", cpus[half:])):
            assert all(t == own for t in got[role]["threads"].values()), got[role]["threads"]
        assert got["decode"]["words"].startswith("pinned: prefill cpu")
    else:
        assert got["prefill"]["cpus"] == got["decode"]["cpus"] == cpus
        assert got["decode"]["words"].startswith("cores shared")


def test_a_child_started_on_a_sides_cores_leaves_ours_as_they_were():
    mine = os.sched_getaffinity(0)
    side = {CPUS_ENV: str(min(mine))}
    with children_on(side):
        child = subprocess.run([sys.executable, "-c",
                                "import os; print(sorted(os.sched_getaffinity(0)))"],
                               capture_output=True, text=True, timeout=60)
    assert child.stdout.strip() == str([min(mine)])
    assert os.sched_getaffinity(0) == mine
    with children_on({}):  # no cores named: nothing changes
        assert os.sched_getaffinity(0) == mine


def test_collective_on_one_gpu_is_one_line_exit_2(monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    with pytest.raises(SystemExit) as e:
        cli.main(["handoff", "--transport", "collective", "--link-gbps", "unpaced",
                  "--seq-len", "32", "--actions", "bf16:r=2"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rekv handoff: error: --transport collective "
                                               "needs a GPU per side"), err


# ------------------------------------------------------------------- the runtime both sides share

EXP = Experiment(seq_len=32, actions=(Action.parse("bf16:r=2", 6),), schedules=("overlapped",),
                 transport="local", warmup=0, reps=2)


@pytest.mark.parametrize("field, value", [("jaxlib", "0.0.1"), ("device_kind", "NVIDIA H100"),
                                          ("xla_flags", "--xla_gpu_autotune_level=4"),
                                          ("attention", "cudnn")])
def test_sides_on_different_runtimes_fail_in_one_line_exit_1(monkeypatch, field, value):
    real = launched_runtime.runtime

    def prefill_differs(attention):  # LocalTransport runs the prefill side on its own thread
        facts = real(attention)
        return facts | {field: value} if threading.current_thread().name == "rekv-prefill" \
            else facts

    monkeypatch.setattr(launched_runtime, "runtime", prefill_differs)
    records = []
    with pytest.raises(RuntimeMismatch) as e:
        run_local(EXP, records.append)
    assert records == []  # before any handoff
    told = describe(e.value)
    assert told.status == 1 and "\n" not in told.line
    assert told.line.startswith(f"runtime: prefill and decode disagree on {field} ")
    assert value in told.line


def test_runtime_names_what_decides_the_bits():
    facts = launched_runtime.runtime("xla")
    assert facts["jax"] == jax.__version__ and facts["attention"] == "xla"
    assert facts["device_kind"] == jax.local_devices()[0].device_kind
    assert set(facts) == {"jax", "jaxlib", "platform", "device_kind", "xla_flags", "attention"}


# ------------------------------------------------------------ the suffix across the two processes

ACROSS = ", suffix checksum = the prefill process's"  # what a person reads


def test_every_rep_checks_the_suffix_against_the_prefill_process():
    out = []
    run_local(dataclasses.replace(EXP, actions=(Action.parse("bf16:r=2", 6),
                                                Action.parse("q8:r=2", 6),
                                                Action.parse("q8:full", 6))), out.append)
    reps = [r for r in out if isinstance(r, Rep)]
    assert [r.cache_check for r in reps] == ["bitwise" + ACROSS] * 2 + [
        "suffix bitwise, prefix within the q8 error bound" + ACROSS] * 2 + [
        "suffix bitwise, prefix within the q8 error bound"] * 2  # transfer-only: no suffix


def test_a_prefill_process_with_other_suffix_bits_is_a_mismatch(monkeypatch):
    real = experiment.prepare

    def other_bits(*args, **kwargs):  # the prefill side's suffix differs by one checksum
        state = real(*args, **kwargs)
        return dataclasses.replace(state, suffix_sums=(state.suffix_sums[0] + 1,
                                                       *state.suffix_sums[1:]))

    monkeypatch.setattr(experiment, "prepare", other_bits)
    out = []
    run_local(EXP, out.append)
    reps = [r for r in out if isinstance(r, Rep)]
    (summary,) = [r for r in out if isinstance(r, Summary)]
    want = "MISMATCH in the prefill process's suffix checksum"
    assert [r.cache_check for r in reps] == [want, want] and summary.cache_check == want


# --------------------------------------------------------- collective + overlapped on a GPU


def test_serialized_only_for_the_collective_overlapping_on_a_gpu():
    joint, full = Action.parse("bf16:r=2", 6), Action.parse("bf16:full", 6)
    assert serializes("collective", Mode.of(joint, "overlapped"), "gpu")
    assert serializes("collective", Mode.of(joint, "chunked", chunks=2), "gpu")
    for args in [("collective", Mode.of(joint, "sequential"), "gpu"),
                 ("collective", Mode.of(joint, "overlapped"), "cpu"),
                 ("transfer-server", Mode.of(joint, "overlapped"), "gpu"),
                 ("collective", Mode.of(full), "gpu")]:
        assert not serializes(*args)


@pytest.mark.parametrize("platform, want", [("gpu", True), ("cpu", False)])
def test_records_of_collective_overlapped_say_serialized_on_a_gpu(monkeypatch, platform, want):
    """The experiment sees a GPU (only its own module's `jax` is patched); the link is local."""
    seen = types.SimpleNamespace(**{n: getattr(jax, n) for n in dir(jax) if not n.startswith("__")})
    seen.default_backend = lambda: platform
    monkeypatch.setattr(experiment, "jax", seen)
    out = []
    exp = dataclasses.replace(EXP, transport="collective", schedules=("overlapped", "sequential"),
                              actions=(Action.parse("bf16:r=2", 6), Action.parse("bf16:full", 6)))
    run_local(exp, out.append)
    summaries = {(str(s.action), s.schedule): s for s in out if isinstance(s, Summary)}
    assert summaries["bf16:r=2", "overlapped"].serialized is want
    assert not summaries["bf16:r=2", "sequential"].serialized
    assert not summaries["bf16:full", "n/a"].serialized
    reps = [r for r in out if isinstance(r, Rep) and r.schedule == "overlapped"]
    assert reps and all(r.serialized is want for r in reps)
    line = summaries["bf16:r=2", "overlapped"].to_json()
    assert Summary.from_json(json.loads(json.dumps(line))).serialized is want
    old = {k: v for k, v in line.items() if k != "serialized"}  # a committed, older line
    assert Summary.from_json(old).serialized is False


# ----------------------------------------------------------------- transfer-server pull ids


def test_pull_ids_agree_within_a_job_and_differ_across_jobs():
    tags = [f"q8:r=2/overlapped/{i}/{p}" for i in range(50) for p in ("boundary", "prefix")]
    job, other = JobKey.new(), JobKey.new()
    ids = [_uuid(t, pull_key(job)) for t in tags]
    assert ids == [_uuid(t, pull_key(JobKey(job.secret))) for t in tags]  # both sides: same ids
    assert len(set(ids)) == len(tags) and all(0 <= i < 2**63 for i in ids)
    for key in (pull_key(other), b"", job.secret):  # another job's; unkeyed; the job key itself
        assert not set(ids) & {_uuid(t, key) for t in tags}
    assert job.secret.hex() not in repr(job) and job.secret.hex() not in str(job)


# --------------------------------------------------------------------- the launcher's one lines


def failing_side(side, how: str) -> str:
    """A side that ends as `how` says (the decode side only; the prefill side returns)."""
    if side.role == "prefill":
        return "prefill done"
    if how == "value":
        side.emit("item 1")
        return "decode done"
    if how == "raise":
        raise ValueError("the experiment does not fit")
    if how == "bug":
        raise KeyError("a bug")
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("how, kind, line", [
    ("raise", ValueError, "the experiment does not fit"),
    ("bug", RuntimeError, "decode-0 failed:\nTraceback"),
    ("kill", TransportError, "decode-0 was killed by SIGKILL"),
])
def test_a_failed_side_is_one_line_naming_it(how, kind, line):
    with pytest.raises(kind) as e:
        run_pair(failing_side, how, envs={role: dict(os.environ) for role in ROLES}, key=None,
                 timeout=120)
    assert str(e.value).startswith(line)
    if how != "bug":
        assert "\n" not in str(e.value)
    items = []
    assert run_pair(failing_side, "value", envs={role: dict(os.environ) for role in ROLES},
                    key=None, on_item=items.append, timeout=120) == "decode done"
    assert items == ["item 1"]


def doubling_side(side, nap_s: float) -> str:
    """The decode member naps, then answers each request with its double; the prefill member
    returns."""
    if side.role == "prefill":
        return "prefill done"
    time.sleep(nap_s)
    for request in side.requests():
        side.emit(2 * request)
    return "decode done"


def test_the_answering_member_takes_requests_one_at_a_time_until_the_job_closes():
    with Job.pair(doubling_side, (0.0,), {role: dict(os.environ) for role in ROLES},
                  key=None) as pair:
        assert pair.wait_ready(timeout=120) == []
        assert pair.ask(3, timeout=120) == [6]
        assert pair.ask("ab", timeout=120) == ["abab"]
        assert pair.close(timeout=120) == "decode done"


def test_members_that_outlive_the_first_end_by_the_grace_are_killed_in_one_line():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"^decode-0 still running 2 s after another member "
                                           r"ended \(killed\)$"):
        run_pair(doubling_side, 600.0, envs={role: dict(os.environ) for role in ROLES},
                 key=None, grace=2, timeout=120)
    assert time.monotonic() - start < 60


def whoami_side(side) -> tuple:
    return side.name, side.members, side.process_id, side.coordinator


def test_a_pair_is_decode_0_and_prefill_0_of_which_some_may_run_elsewhere():
    envs = {role: dict(os.environ) for role in ROLES}
    name, members, pid, coordinator = run_pair(whoami_side, envs=envs, key=None, timeout=120)
    assert (name, members, pid) == ("decode-0", ("decode-0", "prefill-0"), 0)
    assert coordinator.startswith("127.0.0.1:")  # both here: a loopback port of their own
    # one side of a multi-host pair: the other runs elsewhere, and JAX finds the coordinator
    assert run_pair(whoami_side, envs={"prefill": envs["prefill"]}, key=None, timeout=120) == (
        "prefill-0", ("decode-0", "prefill-0"), 1, None)
    with pytest.raises(ValueError, match="decode first"):
        Group(sorted, (), {"prefill-0": {}, "decode-0": {}}, key=None)
    with pytest.raises(ValueError, match="decode first"):  # not a member of the group
        Group(sorted, (), {"prefill-1": {}}, key=None, members=member_names(1, 1))


def test_a_side_that_died_when_its_coordinator_went_away_says_so():
    gone = Ended("the prefill side", -6, log="F1202 client.h:80] Terminating process because the "
                 "JAX distributed service detected fatal errors")
    assert str(gone.failure()) == ("the prefill side stopped: the decode side went away (its "
                                   "coordination service stopped answering)")
    said = Ended("link calibration", 1, error=ValueError("no such model"))
    assert isinstance(said.failure(), ValueError)
    assert str(said.failure()) == "link calibration: no such model"


def _abort_saying(words: str) -> None:
    print(words, file=sys.stderr, flush=True)
    os.abort()


def test_a_crashed_process_is_named_with_its_last_words_and_its_output_kept():
    with pytest.raises(TransportError) as told:
        run_child(_abort_saying, "F0101 x.cc:1] Check failed: ok", env=os.environ,
                  what="the crasher", timeout=120)
    line = str(told.value)
    assert line.startswith("the crasher was killed by SIGABRT; its last words: F0101 x.cc:1] "
                           "Check failed: ok / Fatal Python error: Aborted (its output: ")
    kept = line.rsplit("(its output: ", 1)[1].rstrip(")")
    assert "Check failed: ok" in open(kept).read()  # the whole output, faulthandler's stack too
    os.remove(kept)
    killed = Ended("decode-0", -signal.SIGKILL, log="ran")  # a kill is no crash: no words
    assert str(killed.failure()) == "decode-0 was killed by SIGKILL"


def _done_with_a_teardown_that_aborts(value: int) -> int:
    atexit.register(os.abort)  # as a native runtime's teardown that aborts at interpreter exit
    return value


def _failed_with_a_teardown_that_aborts(text: str) -> None:
    atexit.register(os.abort)
    raise ValueError(text)


def test_a_finished_job_is_not_undone_by_its_process_teardown():
    """A job's outcome is final once sent: the process then ends without the interpreter's
    finalization, where an abort would have turned it into a crash."""
    assert run_child(_done_with_a_teardown_that_aborts, 7, env=os.environ, what="the job",
                     timeout=120) == 7
    with pytest.raises(ValueError, match=r"^the job: no such thing$"):
        run_child(_failed_with_a_teardown_that_aborts, "no such thing", env=os.environ,
                  what="the job", timeout=120)


def test_a_fresh_process_returns_objects_and_its_errors_in_one_line():
    assert run_child(sorted, [3, 1, 2], env=os.environ, what="sorting", timeout=120) == [1, 2, 3]
    with pytest.raises(ValueError, match=r"^sorting: invalid literal"):
        run_child(int, "x", env=os.environ, what="sorting", timeout=120)


# ------------------------------------------------------------------------------- the job's key


def test_a_multi_host_side_needs_a_key_or_insecure(tmp_path, monkeypatch):
    monkeypatch.delenv("REKV_SECRET_FILE", raising=False)
    with pytest.raises(ValueError, match="--secret-file PATH or \\$REKV_SECRET_FILE"):
        key_of(None, False, "a multi-host run (--role)")
    assert key_of(None, True, "x") is None
    path = tmp_path / "key"
    path.write_bytes(os.urandom(32))
    path.chmod(0o644)
    with pytest.raises(ValueError, match="may be read by others .* chmod 600"):
        key_of(str(path), False, "x")
    path.chmod(0o600)
    assert key_of(str(path), False, "x") == key_of(str(path), True, "x")  # both nodes: one key
    monkeypatch.setenv("REKV_SECRET_FILE", str(path))
    assert key_of(None, False, "x") == JobKey.from_file(path)
    short = tmp_path / "short"
    short.write_bytes(b"hunter2")
    short.chmod(0o600)
    with pytest.raises(ValueError, match="at least 16"):
        JobKey.from_file(short)


def test_handoff_role_without_a_key_is_one_line_exit_2(monkeypatch, capsys):
    monkeypatch.delenv("REKV_SECRET_FILE", raising=False)
    with pytest.raises(SystemExit) as e:
        cli.main(["handoff", "--role", "decode", "--coordinator", "127.0.0.1:1", "--seq-len",
                  "32", "--actions", "bf16:r=2", "--link-gbps", "unpaced"])
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("rekv handoff: error: a multi-host run (--role) needs the job's key")
