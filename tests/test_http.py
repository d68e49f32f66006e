"""The OpenAI completions API on loopback, driven by the official `openai` client against a fake
backend that yields deterministic tokens: streaming and not, and every refusal a clear 4xx that
leaves the server serving."""

import asyncio
import json
import threading
import urllib.error
import urllib.request

import openai
import pytest

from rekv_jax.model.loader import SHIPPED_MODEL, load_tokenizer
from rekv_jax.serving import http

TOKENIZER = load_tokenizer(SHIPPED_MODEL)
MODEL = http.ModelInfo("wt2-tiny", context_len=64, tokenizer=TOKENIZER)
KEY = "sk-test"


class Fake:
    """Token i of a request is (sum of its prompt + 7 i) mod 2048; prompts holding id 13 fail
    after one token."""

    def __init__(self):
        self.seen = []

    def submit(self, request):
        self.seen.append(request)

        async def tokens():
            for i in range(request.max_new_tokens):
                if i == 1 and 13 in request.tokens:
                    raise RuntimeError("the decode worker failed")
                await asyncio.sleep(0)
                yield (sum(request.tokens) + 7 * i) % 2048
        return tokens()


def _expected(prompt_ids, n):
    return [(sum(prompt_ids) + 7 * i) % 2048 for i in range(n)]


@pytest.fixture(scope="module")
def server():
    before = set(threading.enumerate())
    fake = Fake()
    with http.running(http.build_app(fake, MODEL, api_key=KEY)) as url:
        yield url, fake
    assert set(threading.enumerate()) <= before  # no thread outlives the server


def _raw(url, body=None, key=KEY):
    """(status, JSON) of a GET (no body) or a POST of raw bytes, with the standard library."""
    headers = {"Content-Type": "application/json"} | (
        {"Authorization": f"Bearer {key}"} if key else {})
    req = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _client(url, key=KEY):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=10)


def test_completions_whole_and_streamed_equal_the_backends_tokens(server):
    url, fake = server
    ids = TOKENIZER.encode("The tower is").ids
    want = TOKENIZER.decode(_expected(ids, 6))
    whole = _client(url).completions.create(model="wt2-tiny", prompt="The tower is",
                                            max_tokens=6, temperature=0)
    assert whole.choices[0].text == want and whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), 6)
    assert fake.seen[-1].tokens == tuple(ids) and fake.seen[-1].max_new_tokens == 6
    stream = _client(url).completions.create(model="wt2-tiny", prompt=ids, max_tokens=6,
                                             stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == 6
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_models_and_health(server):
    url, _ = server
    assert [m.id for m in _client(url).models.list()] == ["wt2-tiny"]
    assert _raw(f"{url}/health", key=None) == (200, {"status": "ok"})  # no key needed


@pytest.mark.parametrize("kwargs, status, words", [
    ({"temperature": 0.7}, 400, "greedy"),
    ({"top_p": 0.5}, 400, "greedy"),
    ({"n": 2}, 400, "one completion"),
    ({"best_of": 3}, 400, "one completion"),
    ({"logprobs": 2}, 400, "log probabilities"),
    ({"stop": ["\n"]}, 400, "stop sequences"),
    ({"model": "gpt-4"}, 404, "'gpt-4' does not exist"),
    ({"prompt": list(range(60)), "max_tokens": 10}, 400, "context holds 64"),
    ({"prompt": [5000]}, 400, "vocabulary"),
    ({"prompt": ""}, 400, "no tokens"),
    ({"prompt": ["a", "b"]}, 400, "one prompt"),
    ({"max_tokens": 0}, 400, "max_tokens"),
])
def test_refusals_are_clear_4xx_and_the_server_goes_on(server, kwargs, status, words):
    url, _ = server
    args = {"model": "wt2-tiny", "prompt": "hello", "max_tokens": 3} | kwargs
    with pytest.raises(openai.APIStatusError) as e:
        _client(url).completions.create(**args)
    assert e.value.status_code == status and words in e.value.message
    assert _client(url).completions.create(model="wt2-tiny", prompt="ok", max_tokens=2)


@pytest.mark.parametrize("body, words", [
    (b"{not json", "not JSON"), (b"[1, 2]", "JSON object"), (b'{"model": "wt2-tiny"}', "prompt"),
    (b'{"model": "wt2-tiny", "prompt": "x", "max_tokens": "many"}', "max_tokens"),
    (b'{"model": "wt2-tiny", "prompt": "x", "frobnicate": 1}', "frobnicate")])
def test_malformed_bodies_are_400(server, body, words):
    url, _ = server
    status, answer = _raw(f"{url}/v1/completions", body)
    assert status == 400 and words in answer["error"]["message"], answer


def test_a_missing_or_wrong_key_is_401(server):
    url, _ = server
    with pytest.raises(openai.AuthenticationError, match="API key"):
        _client(url, "wrong").completions.create(model="wt2-tiny", prompt="x", max_tokens=1)
    assert _raw(f"{url}/v1/completions", b"{}", key=None)[0] == 401  # no key at all
    assert _raw(f"{url}/v1/models", key=None)[0] == 401


def test_a_backend_failure_fails_that_request_only(server):
    url, _ = server
    with pytest.raises(openai.InternalServerError, match="decode worker failed"):
        _client(url).completions.create(model="wt2-tiny", prompt=[13, 1], max_tokens=3)
    chunks = []
    with pytest.raises(openai.APIError, match="decode worker failed"):  # the stream's error event
        for chunk in _client(url).completions.create(model="wt2-tiny", prompt=[13, 1],
                                                     max_tokens=3, stream=True):
            chunks.append(chunk)
    assert len(chunks) == 1  # the first token came before the failure
    assert _client(url).completions.create(model="wt2-tiny", prompt=[1], max_tokens=2)


def test_a_model_without_a_tokenizer_takes_ids_and_answers_ids():
    info = http.ModelInfo("tiny", context_len=64)
    with http.running(http.build_app(Fake(), info)) as url:
        c = _client(url, "none")
        assert c.completions.create(model="tiny", prompt=[1, 2], max_tokens=2
                                    ).choices[0].text == " 3 10"
        with pytest.raises(openai.BadRequestError, match="no tokenizer"):
            c.completions.create(model="tiny", prompt="text", max_tokens=2)


@pytest.mark.parametrize("host, key, ok", [
    ("127.0.0.1", None, True), ("localhost", None, True), ("::1", None, True),
    ("0.0.0.0", None, False), ("10.1.2.3", None, False), ("myhost", None, False),
    ("0.0.0.0", "k", True)])
def test_binding_beyond_loopback_needs_a_key(host, key, ok):
    if ok:
        http.check_bind(host, key)
    else:
        with pytest.raises(ValueError, match="needs --api-key"):
            http.check_bind(host, key)
