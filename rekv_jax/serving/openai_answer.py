"""How a request is answered in the OpenAI API's shapes, whole or streamed: a backend's `Token`s
and its `Ended` become text (`Reply`), then the completions or chat bodies and chunks (`Answer`).

The text is the tokens decoded as they come (`Detokenizer`: a token that ends inside a UTF-8
character waits for the next), special tokens skipped unless asked. Once a request has its
`min_tokens`, the text is cut before the first stop string that a new token completes, and the
reply finishes ("stop") there whatever the backend goes on to send; a streamed reply holds back
text that could be the start of a stop string until it is decided, so no stop text is ever sent.
A token that can only be the last (the `max_new_tokens`-th) waits for `Ended`, so its chunk
carries the finish reason the backend reports and each token is one chunk.

Every body and chunk names the request's sampling seed in a top-level `seed` field (drawn when
the client gave none), so any answer can be replayed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse
from tokenizers import Tokenizer, decoders

from rekv_jax.serving.ends import first_stop
from rekv_jax.serving.openai_request import ApiError, Body, ChatBody, ModelInfo, StreamOptions
from rekv_jax.serving.requests import Ended, ServeRequest, Token

LOGPROB_FLOOR = -9999.0  # a log probability of -inf is written as this (JSON has no infinity)
DEADLINE = "deadline"  # a reply's finish when its client's deadline passed first (`pieces`)


@dataclasses.dataclass(frozen=True)
class Piece:
    """What a reply adds at one step: its new text, the tokens it covers, and its finish reason
    (None: more to come)."""

    text: str
    tokens: tuple[Token, ...]
    finish: str | None = None


def token_text(tokenizer: Tokenizer | None, token: int) -> str:
    """One token's own text, special tokens included (its id as " 12" without a tokenizer)."""
    return f" {token}" if tokenizer is None else tokenizer.decode([token], False)


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """The byte each character of a byte-level BPE vocabulary stands for (GPT-2's alphabet:
    printable bytes as themselves, the other 68 as the characters from U+0100 on)."""
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
             *range(ord("®"), ord("ÿ") + 1)]
    hidden = [b for b in range(256) if b not in shown]
    return {chr(c): b for c, b in zip([*shown, *range(256, 256 + len(hidden))],
                                      [*shown, *hidden], strict=True)}


def token_bytes(tokenizer: Tokenizer | None, token: int) -> list[int]:
    """One token's own bytes, as the OpenAI API reports them: a byte-level BPE token's bytes
    from its vocabulary entry and a byte-fallback token's (<0xHH>) its byte, so that a token
    ending inside a UTF-8 character gives that character's first bytes (its text would be
    U+FFFD); any other token's, and an added token's, are its text in UTF-8."""
    if tokenizer is not None and token not in tokenizer.get_added_tokens_decoder():
        piece, byte_of = tokenizer.id_to_token(token), _byte_of_char()
        if isinstance(tokenizer.decoder, decoders.ByteLevel) and all(c in byte_of for c in piece):
            return [byte_of[c] for c in piece]
        if fallback := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece):
            return [int(fallback[1], 16)]
    return list(token_text(tokenizer, token).encode())


def _floor(logprob: float | None) -> float | None:
    return None if logprob is None else max(logprob, LOGPROB_FLOOR)


class Detokenizer:
    """A request's generated ids as text, token by token (`token_text` without a tokenizer)."""

    def __init__(self, tokenizer: Tokenizer | None, skip_special: bool = True) -> None:
        self._tok, self._skip = tokenizer, skip_special
        self._ids: list[int] = []
        self._prefix = self._read = 0  # ids[prefix:read]: the context of the text given out

    def _new(self) -> str:
        before = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        return self._tok.decode(self._ids[self._prefix:], self._skip)[len(before):]

    def add(self, token: int) -> str:
        """The text `token` completes ("" while it ends inside a character)."""
        self._ids.append(token)
        if self._tok is None:
            return token_text(None, token)
        new = self._new()
        if not new or new.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return new

    def flush(self) -> str:
        """The text still held, as the tokenizer writes it."""
        new = "" if self._tok is None else self._new()
        self._prefix = self._read = len(self._ids)
        return new


