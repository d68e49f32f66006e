"""The cost model under contention (`costmodel.Contention`, `handoff_ends`) and a served
request's prediction (`planning.queueing`): exact properties over random profiles and modes."""

import dataclasses
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rekv_jax.action import ACTION_KINDS, Action, action_space
from rekv_jax.config import ModelConfig
from rekv_jax.mode import Interval, Mode
from rekv_jax.planning import costmodel as cm
from rekv_jax.planning import queueing as qm

SETTINGS = settings(max_examples=40, deadline=None)
small = st.fractions(min_value=0, max_value=20, max_denominator=4)
TINY7B = ModelConfig.preset("tiny-7b")


def _profile(L, gamma, alpha, gbps, fixed, share, seq_len=64) -> cm.Profile:
    h0, m, r0, e, j = fixed
    cfg = dataclasses.replace(ModelConfig.preset("tiny"), num_layers=L)
    return cm.Profile.for_config(
        cfg, seq_len, hardware="test", link="test", link_gbps=gbps, source="analytic",
        quantize_ms={16: 0, 8: alpha}, restore_ms={16: 0, 8: Fraction(1, 10)},
        suffix_layer_ms=gamma, join_ms=dict.fromkeys(ACTION_KINDS, j), embed_ms=e,
        boundary_fixed_ms=h0, message_ms=m,
        suffix_fixed_ms=r0, attention_share=share, chunk_layer_ms=Fraction(0),
        quantize_fixed_ms=Fraction(1, 2),
        restore_fixed_ms={16: Fraction(0), 8: Fraction(1, 4)})


PROFILES = dict(L=st.integers(2, 4), gamma=st.fractions(Fraction(1, 4), 20, max_denominator=4),
                alpha=small, gbps=st.sampled_from([Fraction(1, 1000), Fraction(1, 50)]),
                fixed=st.tuples(*[small] * 5), share=st.sampled_from([0, Fraction(1, 2)]))


def _le(a: float, b: float) -> bool:
    """a <= b, exactly for rationals; BF16's absent quantize phase is the float 0.0, which makes
    some sums floats: 1e-12 of slack for those."""
    return a <= b + 1e-12 * abs(b)


def _modes(L: int) -> list[Mode]:
    out = []
    for a in action_space(L, (16, 8)):
        out += Mode.candidates(a, ("overlapped", "sequential", "chunked"),
                               ("full", "split", "pipelined"), (2,), "prompt")
    return out


@SETTINGS
@given(**PROFILES, wait=small, busy=small, k=st.fractions(1, 4, max_denominator=8),
       f=st.fractions(Fraction(1, 4), 4, max_denominator=8))
def test_contention_delays_by_at_most_itself_and_never_speeds_up(L, gamma, alpha, gbps, fixed,
                                                                  share, wait, busy, k, f):
    """For every mode: a link or decode device busy for w delays the handoff by at most w; a
    stretch k adds at most (k - 1) times its decode-side compute; none makes it faster; an idle
    link and device give `predicted_ms`. A prefill stretch f moves it by at most (f - 1) times
    its prefill-side compute, later for f > 1 and earlier for f < 1."""
    p = _profile(L, gamma, alpha, gbps, fixed, share)
    for mode in _modes(L):
        idle = cm.predicted_ms(p, mode)
        assert cm.handoff_ends(p, mode, cm.Contention()).end_ms == idle
        link = cm.handoff_ends(p, mode, cm.Contention(link_free_ms=wait)).end_ms
        device = cm.handoff_ends(p, mode, cm.Contention(decode_free_ms=busy)).end_ms
        slow = cm.handoff_ends(p, mode, cm.Contention(stretch=k)).end_ms
        assert _le(idle, link) and _le(link, idle + wait), mode
        assert _le(idle, device) and _le(device, idle + busy), mode
        assert _le(idle, slow) and _le(slow, idle + (k - 1) * cm.decode_busy_ms(p, mode)), mode
        if mode.action.cut == L:  # transfer-only computes nothing on the decode side
            assert device == slow == idle
        prompt = cm.handoff_ends(p, mode, cm.Contention(prefill_stretch=f)).end_ms
        lo, hi = sorted((idle, idle + (f - 1) * cm.prefill_busy_ms(p, mode)))
        assert _le(lo, prompt) and _le(prompt, hi), mode


def test_the_lately_timed_stretches_scale_each_devices_compute():
    p, running = _tiny7b_profile(), 2
    mode = Mode.of(Action.parse("q8:r=14", 28), interval="prompt")
    plain = qm.served(p, mode, qm.Queues(running=running), COSTS)
    timed = qm.served(p, mode, qm.Queues(running=running, prefill_stretch=0.5,
                                         decode_stretch=3), COSTS)
    assert timed.prefill_busy_ms == pytest.approx(plain.prefill_busy_ms / 2)
    assert timed.stretch == pytest.approx(3 * plain.stretch) and timed.decode_stretch == 3
    assert timed.after.decode_free_ms == pytest.approx(3 * plain.after.decode_free_ms)
    assert timed.decode_busy_ms == plain.decode_busy_ms  # the compute itself, unstretched
    piped = Mode.of(Action.parse("q8:r=14", 28), "chunked", "pipelined", 2)
    queues = qm.Queues(prefill_stretch=0.5, pipelined_stretch=2)  # a streamed prompt's own
    assert qm.served(p, piped, queues, COSTS).prefill_busy_ms == pytest.approx(
        2 * qm.served(p, piped, qm.Queues(), COSTS).prefill_busy_ms)
    assert qm.served(p, mode, queues, COSTS).prefill_stretch == 0.5


