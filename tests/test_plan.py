"""A handoff as a plan (`Mode.plan`, `rekv_jax.plan`) and the cost model playing it
(`planning.play`): the played plan equals every closed form where the closed form applies, and
the plan is what both sides run."""

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rekv_jax.action import ACTION_KINDS, PREFIX_FORMATS, Action, action_space
from rekv_jax.config import ModelConfig
from rekv_jax.mode import PREFILL_MODES, SCHEDULES, Mode, PrefillMode
from rekv_jax.plan import Join, Plan, Receive, Restore, Suffix, chunks_of
from rekv_jax.planning import costmodel as cm
from rekv_jax.planning import play as pl

TINY = ModelConfig.preset("tiny")
S = 240  # whole chunks for every count below: where the closed forms apply
CHUNKS = (2, 3, 4, 5)
ms = st.floats(0, 50, allow_nan=False)


def _modes(action: Action) -> list[Mode]:
    """Every mode of `action` in the action space: each schedule under each prefill and chunk
    count, from the prompt and from the ready state."""
    out = Mode.candidates(action, SCHEDULES, PREFILL_MODES, CHUNKS, "prompt")
    return out + Mode.candidates(action, SCHEDULES, ("full",), CHUNKS, "ready")


@st.composite
def profiles(draw) -> cm.Profile:
    per_bits = st.fixed_dictionaries({16: st.just(0.0), 8: ms, 4: ms})
    p = cm.Profile.for_config(
        TINY, S, 1, hardware="test", link="test", source="measured",
        link_gbps=draw(st.floats(1e-3, 100)), quantize_ms=draw(per_bits),
        restore_ms=draw(per_bits), suffix_layer_ms=draw(ms), embed_ms=draw(ms),
        join_ms={k: draw(ms) for k in ACTION_KINDS}, quantize_fixed_ms=draw(ms),
        boundary_fixed_ms=draw(ms), message_ms=draw(ms), suffix_fixed_ms=draw(ms),
        restore_fixed_ms=draw(per_bits), chunk_layer_ms=draw(ms),
        attention_share=draw(st.floats(0, 1)))
    return dataclasses.replace(p, num_layers=draw(st.integers(2, 6)))


contentions = st.builds(pl.Contention, ms, ms, st.floats(1, 4))


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


@settings(max_examples=60, deadline=None)
@given(p=profiles(), seen=contentions, fmt=st.sampled_from(PREFIX_FORMATS))
def test_the_played_plan_equals_every_closed_form(p, seen, fmt):
    """Sequential, overlapped, chunked N, split, pipelined N, transfer-only and full
    recomputation, idle and under contention: the plan's critical path is the formula's total,
    and its link end the formula's."""
    for action in action_space(p.num_layers, (16, 8, 4), (fmt,)):
        for mode in _modes(action):
            for contention in (pl.IDLE, seen):
                played = cm.handoff_ends(p, mode, contention)
                closed = cm.closed_form_ends(p, mode, contention)
                assert _close(played.end_ms, closed.end_ms), (mode, played, closed)
                assert _close(played.link_ms, closed.link_ms), (mode, played, closed)


def _prefill_busy(p, mode):
    """The prefill device's time written out: a full prefill's prompt compute and quantize
    calls; a split one's c layers and c quantize calls; a pipelined one's N chunk calls."""
    c, b, n = mode.action.cut, mode.action.bits, mode.chunks
    if mode.prefill == PrefillMode.FULL:
        return cm.prompt_compute_ms(p, p.num_layers) + cm.phase_ms(p, mode.action).quantize
    if c == 0:
        return 0
    if mode.prefill == PrefillMode.SPLIT:
        return (p.embed_ms + c * (p.suffix_fixed_ms + p.suffix_layer_ms)
                + c * (p.quantize_fixed_ms + p.quantize_ms[b] if b < 16 else 0))
    quantize = p.quantize_fixed_ms + c * p.quantize_ms[b] / n if b < 16 else 0
    return sum(p.embed_ms / n + p.suffix_fixed_ms + c * p.chunk_layer(i, n) + quantize
               for i in range(n))


