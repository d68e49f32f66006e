"""What a client of the OpenAI API asks: the bodies of `POST /v1/completions` (`CompletionBody`)
and `POST /v1/chat/completions` (`ChatBody`), and the `ServeRequest` a body becomes
(`request_of`), with its `Sampling` and `Stops`.

Every field is declared, so none is silently ignored. Honoured: the prompt or `messages`
(rendered with the model's chat template, `add_generation_prompt`, `chat_template_kwargs`),
`max_tokens` (chat: `max_completion_tokens` first), `stream` and `stream_options`
(`include_usage`, `continuous_usage_stats`), `temperature` (default 1, the API's), `top_p`,
`top_k` (0 or -1: every token), `seed`, `stop` (a string or a list), `stop_token_ids`,
`min_tokens`, `ignore_eos`, `logprobs` (completions: how many likeliest tokens, 0..5; chat: a
bool, with `top_logprobs` 0..20) and `skip_special_tokens`. A request without a `seed` gets one
drawn (`secrets`), which its answer reports. Accepted at the value that changes nothing
(`REFUSED` says which): `n` and `best_of` 1, the penalties at 0 (`repetition_penalty` 1),
`min_p` 0, no `logit_bias`, `echo`, `suffix` or `tools`, `tool_choice` none or auto,
a text `response_format`, `spaces_between_special_tokens`; `user` and `parallel_tool_calls` at
any value. Any other value of those, and any field not declared, is refused by name (400).
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from tokenizers import Tokenizer

from rekv_jax.model.chat_template import ChatTemplate
from rekv_jax.serving.requests import ServeRequest
from rekv_jax.serving.sampling import Sampling, Stops

DEFAULT_MAX_TOKENS = 16  # the completions API's default (chat: what the context leaves)
DEFAULT_TEMPERATURE = 1.0  # the OpenAI API's default
COMPLETION_LOGPROBS = 5  # the most likeliest tokens the completions API reports
SEEDS = 2**53  # drawn seeds lie in 0..SEEDS-1: exact as a JSON number in any client


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """The model the front end serves."""

    id: str  # the name clients pass as `model`
    context_len: int  # prompt plus generated tokens it can hold
    tokenizer: Tokenizer | None = None  # None: token-id prompts only
    chat_template: ChatTemplate | None = None  # None: no chat


class ApiError(Exception):
    """A refused request: its status and the OpenAI-style error it answers with."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), self.status)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False  # a last chunk with the usage
    continuous_usage_stats: bool = False  # the usage so far in every chunk


class _Body(BaseModel):
    """The fields both APIs share."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True


class CompletionBody(_Body):
    """The body of `POST /v1/completions`."""

    prompt: str | list[int] | list[str] | list[list[int]]
    best_of: int | None = None
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None


class Message(BaseModel):
    """A chat message; fields beyond `role` and `content` (e.g. `name`) reach the template."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatBody(_Body):
    """The body of `POST /v1/chat/completions`."""

    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


Body = CompletionBody | ChatBody

# field -> (whether its value asks for something this server does not do, what to say)
REFUSED = {
    "n": (lambda v: v != 1, "one completion per request (n = 1)"),
    "best_of": (lambda v: v != 1, "one completion per request (best_of = 1)"),
    "echo": (lambda v: v, "the prompt is not echoed"),
    "suffix": (lambda v: bool(v), "suffixes are not supported"),
    "presence_penalty": (lambda v: v != 0, "penalties are not supported (0 is none)"),
    "frequency_penalty": (lambda v: v != 0, "penalties are not supported (0 is none)"),
    "repetition_penalty": (lambda v: v != 1, "penalties are not supported (1 is none)"),
    "min_p": (lambda v: v != 0, "min-p sampling is not supported (0 is none)"),
    "logit_bias": (lambda v: bool(v), "logit biases are not supported"),
    "spaces_between_special_tokens": (lambda v: not v, "special tokens are decoded as the "
                                                       "tokenizer writes them"),
    "tools": (lambda v: bool(v), "tool calls are not supported"),
    "tool_choice": (lambda v: v not in ("none", "auto"), "tool calls are not supported"),
    "response_format": (lambda v: v.get("type") != "text", "only text responses"),
}


def parse(raw: bytes, kind: type[Body]) -> Body:
    """The body `raw` holds, or the ApiError (400) that says what is wrong with it."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"malformed request: the body is not JSON ({e})") from None
    if not isinstance(data, dict):
        raise ApiError(400, "malformed request: the body must be a JSON object")
    try:
        return kind.model_validate(data)
    except ValidationError as e:
        raise ApiError(400, f"malformed request: {first_error(e.errors())}") from None


def first_error(errors: Any) -> str:
    """The first of pydantic's errors, as `where: what`."""
    e = errors[0]
    where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
    return f"{where}: {e.get('msg', 'invalid')}" if where else e.get("msg", "invalid")


