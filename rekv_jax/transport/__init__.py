"""Transports for the prefill -> decode handoff: one narrow interface (`Transport`: send,
receive as futures, acks, metadata, close), three implementations, and two wrappers.

A message (the boundary h_c [B, S, D] with the token ids, a prefix payload, a chunk of either)
moves as one `send` of a few device buffers with their checksums; the decode side's `recv`
returns an `Arrival` at once, which completes with the verified buffers (ValueError for
mismatched shapes, TransportError for a corrupted or lost payload or a dead peer, on both
sides). Every wait has a deadline and checks every 0.5 s that the peer is alive.

  prefill side                               decode side
  t.agree("run", {...})                      t.agree("run", {...})   # both raise if they differ
  t.send("r0/boundary", [h_c])               h = t.recv("r0/boundary", [spec])   # futures, at
  t.send("r0/prefix", [q, scales])           p = t.recv("r0/prefix", specs)      # once
  t.wait_ack("r0/prefix")                    ... the suffix runs from h.result() ...; p.result()
  t.close()                                  t.close()

Implementations (`base.Endpoint`):
  CollectiveTransport      jax.distributed + a cross-process ppermute (gloo on CPU, NCCL on GPU).
  TransferServerTransport  jax.experimental.transfer: the decode side pulls over TCP.
  LocalTransport           both ends in one process, for tests.
Wrappers: `paced.Paced` (a FIFO link of a given bandwidth), `mesh.MeshTransport` (sharded sides).

On a GPU, by design: the transfer server's pulled bytes reach the GPU through
host-to-device copies on a transfer stream, beside the suffix kernels on the compute stream. The
collective's ppermute is a program on the compute stream, so it runs before or after the suffix
program, not beside it (records say `serialized`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import jax

from rekv_jax.errors import TransportError, TransportTimeout
from rekv_jax.transport import cores, distributed
from rekv_jax.transport.base import ROLES, Arrival, Role, Transport, peer_of
from rekv_jax.transport.checksums import checksums
from rekv_jax.transport.collective import CollectiveTransport
from rekv_jax.transport.local import LocalTransport
from rekv_jax.transport.paced import Paced, paced
from rekv_jax.transport.secret import JobKey
from rekv_jax.transport.transfer_server import TransferServerTransport

# what `kind` may name; the first is the default
TRANSPORTS = tuple(t.kind for t in (TransferServerTransport, CollectiveTransport, LocalTransport))


def connect(kind: str, role: Role, coordinator: str | None = None,
            process_id: int | None = None, *, key: JobKey | None, link_gbps: float | None = None,
            timeout: float = 60.0, heartbeat_s: int = 10) -> Transport:
    """This process's end of a two-process link of `kind` ("collective" | "transfer-server").

    `key`: the job's key, which both sides hold (`secret`): the control connection opens only
    between holders of it and the transfer server's pull ids are keyed by it; None (`--insecure`)
    lets anyone who reaches the control port join.

    Initializes jax.distributed unless it already is, so call it before any other JAX work (a
    caller that initializes it should first set `jax_enable_recoverability`, see distributed.py).
    `coordinator` is "host:port" of process 0; None lets JAX detect the cluster (e.g. SLURM).
    `process_id` defaults to decode -> 0 (it hosts the coordination service), prefill -> 1.
    `close()` leaves in order and shuts jax.distributed down."""
    peer_of(role)  # validates the role
    if kind not in TRANSPORTS:
        raise ValueError(f"unknown transport {kind!r}; expected one of {TRANSPORTS}")
    if kind == "local":
        raise ValueError("the local transport has both ends in one process: "
                         "use LocalTransport.pair()")
    if not jax.distributed.is_initialized():
        if coordinator is not None and process_id is None:
            process_id = distributed.DEFAULT_PROCESS_ID[role]
        distributed.initialize(coordinator, process_id, init_timeout_s=int(timeout))
    cores.start_device(os.environ)  # on a pinned CPU side, its host threads leave its cores
    distributed.check_processes(2)
    channel = distributed.PeerChannel(key, heartbeat_s, timeout)
    if kind == "collective":
        return paced(CollectiveTransport(role, channel), link_gbps)
    return paced(TransferServerTransport(role, channel, key, timeout), link_gbps)


def connect_peers(kind: str, role: Role, coordinator: str | None, process_id: int,
                  num_processes: int, peers: Mapping[str, int], *, key: JobKey | None,
                  link_gbps: float | None = None, timeout: float = 60.0, heartbeat_s: int = 10
                  ) -> dict[str, Transport]:
    """This process's links to `peers` (name -> process id: the processes of the other side) in
    a cluster of `num_processes`, one `Transport` each, in process-id order.

    Two processes are the pair's link (`connect`, any kind). More: only `transfer-server`
    (ValueError otherwise), each link over a control connection of its own (`PeerChannel` of
    that pair, authenticated by `key`) and a transfer server of its own. Invariants that make
    the links deadlock-free: every process opens its links one at a time in process-id order
    of its peers (so the lowest unfinished pair always has both ends at it), and should close
    them in that order too (each close waits, bounded, for the peer's). A peer that dies before
    its link opened fails this call (TransportError naming it); one that dies later fails its
    own link only. Initializes jax.distributed unless it already is."""
    peer_of(role)
    if kind not in TRANSPORTS:
        raise ValueError(f"unknown transport {kind!r}; expected one of {TRANSPORTS}")
    if num_processes == 2:  # without a coordinator the cluster's own process ids stand
        (name,) = peers
        return {name: connect(kind, role, coordinator, process_id if coordinator else None,
                              key=key, link_gbps=link_gbps, timeout=timeout,
                              heartbeat_s=heartbeat_s)}
    if kind != TransferServerTransport.kind:
        why = ("it runs one program over a mesh of exactly two processes"
               if kind == CollectiveTransport.kind else "its two ends live in one process")
        raise ValueError(f"--transport {kind} cannot link a group of {num_processes} processes "
                         f"({why}); use --transport {TransferServerTransport.kind}")
    if not jax.distributed.is_initialized():
        distributed.initialize(coordinator, process_id, init_timeout_s=int(timeout),
                               num_processes=num_processes)
    cores.start_device(os.environ)
    distributed.check_processes(num_processes)
    links: dict[str, Transport] = {}
    for name, peer in sorted(peers.items(), key=lambda p: p[1]):
        channel = distributed.PeerChannel(key, heartbeat_s, timeout, peer_id=peer)
        links[name] = paced(TransferServerTransport(role, channel, key, timeout), link_gbps)
    return links


__all__ = [
    "ROLES",
    "Arrival",
    "TRANSPORTS",
    "CollectiveTransport",
    "JobKey",
    "LocalTransport",
    "Paced",
    "Role",
    "TransferServerTransport",
    "Transport",
    "TransportError",
    "TransportTimeout",
    "checksums",
    "connect",
    "connect_peers",
    "paced",
]
