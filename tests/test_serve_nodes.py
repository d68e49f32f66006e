"""`rekv serve` across nodes: the router and each worker started apart (`--role`), joined by the
job's key, as a scheduler starts them one per node, here on loopback.

The group itself (`launch.nodes`), its router and members in threads of this process: members
join in any order, a stranger and a second member of one name join nothing, messages cross both
ways and a member that dies is told in one line. Then the CLI, each process a subprocess: a
router, two prefill workers (one late) and a decode worker serve the official `openai` client's
streamed completions with single-process greedy tokens, while a fifth process with another key
fails to join; a worker killed mid-run takes no more requests. A worker that never starts is
named within the timeout and every process exits; a run across nodes without a key is refused
in one line, exit 2. And the router's own check: a raw client that ignores the router's
proof and sends one it cannot have made with the key is cut off before it says a name."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import openai
from echo_member import echo
from stdout_lines import StdoutLines
from test_serve import greedy
from test_serve_start import QUICK, REPO, STOP_S, _analytic_profile, _env

from rekv_jax.errors import TransportError
from rekv_jax.launch.child import member_names
from rekv_jax.launch.group import Emitted, MemberEnded, loopback
from rekv_jax.launch.nodes import PURPOSE, Hello, NodeGroup, Refused, Rendezvous, run_member
from rekv_jax.model.loader import load_model
from rekv_jax.transport import JobKey, control, secret
from rekv_jax.transport.control import WrongKey

WAIT_S = 60.0  # every process's --timeout (joining, links, any wait)
START_S = 300  # the most a router may take until its workers are ready
JOIN_S = 8  # the timeout of the run whose worker never starts
NEW = 5  # tokens per completion


def _events(group: NodeGroup, want: int) -> list:
    """The group's next `want` events (at most WAIT_S)."""
    got, deadline = [], time.monotonic() + WAIT_S
    while len(got) < want and time.monotonic() < deadline:
        got += group.poll(1.0)
    assert len(got) == want, got
    return got


def test_members_join_in_any_order_and_no_stranger_or_double_joins():
    """decode-0 and a stranger claiming prefill-0 (another job's key) try the router before it
    listens; a second decode-0 comes once decode-0 joined, prefill-0 last. The stranger is told
    the router lacks its key, the second decode-0 that decode-0 joined; each member's job runs in
    a process of its own, the router's messages reach it and its items come back; one that dies
    ends in one line and takes no more messages; the group closes with the other's value."""
    key, address = JobKey.new(), loopback()
    ends: dict[str, BaseException | None] = {}

    def member(label: str, name: str, key: JobKey, delay: float) -> None:
        time.sleep(delay)
        try:
            run_member(name, Rendezvous(address, key), WAIT_S, os.environ)
            ends[label] = None
        except Exception as e:  # asserted below
            ends[label] = e

    plan = [("decode-0", "decode-0", key, 0.0), ("stranger", "prefill-0", JobKey.new(), 0.0),
            ("second", "decode-0", key, 1.5), ("prefill-0", "prefill-0", key, 3.0)]
    threads = [threading.Thread(target=member, args=p, daemon=True) for p in plan]
    for t in threads:
        t.start()
    time.sleep(0.5)  # the first two try before the router listens
    with NodeGroup(echo, ("got ",), member_names(1, 1), Rendezvous(address, key),
                   WAIT_S) as group:
        assert group.send("decode-0", "a") and group.send("prefill-0", "b")
        assert set(_events(group, 2)) == {Emitted("decode-0", "got decode-0 a"),
                                         Emitted("prefill-0", "got prefill-0 b")}
        assert group.send("prefill-0", "die")
        (died,) = _events(group, 1)
        assert isinstance(died, MemberEnded) and died.name == "prefill-0"
        assert died.failure == "prefill-0 exited with status 3"
        assert not group.send("prefill-0", "c") and group.live() == ["decode-0"]
        assert group.send("decode-0", "c")
        assert _events(group, 1) == [Emitted("decode-0", "got decode-0 c")]
        ended = group.close(WAIT_S)
    assert ended["decode-0"].ok and ended["decode-0"].value == 2
    for t in threads:
        t.join(WAIT_S)
    assert ends["decode-0"] is None
    assert isinstance(ends["stranger"], WrongKey)
    assert "does not hold this process's key" in str(ends["stranger"])
    assert isinstance(ends["second"], TransportError)
    assert str(ends["second"]) == "decode-0: decode-0 has joined already"
    assert str(ends["prefill-0"]) == "prefill-0 exited with status 3"


