"""What held of a handoff's cache against a single-process reference (`check_cache`)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from rekv_jax.action import PAPER, Action
from rekv_jax.config import ModelConfig
from rekv_jax.handoff.outcome import Handoff
from rekv_jax.handoff.prefix_format import KeyBias, key_error_bound
from rekv_jax.kv import KVCache
from rekv_jax.mode import Reference
from rekv_jax.model.transformer import Params, prefill, run_prefix, run_suffix
from rekv_jax.quantize import error_bound
from rekv_jax.sharding import make_mesh, replicated, shard_params

# what `check_cache` adds when the recomputed suffix's checksums equal the prefill process's
SUFFIX_ACROSS = ", suffix checksum = the prefill process's"


def reference(cfg: ModelConfig, params: Params, tokens: jax.Array, ref: Reference, cut: int
              ) -> tuple[KVCache, jax.Array]:
    """The single-process cache [L, B, S, K, H] and last logits [B, V] a handoff at `cut` must
    equal (a Q8/Q4 prefix within its error bound), as `ref` (`Mode.reference`) computes it."""
    if ref.split_at_cut:
        h_c, prefix = run_prefix(cfg, params, tokens, cut)
        suffix, logits = run_suffix(cfg, params, h_c, cut, chunks=ref.chunks)
        return KVCache.concat(prefix, suffix), logits
    return prefill(cfg, params, tokens, ref.chunks)


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


class HostReference:
    """A single-process `prefill` cache as `check_cache` compares with it, on the host: each
    layer range stacked, and a Q8/Q4 prefix's error bound, computed once each (a sweep checks
    thousands of reps against one reference). A debiased prefix's bound needs the model's k_proj
    bias (`KeyBias.of`)."""

    def __init__(self, cache: KVCache, key_bias: KeyBias | None = None) -> None:
        self.num_layers = cache.num_layers
        self._cache = cache
        self._key_bias = key_bias
        self._memo: dict[tuple[int, int, int | None, str], tuple[Expected, Expected]] = {}

    def layers(self, start: int, stop: int, bits: int | None = None, fmt: str = PAPER
               ) -> tuple[Expected, Expected]:
        """What the keys and values of layers `start..stop-1` must be: bitwise these (`bits`
        None), or within the error bound of a `bits` round trip in prefix format `fmt`."""
        key = (start, stop, bits, fmt)
        if key not in self._memo:
            k, v = self._cache.layers(start, stop).on_host()
            if bits is None:
                self._memo[key] = Expected.of(k), Expected.of(v)
            else:
                bound = key_error_bound(k, bits, fmt, k.dtype, self._key_bias, layer=start)
                self._memo[key] = (Expected.of(k, bound),
                                   Expected.of(v, error_bound(v, bits, v.dtype)))
        return self._memo[key]


@dataclasses.dataclass(frozen=True)
class Expected:
    """Reference values of a layer range `[n, B, S, K, H]`, in float64 (exact for the cache's
    float dtypes), their dtype, and the largest |got - want| allowed per element
    (`quantize.error_bound`, computed from the reference alone; None: equal)."""

    want: np.ndarray
    dtype: np.dtype
    bound: np.ndarray | None = None

    @staticmethod
    def of(want: np.ndarray, bound: np.ndarray | None = None) -> Expected:
        return Expected(want.astype(np.float64), want.dtype, bound)

    def holds(self, layers: tuple[jax.Array, ...]) -> bool:
        """Each of `layers` (`[B, S, K, H]`, one a layer) has the reference's shape and dtype,
        and equals it (compared in float64: the same values as in its own dtype, faster for
        bfloat16) or lies within the bound."""
        if len(layers) != len(self.want):
            return False
        for i, x in enumerate(layers):
            x = np.asarray(x)
            if x.shape != self.want.shape[1:] or x.dtype != self.dtype:
                return False
            x = x.astype(np.float64)
            if not (np.array_equal(x, self.want[i]) if self.bound is None
                    else np.all(np.abs(x - self.want[i]) <= self.bound[i])):
                return False
        return True


def check_cache(reference: KVCache | HostReference, action: Action, result: Handoff,
                name: str = "") -> str:
    """What held of the handoff's cache against a single-process `prefill` cache (a
    `HostReference` of it, where many handoffs are checked against one), or the chunked
    reference `name`d (e.g. `run_suffix(chunks=4)`), which the text names.

    BF16 prefixes and every recomputed suffix must be bitwise equal to the prefill's; a Q8/Q4
    prefix must lie, element by element, within its format's error bound
    (`quantize.error_bound`, `prefix_format.key_error_bound`) of the prefill's prefix, computed
    from the prefill's KV (and the k_proj bias) alone, not through `pack_prefix`/`unpack_prefix`,
    so the check is independent of the code it checks.
    Where the prefill process sent its own suffix's checksums, they must equal the recomputed
    suffix's (`Handoff.suffix_match`): the same bits in both processes, checked on every rep.
    """
    if isinstance(reference, KVCache):
        reference = HostReference(reference)
    c, L = (0 if result.fallback else action.cut), reference.num_layers
    bounded = c > 0 and action.bits != 16
    parts = [("prefix", result.kv.layers(0, c),
              reference.layers(0, c, action.bits if bounded else None, action.format)),
             ("suffix", result.kv.layers(c, L), reference.layers(c, L))]
    failed = [part for part, got, (want_k, want_v) in parts
              if not (want_k.holds(got.keys) and want_v.holds(got.values))]
    failed += ["the prefill process's suffix checksum"] * (result.suffix_match is False)
    if failed:
        return f"MISMATCH in {' and '.join(failed)}"
    across = SUFFIX_ACROSS * bool(result.suffix_match)
    versus = f" vs {name}" if name else ""
    if not bounded:
        return "bitwise" + versus + across
    fmt = f"/{action.format}" if action.format != PAPER else ""
    return (f"suffix bitwise{versus}, prefix within the {action.precision}{fmt} error bound"
            + across)
