"""Tensor parallelism on one side's devices: the one place that maps logical axes to mesh axes.

A side's mesh has three axes, `("dp", "tp_kv", "tp_q")`: `dp` splits the batch; tensor
parallelism over `tp` devices is viewed as `tp_kv x tp_q` with `tp_kv = gcd(K, tp)`, so the KV
heads split over `tp_kv` and each KV shard is replicated over `tp_q` when there are fewer KV heads
than devices (the usual GQA layout). Attention heads, the MLP's hidden dimension and the vocabulary
split over both (`tp_kv` major), which keeps every query head on the devices of its KV head, so
attention needs no communication; the two contractions over sharded axes (`o_proj` over heads,
`down_proj` over the hidden dimension) end in one all-reduce each. Activations, `h_c` and norms
are replicated over `tp`. The KV `[L, B, S, K, H]` is sharded over `K` (`tp_kv`) and `B` (`dp`).

The model code is unchanged: params placed by `shard_params` and inputs on the same mesh are enough
for GSPMD (no sharding constraint was needed: on a fixed mesh the split is bitwise equal to a full
prefill, tested), and `jax.named_scope` labels each layer's attention and MLP.

Between the two sides (`MeshTransport`), every buffer moves as single-device pieces: a KV-shaped
buffer `[c, B, S, K, *]` (BF16 KV, or Q8/Q4 codes and scales, whose groups run along the last axis)
is cut along `K` at both sides' shard boundaries, so each piece goes from a prefill device that
holds it to a decode device that needs it and no side gathers the array; `h_c` `[B, S, D]` is cut
along `D` over all devices of both sides (parallel links) and the decode side replicates it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import threading
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rekv_jax import sizes
from rekv_jax.config import ModelConfig
from rekv_jax.kv import KVCache
from rekv_jax.model import Params, prefill, run_prefix, run_suffix

MESH_AXES = ("dp", "tp_kv", "tp_q")
TP = ("tp_kv", "tp_q")  # tensor parallelism: tp_kv major


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis -> mesh axes (None: replicated). The one mapping every placement uses."""

    batch: str | None = "dp"
    vocab: tuple[str, ...] | None = TP
    embed: str | None = None
    heads: tuple[str, ...] | None = TP
    kv_heads: str | None = "tp_kv"
    head_dim: str | None = None
    mlp: tuple[str, ...] | None = TP
    layers: str | None = None
    seq: str | None = None

    def spec(self, *logical: str | None) -> P:
        """PartitionSpec of an array whose axes have these logical names (None: replicated)."""
        return P(*(None if name is None else getattr(self, name) for name in logical))


RULES = ShardingRules()

# Logical axes of every parameter; `layers/` entries are those of each per-layer dict.
PARAM_AXES: dict[str, tuple[str, ...]] = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "final_norm/weight": ("embed",),
    "layers/input_norm/weight": ("embed",),
    "layers/post_attn_norm/weight": ("embed",),
    "layers/attn/q_proj": ("embed", "heads", "head_dim"),
    "layers/attn/k_proj": ("embed", "kv_heads", "head_dim"),
    "layers/attn/v_proj": ("embed", "kv_heads", "head_dim"),
    "layers/attn/o_proj": ("heads", "head_dim", "embed"),
    "layers/attn/q_bias": ("heads", "head_dim"),
    "layers/attn/k_bias": ("kv_heads", "head_dim"),
    "layers/attn/v_bias": ("kv_heads", "head_dim"),
    "layers/attn/q_norm/weight": ("head_dim",),
    "layers/attn/k_norm/weight": ("head_dim",),
    "layers/mlp/gate_proj": ("embed", "mlp"),
    "layers/mlp/up_proj": ("embed", "mlp"),
    "layers/mlp/down_proj": ("mlp", "embed"),
}
KV_AXES = ("layers", "batch", "seq", "kv_heads", "head_dim")  # [L, B, S, K, H]
KV_AXIS = 3  # K in [L, B, S, K, H]: the axis the KV is sharded over


