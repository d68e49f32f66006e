"""The OpenAI completions API in front of a serving backend (FastAPI on uvicorn), so standard
clients and load generators drive `rekv serve --http` unchanged.

Routes: `POST /v1/completions` (one prompt, as text for the model's tokenizer or as token ids;
`max_tokens`; `stream` as server-sent events; greedy decoding only), `GET /v1/models`, and
`GET /health` (no key needed: a liveness probe). With an API key every `/v1` route wants
`Authorization: Bearer KEY` (401 otherwise); a bind beyond loopback needs one (`check_bind`).

Every bad request gets a 4xx with an OpenAI-style error body and the server keeps serving: a body
that is not JSON or not a completion request (400), a sampling or other unsupported parameter
(400, naming it), an unknown model (404), a prompt that leaves no room for `max_tokens` in the
model's context (400). A model without a tokenizer takes token ids only and answers with its ids
as text (space-separated).

The backend is anything with `submit(ServeRequest) -> AsyncIterator[int]` (`Backend`): the
router, or a fake in tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import itertools
import json
import secrets
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from tokenizers import Tokenizer

from rekv_jax.serving.requests import ServeRequest

DEFAULT_MAX_TOKENS = 16  # the OpenAI API's default
LOOPBACK = "127.0.0.1"


class Backend(Protocol):
    """What serves the requests the front end takes."""

    def submit(self, request: ServeRequest) -> AsyncIterator[int]:
        """`request`'s generated token ids, the first first, each as soon as it is known."""
        ...


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """The model the front end serves."""

    id: str  # the name clients pass as `model`
    context_len: int  # prompt plus generated tokens it can hold
    tokenizer: Tokenizer | None = None  # None: token-id prompts only


class ApiError(Exception):
    """A refused request: its status and the OpenAI-style error it answers with."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": str(self), "type": self.kind,
                                       "param": self.param, "code": self.code}}, self.status)


class CompletionBody(BaseModel):
    """The body of `POST /v1/completions`: every field of the OpenAI API, so that each one this
    server cannot honour is refused by name rather than ignored."""

    model_config = ConfigDict(extra="forbid")

    model: str
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    best_of: int | None = None
    logprobs: int | None = None
    echo: bool | None = None
    stop: str | list[str] | None = None
    suffix: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None  # greedy decoding is deterministic: any seed is honoured
    user: str | None = None


# parameter -> (whether its value asks for something this server does not do, what to say)
UNSUPPORTED = {
    "temperature": (lambda v: v > 0, "sampling is not supported: decoding is greedy (use 0)"),
    "top_p": (lambda v: v < 1, "sampling is not supported: decoding is greedy (use 1)"),
    "n": (lambda v: v != 1, "one completion per request (n = 1)"),
    "best_of": (lambda v: v != 1, "one completion per request (best_of = 1)"),
    "logprobs": (lambda v: True, "log probabilities are not returned"),
    "echo": (lambda v: v, "the prompt is not echoed"),
    "stop": (lambda v: bool(v), "stop sequences are not supported"),
    "suffix": (lambda v: bool(v), "suffixes are not supported"),
    "presence_penalty": (lambda v: v != 0, "penalties are not supported"),
    "frequency_penalty": (lambda v: v != 0, "penalties are not supported"),
    "logit_bias": (lambda v: bool(v), "logit biases are not supported"),
}


def check_bind(host: str, api_key: str | None) -> None:
    """ValueError unless `host` is loopback or an API key guards the server."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost
        loopback = False
    if not loopback and not api_key:
        raise ValueError(f"--http {host}: serving beyond loopback needs --api-key (clients "
                         "then send Authorization: Bearer KEY)")


def build_app(backend: Backend, model: ModelInfo, api_key: str | None = None) -> FastAPI:
    """The FastAPI application of the module docstring."""
    app = FastAPI(title="rekv serve", docs_url=None, redoc_url=None, openapi_url=None)
    ids, start = itertools.count(), time.monotonic()

    @app.exception_handler(ApiError)
    async def refused(request: Request, e: ApiError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def malformed(request: Request, e: RequestValidationError) -> JSONResponse:
        return ApiError(400, f"malformed request: {_first_error(e.errors())}").response()

    @app.middleware("http")
    async def authorize(request: Request, call_next: Any) -> Any:
        if api_key and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)",
                                code="invalid_api_key").response()
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model.id, "object": "model",
                                            "created": 0, "owned_by": "rekv"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = _parse(await request.body())
        tokens, max_tokens = _check(body, model)
        req = ServeRequest(next(ids), tokens, max_tokens, time.monotonic() - start)
        answer = _Answer(f"cmpl-{req.id}", int(time.time()), model, len(tokens))
        if body.stream:
            usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(answer.events(backend.submit(req), usage),
                                     media_type="text/event-stream")
        return answer.whole(await _collect(backend.submit(req)))

    return app


