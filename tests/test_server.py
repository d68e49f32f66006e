"""`server.Clients`, what a `Server`'s callers and its HTTP clients submit through: each
request's tokens, then its record, reach its caller; a caller that stops following a request
before its end (a closed iterator, an HTTP client's stream closed or cancelled) is reported once
by `cancelled`, which the router's loop aborts; one that read its request to the end is not."""

import asyncio
import threading
import time

import pytest

from rekv_jax.launch.group import Emitted
from rekv_jax.serving.metrics import Served
from rekv_jax.serving.requests import Ended, Finished, ServeRequest, Token
from rekv_jax.serving.serve_config import ServeConfig, Stream, Workers
from rekv_jax.serving.server import Clients, Server


def request(i: int) -> ServeRequest:
    return ServeRequest(i, (1, 2, 3), 4)


def token(i: int, k: int) -> Emitted:
    return Emitted("decode-0", Token(i, k, 10 + k, time.monotonic()))


def served(i: int, n: int, error: str | None = None) -> Served:
    finished = Finished(i, tuple(10 + k for k in range(n)), 0.01, 0.001, 1.0, None, "", False)
    return Served(request(i), "bf16:full", 0.0, (0.1,) * n, None, finished, error)


def test_a_followed_request_yields_its_tokens_then_its_record_and_is_not_cancelled():
    clients = Clients(threading.Event())
    items = clients.follow(request(0))
    assert [r.id for r in clients.take(0.0, False)] == [0]
    clients.on_event(token(0, 0))
    clients.on_event(token(0, 1))
    clients.on_served(served(0, 2))
    got = list(items)
    assert [t.token for t in got[:2]] == [10, 11] and got[2].request.id == 0
    assert clients.cancelled() == []


def test_a_follower_that_closes_early_cancels_its_request_once():
    clients = Clients(threading.Event())
    left, stays = clients.follow(request(0)), clients.follow(request(1))
    clients.on_event(token(0, 0))
    assert next(left).token == 10
    left.close()
    assert clients.cancelled() == [0] and clients.cancelled() == []
    clients.on_event(token(0, 1))  # a token of the cancelled request reaches no one
    clients.on_served(served(1, 0))
    assert [s.request.id for s in stays] == [1] and clients.cancelled() == []


def test_an_http_stream_closed_or_cancelled_mid_stream_cancels_its_request():
    clients = Clients(threading.Event())

    async def run() -> None:
        closed = clients.submit(request(0))
        first = asyncio.ensure_future(anext(closed))
        await asyncio.sleep(0.01)
        clients.on_event(token(0, 0))
        assert (await first).token == 10
        await closed.aclose()
        assert clients.cancelled() == [0]
        cancelled = asyncio.ensure_future(anext(clients.submit(request(1))))
        await asyncio.sleep(0.01)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert clients.cancelled() == [1]
        whole = clients.submit(request(2))
        reading = asyncio.ensure_future(anext(whole))
        await asyncio.sleep(0.01)
        clients.on_served(served(2, 0))
        assert await reading == Ended("length", None)
        with pytest.raises(StopAsyncIteration):
            await anext(whole)
        assert clients.cancelled() == []

    asyncio.run(run())


def test_a_failed_loop_fails_every_open_request():
    clients = Clients(threading.Event())
    items = clients.follow(request(0))
    clients.fail(RuntimeError("the router's loop failed"))
    with pytest.raises(RuntimeError, match="loop failed"):
        next(items)


def test_a_server_serves_callers_over_a_link_in_gb_s():
    with pytest.raises(ValueError, match="generated load"):
        Server(ServeConfig("tiny", ("bf16:full",), workers=Workers(link_gbps=None),
                           streams=(Stream(1.0, (request(0),)),)))
    with pytest.raises(ValueError, match="GB/s or None"):
        Server(ServeConfig("tiny", ("bf16:full",)))
