"""How long this process has spent compiling XLA programs (`compiled_ms`).

A served request's measured times hold every program its worker compiled while it was there: a
compile stalls the worker's device queue, so it lands on that request's TTFT and on the
device's measured speed. The serving warm-up exists to keep compiles out of a timed stream;
each worker reports the compile time a request saw (`Prefilled.compile_ms`,
`Finished.compile_ms`), so a record shows whether it did.

The clock listens to JAX's backend-compile duration events (`jax.monitoring`), which every
jitted call that misses the in-memory cache records once per program compiled; a listener is
registered once per process.
"""

from __future__ import annotations

import threading

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

_lock = threading.Lock()
_total_s = 0.0
_listening = False


def compiled_ms() -> float:
    """The XLA compile time of this process so far (ms), counted from the first call."""
    global _listening
    with _lock:
        if not _listening:
            jax.monitoring.register_event_duration_secs_listener(_heard)
            _listening = True
        return _total_s * 1e3


def _heard(event: str, duration_secs: float, **_: object) -> None:
    global _total_s
    if event == BACKEND_COMPILE_EVENT:
        with _lock:
            _total_s += duration_secs
