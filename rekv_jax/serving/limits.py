"""What bounds one HTTP request of the OpenAI front end (`http`): the size of its body
(`read_body`: over `--max-body-bytes` it is a 413, by its Content-Length before any byte is kept,
else once the bytes read pass the limit), the deadline its client may give (`deadline_of`: the
`X-Request-Timeout` header, seconds from when the server took the request; none by default), and
its client's presence (`while_connected`: a whole answer whose client disconnects is cancelled,
so its request is aborted and its pages freed; a stream is cancelled by Starlette itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response

from rekv_jax.serving.openai_request import ApiError

DISCARD_BYTES = 64 * 2**20  # the most of a refused body read and dropped before its 413
TIMEOUT_HEADER = "X-Request-Timeout"  # the client's deadline: seconds, a positive number
CLIENT_GONE = 499  # the status of an answer whose client disconnected (nobody reads it)

T = TypeVar("T")


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"the request body is larger than this server takes ({max_bytes} "
                         "bytes, --max-body-bytes)", code="request_too_large")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request's body, or a 413 once it is known to pass `max_bytes`: by its Content-Length
    before a byte is kept, else as the bytes are counted. A refused body's bytes are dropped
    as they come, up to `DISCARD_BYTES`, before the 413 is sent: a client that sends its whole
    body before it reads (and closes the connection after one answer) would otherwise meet a
    connection reset instead of the 413."""
    declared = request.headers.get("content-length", "")
    chunks, size = [], 0
    refused = declared.isdigit() and int(declared) > max_bytes
    async for chunk in request.stream():
        size += len(chunk)
        refused = refused or size > max_bytes
        if refused and size > DISCARD_BYTES:
            break  # past it the connection closes as it is
        if not refused:
            chunks.append(chunk)
    if refused:
        raise _too_large(max_bytes)
    return b"".join(chunks)


def deadline_of(request: Request, taken_s: float) -> float | None:
    """When the request must end on `time.monotonic()`'s clock: `TIMEOUT_HEADER` seconds after
    `taken_s`, when the server took it (None: no header, no deadline); a 400 if it is not a
    positive finite number of seconds."""
    given = request.headers.get(TIMEOUT_HEADER)
    if given is None:
        return None
    try:
        seconds = float(given)
    except ValueError:
        seconds = math.nan
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ApiError(400, f"{TIMEOUT_HEADER}: {given!r} is not a positive number of seconds",
                       param=TIMEOUT_HEADER)
    return taken_s + seconds


async def _disconnect(request: Request) -> None:
    """Return once the client disconnects (the body was read: nothing else comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def while_connected(request: Request, work: Awaitable[T]) -> T | Response:
    """`work`'s result, or, if the client disconnects first, `work` cancelled (its backend
    stream closed: the request is aborted) and a `CLIENT_GONE` response nobody reads."""
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, gone):
            pending.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    if task.cancelled():
        return Response(status_code=CLIENT_GONE)
    return task.result()
