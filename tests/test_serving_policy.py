"""The router's ledger and the serving policies, on synthetic loads and profiles (pure Python)."""

import dataclasses

import pytest
from test_queueing import TINY7B, _tiny7b_profile

from rekv_jax.action import Action
from rekv_jax.gate_result import GateResult
from rekv_jax.mode import Interval, Mode
from rekv_jax.planning.costmodel import Profile
from rekv_jax.planning.queueing import DecodeCosts, tpot_slack_ms
from rekv_jax.serving.ledger import (
    ComputeEstimate,
    DecodeQueue,
    Extra,
    Ledger,
    LinkEstimate,
    LinkQueue,
    PrefillQueue,
    Queued,
    Setting,
    Slack,
    Timed,
    octave,
)
from rekv_jax.serving.policy import Asked, Context, check_policy_names, make_policies, served_mode
from rekv_jax.serving.requests import Load, ServeRequest

COSTS = DecodeCosts(step_fixed_ms=6.0, step_per_request_ms=4.0, suffix_budget_ms=20.0)
ARRIVALS = tuple(float(i) for i in range(8))  # one request a second lately
REQUEST = ServeRequest(0, (1,) * 256, 32)


def _context(profile: Profile, **kw) -> Context:
    return Context("tiny-7b", 28, (profile,), COSTS, **kw)


IDLE_DECODE, IDLE_PREFILL = DecodeQueue(), PrefillQueue()


def _busy(ms: float) -> PrefillQueue:
    """A prefill worker with `ms` of one full prefill's compute queued from time 0."""
    return PrefillQueue((Queued(ms, ms, False, 256),), 0.0)


def _ledger(gbps: float, link_s: float = 0.0, decode: DecodeQueue = IDLE_DECODE,
            prefill: PrefillQueue = IDLE_PREFILL) -> Ledger:
    return Ledger((prefill,), (decode,), (LinkQueue(LinkEstimate(gbps), link_s),), ARRIVALS)


def _link_bytes(profile: Profile, a: Action) -> int:
    c, L = a.cut, a.num_layers
    return (c * profile.kv_layer_bytes[a.bits]
            + (0 < c < L) * profile.boundary_bytes + profile.token_bytes)


def test_the_link_estimate_is_the_latest_transfers_bytes_over_their_time():
    e = LinkEstimate(1.0, window=2)
    assert e.gbps == 1.0 and e.observed(0, 5.0) is e
    e = e.observed(2_000_000, 1000.0).observed(1_000_000, 1000.0)
    assert e.gbps == pytest.approx(3e6 / 2e9)
    assert e.observed(4_000_000, 1000.0).gbps == pytest.approx(5e6 / 2e9)  # the oldest left


def test_the_ledger_books_and_corrects_each_resource():
    profile, ledger = _tiny7b_profile(), Ledger.idle(1, 1, 0.01).arrived(0.0)
    policy, = make_policies(["q8:full"], _context(profile))
    assert ledger.queues(0, 0, 0.0, 256).prefill_free_ms == 0
    first = policy.choose(REQUEST, ledger, 0.0)
    ledger = ledger.assigned(first, 0.0, 256).arrived(0.1)
    q = ledger.queues(0, 0, 0.1, 256)
    assert q.prefill_free_ms == pytest.approx(first.why.predicted.prefill_busy_ms - 100)
    assert q.link_free_ms == pytest.approx(first.why.predicted.after.link_free_ms - 100)
    second = policy.choose(REQUEST, ledger, 0.1)
    assert second.why.predicted.prefill_wait_ms == pytest.approx(q.prefill_free_ms)
    ledger = ledger.assigned(second, 0.1, 256)
    done = ledger.prefilled(0, 0.2)  # the first ends early
    assert done.queues(0, 0, 0.2, 256).prefill_free_ms == pytest.approx(
        second.why.predicted.prefill_busy_ms)
    loaded = done.loaded(Load(0, running=3, queued_suffix_ms=50.0, free_pages=9), 0.2, COSTS)
    assert loaded.queues(0, 0, 0.2, 256).decode_free_ms == pytest.approx(50 * COSTS.stretch(3))
    assert loaded.queues(0, 0, 0.2, 256).running == 3
    timed = loaded.link_timed(0, 0, 1_000_000, 100.0)
    assert timed.link(0, 0).estimate.gbps == pytest.approx(0.01)
    # a streamed handoff's time holds its prompt's compute between messages: not the link's
    assert timed.link_timed(0, 0, 1_000_000, 400.0, streamed=True) == timed
    assert timed.arrival_rate == pytest.approx(10.0)  # arrivals at 0 and 0.1 s


