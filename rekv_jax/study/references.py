"""What the decode side of `rekv handoff` checks each timed rep against: the single-process
reference cache and first token of its mode (computed once per reference and cut, kept on the
host), and the same suffix run alone right after the rep (its fidelity)."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from rekv_jax.config import ModelConfig
from rekv_jax.handoff.check import HostReference, check_cache, reference, split_reference
from rekv_jax.handoff.outcome import Handoff
from rekv_jax.handoff.prefix_format import KeyBias
from rekv_jax.mode import Mode, Reference
from rekv_jax.model.transformer import Params, prefill, run_prefix, run_suffix
from rekv_jax.study.records import Fidelity, Rep
from rekv_jax.transport import cores


class References:
    """The single-process caches and first tokens a handoff is checked against (`Mode.reference`
    at its cut), each computed once and kept on the host with its error bounds (`HostReference`);
    between sharded sides, the same split in this process (`split_reference`: bits differ across
    meshes). Also what a rep's suffix costs alone (`fidelity`)."""

    def __init__(self, cfg: ModelConfig, params: Params, tokens: jax.Array,
                 devices: tuple[int, int], first: Reference | None) -> None:
        """`devices`: (prefill, decode) devices per side; `first`: the first mode's reference."""
        self._cfg, self._params, self._tokens = cfg, params, tokens
        self._devices = devices
        self._sharded = self._devices != (1, 1)
        self._cache: dict[tuple, tuple[HostReference, np.ndarray, str]] = {}
        self._boundaries: dict[int, jax.Array] = {}  # h_c [B, S, D] per cut (`fidelity`)
        if not self._sharded and first is not None:  # compile the model's programs now,
            self._reference(first, 0)  # beside the prefill side's

    def _reference(self, ref: Reference, cut: int) -> tuple[HostReference, np.ndarray, str]:
        """(the reference cache `ref` at `cut`, its first token, its name), once."""
        # one (chunked) prefill serves every cut of one-device sides
        key = (cut if self._sharded or ref.split_at_cut else -1, ref)
        if key not in self._cache:
            args = self._cfg, self._params, self._tokens
            cache, logits = (split_reference(*args, cut, *self._devices) if self._sharded
                             else reference(*args, ref, cut))
            self._cache[key] = (HostReference(cache, KeyBias.of(self._cfg, self._params)),
                                np.asarray(jnp.argmax(logits, axis=-1)), ref.name)
        return self._cache[key]

    def rep(self, mode: Mode, rep: int, result: Handoff, serialized: bool,
            use: cores.CoreUse | None) -> Rep:
        """The record of timed rep `rep`: its checks (`check`) and its `fidelity`."""
        first_ok, cache_check = self.check(mode, result)
        return Rep(mode.action, mode.schedule_text, rep, result.total_ms, result.phases_ms,
                   result.fallback, result.timeline_ms, result.sent_bytes, first_ok, cache_check,
                   serialized, mode.chunks,
                   self.fidelity(mode, result, use))

    def fidelity(self, mode: Mode, result: Handoff, use: cores.CoreUse | None
                 ) -> Fidelity | None:
        """The handoff's suffix phase beside the same layers run alone here, now (one-device
        sides; None where nothing was recomputed)."""
        suffix_ms, cut = result.phases_ms.suffix, mode.action.cut
        if self._sharded or suffix_ms <= 0:
            return None
        args = self._cfg, self._params
        if result.fallback or not cut:  # the whole prompt from its ids
            run = functools.partial(prefill, *args, self._tokens,
                                    1 if result.fallback else mode.suffix_chunks)
        else:
            if cut not in self._boundaries:
                self._boundaries[cut] = run_prefix(*args, self._tokens, cut)[0]
            run = functools.partial(run_suffix, *args, self._boundaries[cut], cut,
                                    chunks=mode.suffix_chunks)
        start = time.perf_counter()
        jax.block_until_ready(run())
        alone_ms = 1e3 * (time.perf_counter() - start)
        return Fidelity(alone_ms, suffix_ms / alone_ms, use and use.device_wait_ms,
                        use and use.host_ms)

    def check(self, mode: Mode, result: Handoff) -> tuple[bool, str]:
        """(first token matches, what held of the cache: `check_cache`, plus for sharded sides
        what the cache was compared with)."""
        # a fallback rebuilt the cache from the ids: a plain prefill
        ref, cut = (Reference(), 0) if result.fallback else (mode.reference, mode.action.cut)
        reference_cache, first, name = self._reference(ref, cut)
        text = check_cache(reference_cache, mode.action, result, name)
        if self._sharded:
            text += _reference_text(self._cfg, cut, *self._devices)
        return bool(np.array_equal(result.first_token, first)), text


def _reference_text(cfg: ModelConfig, cut: int, prefill_devices: int, decode_devices: int
                    ) -> str:
    """What the sharded sides' cache was compared with (see `split_reference`)."""
    if cut == 0:
        return f" to a prefill on {decode_devices} devices"
    if cut == cfg.num_layers:
        return f" to a prefill on {prefill_devices} devices"
    return f" to a prefix on {prefill_devices} devices and a suffix on {decode_devices}"