def test_the_closed_forms_refuse_a_prefill_stretch():
    p, mode = _tiny7b_profile(), Mode.of(Action.parse("q8:full", 28), interval="prompt")
    assert cm.closed_form_ends(p, mode) == cm.handoff_ends(p, mode)
    with pytest.raises(ValueError, match="play the plan"):
        cm.closed_form_ends(p, mode, cm.Contention(prefill_stretch=2))


@SETTINGS
@given(**PROFILES, wait=small, busy=small, k=st.fractions(1, 4, max_denominator=8))
def test_eq9_under_contention_closed_form(L, gamma, alpha, gbps, fixed, share, wait, busy, k):
    """Eq. 9 with the boundary held until the link is free and the suffix until the device is:
    T = max(A + X, max(A, D) + k R) + J, A = max(Q, W) + H (Eq. 8: the suffix after A + X)."""
    p = _profile(L, gamma, alpha, gbps, fixed, share)
    seen = cm.Contention(wait, busy, k)
    for a in action_space(L, (8,)):
        if a.cut == 0:  # its absent prefix phase is the float 0.0: not exact
            continue
        ph = cm.phase_ms(p, a)
        arrive = max(ph.quantize, wait) + ph.boundary
        ov = cm.handoff_ends(p, Mode.of(a, "overlapped"), seen)
        seq = cm.handoff_ends(p, Mode.of(a, "sequential"), seen)
        if a.cut == L:
            assert ov.end_ms == seq.end_ms == arrive + ph.prefix + ph.join
            continue
        assert ov.end_ms == max(arrive + ph.prefix, max(arrive, busy) + k * ph.suffix) + ph.join
        assert seq.end_ms == max(arrive + ph.prefix, busy) + k * ph.suffix + ph.join
        assert ov.link_ms == seq.link_ms == arrive + ph.prefix


@SETTINGS
@given(**PROFILES, wait=small, busy=small, live=st.integers(1, 400))
def test_a_live_link_estimate_plays_as_the_profile_on_that_link(L, gamma, alpha, gbps, fixed,
                                                                 share, wait, busy, live):
    """A contention's live bandwidth prices every message as the profile retargeted to it does,
    exactly, in the played plan and in the closed forms (`link_gbps`: a policy plays one
    profile's plans on each link's estimate)."""
    p = _profile(L, gamma, alpha, gbps, fixed, share)
    for a in action_space(L, (8, 16)):
        for mode in (Mode.of(a, "overlapped"), Mode.of(a, "chunked", chunks=2)):
            seen, held = cm.Contention(wait, busy, link_gbps=live), cm.Contention(wait, busy)
            for ends in (cm.handoff_ends, cm.closed_form_ends):
                assert ends(p, mode, seen) == ends(p.at_link(live), mode, held)


def _tiny7b_profile(seq_len: int = 256) -> cm.Profile:
    """tiny-7b in the paper's regime: one BF16 KV layer crosses in 1.15x a suffix layer."""
    gamma = 14.0
    kv = 2 * seq_len * TINY7B.num_kv_heads * TINY7B.head_dim * 2
    return cm.Profile.for_config(
        TINY7B, seq_len, hardware="test", link="paced", link_gbps=kv / (1.15 * gamma * 1e6),
        source="measured", quantize_ms={16: 0.0, 8: 0.07}, restore_ms={16: 0.0, 8: 0.0},
        suffix_layer_ms=gamma, join_ms=0.5, embed_ms=5.0, quantize_fixed_ms=0.8,
        boundary_fixed_ms=1.7, message_ms=2.3, attention_share=0.45)


COSTS = qm.DecodeCosts(step_fixed_ms=6.0, step_per_request_ms=4.0, suffix_budget_ms=20.0)


def test_stretch_is_one_plus_a_step_per_budget():
    assert COSTS.stretch(0) == 1 and COSTS.step_ms(0) == 0
    assert COSTS.stretch(4) == 1 + (6 + 4 * 4) / 20
    with pytest.raises(ValueError, match="positive suffix budget"):
        qm.DecodeCosts(1.0, 1.0, 0.0)


