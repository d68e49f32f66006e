"""What bounds a request of `rekv serve --http`, through the CLI in a subprocess on the real
engine (one prefill and one decode worker of the shipped model, one server for the module): a
body past `--max-body-bytes` is a 413 while `/health` keeps answering fast; a prompt longer than
the context is a 400 naming both lengths; a whole answer whose client disconnects frees its
pages within a second; a client's deadline ends its request with a 504 (whole) or an error event
(streamed) holding exactly the tokens so far; a generation longer than `--timeout` completes (the
server sets no deadline of its own); and a stop refuses new requests with a 503 while those in
flight finish, a stream cut at the grace ending with an error event and then [DONE]."""

import http.client
import json
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_serve_start import QUICK, Server, _analytic_profile

from rekv_jax.serving.shutdown import ABORTED

MAX_BODY = 2_000_000  # --max-body-bytes
TIMEOUT_S = 6.0  # --timeout: the longest any wait of the workers may take
LONG = 2000  # max_tokens of a request that outlives every bound here (the context is 2048)
HEALTH_MS = 50.0  # the slowest /health may answer while a big body is refused
FREED_S = 1.0  # the most a request's pages may outlive its client


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("limits")
    profile = _analytic_profile("rekv_jax/assets/wt2-tiny", folder / "profile.json")
    started = Server(["--profile", str(profile), "--policy", "bf16:full", "--timeout",
                      str(TIMEOUT_S), "--max-body-bytes", str(MAX_BODY), *QUICK], folder)
    try:
        # one request as long as the tests' runs every decode program they meet (a step's
        # programs follow the pages held and the positions reached): an abort waits for a
        # compile in progress to end
        status, answer = _post(started, _asked(started, "The tower is", LONG))
        assert status == 200, answer
        yield started
    finally:
        started.close()


def _base(server) -> str:
    return server.url.removesuffix("/v1")


def _post(server, body: dict | bytes, headers: dict | None = None, path: str = "completions"
          ) -> tuple[int, dict]:
    """(status, JSON body) of a POST with the standard library (which closes the connection
    after one answer)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"{server.url}/{path}", raw, {
        "Content-Type": "application/json"} | (headers or {}))
    try:
        with urllib.request.urlopen(req, timeout=120) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _asked(server, prompt: str, max_tokens: int, **more) -> dict:
    return {"model": server.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True} | more


def _pages_used(server) -> float:
    with urllib.request.urlopen(f"{_base(server)}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "rekv_kv_pages_used")


def _until(done, timeout_s: float) -> float | None:
    """Seconds until `done()` held, polled; None if it did not within `timeout_s`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if done():
            return time.monotonic() - start
        time.sleep(0.01)
    return None


def _sent(server, head: str, body_parts) -> socket.socket:
    """A connection that sent `head` (the request line and headers) and then each body part."""
    host, port = _base(server).removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(head.encode())
    for part in body_parts:
        sock.sendall(part)
    return sock


def _status_line(sock: socket.socket) -> str:
    got = b""
    while b"\r\n" not in got:
        chunk = sock.recv(4096)
        assert chunk, f"the connection closed before an answer: {got!r}"
        got += chunk
    return got.split(b"\r\n")[0].decode()