def test_the_prefill_device_is_timed_apart_alone_and_beside_decodes():
    profile, ledger = _tiny7b_profile(), Ledger.idle(1, 1, 0.01)
    policy, = make_policies(["bf16:full"], _context(profile))
    first = policy.choose(REQUEST, ledger, 0.0)
    priced = first.why.predicted.prefill_busy_ms
    assert first.why.predicted.prefill_stretch == 1 and priced > 0  # untimed: the profile's price
    ledger = ledger.assigned(first, 0.0, 256).prefilled(0, 1.0, 0.5 * priced)  # alone: in half
    alone = policy.choose(REQUEST, ledger, 1.0).why.predicted
    assert alone.prefill_stretch == 0.5 and alone.prefill_busy_ms == pytest.approx(priced / 2)
    busy = ledger.loaded(Load(0, running=2, queued_suffix_ms=0.0, free_pages=9), 1.0, COSTS)
    beside = policy.choose(REQUEST, busy, 1.0)  # beside running decodes: not timed yet
    assert beside.why.predicted.prefill_busy_ms == pytest.approx(priced)
    timed = busy.assigned(beside, 1.0, 256).prefilled(0, 3.0, 1.5 * priced)
    assert timed.queues(0, 0, 3.0, 256).prefill_stretch == pytest.approx(1.5)
    assert timed.prefill[0].estimate.stretch(Setting.ALONE) == 0.5
    assert (policy.choose(REQUEST, timed, 3.0).why.predicted.ttft_ms
            > policy.choose(REQUEST, ledger, 1.0).why.predicted.ttft_ms)


def test_split_and_pipelined_prompts_are_timed_apart():
    """One program per layer and one per token chunk err from their price each its own way:
    a pipelined prompt that took half its price stretches the pipelined prompts after it, not
    the split ones (nor full prefills)."""
    profile, a = _tiny7b_profile(), Action.parse("q8:full", 28)
    modes = {0: Mode.of(a, None, "pipelined", 4, Interval.PROMPT),
             1: Mode.of(a, None, "split", 1, Interval.PROMPT), 2: served_mode(a)}
    policy, idle = Asked(_context(profile), modes), Ledger.idle(1, 1, 0.01)
    first = policy.choose(REQUEST, idle, 0.0)
    ledger = idle.assigned(first, 0.0, 256).prefilled(0, 1.0,
                                                      0.5 * first.why.predicted.prefill_busy_ms)
    queues = ledger.queues(0, 0, 1.0, 256)
    assert (queues.pipelined_stretch, queues.split_stretch, queues.prefill_stretch) == (
        pytest.approx(0.5), 1.0, 1.0)
    for i, stretch in ((0, 0.5), (1, 1.0), (2, 1.0)):
        request = dataclasses.replace(REQUEST, id=i)
        before = policy.choose(request, idle, 1.0).why.predicted
        after = policy.choose(request, ledger, 1.0).why.predicted
        assert after.prefill_stretch == pytest.approx(stretch)
        assert after.prefill_busy_ms - after.overhead_ms == pytest.approx(
            stretch * before.prefill_busy_ms)


