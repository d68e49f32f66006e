"""A serving run's workers as threads of this process: each prefill worker reaches each decode
worker over an in-process link (`LocalTransport.pair`, paced to the setup's bandwidth), and the
router's loop (`router.drive`) drives them as it drives a group of member processes
(`launch.group.Group`): by member name (`child.member_name`), `send` to one, `poll` for what
they emitted, `close` once served. Tests, soaks and the doctor's quick checks run here, on a
model already loaded, with the workers' code open to inspection.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections.abc import Callable

from rekv_jax.errors import one_line
from rekv_jax.launch.child import DECODE, PREFILL, member_name, parse_member
from rekv_jax.launch.group import Emitted, Event, MemberEnded
from rekv_jax.launch.processes import Ended
from rekv_jax.model.loader import LoadedModel
from rekv_jax.serving.engine import DecodeEngine
from rekv_jax.serving.inbox import LocalInbox, Requests
from rekv_jax.serving.member import MemberSetup
from rekv_jax.serving.prefill_worker import PrefillWorker
from rekv_jax.transport import LocalTransport

Serve = Callable[[Requests, Callable[[object], None]], None]


class InProcess:
    """`prefill` prefill workers and `decode` decode engines of `model` under `setup`, each on
    a thread of its own (the `router.Workers` a loop drives)."""

    def __init__(self, setup: MemberSetup, model: LoadedModel, prefill: int = 1,
                 decode: int = 1) -> None:
        cfg, params = model.cfg, model.params
        links = [[LocalTransport.pair(setup.link_gbps) for _ in range(decode)]
                 for _ in range(prefill)]  # links[p][d]: (prefill end, decode end)
        self.engines = [DecodeEngine(cfg, params, [links[p][d][1] for p in range(prefill)],
                                     setup.engine_config(d), model.eos_ids, model.tokenizer)
                        for d in range(decode)]
        self.workers = [PrefillWorker(cfg, params, [end for end, _ in links[p]], p,
                                      setup.timeout) for p in range(prefill)]
        self._links = [end for row in links for pair in row for end in pair]
        self._events: queue.Queue[Event] = queue.Queue()
        self._inboxes: dict[str, LocalInbox] = {}
        self._ends: dict[str, Ended] = {}
        self._threads = [self._start(member_name(PREFILL, p), w.serve)
                         for p, w in enumerate(self.workers)]
        self._threads += [self._start(member_name(DECODE, d), e.serve)
                          for d, e in enumerate(self.engines)]

    def _start(self, name: str, serve: Serve) -> threading.Thread:
        inbox = self._inboxes[name] = LocalInbox()

        def run() -> None:
            try:
                serve(inbox, lambda item: self._events.put(Emitted(name, item)))
            except BaseException as e:  # the router hears it as a member that ended
                ended = Ended(name, 1, error=e, traceback=traceback.format_exc())
                self._ends[name] = ended
                self._events.put(MemberEnded(name, ended, f"{name}: {one_line(e)}"))

        thread = threading.Thread(target=run, name=f"rekv-{name}", daemon=True)
        thread.start()
        return thread

    @property
    def names(self) -> list[str]:
        return list(self._inboxes)

    def send(self, name: str, message: object) -> bool:
        """Hand `message` to member `name` (False once it ended)."""
        if name in self._ends:
            return False
        self._inboxes[name].put(message)
        return True

    def poll(self, timeout: float | None = 0.0) -> list[Event]:
        """What the members emitted: waiting at most `timeout` s for the first (None: until one
        comes), then whatever else is there."""
        out: list[Event] = []
        try:
            out.append(self._events.get(timeout=timeout) if timeout != 0 else
                       self._events.get_nowait())
        except queue.Empty:
            return out
        while True:
            try:
                out.append(self._events.get_nowait())
            except queue.Empty:
                return out

    def close(self, timeout: float) -> dict[str, Ended]:
        """End every member once it served what it holds (each thread given until `timeout` s
        from now), then the links; how each ended (a decode engine's value: the pages its
        requests still hold, as `member.serving_member`'s)."""
        for inbox in self._inboxes.values():
            inbox.close()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        for end in self._links:
            end.close()
        for name, thread in zip(self.names, self._threads, strict=True):
            if name not in self._ends:
                error = TimeoutError(f"{name} did not end") if thread.is_alive() else None
                self._ends[name] = Ended(name, 1 if error else 0, self._value(name), error)
        return dict(self._ends)

    def _value(self, name: str) -> int | None:
        role, index = parse_member(name)
        return self.engines[index].used_pages if role == DECODE else None
