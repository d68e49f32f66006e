"""A member of the group test's run (tests/test_group.py): `serve(member)`, the job of every
member of a launched group, opens the member's links and answers the parent's messages (the
records below) until the group closes, emitting what it did.

A prefill member sends the handoffs it is told to (`Send`), echoes (`Echo`) and dies when told
(`Die`). The decode member advances every handoff it expects (`Expect`, `Watch`) from its one
thread, waiting on the receptions' futures and its inbox together as a serving engine does, and
emits each cache's check against its single-process reference, or the loss of a handoff."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import time

import jax
import numpy as np

from rekv_jax import ModelConfig, init_params
from rekv_jax.errors import TransportError
from rekv_jax.handoff.check import reference
from rekv_jax.handoff.payload import round_trip
from rekv_jax.handoff.prefix_format import PrefixCodec
from rekv_jax.handoff.receiver import Reception
from rekv_jax.handoff.sender import prepare, send_handoff
from rekv_jax.launch.child import CLOSED, Member
from rekv_jax.mode import Mode
from rekv_jax.transport import Transport
from rekv_jax.transport.workers import LIVENESS_S

CFG = ModelConfig.preset("tiny")
SEQ = 32
TIMEOUT = 60.0
HEARTBEAT_S = 3  # the links' liveness interval: a peer silent this long is gone


@dataclasses.dataclass(frozen=True)
class Echo:
    """Any member: emit `Echoed(n)`."""

    n: int


@dataclasses.dataclass(frozen=True)
class Send:
    """A prefill member: send the handoff `tag` of `mode` for the prompt of `seed` to decode-0."""

    tag: str
    mode: Mode
    seed: int


@dataclasses.dataclass(frozen=True)
class Die:
    """A prefill member: emit `Dying`, then end its process at once."""


@dataclasses.dataclass(frozen=True)
class Expect:
    """The decode member: receive the handoff `tag` of `mode` for the prompt of `seed` from
    `peer`, and check its cache."""

    peer: str
    tag: str
    mode: Mode
    seed: int


@dataclasses.dataclass(frozen=True)
class Watch:
    """The decode member: start receiving `tag` from `peer` (which will never send it) and
    emit `Watching`; its loss is emitted as `Lost`."""

    peer: str
    tag: str
    mode: Mode


@dataclasses.dataclass(frozen=True)
class Ready:
    name: str
    pid: int  # the member's OS process id
    links: tuple[str, ...]  # the peers it has a link to


@dataclasses.dataclass(frozen=True)
class Echoed:
    n: int


@dataclasses.dataclass(frozen=True)
class Sent:
    tag: str


@dataclasses.dataclass(frozen=True)
class Dying:
    at: float  # time.monotonic() (one clock for every process of the machine)


@dataclasses.dataclass(frozen=True)
class Watching:
    tag: str


@dataclasses.dataclass(frozen=True)
class Checked:
    tag: str
    peer: str
    cache_bitwise: bool  # every layer's K and V equal the reference's (a Q8 prefix its round trip)
    first_token: bool  # equal to the reference's


@dataclasses.dataclass(frozen=True)
class Lost:
    tag: str
    peer: str
    at: float  # time.monotonic() when the decode member's reception raised
    error: str  # what it raised: a TransportError (its class name first)
    peer_alive: dict[str, bool]  # then, each link's view of its peer


def tokens_of(seed: int) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (1, SEQ), 0, CFG.vocab_size)  # [B, S]


def serve(member: Member) -> str:
    """The job: every member's links, then its side's loop, then its links closed in order."""
    links = member.links("transfer-server", timeout=TIMEOUT, heartbeat_s=HEARTBEAT_S)
    params = init_params(CFG, jax.random.key(0))
    member.emit(Ready(member.name, os.getpid(), tuple(links)))
    if member.role == "prefill":
        _prefill(member, links["decode-0"], params)
    else:
        _Decode(member, links, params).run()
    for link in links.values():
        link.close(TIMEOUT)
    return member.name


def _prefill(member: Member, link: Transport, params: dict) -> None:
    while True:
        for message in member.receive(TIMEOUT):
            if message is CLOSED:
                return
            if isinstance(message, Echo):
                member.emit(Echoed(message.n))
            elif isinstance(message, Send):
                state = prepare(CFG, params, tokens_of(message.seed), message.mode)
                send_handoff(link, state, message.mode, message.tag, timeout=TIMEOUT)
                member.emit(Sent(message.tag))
            elif isinstance(message, Die):
                member.emit(Dying(time.monotonic()))
                os._exit(3)


class _Decode:
    """The decode member's one thread: its inbox and every pending reception, advanced in
    turn; it blocks only on their futures and the inbox's together."""

    def __init__(self, member: Member, links: dict[str, Transport], params: dict) -> None:
        self.member, self.links, self.params = member, links, params
        self.pending: dict[str, tuple[Reception, str, int | None]] = {}  # tag -> (, peer, seed)

    def run(self) -> None:
        closing = False
        while not closing or self.pending:
            for message in self.member.receive(0):
                closing |= message is CLOSED
                if isinstance(message, Echo):
                    self.member.emit(Echoed(message.n))
                elif isinstance(message, Expect | Watch):
                    self._start(message)
            for tag in list(self.pending):
                self._advance(tag)
            waitables = [f for r, _, _ in self.pending.values() for f in r.waitables()]
            concurrent.futures.wait([self.member.incoming(), *waitables], LIVENESS_S,
                                    concurrent.futures.FIRST_COMPLETED)

    def _start(self, message: Expect | Watch) -> None:
        link = self.links[message.peer]
        reception = Reception(link, CFG, self.params, message.mode, 1, SEQ, message.tag,
                              timeout=TIMEOUT)
        if isinstance(message, Expect):  # the sender's clock starts at this rendezvous
            link.agree(f"{message.tag}/go", {}, TIMEOUT)
        reception.start()
        seed = message.seed if isinstance(message, Expect) else None
        self.pending[message.tag] = reception, message.peer, seed
        if isinstance(message, Watch):
            self.member.emit(Watching(message.tag))

    def _advance(self, tag: str) -> None:
        reception, peer, seed = self.pending[tag]
        try:
            if not reception.advance():
                return
        except TransportError as e:
            alive = {name: link.peer_alive() for name, link in self.links.items()}
            self.member.emit(Lost(tag, peer, time.monotonic(), f"{type(e).__name__}: {e}",
                                  alive))
            del self.pending[tag]
            return
        del self.pending[tag]
        self.member.emit(_checked(reception, peer, seed, self.params))


def _checked(reception: Reception, peer: str, seed: int, params: dict) -> Checked:
    """The handoff's cache and first token against its mode's single-process reference: the
    prefix as the decode side restores it (bitwise the quantizer's round trip for Q8)."""
    out, mode = reception.outcome(), reception.mode
    kv, logits = reference(CFG, params, tokens_of(seed), mode.reference, mode.action.cut)
    c = mode.action.cut
    prefix = round_trip(kv.layers(0, c), PrefixCodec.of(CFG, params, mode.action))
    want = [*prefix.keys, *kv.keys[c:], *prefix.values, *kv.values[c:]]  # each [B, S, K, H]
    got = [*out.kv.keys, *out.kv.values]
    bitwise = len(got) == len(want) and all(
        np.array_equal(np.asarray(g), np.asarray(w)) for g, w in zip(got, want, strict=True))
    first = np.array_equal(np.asarray(out.first_token), np.argmax(np.asarray(logits), axis=-1))
    return Checked(reception.tag, peer, bitwise, bool(first))
