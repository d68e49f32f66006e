"""Seeded sampling in the decode engine: a request's tokens and log probabilities depend on its
prompt, parameters and seed alone (not on its batch, slot, arrival or the BF16 action that
handed it off); seeds matter where the distribution is broad; temperature 0 is greedy bitwise;
the draws follow the softmax at the temperature, cut to the top-p set. The ends: EOS, stop ids,
stop strings (one split across tokens), min_tokens, each freeing the request's pages at once."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from hypothesis import given, settings
from hypothesis import strategies as st

from rekv_jax.model.loader import SHIPPED_MODEL, eos_ids
from rekv_jax.model.transformer import attention_width, decode_step, greedy_decode, prefill
from rekv_jax.serving.engine import DecodeEngine, EngineConfig
from rekv_jax.serving.member import MemberSetup
from rekv_jax.serving.pages import PoolConfig
from rekv_jax.serving.prefill_worker import PrefillWorker
from rekv_jax.serving.requests import Finished, ServeRequest, Token
from rekv_jax.serving.sampling import TOP_LOGPROBS, Sampling, Stops, draw, rows_of
from rekv_jax.serving.scripted import Ask, serve_local
from rekv_jax.transport import LocalTransport

SETUP = MemberSetup(str(SHIPPED_MODEL), pool=PoolConfig(40, 16))
BF16 = ("bf16:full", "bf16:r=2", "bf16:recompute")  # transfer-only, joint, recomputation
PROMPTS = ("The game began development in 2010 , carrying over",
           "In 1997 , the band released their second album , which")
NEW = 8
SAMPLED = Sampling(temperature=1.0, top_p=0.95, top_k=200, seed=2**40 + 7, logprobs=3)


def seeds(n: int, key: int) -> list[int]:
    """n distinct seeds drawn at random, none of them a slot index (0..n-1): a draw keyed by its
    slot rather than its seed would not pass for one keyed by its seed."""
    drawn = np.random.default_rng(key).integers(n, 2**63, n).tolist()
    assert len(set(drawn)) == n
    return drawn


@functools.cache
def model():
    """The shipped model without its EOS (the ends' tests give it one where they need it)."""
    return dataclasses.replace(SETUP.load(), eos_ids=())


def ids(prompt: int) -> tuple[int, ...]:
    return tuple(model().tokenizer.encode(PROMPTS[prompt]).ids)


def serve(asks: list[Ask], loaded=None):
    out = serve_local(SETUP, asks, model=loaded or model())
    assert out.used_pages == 0
    return out


def stream(out, request_id: int) -> tuple[np.ndarray, np.ndarray, list]:
    """A request's tokens, their log probabilities and top log probabilities, as emitted."""
    mine = [i for i in out.items if isinstance(i, Token) and i.request_id == request_id]
    assert [t.index for t in mine] == list(range(len(mine)))
    return (np.array([t.token for t in mine]), np.array([t.logprob for t in mine], np.float32),
            [t.top_logprobs for t in mine])


@functools.cache
def alone(sampling: Sampling) -> tuple:
    """The sampled request of prompt 0 served alone (the reference of the batched runs)."""
    out = serve([Ask(ServeRequest(0, ids(0), NEW, sampling=sampling), "bf16:r=2")])
    return stream(out, 0)


@settings(max_examples=5, deadline=None)
@given(action=st.sampled_from(BF16), data=st.data())
def test_a_seeded_request_draws_the_same_bits_in_any_batch(action, data):
    """The sampled request shares its steps with 0..3 others (greedy or sampled, either prompt,
    any BF16 action), arriving among them in any order and at any gaps: its tokens and log
    probabilities are bitwise those it draws alone."""
    others = data.draw(st.lists(st.tuples(st.sampled_from(BF16), st.integers(0, 1),
                                          st.integers(0, 2**63 - 1), st.booleans()),
                                max_size=3))
    slot = data.draw(st.integers(0, len(others)))
    gaps = data.draw(st.lists(st.floats(0.0, 0.1), min_size=len(others) + 1,
                              max_size=len(others) + 1))
    requests = [(a, p, Sampling(0.8 * hot, seed=seed)) for a, p, seed, hot in others]
    requests.insert(slot, (action, 0, SAMPLED))
    arrivals = np.cumsum(gaps)
    asks = [Ask(ServeRequest(i, ids(p), NEW, float(arrivals[i]), sampling), a)
            for i, (a, p, sampling) in enumerate(requests)]
    tokens, logprobs, top = stream(serve(asks), slot)
    want_tokens, want_logprobs, want_top = alone(SAMPLED)
    assert np.array_equal(tokens, want_tokens)
    assert np.array_equal(logprobs, want_logprobs) and top == want_top
    assert all(len(t) == SAMPLED.logprobs for t in top)


def test_seeds_change_the_tokens_and_temperature_zero_is_greedy():
    """Five seeds of one prompt at temperature 1 give five token streams; at temperature 0
    (whatever its seed, top_p and top_k) the engine's tokens are single-process greedy
    decoding's, and each token's log probability is the raw logits' log-softmax."""
    samplings = [Sampling(1.0, seed=s) for s in seeds(5, 1)]
    greedy = Sampling(0.0, top_p=0.5, top_k=3, seed=99, logprobs=TOP_LOGPROBS)
    out = serve([Ask(ServeRequest(i, ids(1), NEW, 0.02 * i, s), a) for i, (s, a) in
                 enumerate(zip([*samplings, greedy], BF16 * 2, strict=True))])
    assert len({f.tokens for f in out.finished[:5]}) == 5
    cfg, params = model().cfg, model().params
    prompt = jnp.asarray([ids(1)], jnp.int32)
    kv, logits = prefill(cfg, params, prompt)
    want = np.asarray(greedy_decode(cfg, params, kv, logits, NEW))[0]
    tokens, logprobs, top = stream(out, 5)
    assert np.array_equal(tokens, want)
    first = jax.nn.log_softmax(logits[0].astype(jnp.float32))
    assert np.isclose(logprobs[0], first[want[0]], rtol=1e-5)
    assert top[0][0] == (int(want[0]), float(logprobs[0])) and len(top[0]) == TOP_LOGPROBS


def reference_logprobs(prompt: tuple[int, ...], tokens: np.ndarray) -> np.ndarray:
    """The log-softmax of the raw logits at each position of `tokens` [N] after `prompt` ([N, V]),
    computed here: the prompt's prefill, then the dense cache's decode steps teacher-forced on
    `tokens` (padded as `greedy_tokens` pads, so the steps attend as a paged step does)."""
    cfg, params = model().cfg, model().params
    kv, logits = prefill(cfg, params, jnp.asarray([prompt], jnp.int32))
    S, n = len(prompt), len(tokens)
    kv = kv.pad(attention_width(S + n, 2 * (S + n))).held_as_bits()
    rows = [logits[0]]
    for i in range(n - 1):
        logits, kv = decode_step(cfg, params, kv, jnp.asarray(tokens[i:i + 1], jnp.int32), S + i)
        rows.append(logits[0])
    return np.asarray(jax.nn.log_softmax(jnp.stack(rows).astype(jnp.float32), axis=-1))


def test_a_sampled_tokens_logprob_is_its_own_at_its_position():
    """Each sampled token's reported log probability is the log-softmax of the raw logits at
    its position, taken at that token (not at the likeliest one, nor at a neighbour's
    position); its top log probabilities are the likeliest of that same row."""
    tokens, logprobs, top = alone(SAMPLED)
    want = reference_logprobs(ids(0), tokens)
    mine = want[np.arange(len(tokens)), tokens]
    assert np.array_equal(logprobs, mine), (logprobs, mine)
    # the property has power here: some sampled tokens are not the likeliest, and a position's
    # log probability of its token differs from the previous position's
    assert (tokens != want.argmax(-1)).sum() >= 2
    assert not np.allclose(mine[1:], want[np.arange(len(tokens) - 1), tokens[1:]], rtol=1e-3)
    for i, row in enumerate(top):
        assert [t for t, _ in row] == np.argsort(-want[i], kind="stable")[:3].tolist()
        assert np.array_equal(np.float32([lp for _, lp in row]), np.sort(want[i])[::-1][:3])


def test_draws_follow_the_softmax_cut_to_top_p():
    """2,000 draws of one position (2,000 seeds, one batched call) over the shipped model's
    logits for a prompt, at temperature 1.5 and top_p 0.9: none falls outside the top-p set,
    and their frequencies fit the softmax at that temperature renormalized over that set."""
    cfg, params = model().cfg, model().params
    logits = prefill(cfg, params, jnp.asarray([ids(0)], jnp.int32))[1].astype(jnp.float32)
    n, temperature, top_p = 2000, 1.5, 0.9
    rows = rows_of([(Sampling(temperature, top_p, seed=s), 0) for s in seeds(n, 2)])
    drawn = np.asarray(draw(jnp.tile(logits, (n, 1)), rows).token)
    scaled = np.asarray(logits[0], np.float64) / temperature
    p = np.exp(scaled - scaled.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    size = int(np.searchsorted(np.cumsum(p[order]), top_p)) + 1  # smallest set reaching top_p
    kept = order[:size]
    assert set(drawn.tolist()) <= set(kept.tolist())
    expected = n * p[kept] / p[kept].sum()
    observed = np.bincount(drawn, minlength=cfg.vocab_size)[kept].astype(float)
    big = expected >= 5
    assert big.sum() >= 10  # a broad distribution: the test has power
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    assert scipy.stats.chisquare(obs[exp > 0], exp[exp > 0]).pvalue > 1e-3


def test_top_k_keeps_the_likeliest():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(1, 64)), jnp.float32)
    n = 300
    drawn = np.asarray(draw(jnp.tile(logits, (n, 1)),
                            rows_of([(Sampling(2.0, top_k=4, seed=s), 3)
                                     for s in seeds(n, 3)])).token)
    assert set(drawn.tolist()) == set(np.argsort(-np.asarray(logits[0]))[:4].tolist())