def test_a_streamed_prompt_is_priced_with_what_streamed_prompts_held_their_worker():
    """A split or pipelined prompt waits at the head of its worker's queue for its admission
    and sends between its steps: the ledger learns that hold (from the prompt's turn to its
    `Prefilled`, less its compute) and prices it into a streamed prompt's TTFT and the
    worker's busy time, not a full prefill's. A compute that tells nothing (None: it compiled
    or was dropped) and a full prefill teach it nothing."""
    profile, a = _tiny7b_profile(), Action.parse("q8:r=14", 28)
    streamed = Mode.of(a, "chunked", "pipelined", 4, Interval.PROMPT)
    asks = {0: streamed, 1: served_mode(a)}
    policy = Asked(_context(profile), asks)
    idle = Ledger.idle(1, 1, 0.01)
    first = policy.choose(REQUEST, idle, 0.0)
    assert first.why.predicted.overhead_ms == 0  # none timed yet
    ledger = idle.assigned(first, 0.0, 256).prefilled(0, 0.5, 380.0)  # 120 ms beyond compute
    assert ledger.prefill[0].overhead == Extra(((None, 120.0),))
    for told_nothing in (idle.assigned(first, 0.0, 256).prefilled(0, 0.5, None),
                         idle.assigned(policy.choose(dataclasses.replace(REQUEST, id=1), idle,
                                                     0.0), 0.0, 256).prefilled(0, 0.5, 380.0)):
        assert told_nothing.prefill[0].overhead == Extra()
    held = Ledger((dataclasses.replace(IDLE_PREFILL, overhead=Extra(
        ((None, 120.0), (None, 20.0), (None, 90.0)))),),
                  idle.decode, idle.links)
    for request_id, extra in ((0, 90.0), (1, 0.0)):  # the median hold; none for a full prefill
        request = dataclasses.replace(REQUEST, id=request_id)
        before = policy.choose(request, idle, 0.0).why.predicted
        after = policy.choose(request, held, 0.0).why.predicted
        assert after.overhead_ms == extra
        assert after.ttft_ms == pytest.approx(before.ttft_ms + extra)
        assert after.prefill_busy_ms == pytest.approx(before.prefill_busy_ms + extra)
        # its compute is timed against its price, not against the hold priced beside it
        chosen = policy.choose(request, held, 0.0)
        timed = held.assigned(chosen, 0.0, 256).prefilled(0, 1.0, before.prefill_busy_ms)
        assert timed.prefill[0].estimate.samples[-1].priced_ms == pytest.approx(
            before.prefill_busy_ms)


def test_first_tokens_lag_after_the_link_is_learned_by_kind_and_length():
    """The decode side's work after a handoff's last message errs from its price by schedule,
    length and load: the ledger learns by how much each kind (streamed or not, per octave,
    beside running decodes or not) lately came later than priced and adds it to that kind's
    TTFT, never before its link's end."""
    profile, a = _tiny7b_profile(), Action.parse("q8:r=14", 28)
    streamed = Mode.of(a, "chunked", "pipelined", 4, Interval.PROMPT)
    policy = Asked(_context(profile), {0: streamed, 1: served_mode(a)})
    full_request = dataclasses.replace(REQUEST, id=1)
    idle = Ledger.idle(1, 1, 0.01)
    choice = policy.choose(REQUEST, idle, 0.0)
    p = choice.why.predicted
    priced = p.ttft_ms - p.after.link_free_ms
    assert p.tail_ms == 0 and priced > 0  # untimed: the plan's own tail
    learned = idle.first_token(choice, 256, priced + 40.0).first_token(choice, 300, priced - 8.0)
    assert learned.decode[0].tail == Extra((((True, 8, False), 40.0), ((True, 8, False), -8.0)))
    again = policy.choose(REQUEST, learned, 0.0).why.predicted
    assert again.tail_ms == 16.0 and again.ttft_ms == pytest.approx(p.ttft_ms + 16)
    decoding = learned.loaded(Load(0, running=2, queued_suffix_ms=0.0, free_pages=9), 0.0, COSTS)
    for other in (policy.choose(full_request, learned, 0.0),  # not streamed
                  policy.choose(dataclasses.replace(REQUEST, tokens=(1,) * 512), learned, 0.0),
                  policy.choose(REQUEST, decoding, 0.0)):  # beside running decodes
        assert other.why.predicted.tail_ms == 0
    early = idle.first_token(choice, 256, -1e6)  # no first token before the link's end
    assert policy.choose(REQUEST, early, 0.0).why.predicted.ttft_ms == pytest.approx(
        p.after.link_free_ms)


def test_a_compute_estimate_keeps_its_window_and_ignores_untimed_prompts():
    e, beside = ComputeEstimate(window=2).observed(4.0, 2.0, Setting.ALONE, 256), Setting.BESIDE
    for priced, measured in ((10.0, 30.0), (10.0, 10.0), (30.0, 15.0), (10.0, 0.0), (0.0, 5.0)):
        e = e.observed(priced, measured, beside, 300)  # 300 tokens: 256's octave
    assert e.samples == (Timed(Setting.ALONE, 8, 4.0, 2.0), Timed(beside, 8, 10.0, 10.0),
                         Timed(beside, 8, 30.0, 15.0))
    assert e.stretch(beside) == 25 / 40 and e.stretch(Setting.ALONE) == 0.5
    assert e.stretch(Setting.SPLIT) == 1.0  # untimed


