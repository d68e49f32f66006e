"""One job run by both sides of a handoff pair, however the sides run: both in this process over
the `local` transport (`PairJob.here`), this process's side over a real transport
(`PairJob.side`), or both on this machine, this process decoding while a child prefills
(`PairJob.launch`). `rekv handoff` and `rekv generate` are each one such job."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

from rekv_jax.transport import connect
from rekv_jax.transport.base import Role, Transport
from rekv_jax.transport.launch import (
    SUPERVISED,
    die_with_parent,
    start_side,
    supervise,
    with_prefill_child,
)
from rekv_jax.transport.local import LocalTransport

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class PairJob(Generic[T]):
    """`job(role, transport)`, run by each side (the decode side's result is the pair's), over
    `transport` paced to `link_gbps`; `command` is the `rekv` command line that runs one side in a
    process of its own, given `--role` and `--coordinator`."""

    job: Callable[[Role, Transport], T]
    transport: str  # transport.TRANSPORTS
    link_gbps: float | None  # receives paced to this link (None: unpaced)
    timeout: float
    command: tuple[str, ...]
    supervised: bool = False  # a process's prefill side runs in a supervised worker (`side`)

    def here(self) -> T:
        """Both sides in this process (the `local` transport): prefill on a thread."""
        return LocalTransport.run_pair(lambda t: self.job("prefill", t),
                                       lambda t: self.job("decode", t), self.link_gbps,
                                       self.timeout)

    def side(self, role: Role, coordinator: str | None) -> T | None:
        """This process's side over a real transport (jax.distributed is initialized here).

        `supervised`: the prefill side runs in a worker of its own: JAX aborts it when the decode
        side (which hosts the coordination service) goes away, and the supervisor turns that into
        one line."""
        start_side()
        if self.supervised and role == "prefill" and not os.environ.get(SUPERVISED):
            supervise(self.argv(role) + ["--coordinator", coordinator] * (coordinator is not None),
                      "the prefill worker")
            return None
        if os.environ.get(SUPERVISED):
            die_with_parent()
        with connect(self.transport, role, coordinator, link_gbps=self.link_gbps,
                     timeout=self.timeout) as transport:
            return self.job(role, transport)

    def launch(self, envs: Mapping[Role, Mapping[str, str]]) -> T:
        """Both sides on this machine over loopback: this process decodes, a child process
        prefills, each in its environment of `envs` (`launch.with_prefill_child`)."""
        return with_prefill_child(self.argv("prefill"),
                                  lambda coordinator: self.side("decode", coordinator),
                                  self.timeout, envs)

    def argv(self, role: Role) -> list[str]:
        """The command line of `role`'s process, less `--coordinator`."""
        return [sys.executable, "-m", "rekv_jax.cli", *self.command, "--role", role]