def _parse(raw: bytes) -> CompletionBody:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"malformed request: the body is not JSON ({e})") from None
    if not isinstance(data, dict):
        raise ApiError(400, "malformed request: the body must be a JSON object")
    try:
        return CompletionBody.model_validate(data)
    except ValidationError as e:
        raise ApiError(400, f"malformed request: {_first_error(e.errors())}") from None


def _first_error(errors: Any) -> str:
    e = errors[0]
    where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
    return f"{where}: {e.get('msg', 'invalid')}" if where else e.get("msg", "invalid")


def _check(body: CompletionBody, model: ModelInfo) -> tuple[tuple[int, ...], int]:
    """The prompt's token ids and the tokens to generate, or the ApiError that refuses them."""
    if body.model != model.id:
        raise ApiError(404, f"the model {body.model!r} does not exist; this server serves "
                            f"{model.id!r}", param="model", code="model_not_found")
    for name, (asks, say) in UNSUPPORTED.items():
        value = getattr(body, name)
        if value is not None and asks(value):
            raise ApiError(400, f"{name}={value!r}: {say}", param=name)
    tokens = _prompt_ids(body.prompt, model)
    max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    if max_tokens < 1:
        raise ApiError(400, f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
    if len(tokens) + max_tokens > model.context_len:
        raise ApiError(400, f"this model's context holds {model.context_len} tokens; the "
                            f"prompt has {len(tokens)} and max_tokens asks for {max_tokens}",
                       param="prompt", code="context_length_exceeded")
    return tokens, max_tokens


def _prompt_ids(prompt: str | list, model: ModelInfo) -> tuple[int, ...]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise ApiError(400, f"one prompt per request, got {len(prompt)}", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if model.tokenizer is None:
            raise ApiError(400, f"{model.id} has no tokenizer: send the prompt as token ids",
                           param="prompt")
        ids = model.tokenizer.encode(prompt).ids
    else:
        ids = list(prompt)
        vocab = model.tokenizer.get_vocab_size() if model.tokenizer else None
        if any(t < 0 or (vocab is not None and t >= vocab) for t in ids):
            raise ApiError(400, "token ids must lie in the model's vocabulary", param="prompt")
    if not ids:
        raise ApiError(400, "the prompt holds no tokens", param="prompt")
    return tuple(ids)


async def _collect(tokens: AsyncIterator[int]) -> list[int]:
    try:
        return [t async for t in tokens]
    except ApiError:
        raise
    except Exception as e:  # the backend failed this request; the server goes on
        raise ApiError(500, f"the request failed: {e}", kind="server_error") from None


@dataclasses.dataclass(frozen=True)
class _Answer:
    """How one completion is answered, whole or streamed."""

    id: str
    created: int
    model: ModelInfo
    prompt_tokens: int

    def text(self, ids: list[int]) -> str:
        tok = self.model.tokenizer
        return tok.decode(ids) if tok is not None else "".join(f" {t}" for t in ids)

    def chunk(self, text: str, finish: str | None) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model.id, "choices": [{"text": text, "index": 0, "logprobs": None,
                                                     "finish_reason": finish}]}

    def usage(self, completion: int) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def whole(self, ids: list[int]) -> dict[str, Any]:
        return self.chunk(self.text(ids), "length") | {"usage": self.usage(len(ids))}

    async def events(self, tokens: AsyncIterator[int], usage: bool) -> AsyncIterator[str]:
        """Server-sent events: a chunk per token (its new text), the finish, usage if asked,
        then [DONE]; a failure ends the stream with an error event."""
        ids: list[int] = []
        try:
            async for t in tokens:
                before = self.text(ids)
                ids.append(t)
                yield _event(self.chunk(self.text(ids)[len(before):], None))
        except Exception as e:  # the backend failed this request; the server goes on
            yield _event({"error": {"message": f"the request failed: {e}",
                                    "type": "server_error"}})
            return
        yield _event(self.chunk("", "length"))
        if usage:
            yield _event({**self.chunk("", None), "choices": [], "usage": self.usage(len(ids))})
        yield "data: [DONE]\n\n"


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


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

