"""The prefill worker of a serving system: a queue of prompts, served first come, first served.

For each `Prefill` it runs the prefill the request's mode asks for (a full prefill; a split or
pipelined one stops at the cut) and sends the handoff's messages under the request's tag
(`send_prompt` without the benchmark's `go` rendezvous; the first token it sends drawn with the
request's `Sampling`, `sampling.first_draw`), then reports `PrefillDone`. Before it
sends it waits until the decode side has admitted the request (`TAG/admitted` on the control
connection): a decode worker without free pages holds this worker's sends, and nothing is
dropped; one that refuses the request (it could never fit) says so there instead. A request
that fails (never admitted within the timeout, a send that fails) is reported with its error
and the queue goes on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax.numpy as jnp

from rekv_jax.config import ModelConfig
from rekv_jax.errors import TransportError, first_line, one_line
from rekv_jax.handoff.sender import send_prompt
from rekv_jax.launch.child import Member
from rekv_jax.model.transformer import Params
from rekv_jax.serving.inbox import MemberInbox, Requests
from rekv_jax.serving.requests import Prefill, PrefillDone, tag
from rekv_jax.serving.sampling import first_draw
from rekv_jax.transport import Transport


class PrefillWorker:
    """The prefill side of a serving worker: `links[d]` reaches decode worker d."""

    def __init__(self, cfg: ModelConfig, params: Params, links: Sequence[Transport],
                 worker: int = 0, timeout: float = 60.0) -> None:
        self._cfg, self._params, self._links = cfg, params, list(links)
        self.worker, self._timeout = worker, timeout

    def prefill(self, request: Prefill) -> PrefillDone:
        """Compute and send one request's handoff once its decode side admitted it."""
        if not 0 <= request.decode_worker < len(self._links):
            return self._failed(request, f"no decode worker {request.decode_worker}")
        link, name = self._links[request.decode_worker], tag(request.request_id)
        try:
            admitted = link.recv_meta(f"{name}/admitted", self._timeout)  # its pages
            if "refused" in admitted:
                return self._failed(request, admitted["refused"])
            report = send_prompt(link, self._cfg, self._params,
                                 jnp.asarray([request.tokens], jnp.int32), request.mode, name,
                                 timeout=self._timeout, go=False,
                                 first=first_draw(request.sampling))
        except (TransportError, ValueError) as e:
            return self._failed(request, one_line(e))
        times = report.times
        return PrefillDone(request.request_id, self.worker, times.prefill_ms + times.quantize_ms,
                           report.link_ms, times.sent_bytes)

    def _failed(self, request: Prefill, error: str) -> PrefillDone:
        return PrefillDone(request.request_id, self.worker, 0.0, 0.0, 0,
                           first_line(error))

    def serve(self, requests: Requests, emit: Callable[[object], None]) -> None:
        """Prefill the requests in the order they come until there are no more."""
        while not requests.ended:
            for request in requests.take(None):
                if not isinstance(request, Prefill):
                    raise ValueError(f"a prefill worker takes Prefill requests, got "
                                     f"{type(request).__name__}")
                emit(self.prefill(request))

    def run(self, member: Member) -> None:
        """Serve the `Prefill`s the router hands this group member."""
        self.serve(MemberInbox(member), member.emit)
