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
import re
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rekv_jax import sizes
from rekv_jax.config import ModelConfig

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
KV_LAYER_AXIS = KV_AXIS - 1  # K in one layer's [B, S, K, *]


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


def shard_params(cfg: ModelConfig, params: dict, mesh: Mesh, rules: ShardingRules = RULES
                 ) -> dict:  # model.Params
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


def kv_layer_sharding(mesh: Mesh, shape: tuple[int, ...], rules: ShardingRules = RULES
                      ) -> NamedSharding:
    """One layer's KV `[B, S, K, *]` (values, or codes and scales) on `mesh`: split over K."""
    return named(mesh, shape, *KV_AXES[1:], rules=rules)


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array (token ids, `h_c` on the decode side)."""
    return NamedSharding(mesh, P())
