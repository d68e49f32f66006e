"""Transports for the prefill -> decode handoff: one small interface, three implementations.

A handoff phase (the BF16 boundary h_c [B, S, D] or the token ids [B, S], then the prefix payload,
e.g. quantized values [2, c, B, S, K, H] and fp16 scales) moves as one `send` of a few contiguous
device buffers, never one per layer. Every phase carries the buffers' specs (a header, before the
data) and their on-device checksums (one more buffer beside the data); the decode side verifies
both and acknowledges, so mismatched shapes raise ValueError and corrupted or lost payloads raise
TransportError on *both* sides. Every wait has a timeout and blocks (no sleep-polling), checking
every 0.5 s that the peer is alive. `link_gbps` paces receives to emulate a link of that bandwidth
(FIFO: a transfer of n bytes completes no earlier than n / W after it, and the previous one,
started).

Fixed cost per phase (base.py has the sequence): the header, which the transfer server's decode
side reads only when its pull brought other buffers than it expects (the checksums buffer ends
with a word of the specs), plus the go-ahead for the collective only, whose program both sides
must enter; the decode side posts its ack without waiting and the sender collects the acks at
the end. Threads
that waits use (a transfer-server pull, a collective program, posted acks, the decode side's
background receive) are made with the transport, not per message (scripts/bench_messages.py).

  prefill side                               decode side
  t.agree("run", {...})                      t.agree("run", {...})   # both raise if they differ
  t.send("r0/boundary", [h_c])               h_c, = t.recv("r0/boundary", [spec])
  t.send("r0/prefix", [q, scales])           fut = t.background.submit(t.recv, "r0/prefix", specs)
  t.wait_ack("r0/prefix")                    ... suffix layers run here ...; q, s = fut.result()
  t.close()                                  t.close()

Implementations:
  CollectiveTransport      jax.distributed + a cross-process ppermute (gloo on CPU, NCCL on GPU).
  TransferServerTransport  jax.experimental.transfer: the decode side pulls over TCP.
  LocalTransport           both ends in one process, for tests.

Overlap (measured on this 2-core CPU machine: scripts/transport_overlap.py). A `recv` on a
background thread runs beside jitted compute on the main thread for both real transports: while the
bytes are in flight (a slow link, emulated by pacing, or a late sender) the wall time is about
max(compute, transfer), not the sum. Where the loopback copy itself is the bottleneck it competes
with the compute for the same 2 cores, so less is saved. A collective program's dispatch returns at
once here (jax 0.10, CPU: 0.1-0.5 ms with the peer 200 ms late), but its results come only once the
peer joined, and waiting for them has no timeout: it runs and is waited for on a worker thread;
a transfer-server pull returns at once and its buffers fill in from the server's own threads.

Expected on GPU (not measured here). Transfer server: host-staged TCP; the pulled bytes reach the
GPU through host-to-device copies on a transfer stream, so they overlap suffix kernels on the
compute stream (costing host copies and CPU threads, no SMs). Collective: PJRT enqueues every
program on the device's compute stream, so a ppermute program from a background thread would run
before or after the suffix program, not beside it; NCCL overlaps compute only inside one program,
where XLA's latency-hiding scheduler puts the collective-permute on its own stream. Overlap on a
GPU with this transport therefore needs the prefix exchange compiled into the same program as
the suffix, which both processes then run (the prefill side on placeholder inputs). The checksum
is a fused elementwise reduction: microseconds per MB on a GPU (about 1.5 GB/s on this CPU).
"""

from __future__ import annotations

import os

import jax

from rekv_jax.errors import TransportError, TransportTimeout
from rekv_jax.transport import cores, distributed
from rekv_jax.transport.base import ROLES, Role, Transport, peer_of
from rekv_jax.transport.checksums import checksums
from rekv_jax.transport.collective import CollectiveTransport
from rekv_jax.transport.local import LocalTransport
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
        distributed.initialize(coordinator, process_id, init_timeout_s=int(timeout),
                               heartbeat_s=heartbeat_s)
    cores.start_device(os.environ)  # on a pinned CPU side, its host threads leave its cores
    distributed.check_two_processes()
    channel = distributed.PeerChannel(key, heartbeat_s, timeout)
    if kind == "collective":
        return CollectiveTransport(role, channel, link_gbps)
    return TransferServerTransport(role, channel, key, link_gbps, timeout)


__all__ = [
    "ROLES",
    "TRANSPORTS",
    "CollectiveTransport",
    "JobKey",
    "LocalTransport",
    "Role",
    "TransferServerTransport",
    "Transport",
    "TransportError",
    "TransportTimeout",
    "checksums",
    "connect",
]