class Reply:
    """The text a client may have of a request so far, and how it finished (`finish`)."""

    def __init__(self, model: ModelInfo, request: ServeRequest, skip_special: bool = True
                 ) -> None:
        self._detok = Detokenizer(model.tokenizer, skip_special)
        self._stops, self._max = request.stops, request.max_new_tokens
        self._text = ""  # every character decoded so far, cut at a stop string
        self._sent = 0  # characters of it given out
        self._pending: list[Token] = []  # tokens no piece covered yet
        self.count = 0  # tokens taken
        self.finish: str | None = None

    def add(self, item: Token | Ended) -> Piece | None:
        """The piece `item` adds (None: wait for the next item)."""
        if isinstance(item, Ended):
            return self.end(item.finish_reason)
        self.count += 1
        self._pending.append(item)
        if self._extend(self._detok.add(item.token)) is not None:
            return self._piece("stop")
        return None if self.count == self._max else self._piece(None)

    def end(self, finish: str) -> Piece:
        """The last piece: the text still held, finished `finish` ("stop" if that text
        completes a stop string)."""
        stop = self._extend(self._detok.flush())
        return self._piece(finish if stop is None else "stop")

    def _extend(self, new: str) -> str | None:
        """Append `new`; the stop string it completes, if any (the text is cut before it)."""
        start = len(self._text)
        self._text += new
        if not new or self.count < self._stops.min_tokens:
            return None
        found = first_stop(self._text, start, self._stops.stop)
        if found is None:
            return None
        i, stop = found
        self._text = self._text[:i]
        return stop

    def _held(self) -> int:
        """Characters at the end of the text that could begin a stop string."""
        return max((k for s in self._stops.stop for k in range(1, len(s))
                    if self._text.endswith(s[:k])), default=0)

    def _piece(self, finish: str | None) -> Piece:
        end = len(self._text) if finish else max(self._sent, len(self._text) - self._held())
        piece = Piece(self._text[self._sent:end], tuple(self._pending), finish)
        self._sent, self._pending, self.finish = end, [], finish
        return piece


async def pieces(items: AsyncGenerator[Token | Ended, None], reply: Reply,
                 deadline_s: float | None = None) -> AsyncIterator[Piece]:
    """`reply`'s pieces as the backend's items come, to the finish; the backend's stream is
    closed then (a reply that stops early drops what the backend sends after). Past
    `deadline_s` (on `time.monotonic()`'s clock; None: none) the stream is closed, which aborts
    the request, and the last piece holds the text still held, its finish `DEADLINE`."""
    try:
        while (item := await _next(items, deadline_s)) is not None:
            if (piece := reply.add(item)) is not None:
                yield piece
                if piece.finish is not None:
                    return
        raise RuntimeError("the backend ended the request without saying how")
    except _Late:
        yield reply.end(DEADLINE)
    finally:
        await items.aclose()


class _Late(Exception):
    """The client's deadline passed before the backend's next item."""


async def _next(items: AsyncGenerator[Token | Ended, None], deadline_s: float | None
                ) -> Token | Ended | None:
    """The backend's next item (None: its stream ended); `_Late` past `deadline_s`, the wait
    for it cancelled (and with it the backend's stream). Whether the deadline passed is the
    timeout's own verdict: the loop's clock may fire it a little before `time.monotonic()`
    reaches `deadline_s`, and a backend may raise a TimeoutError of its own."""
    if deadline_s is None:
        return await anext(items, None)
    try:
        async with asyncio.timeout(deadline_s - time.monotonic()) as scope:
            return await anext(items, None)
    except TimeoutError:
        if scope.expired():
            raise _Late from None
        raise


class _Logprobs:
    """A request's tokens' log probabilities, in its API's shape."""

    def __init__(self, model: ModelInfo, request: ServeRequest, chat: bool) -> None:
        self._tok, self._top, self._chat = model.tokenizer, request.sampling.logprobs, chat
        self._offset = 0  # completions: where the next token's text starts in the completion

    def _entry(self, token: int, logprob: float | None) -> dict[str, Any]:
        text = token_text(self._tok, token)
        return {"token": text, "logprob": _floor(logprob), "bytes": token_bytes(self._tok, token)}

    def of(self, tokens: tuple[Token, ...]) -> dict[str, Any] | None:
        """Completions: tokens, token_logprobs, top_logprobs ({text: logprob}), text_offset;
        chat: content, one entry per token with its top_logprobs; None unless asked."""
        if self._top is None:
            return None
        if self._chat:
            return {"content": [self._entry(t.token, t.logprob) | {"top_logprobs": [
                self._entry(i, lp) for i, lp in t.top_logprobs[:self._top]]} for t in tokens]}
        texts = [token_text(self._tok, t.token) for t in tokens]
        offsets = [self._offset + sum(len(x) for x in texts[:k]) for k in range(len(texts))]
        self._offset += sum(len(x) for x in texts)
        return {"tokens": texts, "token_logprobs": [_floor(t.logprob) for t in tokens],
                "top_logprobs": [{token_text(self._tok, i): _floor(lp)
                                  for i, lp in t.top_logprobs[:self._top]} for t in tokens],
                "text_offset": offsets}