def test_a_compute_estimate_times_each_octave_of_prompt_length_apart():
    """A prompt's stretch comes from prompts of its octave once one is timed, from its
    setting's other octaves until then; each octave keeps its own window."""
    e = ComputeEstimate(window=2)
    for tokens, priced, measured in ((256, 10.0, 12.0), (512, 10.0, 8.0), (256, 10.0, 14.0),
                                     (256, 10.0, 10.0)):
        e = e.observed(priced, measured, Setting.ALONE, tokens)
    assert [octave(n) for n in (181, 182, 362, 363, 512)] == [7, 8, 8, 9, 9]
    assert e.stretch(Setting.ALONE, 256) == pytest.approx(24 / 20)  # its latest two
    assert e.stretch(Setting.ALONE, 500) == pytest.approx(0.8)  # 512's alone
    assert e.stretch(Setting.ALONE, 2048) == pytest.approx(32 / 30)  # untimed: all the setting's
    assert e.stretch(Setting.ALONE) == pytest.approx(32 / 30)
    with pytest.raises(ValueError, match="at least one token"):
        octave(0)


def test_fixed_and_balanced_policies_run_one_action_after_a_full_prefill():
    profile = _tiny7b_profile()
    policies = make_policies(["bf16:full", "q8:balanced", "bf16:recompute"], _context(profile))
    modes = [p.choose(REQUEST, _ledger(profile.link_gbps), 0.0).mode for p in policies]
    assert [str(m.action) for m in modes][::2] == ["bf16:full", "bf16:recompute"]
    _, cuts = profile.balanced_cut(8)
    assert modes[1].action.bits == 8 and modes[1].action.cut in cuts
    assert all(m.prefill == "full" and m.from_prompt for m in modes)


def test_light_load_on_a_fast_link_chooses_bf16_and_a_growing_link_queue_moves_off_it():
    """The link 20x the paper's: idle, a BF16 action; with seconds queued on the link, a
    quantized one that sends fewer bytes (a short queue may first move compute to the prefill
    worker, which would otherwise wait for the link too)."""
    profile = _tiny7b_profile()
    fast = profile.link_gbps * 20
    policy, = make_policies(["adaptive"], _context(profile))
    chosen = [policy.choose(REQUEST, _ledger(fast, link_s), 0.0) for link_s in (0, 3, 10)]
    sent = [_link_bytes(profile, a.mode.action) for a in chosen]
    assert chosen[0].mode.action.bits == 16 and chosen[0].why.predicted.link_wait_ms == 0
    assert [a.mode.action.bits for a in chosen[1:]] == [8, 8]
    assert sent[1] < sent[0] and sent[2] <= sent[1]
    assert chosen[-1].why.predicted.link_wait_ms > 0


def test_a_growing_decode_load_moves_toward_less_recomputation():
    profile = _tiny7b_profile()
    policy, = make_policies(["adaptive"], _context(profile))
    suffix = [policy.choose(REQUEST, _ledger(profile.link_gbps,
                                             decode=DecodeQueue(backlog, running)), 0.0)
              .mode.action.suffix_len for backlog, running in ((0, 0), (0.2, 2), (1, 8))]
    assert suffix == sorted(suffix, reverse=True) and suffix[0] > 0 and suffix[-1] == 0


def test_running_decodes_alone_move_adaptive_toward_less_recomputation():
    """No suffix backlog: only the running batch grows. Each ms of suffix compute holds back
    every running request's tokens (J = B R), so the decode-side compute chosen shrinks."""
    profile = _tiny7b_profile()
    policy, = make_policies(["adaptive"], _context(profile))
    chosen = [policy.choose(REQUEST, _ledger(profile.link_gbps, decode=DecodeQueue(0, running)),
                            0.0).why.predicted for running in (0, 4, 16)]
    busy = [p.decode_busy_ms for p in chosen]
    assert busy == sorted(busy, reverse=True) and busy[-1] < busy[0]
    assert [p.decode_delay_ms for p in chosen] == [r * b for r, b in zip((0, 4, 16), busy,
                                                                         strict=True)]


