"""`/metrics` under a run: the official `openai` client's requests through the HTTP front end, the
`Clients` backend and a real router over faked workers, scraped while requests wait and after
they all ended: every counter equals what the router's `Served` records count."""

import collections
import queue
import threading
import time
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_queueing import _tiny7b_profile
from test_serving_policy import COSTS

from rekv_jax.launch.group import Emitted
from rekv_jax.model.loader import SHIPPED_MODEL, load_tokenizer
from rekv_jax.serving import http
from rekv_jax.serving.ledger import Ledger
from rekv_jax.serving.openai_request import ModelInfo
from rekv_jax.serving.pages import PoolConfig
from rekv_jax.serving.policy import Context, make_policies
from rekv_jax.serving.prometheus import ServingMetrics
from rekv_jax.serving.requests import Admit, Finished, Load, Prefill, PrefillDone, Token
from rekv_jax.serving.router import PREFILL_AHEAD, Router, drive
from rekv_jax.serving.server import Clients

KEY = "k"
POOL = PoolConfig(num_pages=1 + 2)  # two requests of up to 16 positions at once
NEW = 6


class Workers:
    """One prefill and one decode worker, faked: a `Prefill` is answered with its `PrefillDone`
    (1000 bytes a prompt token); an `Admit` with a `Load`, then, once `gate` is set, its tokens
    (ids 7, 8, ...), its `Finished` and a `Load`. A request with an even id ends ("stop") after
    two tokens, one whose prompt holds id 13 fails after one, and odd ids fell back."""

    def __init__(self):
        self._events: queue.Queue = queue.Queue()
        self._admitted: list[Admit] = []
        self._free = POOL.usable_pages
        self.gate = threading.Event()
        self.prompts: dict[int, tuple[int, ...]] = {}

    def send(self, name, message):
        if isinstance(message, Prefill):
            self.prompts[message.request_id] = message.tokens
            self._events.put(Emitted(name, PrefillDone(message.request_id, 0, 1.0, 2.0,
                                                       1000 * len(message.tokens))))
        elif isinstance(message, Admit):
            self._admitted.append(message)
            self._free -= POOL.pages_for(message.prompt_len + message.max_new_tokens)
            self._events.put(Emitted("decode-0", self._load()))
        return True

    def _load(self):
        return Load(0, len(self._admitted), 0.0, self._free)

    def _decode(self, admit):
        rid = admit.request_id
        fails, stops = 13 in self.prompts[rid], rid % 2 == 0
        n = 1 if fails else 2 if stops else admit.max_new_tokens
        out = [Emitted("decode-0", Token(rid, i, 7 + i, time.monotonic())) for i in range(n)]
        self._admitted.remove(admit)
        self._free += POOL.pages_for(admit.prompt_len + admit.max_new_tokens)
        finished = Finished(rid, tuple(7 + i for i in range(n)), 0.01, 0.001, 1.0, None, "",
                            rid % 2 == 1, "the decode worker failed" if fails else None,
                            "stop" if stops else "length", 8 if stops else None)
        return [*out, Emitted("decode-0", finished), Emitted("decode-0", self._load())]

    def poll(self, timeout=0.0):
        out = []
        try:
            out.append(self._events.get(timeout=timeout))
            while True:
                out.append(self._events.get_nowait())
        except queue.Empty:
            pass
        if self.gate.is_set():
            for admit in list(self._admitted):
                out += self._decode(admit)
        return out


