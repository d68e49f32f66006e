"""Soak: one pair of processes through N handoffs with transport faults injected; does it hold?

Both sides draw the same plan from `--seed`: per handoff an action (mixed), a schedule (both), a
fallback (`error` or `recompute`) and, with probability `--fault-rate`, one fault the transport
tests know: a corrupted byte in the prefix payload (prefill side), a lost prefix (the decode
side's pull fails, as if the peer died mid-transfer) or a delayed peer (the prefill side sends
the prefix late). Expected outcomes: `ok` (no fault, or a delay), `recovered` (a failed prefix
under `recompute`: the cache is rebuilt from the token ids), `failed_clean` (under `error`: both
sides raise TransportError and go on). Every cache and first token that comes back is checked
against a single-process prefill: `wrong` counts differences, `unexpected` outcomes that are not
the expected ones, `hangs` handoffs that timed out (or a side that never finished). `faults`
counts the planned faults per kind, `injected` those the hooks applied (prefill side: corrupt,
delay; decode side: lost); a soak passes only if every planned fault was injected.

Resident memory and live threads are read on both sides after a warm-up (one fault-free handoff
per action and schedule) and at the end; latency p50/p99 per action and schedule is over the
fault-free handoffs of the first and the last tenth (the schedule only matters, and is only
named, for joint actions).

    python scripts/soak.py --handoffs 1000 --fault-rate 0.05 --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import threading
import time
from pathlib import Path

import numpy as np

from rekv_jax.launch.child import Side
from rekv_jax.launch.pair import loopback, run_pair
from rekv_jax.transport.base import ROLES
from rekv_jax.transport.secret import JobKey

HANDOFF_TIMEOUT = 30.0
WARMUP_TIMEOUT = 600.0  # the first handoff of each action compiles, slowly on shared cores
FAULTS = ("corrupt", "lost", "delay")
ACTIONS = ("bf16:full", "q8:full", "bf16:r=2", "q8:r=2", "q4:r=3", "bf16:recompute")
DELAY_S = 0.1


@dataclasses.dataclass(frozen=True)
class Step:
    """One planned handoff."""

    action: str
    schedule: str
    fallback: str
    fault: str | None

    @property
    def expected(self) -> str:
        if self.fault in (None, "delay") or self.action == "bf16:recompute":
            return "ok"
        return "recovered" if self.fallback == "recompute" else "failed_clean"


def plan(n: int, fault_rate: float, seed: int) -> list[Step]:
    """The same list on both sides."""
    rng = random.Random(seed)
    steps = []
    for _ in range(n):
        action = rng.choice(ACTIONS)
        fault = rng.choice(FAULTS) if rng.random() < fault_rate else None
        if action == "bf16:recompute":  # nothing but token ids to fault
            fault = None
        steps.append(Step(action, rng.choice(("overlapped", "sequential")),
                          rng.choice(("error", "recompute")), fault))
    return steps


def vitals() -> dict[str, int]:
    """Resident memory (KiB) and live threads (Python's and the OS's) of this process."""
    lines = Path("/proc/self/status").read_text().splitlines()
    status = dict(line.split(":", 1) for line in lines)
    return {"rss_kib": int(status["VmRSS"].split()[0]), "os_threads": int(status["Threads"]),
            "py_threads": threading.active_count()}


def run_side(side: Side, args: argparse.Namespace) -> dict | None:
    """One process of the pair (`launch.run_pair`); the decode side returns the report."""
    import jax

    from rekv_jax.action import Action
    from rekv_jax.handoff.check import check_cache
    from rekv_jax.handoff.receiver import receive_handoff
    from rekv_jax.handoff.sender import prepare, send_handoff
    from rekv_jax.mode import PAPER_SCHEDULES, Mode
    from rekv_jax.model.loader import load_model
    from rekv_jax.model.transformer import prefill
    from rekv_jax.transport import TransportError, TransportTimeout

    role, transport = side.role, side.connect("transfer-server", timeout=HANDOFF_TIMEOUT)
    model = load_model("tiny")
    cfg, params = model.cfg, model.params
    tokens = jax.random.randint(jax.random.key(1), (1, args.seq_len), 0, cfg.vocab_size)
    actions = {a: Action.parse(a, cfg.num_layers) for a in ACTIONS}
    steps = plan(args.handoffs, args.fault_rate, args.seed)
    warmup = [Step(a, s, "error", None) for a in ACTIONS for s in PAPER_SCHEDULES]
    send, receive = transport._send, transport._receive  # the fault hooks

    def faulty_send(tag: str, buffers: list, header: str, deadline: float) -> None:
        fault = faults.get(tag)
        if fault in ("delay", "corrupt"):
            injected[fault] += 1
        if fault == "delay":
            time.sleep(DELAY_S)
        elif fault == "corrupt":
            flipped = np.asarray(buffers[0]).copy()
            flipped.reshape(-1).view(np.uint8)[7] ^= 0x10
            buffers = [jax.device_put(flipped), *buffers[1:]]
        send(tag, buffers, header, deadline)

    def faulty_receive(arrival, specs: list, wire: list) -> None:
        if faults.get(arrival.tag) == "lost":
            injected["lost"] += 1
            transport._settle(arrival, error=TransportError(
                f"{arrival.tag}: injected loss of the prefix"))
            return
        receive(arrival, specs, wire)

    faults: dict[str, str] = {}
    injected = dict.fromkeys(FAULTS, 0)  # faults this side's hooks applied
    transport._send, transport._receive = faulty_send, faulty_receive
    if role == "prefill":
        states = {a: prepare(cfg, params, tokens, Mode.of(action))
                  for a, action in actions.items()}
    else:
        reference, logits = prefill(cfg, params, tokens)
        first = np.asarray(jax.numpy.argmax(logits, axis=-1))
    counts = dict.fromkeys(("ok", "recovered", "failed_clean", "wrong", "unexpected", "hangs"), 0)
    latency: dict[str, list[tuple[int, float]]] = {}
    hung: list[str] = []  # what timed out, warm-up included
    start = None
    for i, step in enumerate(warmup + steps):
        if i == len(warmup):
            start = vitals()
        tag = f"{i}/{step.action}/{step.schedule}"
        timeout = HANDOFF_TIMEOUT if i >= len(warmup) else WARMUP_TIMEOUT
        if step.fault:
            faults[f"{tag}/prefix"] = step.fault
        action = actions[step.action]
        mode = Mode.of(action, step.schedule)
        try:
            if role == "prefill":
                send_handoff(transport, states[step.action], mode, tag, timeout=timeout)
                continue
            result = receive_handoff(transport, cfg, params, mode, 1, args.seq_len, tag,
                                     step.fallback, timeout=timeout)
        except TransportTimeout as e:
            if role == "decode":
                counts["hangs"] += 1
                hung.append(f"{tag}: {e}")
            continue
        except TransportError:
            outcome = "failed_clean"
        else:
            if role == "prefill":
                continue
            good = (np.array_equal(result.first_token, first)
                    and not check_cache(reference, action, result).startswith("MISMATCH"))
            counts["wrong"] += not good
            outcome = "recovered" if result.fallback else "ok"
            if step.fault is None and i >= len(warmup):
                key = step.action + f"/{step.schedule}" * (action.kind == "joint")
                latency.setdefault(key, []).append(
                    (i - len(warmup), result.total_ms))
        if role == "decode" and i >= len(warmup):
            counts[outcome] += 1
            counts["unexpected"] += outcome != step.expected
    end = vitals()
    if role == "prefill":
        transport.send_meta("soak/prefill", {"start": start, "end": end, "injected": injected})
        transport.close()
        return
    prefill_vitals = transport.recv_meta("soak/prefill", HANDOFF_TIMEOUT)
    prefill_injected = prefill_vitals.pop("injected")
    transport.close()
    tenth = max(1, args.handoffs // 10)

    def pct(xs: list[float]) -> dict[str, float | None]:
        return {"p50": float(np.percentile(xs, 50)) if xs else None,
                "p99": float(np.percentile(xs, 99)) if xs else None, "n": len(xs)}

    return {
        "handoffs": args.handoffs, "fault_rate": args.fault_rate, "seq_len": args.seq_len,
        "faults": {f: sum(s.fault == f for s in steps) for f in FAULTS},
        "injected": {f: prefill_injected[f] + injected[f] for f in FAULTS}, **counts, "hung": hung,
        "vitals": {"decode": {"start": start, "end": end}, "prefill": prefill_vitals},
        "latency_ms": {key: {"first_tenth": pct([t for j, t in xs if j < tenth]),
                             "last_tenth": pct([t for j, t in xs if j >= args.handoffs - tenth])}
                       for key, xs in sorted(latency.items())},
    }


def verdict(report: dict, max_rss_growth: float) -> dict:
    """The pass criteria: nothing wrong, unexpected or hung; every planned fault injected;
    memory and threads flat."""
    checks = {"wrong": report["wrong"] == 0, "unexpected": report["unexpected"] == 0,
              "hangs": report["hangs"] == 0, "injected": report["injected"] == report["faults"],
              "all_counted": report["ok"] + report["recovered"] + report["failed_clean"]
              + report["hangs"] == report["handoffs"]}
    for side, v in report["vitals"].items():
        growth = v["end"]["rss_kib"] / v["start"]["rss_kib"] - 1
        report[f"rss_growth_{side}"] = growth
        checks[f"rss_{side}"] = growth < max_rss_growth
        checks[f"threads_{side}"] = all(v["end"][k] == v["start"][k]
                                        for k in ("py_threads", "os_threads"))
    return {"passed": all(checks.values()), "checks": checks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--handoffs", type=int, default=1000)
    parser.add_argument("--fault-rate", type=float, default=0.05)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-rss-growth", type=float, default=0.05)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for the whole soak")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.handoffs < 10 or not 0 <= args.fault_rate <= 1:
        parser.error("--handoffs must be >= 10 and --fault-rate in [0, 1]")
    t0 = time.monotonic()
    try:
        report = run_pair(run_side, args, envs={role: dict(os.environ) for role in ROLES},
                          key=JobKey.new(), coordinator=loopback(), grace=HANDOFF_TIMEOUT,
                          timeout=args.timeout)
    except TimeoutError as e:
        print(json.dumps({"handoffs": args.handoffs, "hangs": 1, "passed": False,
                          "error": str(e)[-2000:]}))
        raise SystemExit(1) from None
    except Exception as e:  # a side that failed: one line naming it
        print(json.dumps({"handoffs": args.handoffs, "passed": False, "error": str(e)[-2000:]}))
        raise SystemExit(1) from None
    report.update(verdict(report, args.max_rss_growth), wall_s=round(time.monotonic() - t0, 1))
    if args.json:
        print(json.dumps(report))
    else:
        for key in ("handoffs", "ok", "recovered", "failed_clean", "wrong", "unexpected", "hangs",
                    "faults", "injected", "vitals", "passed", "checks", "wall_s"):
            print(f"{key:>14}: {report[key]}")
        for key, lat in report["latency_ms"].items():
            print(f"{key:>26}: {lat}")
    raise SystemExit(0 if report["passed"] else 1)


if __name__ == "__main__":
    main()
