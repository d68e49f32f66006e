"""Does a receive overlap jitted compute? Prints one JSON line per transport and link.

On the decode side, per repetition: compute alone, the receive alone, then both (the receive
started, then the compute on this thread, then the receive's result). Overlap is real when
`both_ms` is near `max(compute_ms, recv_ms)` rather than `compute_ms + recv_ms`. The link is the
loopback itself, a paced link (`--gbps`), or a sender that starts `--delay-ms` late (the receive
then waits inside the collective program or the pending pull, which shows whether the runtime runs
it beside compute).

    python scripts/transport_overlap.py --kinds transfer-server,collective --mb 64 --gbps 0,0.25
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

import jax
import jax.numpy as jnp

from rekv_jax.launch.child import Member
from rekv_jax.launch.group import loopback, run_pair
from rekv_jax.transport import JobKey, LocalTransport, Transport, checksums
from rekv_jax.transport.base import ROLES

TIMEOUT = 120.0


def payload_specs(mb: int) -> list[jax.ShapeDtypeStruct]:
    """A prefix-shaped payload of about `mb` MiB: uint8 values [2, n, 1024] and fp16 scales."""
    n = max(1, mb * 2**20 // (2 * 1024 + 2 * 2 * 16))
    return [jax.ShapeDtypeStruct((2, n, 1024), jnp.uint8),
            jax.ShapeDtypeStruct((2, n, 16), jnp.float16)]


@jax.jit
def suffix_like(a: jax.Array) -> jax.Array:
    """Stand-in for the suffix layers: a chain of [1024, 1024] matmuls."""
    for _ in range(12):
        a = jnp.tanh(a @ a)
    return a


def median_ms(xs: list[float]) -> float:
    return round(1000 * statistics.median(xs), 1)


def prefill_side(t: Transport, mb: int, reps: int, delay_ms: float) -> None:
    arrays = [jnp.ones(s.shape, s.dtype) for s in payload_specs(mb)]
    for i in range(1 + 2 * reps):  # warm-up, then "alone" and "both" per repetition
        t.recv_meta(f"go/{i}", TIMEOUT)
        time.sleep(delay_ms / 1000)
        t.send(f"x/{i}", arrays, TIMEOUT)
        t.wait_ack(f"x/{i}", TIMEOUT)


def decode_side(t: Transport, mb: int, reps: int) -> dict:
    specs = payload_specs(mb)
    a = jnp.full((1024, 1024), 1e-3, jnp.float32)
    suffix_like(a).block_until_ready()

    def receive(i: int):
        t.send_meta(f"go/{i}", {})
        return t.recv(f"x/{i}", specs, TIMEOUT)

    receive(0).result(TIMEOUT)
    times: dict[str, list[float]] = {"compute": [], "recv": [], "both": [], "checksum": []}
    for r in range(reps):
        t0 = time.perf_counter()
        suffix_like(a).block_until_ready()
        times["compute"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        got = receive(1 + 2 * r).result(TIMEOUT)
        times["recv"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        checksums(got)
        times["checksum"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        pending = receive(2 + 2 * r)
        suffix_like(a).block_until_ready()
        pending.result(TIMEOUT)
        times["both"].append(time.perf_counter() - t0)
    med = {f"{k}_ms": median_ms(v) for k, v in times.items()}
    bound = max(med["compute_ms"], med["recv_ms"])
    return {"payload_mb": round(sum(s.size * s.dtype.itemsize for s in specs) / 2**20, 1),
            **med, "sum_ms": round(med["compute_ms"] + med["recv_ms"], 1),
            "both_over_max": round(med["both_ms"] / bound, 2)}


def worker(side: Member, kind: str, mb: int, gbps: float, reps: int, delay_ms: float
           ) -> dict | None:
    """One side of the pair (`launch.group.run_pair`); the decode side returns the record."""
    t = side.link(kind, link_gbps=gbps or None, timeout=TIMEOUT)
    out = None
    if side.role == "prefill":
        prefill_side(t, mb, reps, delay_ms)
    else:
        out = {"transport": kind, "link_gbps": gbps or None, "delay_ms": delay_ms,
               **decode_side(t, mb, reps)}
    t.close()
    return out


def run_local(mb: int, gbps: float, reps: int, delay_ms: float) -> dict:
    prefill, decode = LocalTransport.pair(link_gbps=gbps or None)
    sender = threading.Thread(target=prefill_side, args=(prefill, mb, reps, delay_ms))
    sender.start()
    result = decode_side(decode, mb, reps)
    sender.join(TIMEOUT)
    return {"transport": "local", "link_gbps": gbps or None, "delay_ms": delay_ms, **result}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", default="transfer-server,collective,local")
    p.add_argument("--mb", type=int, default=64, help="payload size, MiB")
    p.add_argument("--gbps", default="0,0.25", help="emulated link GB/s per run; 0 = unpaced")
    p.add_argument("--delay-ms", type=float, default=0.0, help="sender starts this late")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    for kind in args.kinds.split(","):
        for gbps in (float(g) for g in args.gbps.split(",")):
            if kind == "local":
                print(json.dumps(run_local(args.mb, gbps, args.reps, args.delay_ms)), flush=True)
                continue
            print(json.dumps(run_pair(worker, kind, args.mb, gbps, args.reps, args.delay_ms,
                                      envs={role: dict(os.environ) for role in ROLES},
                                      key=JobKey.new(), coordinator=loopback(),
                                      timeout=600.0)), flush=True)


if __name__ == "__main__":
    main()