def _raw_join(address: str, proof_of, name: str) -> str:
    """A client that speaks the connection's exchange by hand, never checking the router's
    proof: it sends its nonce, reads the router's nonce and proof, sends `proof_of(nonces,
    router's proof)`, then a `Hello` of `name`. How the router answered: "closed" (the
    connection cut), "refused: WHY" (a `Refused`), or what else came."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + WAIT_S
    while True:  # the router may not listen yet
        try:
            sock = socket.create_connection((host, int(port)), timeout=5)
            break
        except OSError:
            assert time.monotonic() < deadline, f"no router listened at {address}"
            time.sleep(0.1)
    try:
        mine = secret.new_nonce()
        sock.sendall(mine)
        theirs = b""
        while len(theirs) < secret.NONCE_BYTES + secret.PROOF_BYTES:
            chunk = sock.recv(secret.NONCE_BYTES + secret.PROOF_BYTES - len(theirs))
            assert chunk, "the router closed before it proved itself"
            theirs += chunk
        sock.sendall(proof_of(mine + theirs[:secret.NONCE_BYTES], theirs[secret.NONCE_BYTES:]))
        sock.setblocking(True)
        conn = Connection(sock.detach())
        conn.send(Hello(name, 1))
        answer = conn.recv() if conn.poll(WAIT_S) else "nothing"
    except (OSError, EOFError):
        return "closed"
    return f"refused: {answer.why}" if isinstance(answer, Refused) else repr(answer)


def test_the_router_refuses_a_client_that_cannot_prove_the_key():
    """Raw clients that skip the check of the router's proof (so only the router's check of
    theirs can stop them) send a random proof, the router's own proof back, one made with
    another key, and one with the job's key derived for another purpose: the router cuts each
    off before it reads the name. The same client with the right proof gets past the key to the
    router's check of its name (not a member's), and the run's own members then join and are
    served."""
    key, address = JobKey.new(), loopback()
    mine = key.derive(PURPOSE)
    wrong = {
        "random": lambda nonces, theirs: os.urandom(secret.PROOF_BYTES),
        "replayed": lambda nonces, theirs: theirs,
        "another key": lambda nonces, theirs: secret.prove(
            JobKey.new().derive(PURPOSE), "connector", nonces),
        "another purpose": lambda nonces, theirs: secret.prove(
            key.derive(control.PURPOSE), "connector", nonces)}
    outcomes = {}

    def clients() -> None:  # the raw clients first, then the run's members
        for what, proof_of in wrong.items():
            outcomes[what] = _raw_join(address, proof_of, "stranger")
        outcomes["right"] = _raw_join(
            address, lambda nonces, theirs: secret.prove(mine, "connector", nonces), "stranger")
        for name in ("decode-0", "prefill-0"):
            threading.Thread(target=run_member, args=(name, Rendezvous(address, key), WAIT_S,
                                                      os.environ), daemon=True).start()

    thread = threading.Thread(target=clients, daemon=True)
    thread.start()
    with NodeGroup(echo, ("got ",), member_names(1, 1), Rendezvous(address, key),
                   WAIT_S) as group:
        assert group.send("prefill-0", "a")
        assert _events(group, 1) == [Emitted("prefill-0", "got prefill-0 a")]
        ended = group.close(WAIT_S)
    thread.join(WAIT_S)
    assert {what: outcomes[what] for what in wrong} == dict.fromkeys(wrong, "closed")
    assert outcomes["right"] == ("refused: stranger is not a member of this run "
                                 "(decode-0, prefill-0)")
    assert ended["prefill-0"].ok and ended["prefill-0"].value == 1


# ------------------------------------------------------------------ the CLI, one process a node


def _key(path: Path) -> str:
    path.write_bytes(os.urandom(32))
    path.chmod(0o600)
    return str(path)


def _serve(*args: str) -> list[str]:
    return [sys.executable, "-m", "rekv_jax.cli", "serve", *args]


class Node:
    """`rekv serve --role ROLE ARGS` in a subprocess of its own session, as a scheduler starts
    it on a node: its stdout lines read on a thread, its stderr in a file."""

    def __init__(self, role: str, args: list[str], tmp_path: Path) -> None:
        self.role, self.stderr = role, tmp_path / f"{role}.err"
        with open(self.stderr, "w") as err:
            self.process = subprocess.Popen(_serve("--role", role, *args), cwd=REPO, env=_env(),
                                            stdout=subprocess.PIPE, stderr=err, text=True,
                                            start_new_session=True)
        self._lines = StdoutLines(self.process)

    def line(self, timeout: float) -> str:
        line = self._lines.next(timeout)
        assert line is not None, f"{self.role}: no line on stdout in {timeout} s: {self.tail()}"
        return line

    def rest(self) -> list[str]:
        """Its remaining lines on stdout, once it ended."""
        return self._lines.rest(STOP_S)

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.role} still running after {timeout} s: "
                                 f"{self.tail()}") from None

    def tail(self) -> str:
        return self.stderr.read_text()[-3000:]

    def error(self) -> str:
        """Its last line on stderr, which must be its only error and no traceback."""
        text = self.stderr.read_text()
        assert "Traceback" not in text, text
        return text.strip().splitlines()[-1]

    def close(self) -> None:
        """Whatever a failed test left: its session killed (its job dies with it)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(STOP_S)


