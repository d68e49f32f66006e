"""Per-shard transfers between two meshes: a transport whose sides are meshes (`MeshTransport`), and
the split/assemble of each buffer."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from rekv_jax import sizes
from rekv_jax.config import ModelConfig
from rekv_jax.sharding import KV_LAYER_AXIS, kv_layer_sharding, make_mesh, replicated
from rekv_jax.transport.base import Arrival, Transport, Wrapper


@dataclasses.dataclass(frozen=True)
class Transit:
    """How one buffer crosses: cut into `pieces` equal pieces along `axis` (None: whole)."""

    axis: int | None
    pieces: int = 1

    def ranges(self, shape: tuple[int, ...]) -> list[slice]:
        """Piece j's range along `axis`."""
        if self.axis is None:
            return [slice(None)]
        dim = shape[self.axis]
        if dim % self.pieces:
            raise ValueError(f"axis {self.axis} of {shape} does not split into {self.pieces}")
        w = dim // self.pieces
        return [slice(j * w, (j + 1) * w) for j in range(self.pieces)]

    def index(self, ndim: int, r: slice) -> tuple[slice, ...]:
        return tuple(r if a == self.axis else slice(None) for a in range(ndim))


def _holders(sharding: jax.sharding.Sharding, shape: tuple[int, ...], transit: Transit
             ) -> list[list[tuple[jax.Device, int]]]:
    """Per piece, the devices holding all of it and the piece's offset in their block."""
    def full(i: slice, d: int) -> bool:
        return i.indices(d)[:2] == (0, d)

    out = []
    for r in transit.ranges(shape):
        found = []
        for device, index in sharding.devices_indices_map(shape).items():
            others = [(i, d) for a, (i, d) in enumerate(zip(index, shape, strict=True))
                      if a != transit.axis]
            if not all(full(i, d) for i, d in others):
                continue
            if transit.axis is None:
                found.append((device, 0))
                continue
            start, stop, _ = index[transit.axis].indices(shape[transit.axis])
            if start <= r.start and r.stop <= stop:
                found.append((device, r.start - start))
        out.append(found)
    return out


def _balanced(holders: list[list[tuple[jax.Device, int]]]) -> list[tuple[jax.Device, int]]:
    """One holder per piece, least loaded first, so the pieces use as many links as they can."""
    load: dict[jax.Device, int] = {}
    picks = []
    for found in holders:
        device, offset = min(found, key=lambda h: load.get(h[0], 0))
        load[device] = load.get(device, 0) + 1
        picks.append((device, offset))
    return picks


def split(x: jax.Array, transit: Transit) -> list[jax.Array]:
    """Sender: the pieces of `x`, each sliced from a device that holds it (no gather)."""
    shards = {s.device: s.data for s in x.addressable_shards}
    pieces = []
    for (device, offset), r in zip(_balanced(_holders(x.sharding, x.shape, transit)),
                                   transit.ranges(x.shape), strict=True):
        local = shards[device]
        if transit.axis is not None:
            w = r.stop - r.start
            local = jax.lax.slice_in_dim(local, offset, offset + w, axis=transit.axis)
        pieces.append(local)
    return pieces


def piece_specs(spec: jax.ShapeDtypeStruct, transit: Transit, target: NamedSharding
                ) -> list[jax.ShapeDtypeStruct]:
    """Receiver: each piece's shape and the device of `target` it lands on."""
    picks = _balanced(_holders(target, spec.shape, transit))
    out = []
    for (device, _), r in zip(picks, transit.ranges(spec.shape), strict=True):
        shape = list(spec.shape)
        if transit.axis is not None:
            shape[transit.axis] = r.stop - r.start
        out.append(jax.ShapeDtypeStruct(tuple(shape), spec.dtype,
                                        sharding=jax.sharding.SingleDeviceSharding(device)))
    return out


