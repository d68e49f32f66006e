"""The OpenAI API over the real engine: the official `openai` client against one in-process
`Server` (the real router, one prefill and one decode worker process) of the shipped model,
behind the HTTP front end. Greedy text, its usage and its end (EOS, ignored or not; stop strings
and stop ids) equal single-process greedy decoding's tokens cut where they say; a seed replays
its draw and other seeds draw otherwise; each token's log probability is the log-softmax of the
raw logits at its position, computed here.

The shipped model's own EOS (id 0) is next to impossible after its training text, so the served
copy of it declares a second EOS in its `generation_config.json`: a token that the greedy
continuation of `EOS_PROMPT` reaches, and that of `PROMPT` does not."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import openai
import pytest
from test_sampling import reference_logprobs, seeds
from test_serve_abort import greedy

from rekv_jax.model.loader import SHIPPED_MODEL, chat_template_of, load_model, load_tokenizer
from rekv_jax.serving.http import build_app, http_model, running
from rekv_jax.serving.openai_answer import token_bytes
from rekv_jax.serving.serve_config import ServeConfig, Workers
from rekv_jax.serving.server import Server

TOKENIZER = load_tokenizer(SHIPPED_MODEL)
TEMPLATE = chat_template_of(str(SHIPPED_MODEL))
EOS_PROMPT = "The game began development in 2010 , carrying over"
PROMPT = "In 1997 , the band released their second album , which"
NEW = 16
ID_OF_BYTES = {bytes(token_bytes(TOKENIZER, t)): t for t in range(TOKENIZER.get_vocab_size())}


@dataclasses.dataclass(frozen=True)
class Engine:
    client: openai.OpenAI
    model: str  # the served copy's spec, as the API names it
    eos: int  # the EOS its generation_config.json adds
    loaded: object  # the shipped model (`Loaded`), for the references
    references: dict[str, np.ndarray]  # each prompt's first NEW greedy tokens, no EOS heeded


def ids(prompt: str) -> list[int]:
    return TOKENIZER.encode(prompt).ids


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = load_model(str(SHIPPED_MODEL), dtype=jnp.bfloat16, orbax=False)
    references = {p: greedy(model, ids(p), NEW) for p in (EOS_PROMPT, PROMPT)}
    first, other = references[EOS_PROMPT].tolist(), references[PROMPT].tolist()
    eos = next(t for k, t in enumerate(first) if k >= 3 and t not in first[:k] + other)
    folder = tmp_path_factory.mktemp("served") / "wt2-tiny"
    folder.mkdir()
    for entry in Path(SHIPPED_MODEL).iterdir():
        if entry.name != "generation_config.json":
            (folder / entry.name).symlink_to(entry.resolve())
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, eos]}))
    config = ServeConfig(str(folder), ("bf16:full",),
                         workers=Workers(link_gbps=None, timeout=60.0, pin=False))
    with Server(config) as server:
        app = build_app(server.clients, http_model(str(folder)), None, server.clients.metrics)
        with running(app) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                   timeout=120)
            yield Engine(client, str(folder), eos, model, references)


def _complete(engine: Engine, prompt: str, **fields):
    return engine.client.completions.create(model=engine.model, prompt=prompt, **fields)


def test_eos_ends_a_greedy_request_unless_ignored_and_usage_counts_its_tokens(engine):
    want = engine.references[EOS_PROMPT].tolist()
    k = want.index(engine.eos)
    answer = _complete(engine, EOS_PROMPT, max_tokens=NEW, temperature=0)
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].text == TOKENIZER.decode(want[:k + 1])
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (
        len(ids(EOS_PROMPT)), k + 1)
    ignored = _complete(engine, EOS_PROMPT, max_tokens=NEW, temperature=0,
                        extra_body={"ignore_eos": True})
    assert ignored.choices[0].finish_reason == "length"
    assert ignored.choices[0].text == TOKENIZER.decode(want)
    assert ignored.usage.completion_tokens == NEW
    chunks = list(_complete(engine, EOS_PROMPT, max_tokens=NEW, temperature=0, stream=True,
                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == answer.choices[0].text
    assert chunks[-1].usage.completion_tokens == k + 1 and not chunks[-1].choices


def test_chat_usage_counts_the_templated_prompt(engine):
    messages = [{"role": "user", "content": PROMPT}]
    answer = engine.client.chat.completions.create(model=engine.model, messages=messages,
                                                   max_tokens=6, temperature=0)
    prompt = ids(TEMPLATE.render(messages))
    assert answer.usage.prompt_tokens == len(prompt)
    assert answer.usage.completion_tokens == 6 and answer.choices[0].finish_reason == "length"
    want = greedy(engine.loaded, prompt, 6).tolist()
    assert engine.eos not in want and 0 not in want  # else the request would end sooner
    assert answer.choices[0].message.content == TOKENIZER.decode(want)


def test_a_stop_string_and_a_stop_id_end_the_text_where_they_occur(engine):
    want = engine.references[PROMPT].tolist()
    text = TOKENIZER.decode(want)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    whole = _complete(engine, PROMPT, max_tokens=NEW, temperature=0, stop=[stop])
    assert whole.choices[0].finish_reason == "stop"
    assert whole.choices[0].text == text[:text.find(stop)]
    chunks = list(_complete(engine, PROMPT, max_tokens=NEW, temperature=0, stop=[stop],
                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text[:text.find(stop)]
    j = want.index(want[NEW // 2])  # the first occurrence of a token in the second half
    by_id = _complete(engine, PROMPT, max_tokens=NEW, temperature=0,
                      extra_body={"stop_token_ids": [want[j]]})
    assert by_id.choices[0].finish_reason == "stop"
    assert by_id.choices[0].text == TOKENIZER.decode(want[:j + 1])
    assert by_id.usage.completion_tokens == j + 1


def test_a_seed_replays_its_draw_in_any_company_and_seeds_differ(engine):
    """Four seeds at temperature 1, sent at once, and the first seed again beside them: the
    same seed gives the same text, the four seeds four texts."""
    drawn = seeds(4, 11)
    texts: dict[int, str] = {}

    def ask(k: int, seed: int) -> None:
        answer = _complete(engine, PROMPT, max_tokens=12, temperature=1.0, seed=seed)
        texts[k] = answer.choices[0].text

    asking = [threading.Thread(target=ask, args=(k, s)) for k, s in enumerate([*drawn,
                                                                              drawn[0]])]
    for t in asking:
        t.start()
    for t in asking:
        t.join(120)
    assert len(texts) == 5 and texts[4] == texts[0]
    assert len({texts[k] for k in range(4)}) == 4
    again = _complete(engine, PROMPT, max_tokens=12, temperature=1.0, seed=drawn[1])
    assert again.choices[0].text == texts[1]  # alone, as among the others


def test_each_tokens_logprob_is_the_softmax_at_its_position(engine):
    """A sampled chat reply with its logprobs: each token (read back from its bytes) has the
    log-softmax of the raw logits at its position, computed here by a dense decode teacher-
    forced on the reply's tokens; its top log probabilities are that row's likeliest."""
    messages = [{"role": "user", "content": EOS_PROMPT}]
    answer = engine.client.chat.completions.create(
        model=engine.model, messages=messages, max_tokens=10, temperature=1.0,
        seed=seeds(1, 12)[0], logprobs=True, top_logprobs=2)
    content = answer.choices[0].logprobs.content
    tokens = np.array([ID_OF_BYTES[bytes(e.bytes)] for e in content])
    want = reference_logprobs(tuple(ids(TEMPLATE.render(messages))), tokens)
    assert np.array_equal(np.float32([e.logprob for e in content]),
                          want[np.arange(len(tokens)), tokens])
    assert (tokens != want.argmax(-1)).any()  # some drawn token is not the likeliest
    for e, row in zip(content, want, strict=True):
        assert [ID_OF_BYTES[bytes(t.bytes)] for t in e.top_logprobs] == np.argsort(
            -row, kind="stable")[:2].tolist()
    greedy_answer = _complete(engine, PROMPT, max_tokens=6, temperature=0, logprobs=1)
    greedy_tokens = engine.references[PROMPT][:6]
    want = reference_logprobs(tuple(ids(PROMPT)), greedy_tokens)
    assert np.array_equal(np.float32(greedy_answer.choices[0].logprobs.token_logprobs),
                          want[np.arange(6), greedy_tokens])
