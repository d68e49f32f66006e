"""Worker loss with real processes: two prefill workers and one decode worker serve a few
requests of the tiny model through the router's loop. One prefill worker killed mid-stream
loses no request (the other serves those it had not handed off, exactly); the decode worker
killed ends every open request with an error record, and the run (nothing hangs)."""

from __future__ import annotations

import time
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from test_serve import greedy, profile
from test_serving_policy import COSTS

from rekv_jax.launch.group import Emitted, Event, MemberEnded
from rekv_jax.model.loader import load_config, load_model
from rekv_jax.serving.ledger import Ledger
from rekv_jax.serving.lifecycle import Status
from rekv_jax.serving.member import MemberSetup, serving_member
from rekv_jax.serving.metrics import Served
from rekv_jax.serving.pages import PoolConfig
from rekv_jax.serving.policy import Context, make_policies
from rekv_jax.serving.requests import Assignment, PrefillDone, Ready, ServeRequest, Token
from rekv_jax.serving.router import Router, Scheduled, drive
from rekv_jax.serving.serve_config import Workers

TIMEOUT = 60.0  # each request's deadline; a hang would show as a deadline's error
NEW, PROMPT, REQUESTS = 6, 32, 8
POOL = PoolConfig(1 + 4 * PoolConfig(2).pages_for(PROMPT + NEW))  # four requests at once


def requests() -> list[ServeRequest]:
    rng = np.random.default_rng(1)
    vocab = load_config("tiny").vocab_size
    return [ServeRequest(i, rng.integers(0, vocab, PROMPT).tolist(), NEW)  # a burst: the
            for i in range(REQUESTS)]  # policy spreads it over both prefill workers


class Watch:
    """What the loop has shown so far: each request's prefill worker (once assigned) and the
    requests whose handoff was sent or whose first token came."""

    def __init__(self) -> None:
        self.prefill_worker: dict[int, int] = {}
        self.sent: set[int] = set()

    def assigned(self, a: Assignment) -> None:
        self.prefill_worker[a.request_id] = a.prefill_worker

    def saw(self, event: Event) -> None:
        if isinstance(event, Emitted) and isinstance(event.item, PrefillDone | Token):
            self.sent.add(event.item.request_id)

    def mid_stream(self, p: int) -> bool:
        """Prefill worker p sent a handoff and holds at least two requests not sent."""
        mine = [i for i, w in self.prefill_worker.items() if w == p]
        unsent = [i for i in mine if i not in self.sent]
        return 2 <= len(unsent) < len(mine)


def serve_killing(victim: str, when: Callable[[Event, Watch], bool]
                  ) -> tuple[list[Served], float]:
    """`requests()` served by 2 prefill workers and 1 decode worker under bf16:full, `victim`
    killed at the first event `when` holds for; the records, and the seconds from the kill to
    the loop's end."""
    cfg = load_config("tiny")
    setup = MemberSetup("tiny", POOL, timeout=TIMEOUT, cost_position=PROMPT - 1)
    workers = Workers(prefill=2, decode=1, link_gbps=None, timeout=TIMEOUT, pin=False)
    with workers.start(serving_member, (setup,)) as group:
        ready: set[str] = set()
        while len(ready) < 3:
            for event in group.poll(TIMEOUT):
                assert not isinstance(event, MemberEnded), event.failure
                if isinstance(event, Emitted) and isinstance(event.item, Ready):
                    ready.add(event.name)
        (policy,) = make_policies(["bf16:full"], Context(cfg.name, cfg.num_layers,
                                                         (profile(cfg, PROMPT),), COSTS))
        watch, killed = Watch(), []
        router = Router(policy, Ledger.idle(2, 1, 0.05), POOL, COSTS, group.send, 1.0, TIMEOUT,
                        on_assigned=watch.assigned)

        def kill(event: Event) -> None:
            watch.saw(event)
            if not killed and when(event, watch):
                group.kill_member(victim)
                killed.append(time.monotonic())

        served = drive(group, router, Scheduled(requests()), kill)
        assert killed, f"{victim} was never killed"
        return served, time.monotonic() - killed[0]


def test_a_prefill_worker_killed_mid_stream_loses_no_request():
    """prefill-1 is killed once it sent a handoff, with two more of its requests not sent:
    those go again on prefill-0 (after the decode worker dropped what it held of them), and
    every request completes with its single-process greedy tokens."""
    served, _ = serve_killing("prefill-1", lambda e, watch: watch.mid_stream(1))
    assert sorted(s.request.id for s in served) == list(range(REQUESTS))
    assert all(s.completed for s in served), [s.failure for s in served]
    again = [s for s in served if [t.status for t in s.lifecycle].count(Status.WAITING) > 1]
    assert again and all(s.assignment.prefill_worker == 0 for s in again)
    model = load_model("tiny", dtype=jnp.bfloat16, orbax=False)
    for s in served:
        assert np.array_equal(s.finished.tokens, greedy(model, s.request.tokens, NEW))


def test_the_decode_worker_killed_ends_every_open_request_with_an_error_and_the_run():
    """decode-0 is killed at the first token: every request not completed by then ends with
    an error (its decode worker's end, no decode worker left, or a prefill worker's report
    that its peer is gone), as soon as that is known."""
    served, after_s = serve_killing("decode-0", lambda e, watch: isinstance(e, Emitted)
                                    and isinstance(e.item, Token))
    assert sorted(s.request.id for s in served) == list(range(REQUESTS))
    failed = [s for s in served if not s.completed]  # one line each: the router's, or a
    assert failed and all(s.status == Status.ERROR and s.failure for s in failed)  # worker's
    assert any("decode worker 0 ended" in s.error for s in failed)
    assert after_s < TIMEOUT / 2  # it ended as the loss was known, not at a deadline
