"""A handoff on the link, from its last message handed to the link to the decode side's last
verdict (`Sending`), and what the prefill side reports of it then (`SendReport`)."""

from __future__ import annotations

import dataclasses
import time

import jax

from rekv_jax.errors import TransportError, TransportTimeout
from rekv_jax.handoff.outcome import PrefillTimes
from rekv_jax.transport import Transport


@dataclasses.dataclass(frozen=True)
class SendReport:
    """What the prefill side did for one handoff: the times it told the decode side, when its
    first message was handed to the link and when the verdict on its last one came
    (time.monotonic, as the transport's verdicts are timed: `Transport.wait_ack`)."""

    times: PrefillTimes
    sent_s: float
    acked_s: float

    @property
    def link_ms(self) -> float:
        """From its first message handed to the link to its last verdict."""
        return 1e3 * (self.acked_s - self.sent_s)


class Sending:
    """One handoff whose messages are all handed to the link, until the decode side's verdicts
    on them: it holds their buffers until then (as the transport does), so that what is in
    flight can be bounded by `nbytes`. `poll()` never blocks, `wait(timeout)` blocks at most
    that long; either gives the `SendReport` once every verdict came (its `link_ms` ends when
    the last one came, however late it is polled) and raises a failed message's error
    (ValueError, TransportError), or TransportTimeout once the verdicts did not come within the
    send's timeout. `abandon()` stops waiting and lets every buffer go (the transport's too:
    `Transport.forget`)."""

    def __init__(self, link: Transport, tags: list[str], buffers: list[jax.Array],
                 times: PrefillTimes, first_sent: float, timeout: float) -> None:
        self.link, self.times, self.nbytes = link, times, times.sent_bytes
        self._waiting, self._buffers = list(tags), buffers  # in the order they were sent
        self._first_sent, self._timeout = first_sent, timeout
        self._deadline = time.monotonic() + timeout
        self._acked_s = first_sent  # the latest verdict yet
        self.report: SendReport | None = None

    def poll(self) -> SendReport | None:
        """The report once every verdict came; None while one is still to come."""
        return self._settle(0.0)

    def wait(self, timeout: float) -> SendReport:
        """The report, waiting at most `timeout` s (TransportTimeout)."""
        report = self._settle(timeout)
        if report is None:
            raise TransportTimeout(f"{self._waiting[0]}: no verdict within {timeout:g}s")
        return report

    def _settle(self, timeout: float) -> SendReport | None:
        end = min(time.monotonic() + timeout, self._deadline)
        while self._waiting:
            try:
                came = self.link.wait_ack(self._waiting[0], max(0.0, end - time.monotonic()))
            except TransportTimeout:
                if time.monotonic() < self._deadline:
                    return None
                tag = self._waiting[0]
                self.abandon()
                raise TransportTimeout(f"{tag}: no verdict within the send's "
                                       f"{self._timeout:g}s") from None
            except (TransportError, ValueError):
                self.abandon()
                raise
            self._waiting.pop(0)
            self._acked_s = max(self._acked_s, came)
        if self.report is None:
            self._buffers = []
            self.report = SendReport(self.times, self._first_sent, self._acked_s)
        return self.report

    def abandon(self) -> None:
        """Stop waiting for the verdicts still to come; let go of every buffer."""
        for tag in self._waiting:
            self.link.forget(tag)
        self._waiting, self._buffers = [], []
