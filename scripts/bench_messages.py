"""Fixed cost per message: one small phase, send -> recv, over each transport. Prints JSON lines.

Per transport, `--reps` phases of a `--kb` KiB payload (bf16, shaped like `tiny`'s prefix), one
at a time: the decode side posts `go`, the prefill side sends, the decode side receives and
verifies. `phase_ms` is from the prefill side's `send` call to the decode side's `recv` returning
(both processes on one host share `time.monotonic`); the acks are collected at the end, as a
handoff does. `messages` counts the control messages of one phase by key and operation (both
sides; the `go` pacing and the local transport's in-process payload are not counted), which is
what tests/test_messages.py pins: the transfer server's decode side reads no header (it reads it
only when its pull brought other buffers), the collective adds its go-ahead (`ready`).

    python scripts/bench_messages.py --kinds local,transfer-server,collective --reps 200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from collections import Counter

import jax
import jax.numpy as jnp

from rekv_jax.launch.child import Member
from rekv_jax.launch.group import loopback, run_pair
from rekv_jax.transport import JobKey, LocalTransport, Transport
from rekv_jax.transport.base import ROLES

TIMEOUT = 60.0
WARMUP = 10


class Counted:
    """A channel that counts its operations by key suffix (the part after the phase's tag)."""

    def __init__(self, channel: object, counts: Counter) -> None:
        self._channel, self.counts = channel, counts

    def _count(self, op: str, key: str) -> None:
        if key.startswith("x/") and not key.endswith("/payload"):
            self.counts[f"{op} {key.rsplit('/', 1)[1]}"] += 1

    def put(self, key: str, value: object) -> None:
        self._count("put", key)
        self._channel.put(key, value)

    def post(self, key: str, value: object) -> None:
        self._count("post", key)
        self._channel.post(key, value)

    def get(self, key: str, timeout: float) -> object:
        self._count("get", key)
        return self._channel.get(key, timeout)

    def __getattr__(self, name: str) -> object:
        return getattr(self._channel, name)


def payload(kb: int) -> list[jax.Array]:
    """A BF16 prefix of `tiny`'s 6 layers as it crosses: each layer's K and V [1, S, 2, 64], about
    `kb` KiB in all."""
    s = max(1, kb * 1024 // (2 * 6 * 2 * 64 * 2))
    return [jnp.full((1, s, 2, 64), i + 1, jnp.bfloat16) for i in range(12)]


def prefill_side(t: Transport, kb: int, reps: int) -> list[float]:
    arrays, sent_at = payload(kb), []
    for i in range(WARMUP + reps):
        t.recv_meta(f"go/{i}", TIMEOUT)
        sent_at.append(time.monotonic())
        t.send(f"x/{i}", arrays, TIMEOUT)
    for i in range(WARMUP + reps):
        t.wait_ack(f"x/{i}", TIMEOUT)
    return sent_at


def decode_side(t: Transport, kb: int, reps: int) -> list[float]:
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in payload(kb)]
    received_at = []
    for i in range(WARMUP + reps):
        t.send_meta(f"go/{i}", {})
        t.recv(f"x/{i}", specs, TIMEOUT).result(TIMEOUT)
        received_at.append(time.monotonic())
    return received_at


def summary(kind: str, kb: int, sent_at: list[float], received_at: list[float],
            counts: Counter, reps: int) -> dict:
    ms = sorted(1e3 * (r - s) for s, r in zip(sent_at[WARMUP:], received_at[WARMUP:],
                                               strict=True))
    return {"transport": kind, "payload_kib": kb, "reps": reps,
            "phase_ms": round(statistics.median(ms), 3),
            "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 3),
            "messages": {k: v // (WARMUP + reps) for k, v in sorted(counts.items())}}


def worker(side: Member, kind: str, kb: int, reps: int) -> dict | None:
    """One side of the pair (`launch.group.run_pair`); the decode side returns the summary."""
    t = side.link(kind, timeout=TIMEOUT)
    counts: Counter = Counter()
    t._channel = Counted(t._channel, counts)
    out = None
    if side.role == "prefill":
        sent_at = prefill_side(t, kb, reps)
        t.send_meta("result", {"sent_at": sent_at, "counts": counts})
    else:
        received_at = decode_side(t, kb, reps)
        theirs = t.recv_meta("result", TIMEOUT)
        out = summary(kind, kb, theirs["sent_at"], received_at,
                      counts + Counter(theirs["counts"]), reps)
    t.close()
    return out


def run_local(kb: int, reps: int) -> dict:
    counts: Counter = Counter()
    prefill, decode = LocalTransport.pair()
    for end in (prefill, decode):
        end._channel = Counted(end._channel, counts)
    out: list[list[float]] = []
    sender = threading.Thread(target=lambda: out.append(prefill_side(prefill, kb, reps)))
    sender.start()
    received_at = decode_side(decode, kb, reps)
    sender.join(TIMEOUT)
    prefill.close(), decode.close()
    return summary("local", kb, out[0], received_at, counts, reps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", default="local,transfer-server,collective")
    p.add_argument("--kb", type=int, default=48, help="payload KiB (tiny's bf16 prefix at 16 "
                   "tokens: 48)")
    p.add_argument("--reps", type=int, default=200)
    args = p.parse_args()
    for kind in args.kinds.split(","):
        if kind == "local":
            print(json.dumps(run_local(args.kb, args.reps)), flush=True)
            continue
        print(json.dumps(run_pair(worker, kind, args.kb, args.reps,
                                  envs={role: dict(os.environ) for role in ROLES},
                                  key=JobKey.new(), coordinator=loopback(), timeout=600.0)),
              flush=True)


if __name__ == "__main__":
    main()