def _scrape(url):
    req = urllib.request.Request(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _by(metrics, name, label):
    """Each `label` value's sample of `name`, zeros included (a gauge set to 0 is not unset)."""
    return {dict(k)[label]: v for (n, k), v in metrics.items() if n == name}


def _wait_for(url, holds, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = _scrape(url)
        if holds(metrics):
            return metrics
        time.sleep(0.05)
    raise AssertionError(f"the metrics never held: {metrics}")


def test_metrics_during_and_after_a_run_equal_the_served_records():
    (policy,) = make_policies(["q8:full"], Context("tiny-7b", 28, (_tiny7b_profile(),), COSTS))
    workers, clients = Workers(), Clients(threading.Event(), POOL.usable_pages)
    router = Router(policy, Ledger.idle(1, 1, 0.01), POOL, COSTS, workers.send, 0.0, 30.0,
                    clients.on_served, clients.on_assigned)
    loop = threading.Thread(target=drive, args=(workers, router, clients, clients.on_event))
    loop.start()
    tokenizer = load_tokenizer(SHIPPED_MODEL)
    app = http.build_app(clients, ModelInfo("m", 64, tokenizer), KEY, clients.metrics)
    prompts = [[1, 2], [3], [13, 1], "The tower", [5, 6, 7], "is tall"]
    answers = []  # each client's finish reason, or "error"
    try:
        with http.running(app) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0,
                                   timeout=30)

            def ask(k):
                try:
                    if k % 2:
                        answer = client.completions.create(model="m", prompt=prompts[k],
                                                           max_tokens=NEW)
                        answers.append(answer.choices[0].finish_reason)
                    else:
                        *_, last = client.completions.create(model="m", prompt=prompts[k],
                                                             max_tokens=NEW, stream=True)
                        answers.append(last.choices[0].finish_reason)
                except openai.APIError:
                    answers.append("error")

            asking = [threading.Thread(target=ask, args=(k,)) for k in range(len(prompts))]
            for t in asking:
                t.start()
            during = _wait_for(url, lambda m: sum(_by(m, "rekv_queue_depth", "stage").values())
                               == len(prompts))
            assert _by(during, "rekv_queue_depth", "stage") == {  # 2 admitted, 2 ahead of pages
                "prefill": 2 + PREFILL_AHEAD, "waiting": 4 - PREFILL_AHEAD, "decode": 0}
            assert _by(during, "rekv_kv_pages_used", "worker") == {"0": 2}
            assert _by(during, "rekv_kv_pages_free", "worker") == {"0": 0}  # the pool is full
            assert not _by(during, "rekv_requests_total", "outcome")
            workers.gate.set()
            for t in asking:
                t.join(30)
            after = _scrape(url)
    finally:
        clients.closed.set()
        loop.join(30)
    served = router.served
    assert len(served) == len(prompts) and not loop.is_alive()
    outcomes = collections.Counter("error" if s.failure else s.finished.finish_reason
                                   for s in served)
    assert outcomes["error"] == 1 and outcomes["stop"] >= 2 and outcomes["length"] >= 2
    assert collections.Counter(answers) == outcomes  # what each client heard
    assert _by(after, "rekv_requests_total", "outcome") == outcomes
    actions = collections.Counter(str(s.assignment.mode.action) for s in served)
    assert _by(after, "rekv_request_actions_total", "action") == actions
    choices = collections.Counter(s.assignment.mode.label for s in served)
    assert _by(after, "rekv_request_choices_total", "choice") == choices
    for family, values in (("rekv_time_to_first_token_seconds", [s.ttft_ms for s in served]),
                           ("rekv_time_per_output_token_seconds", [s.tpot_ms for s in served]),
                           ("rekv_e2e_request_latency_seconds", [s.e2e_ms for s in served])):
        assert after[(f"{family}_count", ())] == sum(v is not None for v in values)
        assert after[(f"{family}_sum", ())] == pytest.approx(
            sum(v for v in values if v is not None) / 1e3)
    assert after[("rekv_link_bytes_total", ())] == 1000 * sum(
        s.request.prompt_len for s in served)
    assert after[("rekv_fallbacks_total", ())] == sum(s.finished.fell_back for s in served)
    assert after[("rekv_generation_tokens_total", ())] == sum(
        len(s.token_times_s) for s in served)
    assert after[("rekv_prompt_tokens_total", ())] == sum(s.request.prompt_len for s in served)
    assert _by(after, "rekv_queue_depth", "stage") == dict.fromkeys(  # nothing in flight
        ("waiting", "prefill", "decode"), 0)
    assert _by(after, "rekv_kv_pages_free", "worker") == {"0": POOL.usable_pages}


def test_each_app_has_its_own_registry():
    a, b = ServingMetrics(), ServingMetrics()
    a._outcomes.labels("length").inc()
    assert b"rekv_requests_total" in a.exposition()
    assert 'outcome="length"' in a.exposition().decode()
    assert 'outcome="length"' not in b.exposition().decode()
    assert a.content_type.startswith("text/plain")
