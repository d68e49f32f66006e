"""The OpenAI API on loopback, driven by the official `openai` client against a fake backend that
yields deterministic tokens: completions and chat, whole and streamed, the fields each maps to
the request's `Sampling` and `Stops`, stop strings cut from the text, usage, logprobs in each
API's shape, and every refusal a clear 4xx that leaves the server serving (logprobs, stops,
seeds, EOS and usage through the real engine: tests/test_http_engine.py)."""

import asyncio
import json
import threading
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rekv_jax.model.loader import SHIPPED_MODEL, chat_template_of, load_tokenizer
from rekv_jax.serving import http, serve_config
from rekv_jax.serving.openai_request import ModelInfo
from rekv_jax.serving.prometheus import ServingMetrics
from rekv_jax.serving.requests import Ended, Load, Token
from rekv_jax.serving.sampling import Sampling, Stops

TOKENIZER = load_tokenizer(SHIPPED_MODEL)
TEMPLATE = chat_template_of(str(SHIPPED_MODEL))
MODEL = ModelInfo("wt2-tiny", context_len=64, tokenizer=TOKENIZER, chat_template=TEMPLATE)
KEY = "sk-test"
SCRIPT = TOKENIZER.encode("The tower is tall . Où est la tour ? Then more").ids


def logprob(i):
    """The fake's log probability of token i of a request."""
    return -0.25 * (i + 1)


class Fake:
    """Token i of a request is (sum of its prompt + 7 i) mod 2048, or SCRIPT[i] for a prompt
    holding the text "Go on"; each with log probability `logprob(i)` and as many likeliest tokens as
    its sampling asks. A token of `stop_token_ids` ends it ("stop") once it has `min_tokens`;
    prompts holding id 13 fail after one token."""

    def __init__(self):
        self.seen = []
        self.closed_early = 0  # streams closed before their end
        self.metrics = ServingMetrics()  # the app's `/metrics`, fed by the tests

    def tokens(self, request):
        if "Go on" in TOKENIZER.decode(list(request.tokens)):
            return SCRIPT[:request.max_new_tokens]
        return [(sum(request.tokens) + 7 * i) % 2048 for i in range(request.max_new_tokens)]

    def submit(self, request):
        self.seen.append(request)
        ids, stops, top = self.tokens(request), request.stops, request.sampling.logprobs or 0

        async def items():
            ended = False
            try:
                for i, t in enumerate(ids):
                    if i == 1 and 13 in request.tokens:
                        raise RuntimeError("the decode worker failed")
                    await asyncio.sleep(0)
                    yield Token(request.id, i, t, 0.0, logprob(i),
                                tuple((t + k, logprob(i) - k) for k in range(top)))
                    if t in stops.stop_token_ids and i + 1 >= stops.min_tokens:
                        ended = True
                        yield Ended("stop", t)
                        return
                ended = True
                yield Ended("length")
            finally:
                self.closed_early += not ended
        return items()


@pytest.fixture(scope="module")
def server():
    before = set(threading.enumerate())
    fake = Fake()
    with http.running(http.build_app(fake, MODEL, api_key=KEY, metrics=fake.metrics)) as url:
        yield url, fake
    assert set(threading.enumerate()) <= before  # no thread outlives the server


def _raw(url, body=None, key=KEY):
    """(status, JSON or text) of a GET (no body) or a POST of raw bytes, with the standard
    library."""
    headers = {"Content-Type": "application/json"} | (
        {"Authorization": f"Bearer {key}"} if key else {})
    req = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            raw = r.read()
            return r.status, json.loads(raw) if r.headers.get_content_type().endswith(
                "json") else raw.decode()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _client(url, key=KEY):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=10)


def _expected(prompt_ids, n):
    return [(sum(prompt_ids) + 7 * i) % 2048 for i in range(n)]


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
    assert chunks[-1].usage.completion_tokens == 6 and not chunks[-1].choices
    token_chunks = [c for c in chunks if c.choices]
    assert len(token_chunks) == 6  # one chunk per token, the last with the finish reason
    assert [c.choices[0].finish_reason for c in token_chunks] == [None] * 5 + ["length"]


