"""The decode side's verdicts on a handoff's messages, posted together: a two-process transport
holds each "ok" until no other message of its handoff (the tags sharing its prefix up to the
last "/") is being received, then posts them all; a failure is posted at once.

The prefill side reads its verdicts only once it has sent every message (`wait_ack`), so an
"ok" is not needed earlier; but each control frame that crosses inside a handoff wakes a thread
in both processes on the cores that are moving and checking the handoff's data. Held this way,
a handoff's verdicts cross in one burst, just after its last message is settled (after: the
decode side goes on meanwhile). A sender that waited for one message's verdict before sending
the next of the same handoff would wait for that receive's deadline; none does."""

from __future__ import annotations

import threading
from collections.abc import Callable


def handoff_of(tag: str) -> str:
    """The handoff a message's tag belongs to: the tag up to its last "/"."""
    return tag.rpartition("/")[0]


class Verdicts:
    """Held "ok" verdicts per handoff; `post(tag, verdict)` puts one on the control channel."""

    def __init__(self, post: Callable[[str, str], None]) -> None:
        self._post = post
        self._receiving: dict[str, set[str]] = {}  # by handoff: tags not yet settled
        self._held: dict[str, list[str]] = {}  # by handoff: tags settled "ok", not yet posted
        self._lock = threading.Lock()

    def expect(self, tag: str) -> None:
        """A receive of `tag` started."""
        with self._lock:
            self._receiving.setdefault(handoff_of(tag), set()).add(tag)

    def give(self, tag: str, verdict: str, settle: Callable[[], None]) -> None:
        """`settle` the receive of `tag` (its verdict `verdict`), then post the verdict (an "ok"
        once its handoff has no receive left) with the handoff's held ones. Under the lock, so
        that `flush` (closing) finds every verdict either held or posted."""
        handoff = handoff_of(tag)
        with self._lock:
            receiving = self._receiving.get(handoff, set())
            receiving.discard(tag)
            held = self._held.setdefault(handoff, [])
            if verdict == "ok":
                held.append(tag)
            out = [] if verdict == "ok" else [(tag, verdict)]
            if not receiving:
                out += [(t, "ok") for t in held]
                self._held.pop(handoff, None)
                self._receiving.pop(handoff, None)
            settle()
            for t, v in out:
                self._post(t, v)

    def flush(self) -> None:
        """Post every held verdict (the link is closing)."""
        with self._lock:
            for held in self._held.values():
                for t in held:
                    self._post(t, "ok")
            self._held.clear()
            self._receiving.clear()