def test_a_tpot_slack_bounds_the_suffix_compute_chosen_beside_its_request():
    """Adaptive moves a queued prompt's compute to the decode worker; a request there whose
    slack is less than that suffix's compute keeps it off, unless its decode ends before the
    suffix starts, or no mode fits (a fixed policy's one mode). The chosen suffix spends the
    slack of each request still decoding then, and the new request books its own until it is
    released."""
    profile = _tiny7b_profile()
    adaptive, = make_policies(["adaptive"], _context(profile))
    fixed, = make_policies(["q8:balanced"], _context(profile))
    unbounded, = make_policies(["adaptive"], _context(profile, tpot_stretch=None))

    def chosen(policy, *slack):
        decode = DecodeQueue(running=1, slack=slack)
        return policy.choose(REQUEST, _ledger(profile.link_gbps, decode=decode,
                                              prefill=_busy(3000)), 0.0)

    free = chosen(adaptive, Slack(7, 1e9))
    r, starts_s = free.why.predicted.decode_busy_ms, free.why.predicted.suffix_from_ms / 1e3
    assert r > 0 and starts_s >= 3.0 and free.mode == chosen(unbounded).mode
    assert free.why.predicted.tpot_room_ms == 1e9
    tight = chosen(adaptive, Slack(7, r / 2))
    assert 0 <= tight.why.predicted.decode_busy_ms <= r / 2
    assert chosen(adaptive, Slack(7, 0.0)).why.predicted.decode_busy_ms == 0
    assert chosen(adaptive, Slack(7, 0.0, ends_s=1.0)).mode == free.mode  # it ended by then
    assert chosen(adaptive, Slack(7, 0.0, ends_s=1.0)).why.predicted.tpot_room_ms is None
    assert chosen(fixed, Slack(7, 0.0)).why.predicted.decode_busy_ms > 0  # none fits: its own

    # f bounds its TPOT at f d(1); the batch it decodes in takes its share of that first
    alone = tpot_slack_ms(COSTS, 0, REQUEST.max_new_tokens, 1.25)
    assert alone == 31 * (1.25 * 10.0 - 10.0)
    assert tpot_slack_ms(COSTS, 1, REQUEST.max_new_tokens, 1.5) == 31 * (1.5 * 10.0 - 14.0)
    assert tpot_slack_ms(COSTS, 1, REQUEST.max_new_tokens, 1.25) == 0  # d(2) > 1.25 d(1)
    assert free.why.tpot_slack_ms == 0  # request 7 decodes beside it
    assert chosen(adaptive, Slack(7, 1e9, ends_s=1.0)).why.tpot_slack_ms == alone  # ended
    assert chosen(unbounded).why.tpot_slack_ms is None
    slack = free.why.tpot_slack_ms
    ledger = _ledger(profile.link_gbps, decode=DecodeQueue(running=1, slack=(
        Slack(7, 1e9), Slack(8, 5.0, ends_s=starts_s - 0.5))))
    booked = ledger.assigned(free, 0.0, 256)
    assert booked.decode[0].slack == (Slack(7, 1e9 - r), Slack(8, 5.0, starts_s - 0.5),
                                      Slack(REQUEST.id, slack))
    paced = booked.decodes_until(free, (1.0, 1.1, 1.2), 32)  # 31 steps of 0.1 s from 1.0
    assert paced.decode[0].slack[-1] == Slack(REQUEST.id, slack, pytest.approx(4.1))
    assert booked.released(free).decode[0].slack == booked.decode[0].slack[:2]
    with pytest.raises(ValueError, match="at least 1"):
        _context(profile, tpot_stretch=0.9)


def test_a_prefill_queue_moves_prompt_compute_to_the_decode_worker():
    profile = _tiny7b_profile()
    policy, = make_policies(["adaptive"], _context(profile))
    busy = [policy.choose(REQUEST, _ledger(profile.link_gbps, prefill=_busy(w)),
                          0.0).why.predicted.prefill_busy_ms for w in (0, 1000, 3000)]
    assert busy == sorted(busy, reverse=True) and busy[-1] < busy[0]


def test_adaptive_picks_the_cheapest_pair_of_workers():
    profile = _tiny7b_profile()
    policy, = make_policies(["bf16:full"], _context(profile))
    est = LinkEstimate(profile.link_gbps)
    ledger = Ledger((_busy(5000.0), PrefillQueue()), (DecodeQueue(),),
                    (LinkQueue(est), LinkQueue(est)))
    assert policy.choose(REQUEST, ledger, 0.0).prefill_worker == 1


