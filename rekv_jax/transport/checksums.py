"""Checksums of the buffers a transport moves: one uint32 per buffer, computed where the buffer
lives, and the sender's checksums travelling as one more buffer beside the data, ended by a word
of the buffers' specs (see `rekv_jax.transport.base` for the protocol).

On an accelerator a jitted program sums the buffers on their device. Buffers on CPU devices are
host memory, so numpy sums them in place (the same sums, bit for bit): a program would be
compiled per list of buffer shapes, one per phase, cut and precision of a study, where numpy
compiles nothing and sums as fast. A transport whose own program holds the buffers anyway (the
collective's unpack, compiled per list of shapes already) sums them there
(`checksums_in_program`)."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def _checksum(x: jax.Array) -> jax.Array:
    """Position-weighted sum of the buffer's 32-bit words, `sum_i w_i * (2i + 1) mod 2**32`.

    The weights are odd, so any change of one byte (or one word) always changes the sum; weights
    differ per position, so reordered words are caught too (barring rare coincidences)."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    b = jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)  # [bytes]
    b = jnp.pad(b, (0, -b.size % 4))
    w = jax.lax.bitcast_convert_type(b.reshape(-1, 4), jnp.uint32)  # [words]
    i = jax.lax.iota(jnp.uint32, w.size)
    return jnp.sum(w * (2 * i + 1), dtype=jnp.uint32)


def _words(x: np.ndarray) -> np.ndarray:
    """A host buffer's bytes as little-endian 32-bit words, the last zero-padded as on the
    device (a view where no padding is needed)."""
    b = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
    if b.size % 4:
        b = np.concatenate([b, np.zeros(-b.size % 4, np.uint8)])
    return b.view("<u4")


_odd = np.ones(0, np.uint32)  # 2i + 1 for i < its size, grown as needed (shared, read-only)


def _odd_weights(n: int) -> np.ndarray:
    """`2i + 1` for i < n, as uint32 (wrapping as on the device)."""
    global _odd
    if _odd.size < n:
        _odd = np.arange(n, dtype=np.uint32) * np.uint32(2) + np.uint32(1)
    return _odd[:n]


def _on_host(arrays: Sequence[jax.Array]) -> bool:
    return all(d.platform == "cpu" for a in arrays for d in a.devices())


def _host_checksums(arrays: Sequence[jax.Array | np.ndarray]) -> list[int]:
    """`_checksum` of each buffer in host memory (the weights are shared, not made per call)."""
    out = []
    for a in arrays:
        w = _words(np.asarray(a))
        out.append(int(np.add.reduce(w * _odd_weights(w.size), dtype=np.uint32)))
    return out


def checksums_in_program(arrays: Sequence[jax.Array]) -> jax.Array:
    """The checksums of buffers, [n] uint32, traced: for a program that holds the buffers
    anyway (the sums then cost no dispatch and no host work)."""
    return jnp.stack([_checksum(x) for x in arrays])


_checksum_one = jax.jit(_checksum)  # one program per buffer shape, whatever the count


@jax.jit  # one program per list of buffer specs: one dispatch where a transfer is timed
def _checksums_device(arrays: list[jax.Array]) -> jax.Array:
    return checksums_in_program(arrays)  # [n] uint32


@functools.partial(jax.jit, static_argnums=1)  # the word follows from the shapes: no new programs
def _checksums_and_word(arrays: list[jax.Array], word: int) -> jax.Array:
    return jnp.append(checksums_in_program(arrays), jnp.uint32(word))  # [n + 1] uint32


def spec_word(header: str) -> int:
    """A uint32 word of a phase's header (its buffers' specs as JSON), sent at the end of the
    checksums buffer: equal words mean equal specs, barring a 2**-32 coincidence."""
    return int.from_bytes(hashlib.blake2b(header.encode(), digest_size=4).digest(), "big")