# ------------------------------------------------------------------------------------ ends


@functools.cache
def greedy_tokens(prompt: int, new: int = 16) -> tuple[int, ...]:
    """The greedy tokens of a prompt when nothing but their count ends them."""
    return serve([Ask(ServeRequest(0, ids(prompt), new), "bf16:r=2")]).finished[0].tokens


def first_repeat(tokens: tuple[int, ...]) -> int:
    """The first index whose token comes again later."""
    return next(i for i, t in enumerate(tokens) if t in tokens[i + 1:])


def run_alone(stops: Stops, eos=(), prompt: int = 0, new: int = 16, action: str = "bf16:full"
              ) -> Finished:
    """One request through an engine stepped here: the step that emits its last token also
    retires it, and its pages are free after that step."""
    loaded = model()
    prefill_end, decode_end = LocalTransport.pair()
    engine = DecodeEngine(loaded.cfg, loaded.params, [decode_end],
                          EngineConfig(PoolConfig(40, 16), None), eos, loaded.tokenizer)
    ask = Ask(ServeRequest(0, ids(prompt), new, stops=stops), action)
    admit, request = ask.records(loaded.cfg.num_layers)
    engine.admit(admit)
    assert PrefillWorker(loaded.cfg, loaded.params, [prefill_end]).prefill(request).error is None
    while True:
        items = engine.step()
        done = [i for i in items if isinstance(i, Finished)]
        if done:
            last = [i for i in items if isinstance(i, Token)]
            assert last and last[-1].index == len(done[0].tokens) - 1
            assert engine.used_pages == 0 and engine.idle
            return done[0]