def test_the_gate_limits_adaptive_and_unchecked_actions_are_named():
    profile = _tiny7b_profile()
    no_gate, = make_policies(["adaptive"], _context(profile))
    assert "q8:r=12" in no_gate.unchecked(256) and "bf16:full" not in no_gate.unchecked(256)
    gate = (GateResult("tiny-7b", 256, "q8:r=18", True),
            GateResult("tiny-7b", 256, "q8:full", False))
    gated, = make_policies(["adaptive"], _context(profile, gate=gate))
    allowed = {str(m.action) for m in gated.modes(256)}
    assert "q8:r=18" in allowed and "q8:full" not in allowed and "q8:r=12" not in allowed
    assert "bf16:full" in allowed and gated.unchecked(256) == []
    choice = gated.choose(REQUEST, _ledger(profile.link_gbps), 0.0)
    assert choice.why.quality in ("lossless", "eligible")
    assert {str(m.action) for m in gated.modes(512)} == {  # no results at 512: BF16 only
        str(Action(16, c, 28)) for c in range(29)}


def test_profiles_of_other_lengths_are_scaled_from_the_nearest():
    profile = _tiny7b_profile()
    ctx = _context(dataclasses.replace(profile), adaptive_bits=(16,))
    assert ctx.profile(512) == profile.at_length(512) and ctx.profile(256) == profile
    with pytest.raises(ValueError, match="cannot predict"):
        Context("tiny", 6, (profile,), COSTS)
    with pytest.raises(ValueError, match="4-bit"):
        _context(profile, adaptive_bits=(16, 4))


@pytest.mark.parametrize("text, match", [
    ("adaptive,adaptive", "name one twice"), ("fast", "policy 'fast'"),
    ("bf16:balanced", "policy 'bf16:balanced'"), ("q8:r=40", "0..28")])
def test_bad_policy_names(text, match):
    with pytest.raises(ValueError, match=match):
        check_policy_names(text, TINY7B.num_layers)


def test_asked_runs_each_request_as_asked_on_the_cheaper_pair():
    """`Asked` gives each request the mode asked for it, whatever another mode would cost, on
    the pair of workers whose queues predict it soonest; a request nobody asked for is an
    error."""
    profile = _tiny7b_profile()
    slow, fast = served_mode(Action.parse("bf16:full", 28)), served_mode(Action.parse("q8:r=4", 28))
    policy = Asked(_context(profile), {0: slow, 1: fast})
    busy = _busy(5000.0)  # prefill worker 0 has 5 s of prompts queued
    ledger = Ledger((busy, IDLE_PREFILL), (IDLE_DECODE,),
                    (LinkQueue(LinkEstimate(0.01)),) * 2, ARRIVALS)
    for request, mode in ((REQUEST, slow), (dataclasses.replace(REQUEST, id=1), fast)):
        chosen = policy.choose(request, ledger, 0.0)
        assert chosen.mode == mode and (chosen.prefill_worker, chosen.decode_worker) == (1, 0)
        assert chosen.why.policy == "asked"
    with pytest.raises(ValueError, match="no mode was asked for request 2"):
        policy.choose(dataclasses.replace(REQUEST, id=2), ledger, 0.0)


def test_asked_runs_a_request_on_its_asked_pair_or_refuses_one_that_cannot_take_it():
    """A request asked onto a pair runs there, even where another pair predicts it sooner; an
    asked pair not among those that can take it now is a ValueError naming both."""
    profile = _tiny7b_profile()
    mode = served_mode(Action.parse("q8:r=4", 28))
    policy = Asked(_context(profile), {0: mode, 1: mode}, {0: (0, 0)})
    ledger = Ledger((_busy(5000.0), IDLE_PREFILL), (IDLE_DECODE,),
                    (LinkQueue(LinkEstimate(0.01)),) * 2, ARRIVALS)
    chosen = policy.choose(REQUEST, ledger, 0.0)
    assert (chosen.prefill_worker, chosen.decode_worker, chosen.mode) == (0, 0, mode)
    unasked = policy.choose(dataclasses.replace(REQUEST, id=1), ledger, 0.0)
    assert (unasked.prefill_worker, unasked.decode_worker) == (1, 0)
    with pytest.raises(ValueError, match=r"asked for workers \(0, 0\).*\[\(1, 0\)\]"):
        policy.choose(REQUEST, ledger, 0.0, [(1, 0)])
