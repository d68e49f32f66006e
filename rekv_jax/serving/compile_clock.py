"""How long this process has waited for XLA programs (`compiled_ms`).

A served request's measured times hold every program its worker obtained while it was there:
tracing, lowering and compiling a program stalls the worker's device queue, so it lands on that
request's TTFT and on the device's measured speed. The serving warm-up exists to keep programs
out of a timed stream; each worker reports the compile time a request saw
(`Prefilled.compile_ms`, `Finished.compile_ms`), so a record shows whether it did.

The clock listens to JAX's duration events (`jax.monitoring`) of the three stages every jitted
call that misses the in-memory cache goes through once per program (`COMPILE_EVENTS`): tracing
to a jaxpr, lowering it, and the backend's compile, which with the persistent compilation cache
on (`rekv_jax.compile_cache`) is the cache's read on a hit: a program read from disk is still a
wait, so it is counted, never assumed away. A listener is registered once per process.
"""

from __future__ import annotations

import threading

import jax

COMPILE_EVENTS = frozenset({
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",  # wraps a persistent-cache read too
})

_lock = threading.Lock()
_total_s = 0.0
_listening = False


def compiled_ms() -> float:
    """The time this process spent obtaining XLA programs so far (ms), counted from the first
    call."""
    global _listening
    with _lock:
        if not _listening:
            jax.monitoring.register_event_duration_secs_listener(_heard)
            _listening = True
        return _total_s * 1e3


def _heard(event: str, duration_secs: float, **_: object) -> None:
    global _total_s
    if event in COMPILE_EVENTS:
        with _lock:
            _total_s += duration_secs