def make_mesh(cfg: ModelConfig, devices: int | Sequence[jax.Device], dp: int = 1) -> Mesh:
    """A side's mesh: `dp x tp` devices (`devices` a count of local devices, or the devices)."""
    if isinstance(devices, int):
        if devices > jax.local_device_count():
            raise ValueError(f"a side of {devices} devices needs {devices} local devices, this "
                             f"process has {jax.local_device_count()}")
        devices = jax.local_devices()[:devices]
    devices = list(devices)
    if len(devices) % dp:
        raise ValueError(f"{len(devices)} devices do not split into dp={dp}")
    tp = len(devices) // dp
    for name, size in [("attention heads", cfg.num_heads), ("MLP width", cfg.intermediate_size)]:
        if size % tp:
            raise ValueError(f"{cfg.name}: {name} {size} do not split over tp={tp} devices")
    tp_kv = sizes.kv_shards(cfg, tp)
    return Mesh(np.array(devices).reshape(dp, tp_kv, tp // tp_kv), MESH_AXES)


def _fits(spec: P, shape: tuple[int, ...], mesh: Mesh) -> P:
    """`spec` with the mesh axes dropped from dims they do not divide (e.g. an odd vocabulary)."""
    def size(axes) -> int:
        axes = (axes,) if isinstance(axes, str) else axes or ()
        return math.prod(mesh.shape[a] for a in axes)
    return P(*(axes if dim % size(axes) == 0 else None
               for axes, dim in zip(spec, shape, strict=True)))


def named(mesh: Mesh, shape: tuple[int, ...], *logical: str | None,
          rules: ShardingRules = RULES) -> NamedSharding:
    """The NamedSharding of an array of `shape` whose axes have these logical names."""
    return NamedSharding(mesh, _fits(rules.spec(*logical), shape, mesh))


def shard_params(cfg: ModelConfig, params: Params, mesh: Mesh, rules: ShardingRules = RULES
                 ) -> Params:
    """Place every parameter on `mesh` by its logical axes (`PARAM_AXES`, `rules`). An array
    shared by several layers (`init_params(repeat_layers=True)`) is placed once and stays shared."""
    placed: dict[int, jax.Array] = {}

    def place(path, x):
        if id(x) not in placed:
            name = re.sub(r"^layers/\d+/", "layers/",
                          jax.tree_util.keystr(path, simple=True, separator="/"))
            placed[id(x)] = jax.device_put(x, named(mesh, x.shape, *PARAM_AXES[name],
                                                    rules=rules))
        return placed[id(x)]
    return jax.tree_util.tree_map_with_path(place, params)


def kv_sharding(mesh: Mesh, shape: tuple[int, ...], rules: ShardingRules = RULES
                ) -> NamedSharding:
    """The KV `[L, B, S, K, H]` on `mesh`: split over K (and B over dp)."""
    return named(mesh, shape, *KV_AXES, rules=rules)


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array (token ids, `h_c` on the decode side)."""
    return NamedSharding(mesh, P())


def force_host_devices(n: int) -> None:
    """Ask XLA for `n` CPU devices in this process (before JAX starts its backends; on GPU the
    flag only affects the unused CPU platform). One process of a handoff pair calls it per side."""
    if n <= 1:
        return
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count=")]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={n}"])


# ---------------------------------------------------------------------------- between two meshes


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


class MeshTransport:
    """A transport whose two sides are meshes of `prefill_devices` and `decode_devices` (each from
    `make_mesh`, data parallelism 1): `send`/`recv` move every buffer as pieces (`split`, then
    `assemble` in the decode mesh's sharding); everything else is the wrapped transport's.

    By shape: a `[c, B, S, K, *]` buffer is cut along K at both sides' KV-shard boundaries and
    arrives sharded over K; `h_c` `[B, S, D]` is cut along D into lcm(N, M) pieces and arrives
    replicated; token ids and the first token cross whole and arrive replicated."""

    def __init__(self, transport, cfg: ModelConfig, prefill_devices: int, decode_devices: int
                 ) -> None:
        self._transport = transport
        self._devices = (prefill_devices, decode_devices)
        self._kv_pieces = math.lcm(*(sizes.kv_shards(cfg, n) for n in self._devices))
        self.mesh = make_mesh(cfg, self._devices[transport.role == "decode"])

    def _transit(self, shape: tuple[int, ...]) -> Transit:
        if len(shape) == 5:
            return Transit(KV_AXIS, self._kv_pieces)
        if len(shape) == 3:
            return Transit(2, math.lcm(*self._devices))
        return Transit(None)

    def _target(self, shape: tuple[int, ...]) -> NamedSharding:
        return kv_sharding(self.mesh, shape) if len(shape) == 5 else replicated(self.mesh)

    def send(self, tag: str, arrays: Sequence[jax.Array], timeout: float = 60.0) -> None:
        """Prefill side: send the pieces of every buffer (see `Transport.send`)."""
        pieces = [p for a in arrays for p in split(a, self._transit(a.shape))]
        self._transport.send(tag, pieces, timeout)

    def recv(self, tag: str, specs: Sequence[jax.ShapeDtypeStruct], timeout: float = 60.0,
             paced_after: threading.Event | None = None) -> list[jax.Array]:
        """Decode side: the buffers of `tag` on the decode mesh (see `Transport.recv`)."""
        plan = [(s, self._transit(s.shape), self._target(s.shape)) for s in specs]
        wanted = [piece_specs(s, t, target) for s, t, target in plan]
        got = iter(self._transport.recv(tag, [p for ps in wanted for p in ps], timeout,
                                        paced_after))
        return [assemble([next(got) for _ in ps], s, t, target)
                for (s, t, target), ps in zip(plan, wanted, strict=True)]

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


def split_reference(cfg: ModelConfig, params: Params, tokens: jax.Array, cut: int,
                    prefill_devices: int, decode_devices: int) -> tuple[KVCache, jax.Array]:
    """What a handoff at `cut` between sharded sides must produce, computed in this process
    (which needs max(N, M) devices): the prefix and `h_c` on a prefill mesh, the suffix from that
    `h_c` on a decode mesh (`c = 0`: a full prefill on the decode mesh; `c = L`: the first token's
    logits from the prefill mesh). Returns the cache `[L, B, S, K, H]` and logits `[B, V]`."""
    meshes = [make_mesh(cfg, n) for n in (prefill_devices, decode_devices)]
    prefill_mesh, decode_mesh = meshes
    if cut == 0:
        return prefill(cfg, shard_params(cfg, params, decode_mesh), tokens)
    h_c, prefix = run_prefix(cfg, shard_params(cfg, params, prefill_mesh), tokens, cut)
    mesh = prefill_mesh if cut == cfg.num_layers else decode_mesh
    suffix, logits = run_suffix(cfg, shard_params(cfg, params, mesh),
                                jax.device_put(h_c, replicated(mesh)), cut)
    host = [KVCache(*(tuple(map(np.asarray, xs)) for xs in (kv.keys, kv.values)), kv.empty)
            for kv in (prefix, suffix)]
    return KVCache.concat(*host), np.asarray(logits)
