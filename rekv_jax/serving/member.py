"""What each process of a serving group runs (`launch.group.Group`'s job), built from one
record, `MemberSetup`: a decode member is a `DecodeEngine` over its links to every prefill
member; a prefill member is a `PrefillWorker` over its links to every decode member. Each opens
its links first (before any other JAX work: they join jax.distributed; only the persistent
compilation cache is turned on before them, `compile_cache`), loads the model, agrees
the runtime with each peer, warms what it can, tells the router it is `Ready`, then serves what
the router sends until the group closes.
"""

from __future__ import annotations

import dataclasses
import signal

import jax.numpy as jnp

from rekv_jax.compile_cache import use_compile_cache
from rekv_jax.launch.child import Member
from rekv_jax.launch.runtime import agree_runtime
from rekv_jax.mode import Fallback
from rekv_jax.model.layers import ROW_BLOCK
from rekv_jax.model.loader import LoadedModel, load_model
from rekv_jax.model.transformer import attention_backend
from rekv_jax.serving.engine import SUFFIX_BUDGET, DecodeEngine, EngineConfig
from rekv_jax.serving.pages import PoolConfig
from rekv_jax.serving.prefill_worker import PrefillWorker
from rekv_jax.serving.requests import Ready

COST_BATCHES = (1, ROW_BLOCK, 2 * ROW_BLOCK)  # the batch sizes a decode member times
TIMEOUT_S = 120.0  # seconds any wait of a serving run may take, unless told otherwise


@dataclasses.dataclass(frozen=True)
class MemberSetup:
    """What every member of a serving group runs with."""

    model: str  # a preset, a trained-model folder or hf:PATH (`load_model`)
    pool: PoolConfig  # each decode member's page pool
    dtype: str = "bfloat16"
    transport: str = "transfer-server"
    link_gbps: float | None = None  # None: unpaced
    fallback: str = Fallback.ERROR
    suffix_budget: int | None = SUFFIX_BUDGET
    timeout: float = TIMEOUT_S  # seconds any wait may take
    cost_position: int = 511  # where the timed decode steps' rows are (a typical length)
    check: bool = False  # check every request's paged cache (tests)

    def engine_config(self, worker: int = 0) -> EngineConfig:
        """How decode worker `worker` runs."""
        return EngineConfig(self.pool, self.suffix_budget, self.fallback, self.timeout,
                            check=self.check, worker=worker)

    def load(self) -> LoadedModel:
        return load_model(self.model, dtype=jnp.dtype(self.dtype), orbax=False)


def cost_batches(setup: MemberSetup) -> tuple[int, ...]:
    """The `COST_BATCHES` whose rows the pool holds at once at `cost_position` (at least 1)."""
    pages = setup.pool.pages_for(setup.cost_position + 1)
    fit = tuple(b for b in COST_BATCHES if b * pages <= setup.pool.usable_pages)
    if not fit:
        raise ValueError(f"a pool of {setup.pool.usable_pages} usable pages holds no request "
                         f"at position {setup.cost_position}")
    return fit


def serving_member(member: Member, setup: MemberSetup) -> int | None:
    """One member's life (the module's docstring). A decode member returns the pages its
    requests still hold at its end (0: nothing leaked)."""
    # A terminal's Ctrl-C reaches the whole process group; the router ends the group in order
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    use_compile_cache()  # before this process compiles anything
    links = list(member.links(setup.transport, setup.link_gbps, setup.timeout).values())
    try:
        model = setup.load()
        cfg, params = model.cfg, model.params
        for link in links:
            agree_runtime(link, attention_backend(cfg, params["embed"].dtype), setup.timeout)
        if member.role == "prefill":
            member.emit(Ready(member.name))
            PrefillWorker(cfg, params, links, member.index, setup.timeout).run(member)
            return None
        engine = DecodeEngine(cfg, params, links, setup.engine_config(member.index),
                              model.eos_ids, model.tokenizer)
        member.emit(Ready(member.name, engine.step_ms(cost_batches(setup), setup.cost_position)))
        engine.run(member)
        return engine.used_pages
    finally:
        for link in links:
            link.close()