def _streamed(client: openai.OpenAI, prompt: list[int]) -> list[int]:
    """A streamed greedy completion of token ids; its token ids (the preset has no tokenizer:
    each token is its id in the text)."""
    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=NEW, stream=True,
                                       temperature=0)
    return [int(t) for t in "".join(c.choices[0].text for c in stream if c.choices).split()]


def test_a_router_and_three_workers_started_apart_serve_greedy_tokens(tmp_path):
    """Four `rekv serve` processes, each with its role, the same key file and the router's
    address; a fifth, claiming prefill-0 with another key, fails to join before the workers
    start, and prefill-1 starts late. Every streamed BF16 completion is its single-process
    greedy decode, as the router's records say too. prefill-1 killed mid-run takes no more
    requests and the next is served; SIGTERM ends the router in one line naming prefill-1, and
    every worker with it (as on one machine, where a member that died fails the run's end)."""
    key, address = _key(tmp_path / "key"), loopback()
    joining = ["--coordinator", address, "--timeout", f"{WAIT_S:g}"]
    profile = _analytic_profile("tiny", tmp_path / "profile.json")
    nodes: dict[str, Node] = {}
    try:
        nodes["router"] = Node("router", [
            *joining, "--secret-file", key, "--model", "tiny", "--http", "127.0.0.1:0",
            "--profile", str(profile), "--policy", "bf16:full", "--prefill-workers", "2",
            "--json", *QUICK], tmp_path)
        stranger = subprocess.run(_serve("--role", "prefill-0", *joining, "--secret-file",
                                         _key(tmp_path / "wrong")),
                                  cwd=REPO, env=_env(), capture_output=True, text=True,
                                  timeout=WAIT_S + 60)
        assert stranger.returncode == 1, stranger.stderr
        assert stranger.stderr.strip().splitlines()[-1] == (
            f"rekv serve: error: the router at {address} does not hold this process's key "
            "(give every node the same --secret-file)")
        for name in ("decode-0", "prefill-0", "prefill-1"):
            if name == "prefill-1":
                time.sleep(3)  # it starts late
            nodes[name] = Node(name, [*joining, "--secret-file", key], tmp_path)
        url = json.loads(nodes["router"].line(START_S))["url"]
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
        model = load_model("tiny", dtype=jnp.bfloat16, orbax=False)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, model.cfg.vocab_size, n).tolist() for n in (12, 20, 33)]
        streamed = [_streamed(client, p) for p in prompts]
        for prompt, tokens in zip(prompts, streamed, strict=True):
            assert tokens == greedy(model, tuple(prompt), NEW)
        os.killpg(nodes["prefill-1"].process.pid, signal.SIGKILL)
        nodes["prefill-1"].wait(STOP_S)
        time.sleep(1)  # the router sees its connection close
        streamed.append(_streamed(client, prompts[0]))
        assert streamed[-1] == streamed[0]
        nodes["router"].process.send_signal(signal.SIGTERM)
        assert nodes["router"].wait(STOP_S) == 1
        assert nodes["router"].error().startswith(  # decode-0 may be killed past CLOSE_S, its
            "rekv serve: error: the serving group ended badly: prefill-1: its connection to the "
            "router closed before it ended (its process or node went away)")  # link to it closing
        for name in ("decode-0", "prefill-0"):
            nodes[name].wait(STOP_S)
        records = [json.loads(line) for line in nodes["router"].rest()]
    finally:
        for node in nodes.values():
            node.close()
    assert [r["completed"] for r in records] == [True] * 4
    assert [r["tokens"] for r in records] == streamed
    assert {r["assignment"]["action"] for r in records} == {"bf16:full"}
    assert records[-1]["assignment"]["prefill_worker"] == 0  # not the killed prefill-1


