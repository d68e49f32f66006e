"""The request stream: deterministic, Poisson, lengths and tokens as asked."""

import numpy as np
import pytest

from rekv_jax.serving.load_gen import LoadSpec, PromptLens, arrivals, generate


def _spec(**kw) -> LoadSpec:
    return LoadSpec(**({"rate": 4.0, "prompt_lens": PromptLens((256, 512)), "max_new_tokens": 8,
                        "seed": 1, "requests": 50} | kw))


def test_the_same_spec_gives_the_same_requests_and_another_seed_others():
    a, b = generate(_spec(), 512), generate(_spec(), 512)
    assert a == b and [r.id for r in a] == list(range(50))
    assert generate(_spec(seed=2), 512) != a
    times = [r.arrival_s for r in a]
    assert times == sorted(times) and times[0] > 0


def test_arrivals_are_poisson_at_the_rate():
    """Exponential gaps: mean 1/rate, coefficient of variation 1 (within sampling error)."""
    gaps = np.diff([0.0, *arrivals(_spec(rate=5.0, requests=20_000))])
    assert gaps.mean() == pytest.approx(0.2, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.03)
    by_time = arrivals(_spec(rate=5.0, requests=None, duration_s=400.0))
    assert max(by_time) <= 400.0 and len(by_time) == pytest.approx(2000, rel=0.1)


def test_lengths_come_from_the_list_or_the_range_and_the_lengths_do_not_move_arrivals():
    listed = generate(_spec(requests=400), 512)
    assert {r.prompt_len for r in listed} == {256, 512}
    assert all(r.max_new_tokens == 8 and max(r.tokens) < 512 for r in listed)
    ranged = generate(_spec(requests=400, prompt_lens=PromptLens.parse("10..20")), 512)
    assert {r.prompt_len for r in ranged} == set(range(10, 21))
    assert [r.arrival_s for r in ranged] == [r.arrival_s for r in listed]


def test_corpus_prompts_are_windows_of_it():
    corpus = np.arange(3000)  # every id once: a window is a run of consecutive ids
    reqs = generate(_spec(requests=20), 3000, corpus)
    for r in reqs:
        assert r.tokens == tuple(range(r.tokens[0], r.tokens[0] + r.prompt_len))
    assert len({r.tokens[0] for r in reqs}) > 10
    with pytest.raises(ValueError, match="past the model's vocabulary"):
        generate(_spec(), 512, corpus)
    with pytest.raises(ValueError, match="cannot give prompts of 512"):
        generate(_spec(), 3000, corpus[:100])


@pytest.mark.parametrize("kw, match", [
    ({"rate": 0.0}, "arrival rate"), ({"requests": None}, "not both"),
    ({"duration_s": 3.0}, "not both"), ({"requests": 0}, ">= 1"),
    ({"max_new_tokens": 0}, "max_new_tokens")])
def test_bad_specs(kw, match):
    with pytest.raises(ValueError, match=match):
        _spec(**kw)


@pytest.mark.parametrize("text, match", [
    ("", "expected lengths"), ("256,x", "expected lengths"), ("0,5", "positive"),
    ("9..3", "LO <= HI"), ("1..2..3", "expected lengths")])
def test_bad_prompt_lens(text, match):
    with pytest.raises(ValueError, match=match):
        PromptLens.parse(text)
