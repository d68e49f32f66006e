"""`serve`: a generated load through a group of real worker processes (two prefill workers and
one decode worker), and the OpenAI API in front of it, driven by the official client."""

import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

from rekv_jax.action import ACTION_KINDS
from rekv_jax.config import ModelConfig
from rekv_jax.model.loader import SHIPPED_MODEL, chat_template_of, load_config, load_model
from rekv_jax.model.transformer import greedy_decode, prefill
from rekv_jax.planning.costmodel import Profile
from rekv_jax.serving.metrics import Slo
from rekv_jax.serving.requests import ServeRequest
from rekv_jax.serving.serve import serve
from rekv_jax.serving.serve_config import HttpBind, ServeConfig, Stream, Workers

NEW = 4


def profile(cfg: ModelConfig, seq_len: int) -> Profile:
    """A cost-model profile of `cfg` of plausible per-layer costs (the router's predictions
    only steer its choices here; what is tested is what the workers produce)."""
    return Profile.for_config(
        cfg, seq_len, hardware="test", link="test", link_gbps=0.05, source="analytic",
        quantize_ms={16: 0.0, 8: 0.05}, restore_ms={16: 0.0, 8: 0.02}, suffix_layer_ms=0.5,
        join_ms=dict.fromkeys(ACTION_KINDS, 0.1))


def greedy(model, tokens: tuple[int, ...], new: int) -> list[int]:
    ids = jnp.asarray([tokens], jnp.int32)
    return np.asarray(greedy_decode(model.cfg, model.params, *prefill(model.cfg, model.params,
                                                                      ids), new))[0].tolist()


def test_two_prefill_workers_and_one_decode_worker_serve_every_request_exactly():
    """A burst of requests under BF16 transfer, then under adaptive: none lost, both prefill
    workers used, every BF16 request's tokens its single-process greedy decode, the decode
    worker's pool empty at the end (the group's close checks it), and no request's times hold
    a compile: the warm-up ran every program either policy may run, on every worker."""
    model = load_model("tiny", dtype=jnp.bfloat16, orbax=False)
    cfg = model.cfg
    rng = np.random.default_rng(0)
    requests = tuple(ServeRequest(i, rng.integers(0, cfg.vocab_size, n).tolist(), NEW,
                                  arrival_s=0.02 * i) for i, n in enumerate([32, 64] * 5))
    config = ServeConfig("tiny", ("bf16:full", "adaptive"), Slo(10_000, 10_000),
                         Workers(prefill=2, decode=1, link_gbps=None, timeout=60.0, pin=False),
                         (Stream(50.0, requests),), profiles=(profile(cfg, 32),
                                                              profile(cfg, 64)))
    run = serve(config)
    assert len(run.served) == 2 * len(requests)
    assert all(s.completed for s in run.served), [s.error for s in run.served]
    assert {s.assignment.prefill_worker for s in run.served} == {0, 1}
    for s in run.served:
        if s.assignment.mode.action.bits == 16:
            assert list(s.finished.tokens) == greedy(model, s.request.tokens, NEW), s.request.id
    assert [x.policy for x in run.summaries] == ["bf16:full", "adaptive"]
    assert run.costs.step_fixed_ms > 0
    assert [(s.request.id, s.compile_ms) for s in run.served if s.compile_ms] == []
    assert [x.compiled for x in run.summaries] == [0, 0]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, timeout: float, serving: threading.Thread) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and serving.is_alive():
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1.0) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.2)
    state = "still starts" if serving.is_alive() else "ended"
    raise TimeoutError(f"{url} never answered (the server {state})")


def test_the_openai_client_streams_what_rekv_generate_writes():
    """`serve --http` on loopback for the shipped model under q8:full: the official client's
    streamed text equals `rekv generate`'s for the same prompt and action; refusals are 4xx
    and leave the server serving; streamed chat equals completions of the templated prompt, and
    /metrics counts what was served."""
    import urllib.request

    import openai
    from prometheus_client.parser import text_string_to_metric_families

    from rekv_jax.serving.generate import Request, generate

    spec, prompt = str(SHIPPED_MODEL), "The game began development in 2010 , carrying over"
    model = load_model(spec, dtype=jnp.bfloat16, orbax=False)
    ids = model.tokenizer.encode(prompt).ids  # as `rekv generate --prompt` tokenizes it
    want = generate(Request(ids, spec, "q8:full", 12, transport="local"))
    port, stop = _free_port(), threading.Event()
    config = ServeConfig(spec, ("q8:full",), Slo(10_000, 10_000),
                         Workers(link_gbps=None, timeout=60.0, pin=False),
                         http=HttpBind("127.0.0.1", port, "secret"),
                         profiles=(profile(load_config(spec), 16),))
    errors: list[BaseException] = []

    def run() -> None:
        try:
            serve(config, stop=stop)
        except BaseException as e:  # reported by the test
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, 300.0, thread)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="secret")
        stream = client.completions.create(model=spec, prompt=prompt, max_tokens=12, stream=True,
                                           temperature=0)
        assert "".join(c.choices[0].text for c in stream if c.choices) == want.text
        for bad in ({"model": "nope"}, {"n": 2}, {"prompt": "word " * 5000}):
            with pytest.raises(openai.APIStatusError) as e:
                client.completions.create(**{"model": spec, "prompt": prompt,
                                             "max_tokens": 4, **bad})
            assert 400 <= e.value.status_code < 500
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong").completions.create(
                model=spec, prompt=prompt, max_tokens=4)
        again = client.completions.create(model=spec, prompt=prompt, max_tokens=12,
                                          temperature=0)
        assert again.choices[0].text == want.text
        messages = [{"role": "user", "content": prompt}]
        chat = client.chat.completions.create(model=spec, messages=messages, max_tokens=8,
                                              temperature=0, stream=True)
        templated = client.completions.create(
            model=spec, prompt=chat_template_of(spec).render(messages), max_tokens=8,
            temperature=0)
        assert "".join(c.choices[0].delta.content for c in chat) == templated.choices[0].text
        scrape = urllib.request.Request(f"{url}/metrics",
                                        headers={"Authorization": "Bearer secret"})
        with urllib.request.urlopen(scrape, timeout=10) as answer:
            samples = {(s.name, tuple(s.labels.values())): s.value for f in
                       text_string_to_metric_families(answer.read().decode()) for s in f.samples}
        outcomes = {k[1][0]: v for k, v in samples.items() if k[0] == "rekv_requests_total"}
        assert sum(outcomes.values()) == 4 and "error" not in outcomes  # the 4 served above
        assert samples[("rekv_queue_depth", ("decode",))] == 0
    finally:
        stop.set()
        thread.join(120)
    assert not thread.is_alive() and not errors, errors