def test_a_worker_that_never_starts_is_named_within_the_timeout(tmp_path):
    """The router waits JOIN_S for prefill-1, which never starts: it names it in one line, and
    the workers that came exit, each saying so."""
    key, address = _key(tmp_path / "key"), loopback()
    joining = ["--coordinator", address, "--timeout", str(JOIN_S), "--secret-file", key]
    nodes: dict[str, Node] = {}
    start = time.monotonic()
    try:
        nodes["router"] = Node("router", [
            *joining, "--model", "tiny", "--http", "127.0.0.1:0", "--profile",
            str(_analytic_profile("tiny", tmp_path / "profile.json")), "--prefill-workers", "2",
            *QUICK], tmp_path)
        for name in ("decode-0", "prefill-0"):
            nodes[name] = Node(name, joining, tmp_path)
        assert nodes["router"].wait(JOIN_S + 60) == 1  # its start, then the timeout
        took = time.monotonic() - start
        line = f"prefill-1 did not join the router at {address} within {JOIN_S} s"
        assert nodes["router"].error() == f"rekv serve: error: {line}"
        for name in ("decode-0", "prefill-0"):
            assert nodes[name].wait(STOP_S) == 1
            assert nodes[name].error() == f"rekv serve: error: {name}: {line}"
    finally:
        for node in nodes.values():
            node.close()
    print(f"the router named prefill-1 {took:.1f} s after it started")


def test_a_run_across_nodes_without_a_key_exits_2_in_one_line():
    env = {k: v for k, v in _env().items() if k != "REKV_SECRET_FILE"}
    done = subprocess.run(_serve("--role", "decode-0", "--coordinator", "127.0.0.1:1"), cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "rekv serve: error: a run across nodes (--role) needs the job's key: --secret-file PATH "
        "or $REKV_SECRET_FILE (the same file on every node, readable by its owner only)"]
