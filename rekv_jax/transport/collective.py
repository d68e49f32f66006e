"""Transport (a): one cross-process `ppermute` program per phase over a 2-device mesh (one device
per process; gloo on CPU, NCCL on GPU). Both sides run the same program with the same shapes.

Between sharded sides (`rekv_jax.transport.mesh.MeshTransport`) the decode side's specs name the
device each buffer (a piece of a shard) must reach; its go-ahead carries those devices and the
prefill side answers with where each piece lives. One program over just the devices involved then
runs one `ppermute` per piece from its prefill device to its decode device, so the device pairs move
their pieces at once and neither side gathers. Processes may hold different device counts."""

from __future__ import annotations

import concurrent.futures
import functools
import json
import math
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rekv_jax.errors import TransportError, TransportTimeout
from rekv_jax.transport import distributed
from rekv_jax.transport.base import Arrival, Endpoint, Role, mismatch_text, spec_of
from rekv_jax.transport.checksums import checksums_in_program
from rekv_jax.transport.verdicts import Verdicts
from rekv_jax.transport.workers import Watchdog, Worker, wait_for

_SRC_TIMEOUT_S = 60.0  # the sender puts the pieces' devices before it enters the program


def _devices_by_id() -> dict[int, jax.Device]:
    return {d.id: d for d in jax.devices()}


def _device_of(spec: jax.ShapeDtypeStruct) -> jax.Device:
    return next(iter(spec.sharding.device_set))


def _placement(specs: list[jax.ShapeDtypeStruct]) -> list[int] | None:
    """The device id each buffer goes to, where the specs name devices (sharded sides)."""
    if all(s.sharding is None for s in specs):
        return None
    return [_device_of(s).id for s in specs]


@jax.jit
def _packed(xs: list[jax.Array]) -> jax.Array:
    """The buffers' bytes end to end [sum of nbytes] uint8, on their device: the exchange then
    moves one buffer (gloo and NCCL pay a fixed cost per collective, and a sharded program's
    dispatch one per argument)."""
    return jnp.concatenate([jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1) for x in xs])


@functools.partial(jax.jit, static_argnums=1)
def _unpacked(flat: jax.Array, like: tuple[tuple[tuple[int, ...], str], ...]
              ) -> tuple[list[jax.Array], jax.Array]:
    """`_packed`'s inverse: buffers of the (shape, dtype) in `like` from their bytes, and the
    checksums of all but the last (the sender's checksums, `checksums_buffer`), [n - 1] uint32,
    computed where the program reads every byte anyway."""
    out, start = [], 0
    for shape, name in like:
        dtype = jnp.dtype(name)
        size = math.prod(shape) * dtype.itemsize
        piece = flat[start:start + size]
        out.append(jax.lax.bitcast_convert_type(
            piece.reshape(shape if dtype.itemsize == 1 else (*shape, dtype.itemsize)), dtype))
        start += size
    return out, checksums_in_program(out[:-1])


def _nbytes(specs: list) -> int:
    return sum(math.prod(s.shape) * jnp.dtype(s.dtype).itemsize for s in specs)