def test_a_served_prediction_on_idle_resources_is_the_handoffs():
    p = _tiny7b_profile()
    for mode in (Mode.of(Action.parse(a, 28), s, pf, n, Interval.PROMPT)
                 for a, s, pf, n in (("bf16:full", "overlapped", "full", 1),
                                     ("q8:r=12", "overlapped", "split", 1),
                                     ("q8:r=12", "chunked", "pipelined", 4),
                                     ("bf16:recompute", "overlapped", "full", 1))):
        got = qm.served(p, mode, qm.Queues(), COSTS)
        assert got.ttft_ms == got.handoff_ms == got.idle_ms == cm.predicted_ms(p, mode)
        assert got.prefill_wait_ms == got.link_wait_ms == got.decode_wait_ms == 0
        assert got.imposed_ms == 0  # no arrivals known: nobody to delay
        assert got.after.prefill_free_ms == got.prefill_busy_ms == cm.prefill_busy_ms(p, mode)
    with pytest.raises(ValueError, match="timed from its prompt"):
        qm.served(p, Mode.of(Action.parse("q8:full", 28)), qm.Queues(), COSTS)


def test_the_prefill_queue_delays_the_whole_handoff():
    """A prompt that waits w for the prefill device starts its handoff w later; a link and
    decode device that are free by then cost nothing."""
    p, w = _tiny7b_profile(), 700.0
    mode = Mode.of(Action.parse("q8:r=12", 28), "overlapped", "full", 1, Interval.PROMPT)
    got = qm.served(p, mode, qm.Queues(prefill_free_ms=w, link_free_ms=w - 1,
                                       decode_free_ms=w / 2), COSTS)
    assert got.ttft_ms == w + cm.predicted_ms(p, mode) and got.prefill_wait_ms == w
    assert got.link_wait_ms == got.decode_wait_ms == 0


def test_busy_time_split_prefills_stop_at_the_cut():
    p, L = _tiny7b_profile(), 28
    full = cm.prefill_busy_ms(p, Mode.of(Action(16, L, L), None, "full", 1, "prompt"))
    assert full == cm.prompt_compute_ms(p, L)
    for c in (0, 1, 14, 27):
        a = Action(16, c, L)
        split = cm.prefill_busy_ms(p, Mode.of(a, "overlapped", "split", 1, "prompt"))
        assert split == (0 if c == 0 else p.embed_ms + c * p.suffix_layer_ms)
        assert cm.decode_busy_ms(p, Mode.of(a, "overlapped", "split", 1, "prompt")) == (
            cm.prompt_compute_ms(p, L) if c == 0 else (L - c) * p.suffix_layer_ms)
    assert cm.decode_busy_ms(p, Mode.of(Action(8, L, L))) == 0


def test_imposed_delay_weighs_what_each_resource_gains_by_when_it_drains():
    before = qm.Queues(100.0, 2000.0, 0.0, 2, arrival_rate=2.0)
    after = dataclasses.replace(before, prefill_free_ms=400.0, link_free_ms=2500.0,
                                decode_free_ms=50.0)
    assert qm.imposed_ms(before, after) == pytest.approx(
        300 * 2 * 0.4 + 500 * 2 * 2.5 + 50 * 2 * 0.05)


def test_suffix_compute_is_charged_to_every_running_decode():
    """J = B R: each running request's later tokens wait for each ms of the suffix's compute;
    a transfer-only handoff computes nothing there and holds no decode back."""
    p, L = _tiny7b_profile(), 28
    recompute = Mode.of(Action(16, 0, L), "overlapped", "split", 1, Interval.PROMPT)
    transfer = Mode.of(Action(16, L, L), None, "full", 1, Interval.PROMPT)
    for running in (0, 1, 5):
        q = qm.Queues(running=running)
        got = qm.served(p, recompute, q, COSTS)
        assert got.decode_delay_ms == running * cm.decode_busy_ms(p, recompute) > -1
        assert got.cost_ms == got.ttft_ms + got.imposed_ms + got.decode_delay_ms
        assert qm.served(p, transfer, q, COSTS).decode_delay_ms == 0
    assert qm.served(p, recompute, qm.Queues(running=5), COSTS).decode_delay_ms > 0


def test_a_profile_scaled_to_another_length():
    """Bytes exactly those of the config at the new length; γ by its attention share."""
    p = _tiny7b_profile(256)
    q, want = p.at_length(512), cm.Profile.for_config(
        TINY7B, 512, hardware="", link="", link_gbps=1.0, source="", quantize_ms={16: 0, 8: 0},
        restore_ms={16: 0, 8: 0}, suffix_layer_ms=0.0, join_ms=0.0)
    assert p.at_length(256) is p
    assert (q.kv_layer_bytes, q.boundary_bytes, q.token_bytes) == (
        want.kv_layer_bytes, want.boundary_bytes, want.token_bytes)
    assert q.suffix_layer_ms == pytest.approx(14.0 * 2 * (0.55 + 0.45 * 2))
    assert q.attention_share == pytest.approx(0.9 / (0.55 + 0.9))
    assert q.at_length(256).suffix_layer_ms == pytest.approx(p.suffix_layer_ms)
    assert (q.join_ms, q.message_ms, q.embed_ms) == (p.join_ms, p.message_ms, 10.0)
