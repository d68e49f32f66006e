"""A schedule the library does not have, defined in this file alone: the suffix in two halves of
its layers, the second once the prefix's first half has landed, the prefix in two messages. Both
sides run it from its plan and the cost model predicts it, with no library change; over a real
link between two processes its suffix and cache are bitwise its reference's."""

from __future__ import annotations

import concurrent.futures
import os
import threading

import jax
import numpy as np
import pytest

from rekv_jax import Action, ModelConfig, init_params
from rekv_jax.handoff.check import reference
from rekv_jax.handoff.payload import round_trip
from rekv_jax.handoff.prefix_format import PrefixCodec
from rekv_jax.handoff.receiver import Reception
from rekv_jax.handoff.sender import prepare, send_handoff
from rekv_jax.launch.environments import pair_environments, visible_gpus
from rekv_jax.launch.group import loopback, run_pair
from rekv_jax.mode import Mode
from rekv_jax.plan import Builder, Message, Part, Plan, Quantize, Receive, Suffix, chunks_of
from rekv_jax.planning import costmodel as cm
from rekv_jax.planning.play import play
from rekv_jax.transport import JobKey, LocalTransport
from rekv_jax.transport.cores import usable_cpus
from rekv_jax.transport.workers import LIVENESS_S

CFG = ModelConfig.preset("tiny")
SEQ = 32
ACTIONS = ("q8:r=3", "bf16:r=2")


def two_halves(mode: Mode, seq_len: int) -> Plan:
    """A full prefill's handoff (ready interval): the ids, first token and h_c; the prefix as
    two messages of half its layers each; the suffix's lower half of layers on h_c, its upper
    half once the lower half is queued and the prefix's first message is restored."""
    action, whole = mode.action, chunks_of(seq_len, 1)[0]
    c, L = action.cut, action.num_layers
    half, mid = c // 2, (c + L) // 2
    build = Builder(action, seq_len)
    ready = (build.add(Quantize((0, c), whole)),) if action.bits < 16 else ()
    head = Message("boundary", (Part.TOKENS, Part.FIRST, Part.BOUNDARY), (0, seq_len))
    boundary = build.add(Receive(head, ready))
    first = build.prefix(Message("prefix0", (Part.PREFIX,), (0, seq_len), (0, half)), ready)
    build.prefix(Message("prefix1", (Part.PREFIX,), (0, seq_len), (half, c)), ready)
    lower = build.add(Suffix((c, mid), whole, (boundary,)))
    build.add(Suffix((mid, L), whole, (lower, first)))
    return build.plan()


def _model(text: str):
    params = init_params(CFG, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, SEQ), 0, CFG.vocab_size)
    return params, tokens, Mode.of(Action.parse(text, CFG.num_layers))


def send_side(link, text: str) -> None:
    """The prefill side of one handoff of `text` as `two_halves`, with its suffix checksums."""
    params, tokens, mode = _model(text)
    state = prepare(CFG, params, tokens, mode, check_suffix=True)
    send_handoff(link, state, mode, text, plan=two_halves(mode, SEQ))


def receive_side(link, text: str) -> dict[str, bool]:
    """The decode side of it: whether its suffix checksums matched, its cache equals its
    reference's (the prefix as restored) and its first token the prefill side's."""
    params, tokens, mode = _model(text)
    reception = Reception(link, CFG, params, mode, 1, SEQ, text, plan=two_halves(mode, SEQ))
    link.agree(f"{text}/go", {}, 60.0)
    reception.start()
    while not reception.advance():
        concurrent.futures.wait(reception.waitables(), LIVENESS_S,
                                concurrent.futures.FIRST_COMPLETED)
    out, c = reception.outcome(), mode.action.cut
    kv, _ = reference(CFG, params, tokens, mode.reference, c)
    prefix = round_trip(kv.layers(0, c), PrefixCodec.of(CFG, params, mode.action))
    want = (*prefix.keys, *kv.keys[c:], *prefix.values, *kv.values[c:])
    got = (*out.kv.keys, *out.kv.values)
    first = prepare(CFG, params, tokens, mode).first_token
    return {"suffix": out.suffix_match is True,
            "cache": all(np.array_equal(np.asarray(g), np.asarray(w))
                         for g, w in zip(got, want, strict=True)),
            "first": bool(np.array_equal(np.asarray(out.first_token), np.asarray(first)))}


def test_the_schedule_is_one_plan_and_the_cost_model_predicts_it():
    """Its wire order is its plan's; played against a profile, it is never faster than Eq. 9
    with the suffix on h_c at once, and it waits for the prefix's first half."""
    p = cm.Profile.for_config(CFG, SEQ, 1, hardware="test", link="test", link_gbps=0.01,
                              source="measured", quantize_ms={16: 0.0, 8: 0.1},
                              restore_ms={16: 0.0, 8: 0.1}, suffix_layer_ms=0.01, embed_ms=0.0,
                              join_ms=0.0, message_ms=0.0)
    for text in ACTIONS:
        mode = Mode.of(Action.parse(text, CFG.num_layers))
        plan = two_halves(mode, SEQ)
        assert [m.name for m in plan.messages] == ["boundary", "prefix0", "prefix1"]
        halves, overlapped = play(plan, p), cm.handoff_ends(p, mode)
        assert halves.end_ms >= overlapped.end_ms - 1e-9
        first_half = p.prefix_ms(mode.action.bits, mode.action.cut // 2) - p.message_ms
        assert halves.end_ms >= cm.phase_ms(p, mode.action).boundary + first_half


@pytest.mark.parametrize("text", ACTIONS)
def test_the_schedule_runs_bitwise_in_one_process(text):
    send, recv = LocalTransport.pair()
    sender = threading.Thread(target=send_side, args=(send, text))
    sender.start()
    assert receive_side(recv, text) == {"suffix": True, "cache": True, "first": True}
    sender.join(60)


def side(member, texts: tuple[str, ...]) -> dict[str, dict[str, bool]] | None:
    """A launched side: every handoff of `texts` as `two_halves` over the pair's link."""
    with member.link("transfer-server", None, 60.0) as link:
        if member.role == "prefill":
            for text in texts:
                send_side(link, text)
            return None
        return {text: receive_side(link, text) for text in texts}


def test_the_schedule_runs_bitwise_over_two_processes():
    """Each side its own process (pinned to its own core where there are two), its own compiled
    programs, a transfer server between them."""
    cpus = usable_cpus() if len(usable_cpus()) >= 2 else None
    envs = pair_environments(visible_gpus(), {**os.environ, "JAX_PLATFORMS": "cpu"}, cpus=cpus)
    got = run_pair(side, ACTIONS, envs=envs, key=JobKey.new(), coordinator=loopback(),
                   timeout=300)
    assert got == {text: {"suffix": True, "cache": True, "first": True} for text in ACTIONS}