def test_a_character_split_across_tokens_is_sent_whole(server):
    url, _ = server
    chunks = list(_client(url).completions.create(model="wt2-tiny", prompt="Go on",
                                                  max_tokens=len(SCRIPT), stream=True))
    texts = [c.choices[0].text for c in chunks]
    assert "".join(texts) == TOKENIZER.decode(SCRIPT) and "\ufffd" not in "".join(texts)
    assert "" in texts  # the first byte of "ù" waited for the second


def test_chat_whole_and_streamed_equal_completions_of_the_templated_prompt(server):
    url, fake = server
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Where is"},
                                             {"type": "text", "text": "the tower?"}]}]
    flat = [messages[0], {"role": "user", "content": "Where is\nthe tower?"}]
    prompt = TEMPLATE.render(flat)
    completion = _client(url).completions.create(model="wt2-tiny", prompt=prompt, max_tokens=8,
                                                 temperature=0)
    chunks = list(_client(url).chat.completions.create(
        model="wt2-tiny", messages=messages, max_completion_tokens=8, temperature=0,
        stream=True))
    assert fake.seen[-1].tokens == fake.seen[-2].tokens == tuple(TOKENIZER.encode(prompt).ids)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == completion.choices[0].text
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    whole = _client(url).chat.completions.create(model="wt2-tiny", messages=messages,
                                                 max_tokens=8, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == completion.choices[0].text
    assert whole.usage.prompt_tokens == completion.usage.prompt_tokens


def test_chat_without_max_tokens_may_fill_the_context(server):
    url, fake = server
    _client(url).chat.completions.create(model="wt2-tiny",
                                         messages=[{"role": "user", "content": "Hi"}])
    assert fake.seen[-1].prompt_len + fake.seen[-1].max_new_tokens == MODEL.context_len


@pytest.mark.parametrize("info, words", [
    (ModelInfo("wt2-tiny", 64, TOKENIZER), "has no a chat template"),
    (ModelInfo("wt2-tiny", 64, None, TEMPLATE), "has no a tokenizer"),
])
def test_chat_on_a_model_without_template_or_tokenizer_is_400_saying_why(info, words):
    with http.running(http.build_app(Fake(), info)) as url:
        with pytest.raises(openai.BadRequestError, match=words):
            _client(url).chat.completions.create(
                model="wt2-tiny", messages=[{"role": "user", "content": "Hi"}])


def test_sampling_and_stop_fields_reach_the_backends_request(server):
    url, fake = server
    _client(url).completions.create(
        model="wt2-tiny", prompt="x", max_tokens=5, temperature=0.7, top_p=0.9, seed=123,
        logprobs=2, stop=["a", "bc"], extra_body={"top_k": 40, "stop_token_ids": [7],
                                                  "min_tokens": 2, "ignore_eos": True})
    assert fake.seen[-1].sampling == Sampling(0.7, 0.9, 40, 123, 2)
    assert fake.seen[-1].stops == Stops(("a", "bc"), (7,), True, 2)
    _client(url).chat.completions.create(
        model="wt2-tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3,
        temperature=0, seed=5, logprobs=True, top_logprobs=4, stop="\n",
        extra_body={"top_k": -1})
    assert fake.seen[-1].sampling == Sampling(0.0, 1.0, 0, 5, 4)
    assert fake.seen[-1].stops == Stops(("\n",))
    _client(url).completions.create(model="wt2-tiny", prompt="x", max_tokens=2)
    assert fake.seen[-1].sampling.temperature == 1.0  # the API's default
    assert fake.seen[-1].sampling.logprobs is None


def test_a_drawn_seed_is_reported_and_replays_the_request(server):
    url, fake = server
    whole = _client(url).completions.create(model="wt2-tiny", prompt="x", max_tokens=2)
    drawn = fake.seen[-1].sampling
    assert whole.seed == drawn.seed
    chunks = list(_client(url).chat.completions.create(
        model="wt2-tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3,
        stream=True, stream_options={"include_usage": True}))
    assert {c.seed for c in chunks} == {fake.seen[-1].sampling.seed} != {drawn.seed}
    _client(url).completions.create(model="wt2-tiny", prompt="x", max_tokens=2,
                                    seed=whole.seed)
    assert fake.seen[-1].sampling == drawn  # the reported seed asks for the same draws


def _stream_text(url, **kwargs):
    chunks = list(_client(url).completions.create(model="wt2-tiny", stream=True, **kwargs))
    return [c.choices[0].text for c in chunks], chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize("stop, cut", [
    ("wer is t", "The to"),  # split across three tokens
    (["zz", " is"], "The tower"),
    (["all .", "r i"], "The towe"),  # the earliest of two
    ("est", "The tower is tall . Où "),  # after a character split across tokens
])
def test_stop_strings_cut_the_text_whole_and_streamed(server, stop, cut):
    url, fake = server
    n = len(SCRIPT)
    whole = _client(url).completions.create(model="wt2-tiny", prompt="Go on", max_tokens=n,
                                            stop=stop)
    assert whole.choices[0].text == cut and whole.choices[0].finish_reason == "stop"
    before = fake.closed_early
    texts, finish = _stream_text(url, prompt="Go on", max_tokens=n, stop=stop)
    assert "".join(texts) == cut and finish == "stop"  # no chunk ever held stop text
    assert fake.closed_early == before + 1  # the backend's stream was closed at the stop
    chat = list(_client(url).chat.completions.create(
        model="wt2-tiny", messages=[{"role": "user", "content": "Go on"}], max_tokens=n,
        stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content for c in chat) == cut
    assert chat[-1].choices[0].finish_reason == "stop"


def test_held_back_text_is_sent_once_no_stop_matches(server):
    url, _ = server
    texts, finish = _stream_text(url, prompt="Go on", max_tokens=6, stop="tower iz")
    assert "".join(texts) == TOKENIZER.decode(SCRIPT[:6]) and finish == "length"
    assert texts[2:5] == [" ", "", ""]  # " to", "w", "er": "to", "w", "er" begin "tower iz"


def test_a_stop_string_within_min_tokens_does_not_end_the_request(server):
    url, _ = server
    whole = _client(url).completions.create(model="wt2-tiny", prompt="Go on", max_tokens=10,
                                            stop=" t", extra_body={"min_tokens": 5})
    assert whole.choices[0].text == "The tower is" and whole.usage.completion_tokens == 7


def test_a_stop_token_ends_the_request_with_stop(server):
    url, _ = server
    ids = [5]
    stop_id = _expected(ids, 4)[2]
    whole = _client(url).completions.create(model="wt2-tiny", prompt=ids, max_tokens=8,
                                            extra_body={"stop_token_ids": [stop_id]})
    assert whole.choices[0].finish_reason == "stop" and whole.usage.completion_tokens == 3
    texts, finish = _stream_text(url, prompt=ids, max_tokens=8,
                                 extra_body={"stop_token_ids": [stop_id]})
    assert "".join(texts) == whole.choices[0].text and finish == "stop"


def test_usage_as_the_last_chunk_and_in_every_chunk(server):
    url, _ = server
    chunks = list(_client(url).chat.completions.create(
        model="wt2-tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4,
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert [c.usage.completion_tokens for c in chunks] == [1, 2, 3, 4, 4]
    assert not chunks[-1].choices
    total = chunks[-1].usage
    assert total.total_tokens == total.prompt_tokens + 4
    plain = list(_client(url).chat.completions.create(
        model="wt2-tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4,
        stream=True))
    assert all(c.usage is None for c in plain) and all(c.choices for c in plain)


def test_completions_logprobs_have_the_completions_shape(server):
    url, _ = server
    n = 5
    texts = [TOKENIZER.decode([t]) for t in SCRIPT[:n]]
    whole = _client(url).completions.create(model="wt2-tiny", prompt="Go on", max_tokens=n,
                                            logprobs=2)
    lp = whole.choices[0].logprobs
    assert lp.tokens == texts and lp.token_logprobs == [logprob(i) for i in range(n)]
    assert lp.top_logprobs == [{TOKENIZER.decode([t]): logprob(i),
                                TOKENIZER.decode([t + 1]): logprob(i) - 1}
                               for i, t in enumerate(SCRIPT[:n])]
    assert lp.text_offset == [sum(len(x) for x in texts[:i]) for i in range(n)]
    chunks = list(_client(url).completions.create(model="wt2-tiny", prompt="Go on", max_tokens=n,
                                                  logprobs=2, stream=True))
    assert sum((c.choices[0].logprobs.tokens for c in chunks), []) == texts
    assert sum((c.choices[0].logprobs.text_offset for c in chunks), []) == lp.text_offset
    plain = _client(url).completions.create(model="wt2-tiny", prompt="Go on", max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_chat_logprobs_have_the_chat_shape(server):
    url, _ = server
    n = 4
    whole = _client(url).chat.completions.create(
        model="wt2-tiny", messages=[{"role": "user", "content": "x"}], max_tokens=n,
        logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert [e.logprob for e in content] == [logprob(i) for i in range(n)]
    for e in content:
        assert len(e.top_logprobs) == 3
        first = e.top_logprobs[0]  # the backend's likeliest is the token itself
        assert (first.logprob, first.token, first.bytes) == (e.logprob, e.token, e.bytes)
    assert "".join(e.token for e in content) == whole.choices[0].message.content
    assert bytes(b for e in content for b in e.bytes).decode() == whole.choices[0].message.content
    chunks = list(_client(url).chat.completions.create(
        model="wt2-tiny", messages=[{"role": "user", "content": "x"}], max_tokens=n,
        logprobs=True, stream=True))
    streamed = [e for c in chunks for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(e.top_logprobs == [] for e in streamed)  # logprobs without top_logprobs


def test_a_token_that_splits_a_character_has_its_own_bytes(server):
    """A token that ends inside a UTF-8 character reads U+FFFD as text, but its bytes are its
    own: all the tokens' bytes together are the reply's text in UTF-8."""
    url, _ = server
    whole = _client(url).chat.completions.create(
        model="wt2-tiny", messages=[{"role": "user", "content": "Go on"}],
        max_tokens=len(SCRIPT), logprobs=True)
    content, text = whole.choices[0].logprobs.content, whole.choices[0].message.content
    assert text == TOKENIZER.decode(SCRIPT) and "ù" in text
    split = [e for e in content if e.token == "\ufffd"]
    assert split and all(e.bytes != list("\ufffd".encode()) for e in split)
    assert bytes(b for e in content for b in e.bytes) == text.encode()


NEUTRAL = [
    {"repetition_penalty": 1.0}, {"min_p": 0.0}, {"presence_penalty": 0},
    {"frequency_penalty": 0.0}, {"user": "me"}, {"n": 1}, {"skip_special_tokens": True},
    {"spaces_between_special_tokens": True}, {"ignore_eos": True}, {"logit_bias": {}},
    {"stop": None}, {"logprobs": None}, {"stream_options": {"include_usage": True}},
]


@pytest.mark.parametrize("fields", NEUTRAL + [{"best_of": 1}, {"echo": False}, {"suffix": ""},
                                              {"prompt": ["one prompt as a list"]}])
def test_fields_that_change_nothing_are_accepted_in_completions(server, fields):
    url, _ = server
    body = {"model": "wt2-tiny", "prompt": "hi", "max_tokens": 2} | fields
    status, answer = _raw(f"{url}/v1/completions", json.dumps(body).encode())
    assert status == 200 and answer["choices"][0]["finish_reason"] == "length", answer


@pytest.mark.parametrize("fields", NEUTRAL + [
    {"tools": []}, {"tool_choice": "none"}, {"tool_choice": "auto"},
    {"response_format": {"type": "text"}}, {"parallel_tool_calls": True},
    {"max_completion_tokens": 2, "max_tokens": 9}, {"add_generation_prompt": True},
    {"chat_template_kwargs": {"enable_thinking": False}}])
def test_fields_that_change_nothing_are_accepted_in_chat(server, fields):
    url, fake = server
    body = {"model": "wt2-tiny", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2} | fields
    status, answer = _raw(f"{url}/v1/chat/completions", json.dumps(body).encode())
    assert status == 200 and answer["choices"][0]["finish_reason"] == "length", answer
    assert fake.seen[-1].max_new_tokens == 2


# the bodies four serving benchmarks send (vLLM's bench serve, guidellm, inference-perf, aiperf)
BENCHMARK_BODIES = [
    ("completions", {"prompt": "hi", "repetition_penalty": 1.0, "max_tokens": 3,
                     "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
                     "ignore_eos": True}),
    ("chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}]}], "max_completion_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True}),
    ("completions", {"prompt": "hi", "stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}, "max_tokens": 3, "stop": None,
        "ignore_eos": True}),
    ("chat/completions", {"stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}, "max_completion_tokens": 3,
        "stop": None, "ignore_eos": True, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "hi"}]}]}),
    ("completions", {"prompt": "hi", "max_tokens": 3, "ignore_eos": False, "stream": True,
                     "stream_options": {"include_usage": True}}),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                          "ignore_eos": False, "stream": False}),
    ("completions", {"prompt": ["hi"], "stream": True, "max_tokens": 3,
                     "stream_options": {"include_usage": True}}),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True,
                          "max_completion_tokens": 3, "stream_options": {
                              "include_usage": True, "continuous_usage_stats": True}}),
]


