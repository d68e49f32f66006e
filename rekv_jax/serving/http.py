"""The OpenAI API in front of a serving backend (FastAPI on uvicorn), so standard clients and
load generators drive `rekv serve --http` unchanged.

Routes: `POST /v1/completions` (one prompt, as text for the model's tokenizer or as token ids),
`POST /v1/chat/completions` (messages rendered with the model's chat template), both whole or
streamed as server-sent events (`openai_request` says which fields each honours, accepts or
refuses; `openai_answer` how each is answered), `GET /v1/models`, `GET /metrics` (Prometheus
text, `prometheus.ServingMetrics`) and `GET /health` (no key needed: a liveness probe). With an
API key every `/v1` route and `/metrics` want `Authorization: Bearer KEY` (401 otherwise); a
bind beyond loopback needs one (`serve_config.check_bind`).

Every bad request gets a 4xx with an OpenAI-style error body and the server keeps serving: a body
larger than `max_body_bytes` (413, before it is read: `limits`), a body that is not JSON or not a
request of its route (400), a parameter this server cannot honour (400, naming it), an unknown
model (404), a prompt longer than the model's context or that leaves no room for `max_tokens` in
it (400, naming the lengths), chat on a model without a tokenizer or chat template (400, saying
which). The event loop never waits on a request's own work: its body is parsed, its messages
rendered and its prompt tokenized on a worker thread (the default executor's, bounded). A
request ends when its client goes (a whole answer's disconnect is watched; a stream's is
Starlette's) or when its client's deadline passes (`X-Request-Timeout` seconds: a 504 holding
the text so far, or a stream's error event), and has no deadline of the server's own.
A model without a tokenizer takes token ids only and answers with its ids as text
(space-separated).

The backend is anything with `submit(ServeRequest)` yielding the request's `Token`s then one
`Ended` (`Backend`): the router (`serve.Clients`), or a fake in tests. Closing a request's stream
before its end aborts it there.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import threading
import time
from collections.abc import AsyncGenerator, Iterator
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse

from rekv_jax.model.loader import chat_template_of, tokenizer_of
from rekv_jax.serving.limits import deadline_of, read_body, while_connected
from rekv_jax.serving.openai_answer import Answer, Reply, pieces
from rekv_jax.serving.openai_request import (
    ApiError,
    Body,
    ChatBody,
    CompletionBody,
    ModelInfo,
    first_error,
    parse,
    request_of,
)
from rekv_jax.serving.prometheus import ServingMetrics
from rekv_jax.serving.requests import Ended, ServeRequest, Token
from rekv_jax.serving.serve_config import MAX_BODY_BYTES, http_context

LOOPBACK = "127.0.0.1"
GUARDED = ("/v1", "/metrics")  # the paths an API key guards


class Backend(Protocol):
    """What serves the requests the front end takes."""

    def submit(self, request: ServeRequest) -> AsyncGenerator[Token | Ended, None]:
        """`request`'s generated tokens, each as soon as it is known (with its log
        probabilities when `request.sampling` asks), then how it ended; raises if it failed."""
        ...


def http_model(spec: str) -> ModelInfo:
    """What the OpenAI API serves of model `spec`: its context, tokenizer and chat template."""
    return ModelInfo(spec, http_context(spec), tokenizer_of(spec), chat_template_of(spec))


class Closing:
    """The front end's backend: `backend`, refusing every request once `stop` is set, so none
    is taken after the router's loop has ended."""

    def __init__(self, backend: Backend, stop: threading.Event) -> None:
        self._backend, self._stop = backend, stop

    def submit(self, request: ServeRequest) -> AsyncGenerator[Token | Ended, None]:
        if self._stop.is_set():
            raise ApiError(503, "the server is stopping", kind="server_error")
        return self._backend.submit(request)


def build_app(backend: Backend, model: ModelInfo, api_key: str | None = None,
              metrics: ServingMetrics | None = None, ids: Iterator[int] | None = None,
              max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The FastAPI application of the module docstring; `/metrics` shows `metrics` (None: a
    fresh, empty set); each request's id is the next of `ids` (None: its own count); a body
    past `max_body_bytes` is refused (413)."""
    app = FastAPI(title="rekv serve", docs_url=None, redoc_url=None, openapi_url=None)
    ids, start = ids or itertools.count(), time.monotonic()
    metrics = metrics or ServingMetrics()

    @app.exception_handler(ApiError)
    async def refused(request: Request, e: ApiError) -> Response:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def malformed(request: Request, e: RequestValidationError) -> Response:
        return ApiError(400, f"malformed request: {first_error(e.errors())}").response()

    @app.middleware("http")
    async def authorize(request: Request, call_next: Any) -> Any:
        if api_key and request.url.path.startswith(GUARDED):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)",
                                code="invalid_api_key").response()
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def exposition() -> Response:
        return Response(metrics.exposition(), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model.id, "object": "model",
                                            "created": 0, "owned_by": "rekv"}]}

    async def answer(request: Request, kind: type[Body]) -> Any:
        taken_s = time.monotonic()
        deadline_s = deadline_of(request, taken_s)
        raw = await read_body(request, max_body_bytes)
        body, req = await asyncio.to_thread(_parsed, raw, kind, model, next(ids), taken_s - start)
        return await _answer(backend, model, request, body, req, deadline_s)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await answer(request, CompletionBody)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await answer(request, ChatBody)

    return app


def _parsed(raw: bytes, kind: type[Body], model: ModelInfo, request_id: int, arrival_s: float
            ) -> tuple[Body, ServeRequest]:
    """The body `raw` holds and the request it asks for (a worker thread's work: parsing,
    templating and tokenizing take time in proportion to the body)."""
    body = parse(raw, kind)
    return body, request_of(body, model, request_id, arrival_s)


async def _answer(backend: Backend, model: ModelInfo, request: Request, body: Body,
                  req: ServeRequest, deadline_s: float | None) -> Any:
    """Serve `req` through `backend`: the whole answer (its request aborted if its client
    disconnects first), or its stream; each ended at `deadline_s` (None: no deadline)."""
    answer = Answer.of(body, model, req)
    replied = pieces(backend.submit(req), Reply(model, req, body.skip_special_tokens),
                     deadline_s)
    if body.stream:
        return StreamingResponse(answer.events(replied, body.stream_options),
                                 media_type="text/event-stream")
    return await while_connected(request, answer.whole(replied))


@contextlib.contextmanager
def running(app: FastAPI, host: str = LOOPBACK, port: int = 0, timeout: float = 10.0
            ) -> Iterator[str]:
    """Serve `app` on a thread for the `with` block; yields its base URL (port 0: a free one).
    Start-up and shut-down each wait at most `timeout` seconds, and the thread is gone after."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, name="rekv-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            thread.join(timeout)
            raise RuntimeError(f"the HTTP server did not start on {host}:{port}")
        time.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        thread.join(timeout)
        if thread.is_alive():
            raise RuntimeError("the HTTP server did not stop")