def checksums(arrays: Sequence[jax.Array]) -> list[int]:
    """One uint32 checksum per buffer, computed where it lives: one program per buffer shape (a
    cache's layers share one, whatever the cut), the sums fetched together."""
    if _on_host(arrays):
        return _host_checksums(arrays)
    return [int(s) for s in jax.device_get([_checksum_one(a) for a in arrays])]


def _checksums_dispatch(arrays: list[jax.Array]
                        ) -> list[tuple[list[int], jax.Array | np.ndarray]]:
    """Start one jitted checksum call per device holding some of the buffers (one call when they
    share a device, as on a single-device side): (buffer indices, their checksums). In host
    memory: the sums themselves, computed here."""
    if _on_host(arrays):
        return [(list(range(len(arrays))), np.asarray(_host_checksums(arrays), np.uint32))]
    groups: dict[frozenset, list[int]] = {}
    for i, a in enumerate(arrays):
        groups.setdefault(frozenset(a.devices()), []).append(i)
    return [(idx, _checksums_device([arrays[i] for i in idx])) for idx in groups.values()]


def _checksums_collect(pending: list[tuple[list[int], jax.Array | np.ndarray]]
                       ) -> list[int]:
    sums = {i: s for idx, device_sums in pending
            for i, s in zip(idx, np.asarray(device_sums).tolist(), strict=True)}
    return [sums[i] for i in range(len(sums))]


def _first_device(x: jax.Array | jax.sharding.Sharding) -> jax.Device:
    devices = x.devices() if isinstance(x, jax.Array) else x.device_set
    return min(devices, key=lambda d: d.id)


def checksums_buffer(arrays: list[jax.Array], word: int) -> jax.Array:
    """Sender: the buffers' checksums, then `word` (`spec_word`), as one uint32 [n + 1] array on
    the first buffer's device, dispatched (not waited for; in host memory: computed here)."""
    if _on_host(arrays):
        sums = np.asarray([*_host_checksums(arrays), word], np.uint32)
        return jax.device_put(sums, _first_device(arrays[0]))
    if len({frozenset(a.devices()) for a in arrays}) == 1:  # one program for all
        return _checksums_and_word(arrays, word)
    device = _first_device(arrays[0])
    sums = [jax.device_put(_checksum_one(a), device) for a in arrays]
    return jnp.stack([*sums, jax.device_put(np.uint32(word), device)])  # [n + 1] uint32


def checksums_spec(specs: Sequence[jax.ShapeDtypeStruct]) -> jax.ShapeDtypeStruct:
    """Receiver: the spec of the checksums buffer that comes with `specs` (on the first buffer's
    device where the specs name devices)."""
    sharding = specs[0].sharding
    return jax.ShapeDtypeStruct((len(specs) + 1,), jnp.uint32, sharding=None if sharding is None
                                else jax.sharding.SingleDeviceSharding(_first_device(sharding)))


Dispatched = tuple[list[list[int]], list[jax.Array]]  # buffer indices per device, checksums


def verdict_dispatch(arrays: Sequence[jax.Array], sent: jax.Array) -> Dispatched:
    """Receiver: start checksumming received buffers (queued behind them if they are still
    landing); `verdict_collect` waits for the result."""
    pending = _checksums_dispatch(list(arrays))
    return [idx for idx, _ in pending], [sums for _, sums in pending] + [sent]


def verdict_collect(dispatched: Dispatched) -> tuple[list[int], list[int]]:
    """(the checksums computed here, the checksums sent with the buffers), fetched to the host
    in one transfer (in host memory: read in place, which costs less than that transfer)."""
    groups, device_sums = dispatched
    arrays = [x for x in device_sums if isinstance(x, jax.Array)]
    fetched = ([np.asarray(x) for x in device_sums] if _on_host(arrays) else
               jax.device_get(device_sums))
    *got, want = fetched
    return (_checksums_collect(list(zip(groups, got, strict=True))),
            np.asarray(want).tolist())