def request_of(body: Body, model: ModelInfo, request_id: int, arrival_s: float
               ) -> ServeRequest:
    """The `ServeRequest` `body` asks for, or the ApiError that refuses it."""
    if body.model != model.id:
        raise ApiError(404, f"the model {body.model!r} does not exist; this server serves "
                            f"{model.id!r}", param="model", code="model_not_found")
    for name in type(body).model_fields:
        value, (asks, say) = getattr(body, name), REFUSED.get(name, (None, ""))
        if asks is not None and value is not None and asks(value):
            raise ApiError(400, f"{name}={value!r}: {say}", param=name)
    if isinstance(body, ChatBody):
        tokens = _chat_ids(body, model)
        asked = (body.max_tokens if body.max_completion_tokens is None
                 else body.max_completion_tokens)
        max_tokens = model.context_len - len(tokens) if asked is None else asked
    else:
        tokens = _prompt_ids(body.prompt, model)
        max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    _check_room(len(tokens), max_tokens, model)
    return ServeRequest(request_id, tokens, max_tokens, arrival_s, _sampling(body),
                        _stops(body, max_tokens))


def _check_room(prompt_len: int, max_tokens: int, model: ModelInfo) -> None:
    if prompt_len >= model.context_len:  # named alone: a chat's default max_tokens is negative
        raise ApiError(400, f"the prompt has {prompt_len} tokens; this model's context holds "
                            f"{model.context_len} (the prompt and at least one new token)",
                       param="prompt", code="context_length_exceeded")
    if prompt_len + max(max_tokens, 1) > model.context_len:
        raise ApiError(400, f"this model's context holds {model.context_len} tokens; the "
                            f"prompt has {prompt_len} and max_tokens asks for {max_tokens}",
                       param="prompt", code="context_length_exceeded")
    if max_tokens < 1:
        raise ApiError(400, f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")


def _sampling(body: Body) -> Sampling:
    """How `body` asks its tokens to be drawn (its seed drawn if it gives none)."""
    if isinstance(body, ChatBody):
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        logprobs = body.logprobs
        if logprobs is not None and not 0 <= logprobs <= COMPLETION_LOGPROBS:
            raise ApiError(400, f"logprobs={logprobs}: the completions API reports 0.."
                                f"{COMPLETION_LOGPROBS} likeliest tokens", param="logprobs")
    top_k = body.top_k if body.top_k not in (None, -1) else 0
    try:
        return Sampling(DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
                        1.0 if body.top_p is None else body.top_p, top_k,
                        secrets.randbelow(SEEDS) if body.seed is None else body.seed, logprobs)
    except ValueError as e:
        raise ApiError(400, str(e)) from None


def _stops(body: Body, max_tokens: int) -> Stops:
    """What else `body` asks to end its request."""
    if body.min_tokens > max_tokens:
        raise ApiError(400, f"min_tokens={body.min_tokens} is more than max_tokens="
                            f"{max_tokens}", param="min_tokens")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    try:
        return Stops(stop, tuple(body.stop_token_ids or ()), body.ignore_eos, body.min_tokens)
    except ValueError as e:
        raise ApiError(400, str(e)) from None


def _prompt_ids(prompt: str | list, model: ModelInfo) -> tuple[int, ...]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise ApiError(400, f"one prompt per request, got {len(prompt)}", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if model.tokenizer is None:
            raise ApiError(400, f"{model.id} has no tokenizer: send the prompt as token ids",
                           param="prompt")
        ids = encode(model.tokenizer, prompt, True)
    else:
        ids = list(prompt)
        vocab = model.tokenizer.get_vocab_size() if model.tokenizer else None
        if any(t < 0 or (vocab is not None and t >= vocab) for t in ids):
            raise ApiError(400, "token ids must lie in the model's vocabulary", param="prompt")
    if not ids:
        raise ApiError(400, "the prompt holds no tokens", param="prompt")
    return tuple(ids)


def encode(tokenizer: Tokenizer, text: str, special: bool) -> tuple[int, ...]:
    """`text`'s ids (`special`: with the tokenizer's added tokens, e.g. BOS). Through
    `encode_batch`, which releases the GIL while it runs (`encode` holds it): a long prompt
    tokenized on a worker thread leaves the event loop's thread running."""
    return tuple(tokenizer.encode_batch([text], add_special_tokens=special)[0].ids)


def _chat_ids(body: ChatBody, model: ModelInfo) -> tuple[int, ...]:
    """The token ids of `body.messages` rendered with the model's chat template (the template
    writes any BOS itself, so the tokenizer adds none)."""
    if model.tokenizer is None or model.chat_template is None:
        missing = ("a tokenizer" if model.tokenizer is None else
                   "a chat template (chat_template in its tokenizer_config.json or a "
                   "chat_template.jinja file)")
        raise ApiError(400, f"{model.id} has no {missing}: it takes /v1/completions only",
                       param="messages")
    if not body.messages:
        raise ApiError(400, "messages holds no message", param="messages")
    messages = [m.model_dump() | {"content": _text(m.content, i)}
                for i, m in enumerate(body.messages)]
    try:
        text = model.chat_template.render(messages, body.add_generation_prompt,
                                          body.chat_template_kwargs)
    except ValueError as e:
        raise ApiError(400, str(e), param="messages") from None
    ids = encode(model.tokenizer, text, False)
    if not ids:
        raise ApiError(400, "the rendered messages hold no tokens", param="messages")
    return tuple(ids)


def _text(content: str | list[dict[str, Any]] | None, index: int) -> str:
    """A message's content as text: its text parts joined by newlines."""
    if content is None or isinstance(content, str):
        return content or ""
    kinds = {part.get("type") for part in content} - {"text"}
    if kinds:
        raise ApiError(400, f"messages[{index}].content: only text parts are supported, got "
                            f"{sorted(map(str, kinds))}", param="messages")
    return "\n".join(str(part.get("text", "")) for part in content)