def _decode_busy(p, mode):
    """The decode device's time written out: its suffix calls (and the embedding at c = 0)."""
    c, n = mode.action.cut, mode.suffix_chunks
    if c == p.num_layers:
        return 0
    calls = sum(p.suffix_fixed_ms + (p.num_layers - c) * p.chunk_layer(i, n) for i in range(n))
    return calls + (p.embed_ms if c == 0 else 0)


@settings(max_examples=30, deadline=None)
@given(p=profiles())
def test_busy_times_are_the_plans_steps(p):
    """What a served handoff occupies, as the queueing model charges it from its plan, is each
    device's work written out per prefill mode."""
    for action in action_space(p.num_layers, (16, 8)):
        for mode in Mode.candidates(action, SCHEDULES, PREFILL_MODES, CHUNKS, "prompt"):
            assert _close(cm.prefill_busy_ms(p, mode), _prefill_busy(p, mode)), mode
            assert _close(cm.decode_busy_ms(p, mode), _decode_busy(p, mode)), mode


def test_unequal_chunks_are_played_by_their_tokens():
    """Chunks of unequal length carry their own tokens' share of h_c: its link carries exactly
    the boundary's bytes, and where the suffix is the critical path, the first (longer) piece
    starts it later than the equal-piece closed form has it."""
    p = cm.Profile.for_config(TINY, 256, 1, hardware="test", link="test", link_gbps=0.01,
                              source="measured", quantize_ms={16: 0.0, 8: 0.1},
                              restore_ms={16: 0.0, 8: 0.1}, suffix_layer_ms=100.0, embed_ms=0.0,
                              join_ms=0.0, message_ms=0.0)
    mode = Mode.of(Action(16, 3, TINY.num_layers), "chunked", chunks=3)
    plan = mode.plan(256, TINY.num_layers)
    pieces = [s for s in plan.steps if isinstance(s, Receive) and s.message.name != "prefix"]
    crossing = sum(pl.step_ms(plan, p, s) for s in pieces)
    assert [s.message.tokens for s in pieces] == [(0, 86), (86, 171), (171, 256)]
    assert _close(crossing, cm.transfer_ms(p.token_bytes + p.boundary_bytes, p.link_gbps))
    played = cm.handoff_ends(p, mode).end_ms
    assert played > cm.closed_form_ends(p, mode).end_ms


def test_a_plan_is_what_each_side_runs():
    """The wire order is the plan's receives; each suffix chunk needs its piece and the chunk
    before (the sequential schedule: every restore too); the join needs every decode step."""
    L = TINY.num_layers
    for schedule in ("overlapped", "sequential", "chunked"):
        mode = Mode.of(Action(8, 2, L), schedule, chunks=3)
        plan = mode.plan(S, L)
        assert plan.messages == mode.messages(S, L)
        steps = plan.steps
        suffixes = [i for i, s in enumerate(steps) if isinstance(s, Suffix)]
        restores = {i for i, s in enumerate(steps) if isinstance(s, Restore)}
        assert [steps[i].chunk for i in suffixes] == chunks_of(S, mode.chunks)
        for k, i in enumerate(suffixes):
            piece = steps[steps[i].after[0]]
            assert isinstance(piece, Receive) and piece.message.tokens == steps[i].chunk.tokens
            assert (suffixes[k - 1] in steps[i].after) == (k > 0)
            assert restores <= set(steps[i].after) or schedule != "sequential"
        assert isinstance(steps[-1], Join) and set(suffixes) | restores <= set(steps[-1].after)


def test_a_plan_refuses_steps_out_of_order():
    action = Action(16, 1, 2)
    with pytest.raises(ValueError, match="does not come before"):
        Plan(action, 8, (Join((1,)), Join()))
    with pytest.raises(ValueError, match="ends with its join"):
        Plan(action, 8, ())