class CollectiveTransport(Endpoint):
    """A message's buffers, packed into one byte buffer on the prefill device (`_packed`), become
    the local block of a global array sharded over the process axis; the program moves that
    block to the decode device (the decode side contributes a cached zero block), which cuts it
    apart and checksums the pieces in the same program (`_unpacked`). Both sides must enter the
    program, so mismatched shapes must never reach it: the decode side puts the specs it expects
    (`TAG/ready`, its go-ahead) before it reads the header, the sender compares them with its
    own before it pushes, and each side enters only on a match (one round trip). The sender's
    program runs on a worker thread: `send` returns once it started, `wait_ack` waits for it."""

    kind = "collective"

    def __init__(self, role: Role, channel: distributed.PeerChannel) -> None:
        super().__init__(role, channel)
        me = jax.process_index()
        devices = [min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
                   for p in range(2)]
        self._device = devices[me]
        mesh = Mesh(np.array(devices), ("p",))
        src = me if role == "prefill" else 1 - me
        perm = [(src, 1 - src)]
        self._sharding = NamedSharding(mesh, P("p"))
        self._program = jax.jit(jax.shard_map(  # one byte buffer from the prefill device
            lambda flat: jax.lax.ppermute(flat, "p", perm),
            mesh=mesh, in_specs=P("p"), out_specs=P("p")))
        # The program's results come once the peer joined, and waiting for them has no timeout:
        # run it on a worker thread, which keeps the programs in call order, so that every wait
        # stays bounded (the sender's by its own wait, a receive's by the watchdog)
        self._runner = Worker("rekv-collective")
        self._watchdog = (Watchdog("rekv-receive-watchdog", channel.peer_alive)
                          if role == "decode" else None)
        self._verdicts = Verdicts(self._post_verdict)
        self._blanks: dict[tuple, jax.Array] = {}
        self._placed: dict[tuple, tuple] = {}  # (devices, pairs) -> (sharding, program)
        self._broken: str | None = None
        self._exchanges: dict[str, tuple[concurrent.futures.Future, float]] = {}  # sent, running

    def _send(self, tag: str, buffers: list[jax.Array], header: str, deadline: float) -> None:
        """Put the header, wait for the go-ahead (the specs the decode side expects), then start
        the program on the runner; returns at once (`wait_ack` waits for the exchange), so the
        next message is prepared while this one moves."""
        self._channel.put(f"{tag}/header", header)
        sent = json.loads(header)
        ready = json.loads(
            self._channel.get(f"{tag}/ready", max(0.0, deadline - time.monotonic())))
        if ready["expect"] != sent:  # the decode side finds the same in the header: neither
            raise ValueError(mismatch_text(tag, sent, ready["expect"]))  # enters the program
        if ready["placed"] is None:
            here = {self._device}
            run = self._exchange(_packed([a if a.devices() == here else
                                          jax.device_put(a, self._device) for a in buffers]))
        else:
            src = [next(iter(a.devices())) for a in buffers]
            self._channel.put(f"{tag}/src", json.dumps([d.id for d in src]))
            dst = [_devices_by_id()[i] for i in ready["placed"]]
            run = self._exchange_placed(tag, buffers, src, dst)
        if self._broken:  # the next program would queue behind the stuck one on the runner
            raise TransportError(f"{tag}: collective link unusable after {self._broken}")
        self._exchanges[tag] = self._runner.submit(run), deadline

    def _receive(self, arrival: Arrival, specs: list[jax.ShapeDtypeStruct],
                 wire: list[jax.ShapeDtypeStruct]) -> None:
        expected = [spec_of(s) for s in specs]
        self._verdicts.expect(arrival.tag)
        self._channel.put(f"{arrival.tag}/ready", self._ready(wire, expected))
        if self._broken:
            self._settle(arrival, error=TransportError(
                f"{arrival.tag}: collective link unusable after {self._broken}"))
            return
        self._runner.submit(self._take, arrival, specs, wire, expected)
        self._bound(arrival, self._runner, self._watchdog, self._stuck(arrival.tag))

    def _stuck(self, tag: str) -> Callable[[], None]:
        """A receive that did not complete leaves the link unusable (the next program would
        queue behind the stuck one)."""

        def broken() -> None:
            self._broken = self._broken or f"{tag} did not complete"

        return broken

    def _take(self, arrival: Arrival, specs: list[jax.ShapeDtypeStruct],
              wire: list[jax.ShapeDtypeStruct], expected: list) -> None:
        try:
            if not self._check_header(arrival, expected):
                return
            (*arrays, sums), got = self._pull(arrival.tag, wire)
            arrival.landed = time.monotonic()
            judged = (self._verify(arrival, arrays, sums, specs) if got is None else
                      self._judge(arrival, arrays, np.asarray(got).tolist(),
                                  np.asarray(sums).tolist(), specs))
            if not judged:  # the header matched
                self._settle(arrival, error=TransportError(
                    f"{arrival.tag}: the checksums' spec word is corrupted"))
        except TransportError as e:
            self._settle(arrival, error=e)
        except Exception as e:  # gloo/NCCL report a peer that died inside the program
            self._broken = f"{arrival.tag} failed"
            self._settle(arrival, error=TransportError(
                f"{arrival.tag}: collective failed (peer died?): {e}"))

    def _pull(self, tag: str, specs: list[jax.ShapeDtypeStruct]
              ) -> tuple[list[jax.Array], jax.Array | None]:
        """The decode side's program, run here (on the runner: `_receive`): the buffers (the
        checksums last) and, unpacked from one byte buffer, the checksums of the others."""
        if _placement(specs) is None:
            like = tuple((tuple(s.shape), jnp.dtype(s.dtype).name) for s in specs)
            flat = self._exchange(self._blank(jax.ShapeDtypeStruct((_nbytes(specs),), jnp.uint8)))
            return _unpacked(flat(), like)
        src = json.loads(self._channel.get(f"{tag}/src", _SRC_TIMEOUT_S))
        return self._exchange_placed(tag, specs, [_devices_by_id()[i] for i in src],
                                     [_device_of(s) for s in specs])(), None

    @staticmethod
    def _ready(specs: list[jax.ShapeDtypeStruct], expected: list) -> str:
        """The go-ahead: the specs the decode side expects; specs that name their devices
        (sharded sides) tell the sender where each buffer goes."""
        return json.dumps({"expect": expected, "placed": _placement(specs)})

    def _blank(self, spec: jax.ShapeDtypeStruct, device: jax.Device | None = None) -> jax.Array:
        device = device or self._device
        key = (tuple(spec.shape), jnp.dtype(spec.dtype), device)
        if key not in self._blanks:
            self._blanks[key] = jnp.zeros(spec.shape, spec.dtype, device=device)
        return self._blanks[key]

    def _exchange_placed(self, tag: str, local: list, src: list[jax.Device],
                         dst: list[jax.Device]) -> Callable[[], list[jax.Array]]:
        """Buffer j from device src[j] (prefill) to dst[j] (decode), all in one program over the
        devices involved: one ppermute per buffer, so the links between device pairs run in
        parallel and neither side gathers. `local` holds the buffers (prefill side) or their
        specs (decode side); the program, run, gives what landed on this process's devices."""
        devices = sorted(set(src) | set(dst), key=lambda d: d.id)
        perms = tuple((devices.index(s), devices.index(t)) for s, t in zip(src, dst, strict=True))
        key = (tuple(d.id for d in devices), perms)
        if key not in self._placed:
            mesh = Mesh(np.array(devices), ("d",))
            self._placed[key] = (NamedSharding(mesh, P("d")), jax.jit(jax.shard_map(
                lambda *xs: [jax.lax.ppermute(x, "d", [p]) for x, p in zip(xs, perms, strict=True)],
                mesh=mesh, in_specs=P("d"), out_specs=P("d"))))
        sharding, program = self._placed[key]
        mine = [d for d in devices if d.process_index == jax.process_index()]
        sending = self.role == "prefill"

        def run() -> list[jax.Array]:
            inputs = []
            for j, x in enumerate(local):
                block = jax.ShapeDtypeStruct((1, *x.shape), x.dtype)
                blocks = [x[None] if sending and d == src[j] else self._blank(block, d)
                          for d in mine]
                inputs.append(jax.make_array_from_single_device_arrays(
                    (len(devices), *x.shape), sharding, blocks))
            out = self._program_outputs(program(*inputs), dst)
            return jax.block_until_ready(out)

        return run

    @staticmethod
    def _program_outputs(outputs: list[jax.Array], dst: list[jax.Device]) -> list[jax.Array]:
        """Each buffer's block on its destination device (on the sending side: nothing)."""
        return [s.data[0] for o, d in zip(outputs, dst, strict=True)
                for s in o.addressable_shards if s.device == d]

    def _exchange(self, flat: jax.Array) -> Callable[[], jax.Array]:
        """The program on this side's byte buffer (`_packed`, or a blank one to receive into),
        which, run, gives this side's received bytes."""

        def run() -> jax.Array:
            block = jax.make_array_from_single_device_arrays((2 * flat.shape[0],),
                                                             self._sharding, [flat])
            return jax.block_until_ready(self._program(block).addressable_shards[0].data)

        return run

    def wait_ack(self, tag: str, timeout: float = 60.0) -> float:
        """Prefill side: wait for `tag`'s exchange to end (by its send's deadline), then for the
        decode side's verdict (`Endpoint.wait_ack`). A `timeout` that ends before the send's
        deadline leaves a running exchange running (TransportTimeout): a later wait goes on."""
        exchange = self._exchanges.get(tag)
        if exchange is not None:
            run, deadline = exchange
            if time.monotonic() + timeout < deadline:
                try:
                    wait_for(run, time.monotonic() + timeout, self._channel.peer_alive, tag)
                except TransportTimeout:
                    raise  # this wait's time is up, not the exchange's
                except Exception:  # the exchange failed: raised below, where it breaks the link
                    pass
            del self._exchanges[tag]
            self._exchanged(tag, run, deadline)
        return super().wait_ack(tag, timeout)

    def _acked(self, tag: str) -> None:
        self._exchanges.pop(tag, None)  # forgotten: its program runs on, unwaited

    def _exchanged(self, tag: str, run: concurrent.futures.Future, deadline: float) -> None:
        """Wait at most until `deadline` for a program started on the runner; one that did not
        end, or failed, leaves the link unusable."""
        try:
            wait_for(run, deadline, self._channel.peer_alive, tag)
        except TransportError:  # timed out or the peer died before joining: the worker is stuck
            self._broken = f"{tag} did not complete"
            raise
        except Exception as e:  # gloo/NCCL report a peer that died inside the program
            self._broken = f"{tag} failed"
            raise TransportError(f"{tag}: collective failed (peer died?): {e}") from e

    def _verdict(self, tag: str, verdict: str, settle: Callable[[], None]) -> None:
        self._verdicts.give(tag, verdict, settle)  # a handoff's "ok"s together (`verdicts`)

    def _close(self, timeout: float) -> None:
        self._exchanges.clear()
        self._runner.close()
        if self._watchdog is not None:
            self._watchdog.close()
        self._verdicts.flush()
        distributed.shutdown(self._channel, timeout)
