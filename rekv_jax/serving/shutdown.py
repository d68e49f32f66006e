"""How `rekv serve --http` stops: SIGINT or SIGTERM (`stopped_by_signals`), or its caller's
`stop` event, sets `stop`; from then on the front end, still listening, refuses every new request
(`http.Closing`, a 503), the requests in flight have `GRACE_S` to end before the router's loop
fails them as `ABORTED` (`Grace`); once the loop ended (`DRAIN_S` more at most) the HTTP server
stops, and the workers have `CLOSE_S` to close before they are killed. A stop thus ends the
server within `GRACE_S + DRAIN_S + CLOSE_S` and a few seconds more for the process.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Iterator

ABORTED = "aborted by shutdown"  # the error of a request the stop ended
GRACE_S = 3.0  # after a stop, the requests in flight have this long to end
DRAIN_S = 1.0  # then the router's loop has this long to end them, its clients to hear of it
CLOSE_S = 5.0  # then the workers have this long to close


class Grace:
    """The router loop's `abort` (`router.drive`): no reason until `stop` is set, then `ABORTED`
    once `grace_s` seconds have passed since the loop first saw it."""

    def __init__(self, stop: threading.Event, grace_s: float) -> None:
        self._stop, self._grace_s, self._since = stop, grace_s, None

    def __call__(self) -> str | None:
        if not self._stop.is_set():
            return None
        if self._since is None:
            self._since = time.monotonic()
            print(f"rekv serve: stopping; the requests in flight have {self._grace_s:g} s to end",
                  file=sys.stderr, flush=True)
        return ABORTED if time.monotonic() - self._since > self._grace_s else None


@contextlib.contextmanager
def stopped_by_signals(stop: threading.Event) -> Iterator[None]:
    """While the block runs, SIGINT and SIGTERM set `stop`, whatever the process inherited (a
    shell starts a background job with SIGINT ignored). Only the main thread may set handlers:
    on another (a caller's thread) `stop` alone ends the run."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signals = (signal.SIGINT, signal.SIGTERM)
    before = [signal.signal(s, lambda *_: stop.set()) for s in signals]
    try:
        yield
    finally:
        for s, handler in zip(signals, before, strict=True):  # None: one set outside Python
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