@dataclasses.dataclass
class Answer:
    """How one request is answered in its API's shape, whole or streamed."""

    request: ServeRequest
    chat: bool
    model_id: str
    logprobs: _Logprobs
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @classmethod
    def of(cls, body: Body, model: ModelInfo, request: ServeRequest) -> Answer:
        chat = isinstance(body, ChatBody)
        return cls(request, chat, model.id, _Logprobs(model, request, chat))

    def _body(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        kind = "text_completion" if not self.chat else (
            "chat.completion.chunk" if chunk else "chat.completion")
        return {"id": f"{'chatcmpl' if self.chat else 'cmpl'}-{self.request.id}",
                "object": kind, "created": self.created, "model": self.model_id,
                "choices": choices, "seed": self.request.sampling.seed}

    def usage(self, completion: int) -> dict[str, int]:
        prompt = self.request.prompt_len
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def _choice(self, text: str, tokens: tuple[Token, ...], finish: str | None, part: str
                ) -> dict[str, Any]:
        """The one choice of a whole answer (`part` "whole") or of a chunk ("first", "next")."""
        if not self.chat:
            said = {"text": text}
        elif part == "whole":
            said = {"message": {"role": "assistant", "content": text}}
        else:
            role = {"role": "assistant"} if part == "first" else {}
            said = {"delta": role | {"content": text}}
        return {"index": 0, **said, "logprobs": self.logprobs.of(tokens),
                "finish_reason": finish}

    async def whole(self, replied: AsyncIterator[Piece]) -> dict[str, Any] | JSONResponse:
        """The whole answer: its text, finish reason, usage and logprobs; past its deadline, a
        504 whose body holds the text so far beside the error."""
        try:
            got = [p async for p in replied]
        except Exception as e:  # the backend failed this request; the server goes on
            raise ApiError(500, f"the request failed: {e}", kind="server_error") from None
        tokens = tuple(t for p in got for t in p.tokens)
        late = got[-1].finish == DEADLINE
        choice = self._choice("".join(p.text for p in got), tokens,
                              None if late else got[-1].finish, "whole")
        body = self._body([choice], False) | {"usage": self.usage(len(tokens))}
        if late:
            return JSONResponse(body | _late(len(tokens)).body(), 504)
        return body

    async def events(self, replied: AsyncIterator[Piece], options: StreamOptions | None
                     ) -> AsyncIterator[str]:
        """Server-sent events: a chunk per piece (chat: the first with the role), the last
        with the finish reason, usage if asked, then [DONE]. A failure, or the deadline passing
        (after a chunk of the text still held), sends an error event, then [DONE]."""
        options, count, first, late = options or StreamOptions(), 0, True, False
        try:
            async for p in replied:
                count += len(p.tokens)
                late = p.finish == DEADLINE
                if not late or p.text or p.tokens:
                    yield _event(self._chunk(p, first, count, options, None if late else p.finish))
                first = False
            if late:
                yield _event(_late(count).body())
            elif options.include_usage:
                yield _event(self._body([], True) | {"usage": self.usage(count)})
        except Exception as e:  # the backend failed this request; the server goes on
            yield _event(ApiError(500, f"the request failed: {e}", kind="server_error").body())
        yield "data: [DONE]\n\n"

    def _chunk(self, p: Piece, first: bool, count: int, options: StreamOptions,
               finish: str | None) -> dict[str, Any]:
        choice = self._choice(p.text, p.tokens, finish, "first" if first else "next")
        usage = {"usage": self.usage(count)} if options.continuous_usage_stats else {}
        return self._body([choice], True) | usage


def _late(tokens: int) -> ApiError:
    """The error of a request its client's deadline ended, after `tokens` tokens."""
    return ApiError(504, f"the request's deadline passed after {tokens} tokens (the text so far "
                         "is sent; the request was aborted)", kind="timeout",
                    code="deadline_exceeded")


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"