@pytest.mark.parametrize("route, body", BENCHMARK_BODIES)
def test_the_bodies_serving_benchmarks_send_are_served(server, route, body):
    url, fake = server
    data = json.dumps({"model": "wt2-tiny", **body}).encode()
    req = urllib.request.Request(f"{url}/v1/{route}", data=data, headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200
        raw = r.read().decode()
    assert fake.seen[-1].max_new_tokens == 3
    if body["stream"]:
        assert raw.endswith("data: [DONE]\n\n") and '"completion_tokens": 3' in raw


@pytest.mark.parametrize("kwargs, status, words", [
    ({"n": 2}, 400, "n=2: one completion"),
    ({"best_of": 3}, 400, "best_of=3"),
    ({"echo": True}, 400, "echo=True"),
    ({"suffix": "x"}, 400, "suffix="),
    ({"logit_bias": {"1": 5}}, 400, "logit_bias="),
    ({"presence_penalty": 0.5}, 400, "presence_penalty=0.5"),
    ({"frequency_penalty": 0.5}, 400, "frequency_penalty=0.5"),
    ({"extra_body": {"repetition_penalty": 1.1}}, 400, "repetition_penalty=1.1"),
    ({"extra_body": {"min_p": 0.1}}, 400, "min_p=0.1"),
    ({"extra_body": {"spaces_between_special_tokens": False}}, 400,
     "spaces_between_special_tokens=False"),
    ({"extra_body": {"frobnicate": 1}}, 400, "frobnicate"),
    ({"logprobs": 6}, 400, "logprobs=6"),
    ({"temperature": -1}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"seed": -1}, 400, "seed"),
    ({"stop": ""}, 400, "stop string"),
    ({"extra_body": {"min_tokens": 5}}, 400, "min_tokens=5"),
    ({"model": "gpt-4"}, 404, "'gpt-4' does not exist"),
    ({"prompt": list(range(60)), "max_tokens": 10}, 400, "context holds 64"),
    ({"prompt": [5000]}, 400, "vocabulary"),
    ({"prompt": ""}, 400, "no tokens"),
    ({"prompt": ["a", "b"]}, 400, "one prompt"),
    ({"max_tokens": 0}, 400, "max_tokens"),
])
def test_completions_refusals_are_clear_4xx_and_the_server_goes_on(server, kwargs, status,
                                                                   words):
    url, _ = server
    args = {"model": "wt2-tiny", "prompt": "hello", "max_tokens": 3} | kwargs
    with pytest.raises(openai.APIStatusError) as e:
        _client(url).completions.create(**args)
    assert e.value.status_code == status and words in e.value.message, e.value.message
    assert _client(url).completions.create(model="wt2-tiny", prompt="ok", max_tokens=2)