@pytest.mark.parametrize("action", ["bf16:full", "bf16:r=2"])
def test_eos_ends_a_request_unless_ignored(action):
    full = greedy_tokens(0)
    k = first_repeat(full)
    out = run_alone(Stops(), eos=(99999, full[k]), action=action)
    assert out.tokens == full[:k + 1] and (out.finish_reason, out.stop) == ("stop", full[k])
    out = run_alone(Stops(ignore_eos=True), eos=(full[k],), action=action)
    assert out.tokens == full and (out.finish_reason, out.stop) == ("length", None)


def test_stop_token_ids_and_min_tokens():
    """A stop id ends the request at its first token (the handoff's, too) from `min_tokens`
    tokens on; before that the same id goes by."""
    full = greedy_tokens(0)
    k = first_repeat(full)
    again = full.index(full[k], k + 1)
    out = run_alone(Stops(stop_token_ids=(full[k],)))
    assert out.tokens == full[:k + 1] and out.stop == full[k]
    out = run_alone(Stops(stop_token_ids=(full[k],), min_tokens=k + 2))
    assert out.tokens == full[:again + 1] and (out.finish_reason, out.stop) == ("stop", full[k])
    out = run_alone(Stops(stop_token_ids=(full[0],)))  # the first token, from the handoff
    assert out.tokens == full[:1] and out.finish_reason == "stop"
    out = run_alone(Stops(stop_token_ids=(full[k],), min_tokens=17))
    assert out.tokens == full and out.finish_reason == "length"


def test_stop_strings_are_caught_across_tokens():
    """A stop string made of the end of one token's text and the start of the next ends the
    request at that next token; the earliest of two stop strings is reported."""
    tok, full = model().tokenizer, greedy_tokens(1)
    texts = [tok.decode(list(full[:i + 1])) for i in range(len(full))]
    j = next(i for i in range(2, len(full) - 1) if len(texts[i]) - len(texts[i - 1]) >= 2
             and len(texts[i + 1]) - len(texts[i]) >= 2
             and texts[i + 1][len(texts[i]) - 2:len(texts[i]) + 2] not in texts[i])
    split = texts[j + 1][len(texts[j]) - 2:len(texts[j]) + 2]
    out = run_alone(Stops(stop=("never seen", split)), prompt=1)
    assert out.tokens == full[:j + 2] and (out.finish_reason, out.stop) == ("stop", split)
    later = texts[-1][len(texts[j + 1]):]
    out = run_alone(Stops(stop=(later, split)), prompt=1)
    assert out.stop == split  # the one the text held first


def test_stop_strings_need_a_tokenizer():
    """A model without a tokenizer refuses a request with stop strings at admission, in one
    line; its prefill side is told, nothing is held."""
    asked = [Ask(ServeRequest(0, ids(0), 4, stops=Stops(stop=("x",))), "bf16:r=2"),
             Ask(ServeRequest(1, ids(0), 4, stops=Stops(stop_token_ids=(1,))), "bf16:r=2")]
    out = serve(asked, dataclasses.replace(model(), tokenizer=None))
    assert out.finished[0].tokens == () and "need the model's tokenizer" in out.finished[0].error
    assert out.finished[1].error is None


def test_eos_ids_come_from_the_model_files(tmp_path):
    assert eos_ids(str(SHIPPED_MODEL)) == (0,) == SETUP.load().eos_ids
    assert model().tokenizer.id_to_token(0) == "<|endoftext|>"
    assert eos_ids("tiny") == ()
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert eos_ids(f"hf:{tmp_path}") == (7,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    assert eos_ids(f"hf:{tmp_path}") == (5, 6)
