"""Several workers per side: a group of member processes (2 prefill + 1 decode) launched by one
parent that talks to each while they run, with a link per (prefill, decode) pair.

One run (`run`, shared by the tests that read it): each prefill member hands decode-0 a handoff
of a different mode over its own transfer-server link, and decode-0, advancing both from one
thread, ends with each reference's cache bitwise; the parent's messages reach each member and
its items come back in order; then one prefill member is killed: the parent is told in one line,
decode-0's link to it fails within the liveness interval, its other link carries another
handoff, and the group closes without hanging. Besides: a stranger who reads the coordinator's
store cannot join a pair's control connection, and the collective transport refuses a group."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import pytest
from group_worker import (
    HEARTBEAT_S,
    Checked,
    Die,
    Dying,
    Echo,
    Echoed,
    Expect,
    Lost,
    Ready,
    Send,
    Sent,
    Watch,
    Watching,
    serve,
)
from store_reader import read_dir

from rekv_jax import Action
from rekv_jax.launch.child import CLOSE, CLOSED, MESSAGE, Inbox, Member, member_names
from rekv_jax.launch.environments import SHARED_MEMORY, group_environments
from rekv_jax.launch.group import Emitted, Event, Group, MemberEnded, run_child
from rekv_jax.launch.processes import Ended
from rekv_jax.mode import Mode
from rekv_jax.transport import JobKey, TransportError, control, distributed, secret
from rekv_jax.transport.cores import CPUS_ENV, HOST_CPUS_ENV, PINNING_ENV, usable_cpus
from rekv_jax.transport.transfer_server import pull_key

L = 6  # layers of the `tiny` preset
MODES = (Mode.of(Action.parse("q8:r=2", L)),  # overlapped
         Mode.of(Action.parse("bf16:r=3", L), "chunked", chunks=2))
WAIT_S = 120.0
PREFILLS = ("prefill-0", "prefill-1")


# ------------------------------------------------------------------ names and environments


def test_members_are_named_and_numbered_decode_first():
    assert member_names(2, 1) == ("decode-0", "prefill-0", "prefill-1")
    assert member_names(1, 2) == ("decode-0", "decode-1", "prefill-0")


@pytest.mark.parametrize("cpus, want", [
    ([0, 1, 2], {"prefill-0": "0", "prefill-1": "1", "decode-0": "2"}),
    ([0, 1, 2, 3], {"prefill-0": "0", "prefill-1": "1", "decode-0": "2,3"}),
    (list(range(8)), {"prefill-0": "0,1", "prefill-1": "2,3,4", "decode-0": "5,6,7"}),
])
def test_cpu_members_get_disjoint_cores_where_there_is_one_each(cpus, want):
    envs = group_environments([], {"PATH": "/usr/bin", CPUS_ENV: "9"}, 2, 1, cpus)
    assert list(envs) == ["decode-0", "prefill-0", "prefill-1"]  # process-id order
    assert {name: env[CPUS_ENV] for name, env in envs.items()} == want
    for env in envs.values():
        assert env[HOST_CPUS_ENV] == ",".join(map(str, cpus)) and env["PATH"] == "/usr/bin"
        assert env[PINNING_ENV].startswith("pinned: prefill-0 cpu")


@pytest.mark.parametrize("cpus, words", [([0, 1], "cores shared (2 cores for 3 processes)"),
                                         ([4], "cores shared (one core: nothing to pin)"),
                                         (None, "cores shared")])
def test_cpu_members_share_the_cores_where_there_are_too_few(cpus, words):
    envs = group_environments([], {"PATH": "/usr/bin", CPUS_ENV: "9"}, 2, 1, cpus)
    assert all(env == {"PATH": "/usr/bin", PINNING_ENV: words} for env in envs.values())


def test_gpu_members_get_one_each_or_share_them_all():
    envs = group_environments(["5", "6", "7", "8"], {}, 2, 1, None)
    assert {n: e["CUDA_VISIBLE_DEVICES"] for n, e in envs.items()} == {
        "decode-0": "5", "prefill-0": "6", "prefill-1": "7"}
    assert not any("XLA_PYTHON_CLIENT_MEM_FRACTION" in e for e in envs.values())
    envs = group_environments(["5", "6"], {}, 2, 1, None)
    for env in envs.values():
        assert env["CUDA_VISIBLE_DEVICES"] == "5,6"
        assert 3 * float(env["XLA_PYTHON_CLIENT_MEM_FRACTION"]) <= SHARED_MEMORY


def test_a_group_of_other_names_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="decode first"):
        Group(serve, (), {"prefill-0": {}, "decode-0": {}}, key=None)
    with pytest.raises(ValueError, match="a prefill and a decode member"):
        group_environments([], {}, 0, 2, None)


# ------------------------------------------------------------------ a member's inbox


def test_the_inbox_keeps_order_wakes_a_waiter_and_ends_with_the_close():
    ours, theirs = multiprocessing.Pipe()
    inbox = Inbox(theirs)
    assert inbox.receive(0) == []
    waiter = inbox.incoming()
    assert waiter is inbox.incoming() and not waiter.done()  # one future for every caller
    for n in range(5):
        ours.send((MESSAGE, n))
    waiter.result(timeout=10)
    got = inbox.receive(10)
    while len(got) < 5:
        got += inbox.receive(10)
    assert got == [0, 1, 2, 3, 4]
    ours.send((MESSAGE, "last"))
    ours.send((CLOSE, None))
    deadline = time.monotonic() + 10
    while CLOSED not in got and time.monotonic() < deadline:
        got += inbox.receive(1)
    assert got[-2:] == ["last", CLOSED]
    assert inbox.receive(0) == [CLOSED] and inbox.incoming().done()  # the close stays


def test_the_collective_transport_refuses_a_group_in_one_line():
    ours, theirs = multiprocessing.Pipe()
    member = Member.start("decode-0", member_names(2, 1), "127.0.0.1:1", None, theirs)
    assert member.peers == {"prefill-0": 1, "prefill-1": 2}
    with pytest.raises(ValueError) as refused:
        member.links("collective")
    line = str(refused.value)
    assert "\n" not in line and "exactly two processes" in line and "3 processes" in line
    assert "--transport transfer-server" in line
    assert not jax.distributed.is_initialized()  # refused before anything started
    ours.close()


# ------------------------------------------------------------------ one run of a group


@dataclasses.dataclass
class Events:
    """What a group sent so far, with waits for what a test expects next."""

    group: Group
    seen: list[Event] = dataclasses.field(default_factory=list)

    def until(self, done: Callable[[], bool], what: str, may_end: tuple[str, ...] = ()) -> None:
        """Poll until `done()`; AssertionError if a member not in `may_end` ended meanwhile,
        TimeoutError past WAIT_S."""
        deadline = time.monotonic() + WAIT_S
        while not done():
            for event in self.seen:
                if isinstance(event, MemberEnded) and event.name not in may_end:
                    raise AssertionError(f"{event.failure} while waiting for {what}:\n"
                                         f"{event.ended.log[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {WAIT_S:g}s; events: {self.seen}")
            self.seen += self.group.poll(1.0)

    def items(self, name: str, kind: type) -> list:
        return [e.item for e in self.seen
                if isinstance(e, Emitted) and e.name == name and isinstance(e.item, kind)]

    def ends(self) -> dict[str, MemberEnded]:
        return {e.name: e for e in self.seen if isinstance(e, MemberEnded)}


@dataclasses.dataclass(frozen=True)
class Run:
    events: Events
    ended: dict[str, Ended]  # what `close` returned
    close_s: float
    sent_to_the_dead: bool  # what `send` said of a message to the killed member


def _echo_all(group: Group, names: tuple[str, ...], numbers: range) -> None:
    for n in numbers:
        for name in names:
            group.send(name, Echo(n))


def _drive(group: Group) -> Run:
    """The run's script: ready, two handoffs (with echoes sent among them), a kill, one more
    handoff, close."""
    events = Events(group)
    events.until(lambda: all(events.items(n, Ready) for n in group.names), "every member ready")
    _echo_all(group, group.names, range(3))
    for i, name in enumerate(PREFILLS):
        group.send("decode-0", Expect(name, f"h{i}", MODES[i], seed=i + 1))
        group.send(name, Send(f"h{i}", MODES[i], seed=i + 1))
        _echo_all(group, group.names, range(3 + 2 * i, 5 + 2 * i))
    events.until(lambda: len(events.items("decode-0", Checked)) == 2
                 and all(len(events.items(n, Echoed)) == 7 for n in group.names),
                 "both handoffs checked and every echo back")
    group.send("decode-0", Watch("prefill-1", "never", Mode.of(Action.parse("bf16:full", L))))
    events.until(lambda: events.items("decode-0", Watching), "decode-0 watching prefill-1")
    group.send("prefill-1", Die())
    events.until(lambda: "prefill-1" in events.ends() and events.items("decode-0", Lost),
                 "prefill-1's end and its loss", may_end=("prefill-1",))
    group.send("decode-0", Expect("prefill-0", "after", MODES[0], seed=7))
    group.send("prefill-0", Send("after", MODES[0], seed=7))
    events.until(lambda: len(events.items("decode-0", Checked)) == 3, "the handoff after",
                 may_end=("prefill-1",))
    sent_to_the_dead = group.send("prefill-1", Echo(99))
    start = time.monotonic()
    ended = group.close(WAIT_S)
    close_s = time.monotonic() - start
    events.seen += group.poll(0)
    return Run(events, ended, close_s, sent_to_the_dead)


@pytest.fixture(scope="module")
def run() -> Run:
    envs = group_environments([], os.environ, 2, 1, usable_cpus())
    with Group(serve, (), envs, key=JobKey.new()) as group:
        return _drive(group)


def test_each_prefill_members_handoff_is_its_references_cache_bitwise(run):
    checks = {c.tag: c for c in run.events.items("decode-0", Checked)}
    assert {t: c.peer for t, c in checks.items()} == {
        "h0": "prefill-0", "h1": "prefill-1", "after": "prefill-0"}
    for check in checks.values():
        assert check.cache_bitwise and check.first_token, check
    assert [s.tag for s in run.events.items("prefill-0", Sent)] == ["h0", "after"]
    assert [s.tag for s in run.events.items("prefill-1", Sent)] == ["h1"]


def test_each_member_links_to_every_member_of_the_other_side(run):
    links = {n: run.events.items(n, Ready)[0].links for n in ("decode-0", *PREFILLS)}
    assert links == {"decode-0": PREFILLS, "prefill-0": ("decode-0",),
                     "prefill-1": ("decode-0",)}


def test_messages_reach_members_while_they_run_and_items_come_back_in_order(run):
    for name in ("decode-0", *PREFILLS):
        assert [e.n for e in run.events.items(name, Echoed)] == list(range(7)), name
    order = [type(e.item).__name__ for e in run.events.seen
             if isinstance(e, Emitted) and e.name == "prefill-1"]
    assert order[0] == "Ready" and order[-1] == "Dying"


def test_a_killed_member_ends_alone_and_its_link_alone_says_so(run):
    died = run.events.ends()["prefill-1"]
    assert died.failure == "prefill-1 exited with status 3"
    assert not run.sent_to_the_dead  # the parent is told, never raised at
    (lost,) = run.events.items("decode-0", Lost)
    (dying,) = run.events.items("prefill-1", Dying)
    assert lost.tag == "never" and lost.peer == "prefill-1"
    assert lost.error.startswith("TransportError: never/"), lost.error
    assert 0 < lost.at - dying.at < HEARTBEAT_S  # within the links' liveness interval
    assert lost.peer_alive == {"prefill-0": True, "prefill-1": False}


def test_the_group_closes_in_order_without_hanging(run):
    assert run.close_s < 30
    assert run.ended["decode-0"].ok and run.ended["decode-0"].value == "decode-0"
    assert run.ended["prefill-0"].ok and run.ended["prefill-0"].value == "prefill-0"
    assert run.ended["prefill-1"].exitcode == 3
    assert {e.name for e in run.events.ends().values() if e.failure is None} == {
        "decode-0", "prefill-0"}
    pids = [run.events.items(n, Ready)[0].pid for n in ("decode-0", *PREFILLS)]
    assert not any(_running(pid) for pid in pids)  # nothing outlives the launcher


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# ------------------------------------------------------------------ a stranger


PAYLOAD = np.arange(1024, dtype=np.float32).reshape(32, 32)
ATTACKED = "rekv/control/0-1"  # the store key of the pair (decode-0, prefill-0)


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} never came")
        time.sleep(0.05)


def attacked_member(member, folder: str) -> bool | None:
    """A member of a group with a stranger about: prefill-0 joins jax.distributed, then lets the
    stranger try to join its pair's control connection first (`joined`); each prefill member
    sends decode-0 one buffer, and decode-0 says whether both arrived intact."""
    if member.name == "prefill-0":  # the backends start together: theirs exchange topologies
        distributed.initialize(member.coordinator, member.process_id, init_timeout_s=int(WAIT_S),
                               num_processes=len(member.members))
        jax.devices()
        _wait_for(Path(folder, "joined"))
    links = member.links("transfer-server", timeout=WAIT_S)
    if member.role == "prefill":
        links["decode-0"].send(member.name, [jax.device_put(PAYLOAD)], timeout=WAIT_S)
        links["decode-0"].wait_ack(member.name, timeout=WAIT_S)
        links["decode-0"].close(WAIT_S)
        return None
    spec = [jax.ShapeDtypeStruct(PAYLOAD.shape, PAYLOAD.dtype)]
    got = [links[n].recv(n, spec, timeout=WAIT_S).result(WAIT_S)[0] for n in PREFILLS]
    for link in links.values():
        link.close(WAIT_S)
    return all(np.array_equal(np.asarray(g), PAYLOAD) for g in got)


def stranger_joins(coordinator: str, key: JobKey) -> tuple[dict[str, bytes], list[str]]:
    """The store as a stranger reads it once decode-0 listens for prefill-0, and how each attempt
    to join that pair's control connection ended: with a key made of each value it read, by
    hand, and with the job's own key under another pair's purpose (a proof is its pair's)."""
    distributed.wait_for_port(coordinator, WAIT_S)  # the coordinator may not be up yet
    deadline = time.monotonic() + WAIT_S
    while ATTACKED not in (store := read_dir(coordinator, "rekv")):
        if time.monotonic() > deadline:
            raise TimeoutError("decode-0 never posted its control address for prefill-0")
        time.sleep(0.1)
    address = store[ATTACKED].decode()
    attempts = [(JobKey(value), control.PURPOSE + " 0-1") for value in store.values()]
    attempts += [(key, control.PURPOSE), (key, control.PURPOSE + " 0-2")]
    outcomes = []
    for attempt_key, purpose in attempts:
        try:
            control.connect(address, attempt_key, 5, purpose).close()
            outcomes.append("joined")
        except TransportError:
            outcomes.append("refused")
    with socket.create_connection(address.rsplit(":", 1), timeout=5) as raw:
        raw.sendall(os.urandom(secret.NONCE_BYTES))
        raw.recv(secret.NONCE_BYTES + secret.PROOF_BYTES)
        raw.sendall(store[ATTACKED][:secret.PROOF_BYTES].ljust(secret.PROOF_BYTES, b"0"))
        outcomes.append("joined" if raw.recv(1) else "refused")
    return store, outcomes


def test_a_stranger_who_reads_the_store_cannot_join_a_pair_and_the_group_goes_on(tmp_path):
    key = JobKey.new()
    envs = {name: dict(os.environ) for name in member_names(2, 1)}
    found: dict[str, object] = {}
    with Group(attacked_member, (str(tmp_path),), envs, key=key) as group:

        def stranger() -> None:  # beside the run, in a process of its own
            try:
                found["store"], found["joins"] = run_child(
                    stranger_joins, group.coordinator, key, env=os.environ,
                    what="the stranger", timeout=WAIT_S)
            finally:
                (tmp_path / "joined").touch()

        thread = threading.Thread(target=stranger)
        thread.start()
        ended = group.close(2 * WAIT_S)  # nothing to tell them: they end on their own
        thread.join(WAIT_S)
    assert ended["decode-0"].value is True, ended  # both buffers arrived bit for bit
    assert all(e.ok for e in ended.values()), ended
    store = found["store"]
    assert ATTACKED in store
    assert all(k.startswith(("rekv/control/", "rekv/beat/")) for k in store), store
    purposes = [control.PURPOSE + f" 0-{p}" for p in (1, 2)]
    for value in store.values():  # public data only: addresses and heartbeat counts
        for secret_bytes in (key.secret, pull_key(key), *map(key.derive, purposes)):
            assert secret_bytes not in value and secret_bytes.hex().encode() not in value
    assert found["joins"] == ["refused"] * len(found["joins"])
