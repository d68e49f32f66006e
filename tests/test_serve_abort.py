"""A streaming HTTP client that disconnects aborts its request: streaming clients of the OpenAI
API over a `Server` of the shipped model (one prefill and one decode worker). 8 stream at once,
4 of which leave mid-stream; then `PREFILL_AHEAD` more are prefilled ahead of their pages and
one beyond them waits in the router's queue, and those leave too. The 4 that stay get exactly
their single-process greedy tokens, the decode worker's pool is empty within the decode step of
the last finish, and the request that left while queued was never prefilled."""

import http.client
import json
import threading
import time
import urllib.request

import jax.numpy as jnp
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from rekv_jax.launch.group import Emitted
from rekv_jax.model.loader import SHIPPED_MODEL, load_model
from rekv_jax.model.transformer import greedy_decode, prefill
from rekv_jax.serving.http import build_app, http_model, running
from rekv_jax.serving.requests import Finished, Load, PrefillDone, Token
from rekv_jax.serving.router import PREFILL_AHEAD
from rekv_jax.serving.serve_config import ServeConfig, Workers, member_setup
from rekv_jax.serving.server import Server

SPEC = str(SHIPPED_MODEL)
PROMPT = 8  # prompt tokens of every request
# A pool of one 2048-position request (128 pages of 16): the 4 that stay (3 pages each) and the
# 3 that leave after a few tokens (13 pages each) fit at once; a request of 95 pages waits until
# one of the 3 gives its pages back: the first `PREFILL_AHEAD` of them are prefilled ahead, the
# next is still queued when its client leaves.
STAY, LEAVE, QUEUED = 32, 200, 1500  # max_tokens of each kind
WAIT_S = 120.0


def greedy(model, tokens: list[int], new: int) -> np.ndarray:
    ids = jnp.asarray([tokens], jnp.int32)
    return np.asarray(greedy_decode(model.cfg, model.params,
                                    *prefill(model.cfg, model.params, ids), new))[0]


def _depth(url: str, stage: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "rekv_queue_depth" and s.labels["stage"] == stage)


def _in_flight(url: str) -> float:
    return sum(_depth(url, stage) for stage in ("waiting", "prefill", "decode"))


class Client(threading.Thread):
    """One streaming completion of `prompt`; with `leave` it closes the connection once
    `leave_after` chunks came (0: once the answer's headers came) and `leave` is set."""

    def __init__(self, url: str, prompt: list[int], max_tokens: int,
                 leave: threading.Event | None = None, leave_after: int = 0) -> None:
        super().__init__(daemon=True)
        self.url, self.prompt, self.max_tokens = url, prompt, max_tokens
        self.leave, self.leave_after = leave, leave_after
        self.chunks: list[str] = []
        self.streaming = threading.Event()  # its answer began (a chunk came, or headers: 0)
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"model": SPEC, "prompt": self.prompt, "max_tokens": self.max_tokens,
                "stream": True, "temperature": 0}
        connection = http.client.HTTPConnection(self.url.removeprefix("http://"),
                                                timeout=WAIT_S)
        try:
            connection.request("POST", "/v1/completions", json.dumps(body),
                               {"Content-Type": "application/json"})
            answer = connection.getresponse()
            assert answer.status == 200, answer.read()
            while not self._leaving():
                raw = answer.readline()
                if not raw:
                    return  # the stream ended
                line = raw.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    self.chunks.append(json.loads(line[6:])["choices"][0]["text"])
        except BaseException as e:  # reported by the test
            self.error = e
        finally:
            connection.close()  # mid-stream: the client disconnects

    def _leaving(self) -> bool:
        """Whether to close the connection now (after waiting for `leave`)."""
        if self.leave_after == 0 or self.chunks:
            self.streaming.set()
        if self.leave is None or len(self.chunks) < self.leave_after:
            return False
        return self.leave.wait(WAIT_S)


def _until(done, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.05)
    return done()


def test_clients_that_disconnect_abort_their_requests_and_the_others_are_exact():
    model = load_model(SPEC, dtype=jnp.bfloat16, orbax=False)
    rng = np.random.default_rng(0)
    n = 8 + PREFILL_AHEAD
    prompts = [rng.integers(0, model.cfg.vocab_size, PROMPT).tolist() for _ in range(n)]
    config = ServeConfig(SPEC, ("bf16:full",), workers=Workers(link_gbps=None, timeout=60.0,
                                                              pin=False), pool_requests=1)
    events, served, release = [], {}, threading.Event()
    go = [threading.Event() for _ in prompts[7:]]  # each queued client's leave
    with Server(config, on_event=events.append,
                on_served=lambda s: served.update({s.request.tokens: s})) as server:
        app = build_app(server.clients, http_model(SPEC), None, server.clients.metrics)
        with running(app) as url:
            stay = [Client(url, p, STAY) for p in prompts[:4]]
            leave = [Client(url, p, LEAVE, release, 2) for p in prompts[4:7]]
            for client in stay + leave:
                client.start()
            assert all(c.streaming.wait(WAIT_S) for c in stay + leave)
            queued = []
            for k, p in enumerate(prompts[7:]):  # one at a time: arrival order is their order
                queued.append(Client(url, p, QUEUED, go[k]))
                queued[-1].start()
                assert _until(lambda k=k: _in_flight(url) == 8 + k, WAIT_S)
            assert _depth(url, "waiting") == 1  # the last waits in the queue, unprefilled
            # their clients leave while they wait for pages, the waiting one first (a slot
            # another's leave freed would otherwise be its before its own leave is heard)
            for k in reversed(range(len(go))):
                go[k].set()
                assert _until(lambda k=k: tuple(prompts[7 + k]) in served, 10.0)
            release.set()  # then the 3 others leave mid-stream
            for client in [*stay, *leave, *queued]:
                client.join(WAIT_S)
            assert _until(lambda: len(served) == n, WAIT_S)
    assert not [c.error for c in [*stay, *leave, *queued] if c.error is not None]
    for p in prompts[:4]:
        s = served[tuple(p)]
        assert s.completed and np.array_equal(s.finished.tokens, greedy(model, p, STAY))
    for p in prompts[4:]:
        s = served[tuple(p)]
        assert not s.completed and len(s.token_times_s) < s.request.max_new_tokens
    never = served[tuple(prompts[-1])]
    assert never.assignment is None and never.prefill_done is None and not never.token_times_s
    assert not [e for e in events if isinstance(e, Emitted) and isinstance(
        e.item, Token | PrefillDone | Finished) and e.item.request_id == never.request.id]
    emitted = [e.item for e in events if isinstance(e, Emitted)]
    last = max(i for i, item in enumerate(emitted) if isinstance(item, Finished))
    load = next(item for item in emitted[last:] if isinstance(item, Load))
    assert load.free_pages == member_setup(config, None).pool.usable_pages