def assemble(pieces: list[jax.Array], spec: jax.ShapeDtypeStruct, transit: Transit,
             target: NamedSharding) -> jax.Array:
    """Receiver: the global array in `target` from its pieces; a device needing a piece that
    landed on another device of this side (a replica) gets a local copy."""
    ranges = transit.ranges(spec.shape)
    blocks = []
    for device, index in target.addressable_devices_indices_map(spec.shape).items():
        if transit.axis is None:
            parts = pieces
        else:
            start, stop, _ = index[transit.axis].indices(spec.shape[transit.axis])
            parts = [p for p, r in zip(pieces, ranges, strict=True)
                     if start <= r.start and r.stop <= stop]
        parts = [p if p.devices() == {device} else jax.device_put(p, device) for p in parts]
        blocks.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts, transit.axis))
    return jax.make_array_from_single_device_arrays(spec.shape, target, blocks)


class Layout(enum.Enum):
    """How a handoff buffer lies on a side's mesh, by what it is (`layout_of`)."""

    KV_LAYER = "kv"  # one layer's K or V `[B, T, K, *]` (values, codes or scales): split over K
    HIDDEN = "hidden"  # h_c `[B, T, D]`: replicated, crossing as lcm(N, M) pieces along D
    WHOLE = "whole"  # token ids [B, S], the first token [B]: replicated, crossing whole


def layout_of(shape: tuple[int, ...]) -> Layout:
    """The layout of a handoff buffer: the payload's formats fix one rank per kind (a KV layer
    4, h_c 3, ids and first token fewer)."""
    return {4: Layout.KV_LAYER, 3: Layout.HIDDEN}.get(len(shape), Layout.WHOLE)


class MeshTransport(Wrapper):
    """A `Transport` whose two sides are meshes of `prefill_devices` and `decode_devices` (each
    from `make_mesh`, data parallelism 1), over `transport` (one process per side): `send` and
    `recv` move every buffer as pieces (`split`, then `assemble` in the decode mesh's layout), so
    no side gathers; everything else is the wrapped transport's."""

    def __init__(self, transport: Transport, cfg: ModelConfig, prefill_devices: int,
                 decode_devices: int) -> None:
        super().__init__(transport)
        self._devices = (prefill_devices, decode_devices)
        self._kv_pieces = math.lcm(*(sizes.kv_shards(cfg, n) for n in self._devices))
        self.mesh = make_mesh(cfg, self._devices[transport.role == "decode"])

    def _transit(self, shape: tuple[int, ...]) -> Transit:
        return {Layout.KV_LAYER: Transit(KV_LAYER_AXIS, self._kv_pieces),
                Layout.HIDDEN: Transit(2, math.lcm(*self._devices)),
                Layout.WHOLE: Transit(None)}[layout_of(shape)]

    def _target(self, shape: tuple[int, ...]) -> NamedSharding:
        if layout_of(shape) == Layout.KV_LAYER:
            return kv_layer_sharding(self.mesh, shape)
        return replicated(self.mesh)

    def send(self, tag: str, arrays: Sequence[jax.Array], timeout: float = 60.0) -> None:
        """Prefill side: send the pieces of every buffer (see `Transport.send`)."""
        pieces = [p for a in arrays for p in split(a, self._transit(a.shape))]
        self._transport.send(tag, pieces, timeout)

    def recv(self, tag: str, specs: Sequence[jax.ShapeDtypeStruct], timeout: float = 60.0
             ) -> Arrival:
        """Decode side: the buffers of `tag` on the decode mesh (see `Transport.recv`)."""
        plan = [(s, self._transit(s.shape), self._target(s.shape)) for s in specs]
        wanted = [piece_specs(s, t, target) for s, t, target in plan]
        inner = self._transport.recv(tag, [p for ps in wanted for p in ps], timeout)
        arrival = Arrival(tag, inner.nbytes, inner.deadline)

        def assembled(done: Arrival) -> None:  # on the thread that settled the pieces
            arrival.landed = done.landed
            if done.exception() is not None:
                arrival.set_exception(done.exception())
                return
            got = iter(done.result())
            arrival.set_result([assemble([next(got) for _ in ps], s, t, target)
                                for (s, t, target), ps in zip(plan, wanted, strict=True)])

        inner.add_done_callback(assembled)
        return arrival