def test_a_big_body_is_413_while_health_answers_fast(server):
    """A 10 MB body, sent slowly (a megabyte at a time) so it is in flight a while, gets a 413;
    every /health probe meanwhile answers within `HEALTH_MS`. A body past the flag but short of
    the default, from a client that sends it whole and closes after one answer, gets the 413
    too (not a reset), naming the limit; the server then serves as before."""
    size, part = 10_000_000, b"a" * 1_000_000
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {size}\r\n\r\n")
    probes_ms, sending = [], threading.Event()

    def probe() -> None:
        sending.wait(60)
        while sending.is_set():
            start = time.monotonic()
            with urllib.request.urlopen(f"{_base(server)}/health", timeout=10) as answer:
                assert answer.status == 200
            probes_ms.append((time.monotonic() - start) * 1e3)
            time.sleep(0.05)  # a probe every 50 ms or so, as a load balancer's
    prober = threading.Thread(target=probe, daemon=True)
    prober.start()

    def slowly():
        sending.set()
        for _ in range(size // len(part)):
            time.sleep(0.05)
            yield part
    sock = _sent(server, head, slowly())
    try:
        status = _status_line(sock)
    finally:
        sending.clear()
        sock.close()
    prober.join(30)
    assert status.startswith("HTTP/1.1 413"), status
    assert len(probes_ms) >= 5 and max(probes_ms) <= HEALTH_MS, probes_ms
    status, answer = _post(server, b" " * (MAX_BODY + 1))
    assert status == 413 and str(MAX_BODY) in answer["error"]["message"], answer
    status, answer = _post(server, _asked(server, "The tower is", 2))
    assert status == 200 and answer["usage"]["completion_tokens"] == 2


def test_a_prompt_longer_than_the_context_is_400_naming_both_lengths(server):
    """A completions prompt of token ids, and a chat whose messages alone pass the context
    (so its default max_tokens would be negative): each a 400 naming the prompt's length and
    the context's."""
    status, answer = _post(server, _asked(server, "", 4) | {"prompt": [5] * 2100})
    assert status == 400, answer
    assert "the prompt has 2100 tokens; this model's context holds 2048" in (
        answer["error"]["message"]), answer
    chat = {"model": server.model, "messages": [{"role": "user", "content": "a " * 3000}]}
    status, answer = _post(server, chat, path="chat/completions")
    message = answer["error"]["message"]
    assert status == 400 and "this model's context holds 2048" in message, answer
    assert int(message.split("the prompt has ")[1].split()[0]) > 2048, message


def test_a_whole_answer_whose_client_leaves_frees_its_pages_within_a_second(server):
    """A non-streamed request of `LONG` tokens: once its pages are held, its client closes the
    connection; the pages gauge is back to 0 within `FREED_S` (the request decoded to its end
    would hold them for seconds)."""
    body = json.dumps(_asked(server, "The tower is", LONG)).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    assert _pages_used(server) == 0
    sock = _sent(server, head, [body])
    try:
        assert _until(lambda: _pages_used(server) > 0, 60) is not None
        time.sleep(0.2)  # decoding
    finally:
        sock.close()
    freed = _until(lambda: _pages_used(server) == 0, 10)
    assert freed is not None and freed <= FREED_S, freed


def _stream(server, body: dict, headers: dict) -> list[dict | str]:
    """Every event of a streamed completion: each data's JSON, or "[DONE]"."""
    host = _base(server).removeprefix("http://")
    connection = http.client.HTTPConnection(host, timeout=120)
    try:
        connection.request("POST", "/v1/completions", json.dumps(body | {"stream": True}),
                           {"Content-Type": "application/json"} | headers)
        answer = connection.getresponse()
        assert answer.status == 200, answer.read()
        events = []
        for raw in answer:
            line = raw.decode().strip()
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
        return events
    finally:
        connection.close()


def test_a_clients_deadline_ends_it_with_504_and_exactly_its_tokens_so_far(server):
    """`X-Request-Timeout: 1` on a request of `LONG` tokens: whole, a 504 within about a second
    whose body holds the text of its tokens so far (the same text a request for that many
    tokens gets) beside the error; streamed, its chunks, then an error event, then [DONE].
    Either way its pages are freed at once. A deadline that is not a positive number is a 400."""
    prompt, late = "The tower is", {"X-Request-Timeout": "1"}
    start = time.monotonic()
    status, answer = _post(server, _asked(server, prompt, LONG), late)
    took = time.monotonic() - start
    assert status == 504 and answer["error"]["code"] == "deadline_exceeded", answer
    assert 1.0 <= took < 1.0 + FREED_S, took
    got = answer["usage"]["completion_tokens"]
    assert 0 < got < LONG and answer["choices"][0]["finish_reason"] is None, answer
    assert _until(lambda: _pages_used(server) == 0, FREED_S) is not None
    status, alone = _post(server, _asked(server, prompt, got))
    assert status == 200 and answer["choices"][0]["text"] == alone["choices"][0]["text"]

    events = _stream(server, _asked(server, prompt, LONG), late)
    *chunks, error, done = events
    assert done == "[DONE]" and error["error"]["code"] == "deadline_exceeded", events[-3:]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    count = int(error["error"]["message"].split("after ")[1].split()[0])
    assert 0 < count < LONG and all(c["choices"][0]["finish_reason"] is None for c in chunks)
    assert _until(lambda: _pages_used(server) == 0, FREED_S) is not None
    assert text == _post(server, _asked(server, prompt, count))[1]["choices"][0]["text"]
    for bad in ("0", "-1", "soon", "nan"):
        status, answer = _post(server, _asked(server, prompt, 2), {"X-Request-Timeout": bad})
        assert status == 400 and "X-Request-Timeout" in answer["error"]["message"], answer


def test_a_generation_longer_than_the_timeout_completes(server):
    """Two requests of `LONG` tokens at once, each decoding for longer than `--timeout`: both
    complete with every token (the server gives a request no deadline of its own)."""
    answers, took = [], []

    def ask(k: int) -> None:
        start = time.monotonic()
        answers.append(_post(server, _asked(server, f"The tower {k} is", LONG)))
        took.append(time.monotonic() - start)
    threads = [threading.Thread(target=ask, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert min(took) > TIMEOUT_S, f"too quick to tell a deadline from none: {took}"
    assert [(s, a["usage"]["completion_tokens"]) for s, a in answers] == [(200, LONG)] * 2


def test_a_stop_refuses_new_requests_while_those_in_flight_finish(server):
    """SIGTERM with two requests in flight: a short one finishes (200, every token) within the
    grace, a request sent after the signal gets a 503, and a stream too long for the grace ends
    with an error event naming the abort, then [DONE]; the server exits 0, no worker left.
    The module's last test: it stops the server."""
    results = {}
    short = threading.Thread(target=lambda: results.update(
        short=_post(server, _asked(server, "The tower is", 200))))
    long = threading.Thread(target=lambda: results.update(
        long=_stream(server, _asked(server, "A stream", LONG), {})))
    long.start()
    assert _until(lambda: _pages_used(server) > 0, 60) is not None
    short.start()
    time.sleep(0.3)  # both in flight

    def late() -> None:
        time.sleep(0.5)  # after the signal, before the grace ends
        results["late"] = _post(server, _asked(server, "The tower is", 2))
    refused = threading.Thread(target=late)
    refused.start()
    server.stop(signal.SIGTERM)
    for t in (short, long, refused):
        t.join(10)
    status, answer = results["short"]
    assert status == 200 and answer["usage"]["completion_tokens"] == 200, answer
    status, answer = results["late"]
    assert status == 503 and "stopping" in answer["error"]["message"], answer
    *chunks, error, done = results["long"]
    assert done == "[DONE]" and ABORTED in error["error"]["message"], results["long"][-3:]
    assert 0 < len(chunks) < LONG