@pytest.mark.parametrize("kwargs, words", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools="),
    ({"tool_choice": "required"}, "tool_choice='required'"),
    ({"response_format": {"type": "json_object"}}, "response_format="),
    ({"top_logprobs": 2}, "top_logprobs needs logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "logprobs must be in 0..20"),
    ({"messages": []}, "no message"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:,"}}]}]}, "only text parts"),
    ({"max_completion_tokens": 100}, "context holds 64"),
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
])
def test_chat_refusals_name_the_field(server, kwargs, words):
    url, _ = server
    args = {"model": "wt2-tiny", "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 3} | kwargs
    with pytest.raises(openai.BadRequestError) as e:
        _client(url).chat.completions.create(**args)
    assert words in e.value.message, e.value.message


@pytest.mark.parametrize("body, words", [
    (b"{not json", "not JSON"), (b"[1, 2]", "JSON object"), (b'{"model": "wt2-tiny"}', "prompt"),
    (b'{"model": "wt2-tiny", "prompt": "x", "max_tokens": "many"}', "max_tokens"),
    (b'{"model": "wt2-tiny", "prompt": "x", "frobnicate": 1}', "frobnicate"),
    (b'{"model": "wt2-tiny", "prompt": "x", "stream_options": {"x": 1}}', "stream_options.x")])
def test_malformed_bodies_are_400(server, body, words):
    url, _ = server
    status, answer = _raw(f"{url}/v1/completions", body)
    assert status == 400 and words in answer["error"]["message"], answer


def test_a_missing_or_wrong_key_is_401(server):
    url, fake = server
    with pytest.raises(openai.AuthenticationError, match="API key"):
        _client(url, "wrong").completions.create(model="wt2-tiny", prompt="x", max_tokens=1)
    assert _raw(f"{url}/v1/completions", b"{}", key=None)[0] == 401  # no key at all
    assert _raw(f"{url}/v1/chat/completions", b"{}", key=None)[0] == 401
    assert _raw(f"{url}/v1/models", key=None)[0] == 401
    assert _raw(f"{url}/metrics", key=None)[0] == 401
    assert _raw(f"{url}/metrics", key="wrong")[0] == 401
    fake.metrics.emitted(Load(0, 1, 0.0, 37))  # a decode worker's pool, as it reports it
    status, text = _raw(f"{url}/metrics")
    samples = {(s.name, tuple(s.labels.items())): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert status == 200 and samples[("rekv_kv_pages_free", (("worker", "0"),))] == 37


def test_models_and_health(server):
    url, _ = server
    assert [m.id for m in _client(url).models.list()] == ["wt2-tiny"]
    assert _raw(f"{url}/health", key=None) == (200, {"status": "ok"})  # no key needed


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
    raw = _raw(f"{url}/v1/completions", json.dumps({"model": "wt2-tiny", "prompt": [13, 1],
                                                   "max_tokens": 3, "stream": True}).encode())[1]
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    assert len(events) == 3 and events[-1] == "[DONE]", events  # a chunk, the error, [DONE]
    assert "decode worker failed" in json.loads(events[1])["error"]["message"]
    assert _client(url).completions.create(model="wt2-tiny", prompt=[1], max_tokens=2)


def test_a_body_past_the_limit_is_413_counted_as_it_comes():
    """A body past `max_body_bytes` is a 413 whether its Content-Length says so or, sent in
    chunks without one, its bytes pass the limit as they are read; one within it is served."""
    from http.client import HTTPConnection

    with http.running(http.build_app(Fake(), MODEL, max_body_bytes=200)) as url:
        body = json.dumps({"model": "wt2-tiny", "prompt": "x" * 300, "max_tokens": 1}).encode()
        assert _raw(f"{url}/v1/completions", body)[0] == 413
        connection = HTTPConnection(url.removeprefix("http://"), timeout=10)
        try:
            connection.request("POST", "/v1/completions", iter([body[:150], body[150:]]),
                               {"Content-Type": "application/json"}, encode_chunked=True)
            answer = connection.getresponse()
            assert answer.status == 413 and "200 bytes" in json.loads(answer.read())[
                "error"]["message"]
        finally:
            connection.close()
        small = json.dumps({"model": "wt2-tiny", "prompt": "x", "max_tokens": 1}).encode()
        assert _raw(f"{url}/v1/completions", small)[0] == 200


def test_a_model_without_a_tokenizer_takes_ids_and_answers_ids():
    info = ModelInfo("tiny", context_len=64)
    with http.running(http.build_app(Fake(), info)) as url:
        c = _client(url, "none")
        assert c.completions.create(model="tiny", prompt=[1, 2], max_tokens=2
                                    ).choices[0].text == " 3 10"
        assert c.completions.create(model="tiny", prompt=[1, 2], max_tokens=4, stop=" 17"
                                    ).choices[0].text == " 3 10"
        with pytest.raises(openai.BadRequestError, match="no tokenizer"):
            c.completions.create(model="tiny", prompt="text", max_tokens=2)


@pytest.mark.parametrize("host, key, ok", [
    ("127.0.0.1", None, True), ("localhost", None, True), ("::1", None, True),
    ("0.0.0.0", None, False), ("10.1.2.3", None, False), ("myhost", None, False),
    ("0.0.0.0", "k", True)])
def test_binding_beyond_loopback_needs_a_key(host, key, ok):
    if ok:
        serve_config.check_bind(host, key)
    else:
        with pytest.raises(ValueError, match="needs --api-key"):
            serve_config.check_bind(host, key)
