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
import contextlib
import dataclasses
import json
import os
import random
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from rekv_jax.launch.child import Member
from rekv_jax.launch.group import loopback, run_pair
from rekv_jax.transport.base import ROLES
from rekv_jax.transport.secret import JobKey

if TYPE_CHECKING:
    from rekv_jax.action import Action
    from rekv_jax.config import ModelConfig
    from rekv_jax.kv import KVCache
    from rekv_jax.transport import Transport

HANDOFF_TIMEOUT = 30.0
WARMUP_TIMEOUT = 600.0  # the first handoff of each action compiles, slowly on shared cores
FAULTS = ("corrupt", "lost", "delay")
ACTIONS = ("bf16:full", "q8:full", "bf16:r=2", "q8:r=2", "q4:r=3", "bf16:recompute")
DELAY_S = 0.1
OUTCOMES = ("ok", "recovered", "failed_clean", "wrong", "unexpected", "hangs")


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


def vitals(reads: int = 10, every_s: float = 0.05) -> dict[str, int]:
    """Resident memory (KiB) and live threads (Python's and the OS's) of this process. The OS's
    count is the least of `reads` reads `every_s` apart: a thread that just ended in Python
    lives on in the OS for a moment, and runtime pools start and retire threads of their own,
    so one read may count one that is leaving."""
    os_threads = []
    for _ in range(reads):
        lines = Path("/proc/self/status").read_text().splitlines()
        status = dict(line.split(":", 1) for line in lines)
        os_threads.append(int(status["Threads"]))
        time.sleep(every_s)
    return {"rss_kib": int(status["VmRSS"].split()[0]), "os_threads": min(os_threads),
            "py_threads": threading.active_count()}


class FaultHooks:
    """The transport's send and receive, wrapped to apply the planned faults: `faults` maps a
    message tag to its fault; `injected` counts the faults this side's hooks applied (the
    prefill side's: corrupt, delay; the decode side's: lost)."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.faults: dict[str, str] = {}
        self.injected = dict.fromkeys(FAULTS, 0)
        self._send, self._receive = transport._send, transport._receive
        transport._send, transport._receive = self.send, self.receive

    def send(self, tag: str, buffers: list, header: str, deadline: float) -> None:
        import jax

        fault = self.faults.get(tag)
        if fault in ("delay", "corrupt"):
            self.injected[fault] += 1
        if fault == "delay":
            time.sleep(DELAY_S)
        elif fault == "corrupt":
            flipped = np.asarray(buffers[0]).copy()
            flipped.reshape(-1).view(np.uint8)[7] ^= 0x10
            buffers = [jax.device_put(flipped), *buffers[1:]]
        self._send(tag, buffers, header, deadline)

    def receive(self, arrival, specs: list, wire: list) -> None:
        from rekv_jax.transport import TransportError

        if self.faults.get(arrival.tag) == "lost":
            self.injected["lost"] += 1
            self.transport._settle(arrival, error=TransportError(
                f"{arrival.tag}: injected loss of the prefix"))
            return
        self._receive(arrival, specs, wire)


@dataclasses.dataclass
class Tally:
    """What the decode side counts: the outcomes of the measured handoffs (`wrong` and `hangs`
    the warm-up's too), what timed out, and the fault-free latencies per action (and schedule,
    for a joint action) as (measured index, ms)."""

    counts: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    latency: dict[str, list[tuple[int, float]]] = dataclasses.field(default_factory=dict)
    hung: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class SoakSide:
    """One side's end of the soak: its transport (fault hooks installed), the model and the
    prompt; the prefill side's prepared states per action, the decode side's reference cache
    and first token."""

    role: str
    transport: Transport
    hooks: FaultHooks
    cfg: ModelConfig
    params: dict
    seq_len: int
    actions: dict[str, Action]
    states: dict | None = None  # prefill side: action -> prepared state
    reference: KVCache | None = None  # decode side: the single-process prefill's cache
    first: np.ndarray | None = None  # decode side: its first token
    tally: Tally = dataclasses.field(default_factory=Tally)

    @classmethod
    def open(cls, side: Member, seq_len: int) -> SoakSide:
        import jax

        from rekv_jax.action import Action
        from rekv_jax.handoff.sender import prepare
        from rekv_jax.mode import Mode
        from rekv_jax.model.loader import load_model
        from rekv_jax.model.transformer import prefill

        transport = side.link("transfer-server", timeout=HANDOFF_TIMEOUT)
        hooks = FaultHooks(transport)
        model = load_model("tiny")
        cfg, params = model.cfg, model.params
        tokens = jax.random.randint(jax.random.key(1), (1, seq_len), 0, cfg.vocab_size)
        actions = {a: Action.parse(a, cfg.num_layers) for a in ACTIONS}
        out = cls(side.role, transport, hooks, cfg, params, seq_len, actions)
        if side.role == "prefill":
            out.states = {a: prepare(cfg, params, tokens, Mode.of(action))
                          for a, action in actions.items()}
        else:
            out.reference, logits = prefill(cfg, params, tokens)
            out.first = np.asarray(jax.numpy.argmax(logits, axis=-1))
        return out

    def handoff(self, i: int, step: Step, timeout: float, measured: int | None) -> None:
        """Handoff `i` of the plan, its fault planned on its prefix; `measured`: its index among
        the measured handoffs (None in the warm-up)."""
        tag = f"{i}/{step.action}/{step.schedule}"
        if step.fault:
            self.hooks.faults[f"{tag}/prefix"] = step.fault
        if self.role == "prefill":
            self.send(tag, step, timeout)
        else:
            self.receive(tag, step, timeout, measured)

    def send(self, tag: str, step: Step, timeout: float) -> None:
        """The prefill side of one handoff: a transport error (a planned fault's) ends only it."""
        from rekv_jax.handoff.sender import send_handoff
        from rekv_jax.mode import Mode
        from rekv_jax.transport import TransportError

        mode = Mode.of(self.actions[step.action], step.schedule)
        with contextlib.suppress(TransportError):
            send_handoff(self.transport, self.states[step.action], mode, tag, timeout=timeout)

    def receive(self, tag: str, step: Step, timeout: float, measured: int | None) -> None:
        """The decode side of one handoff, its cache and first token checked, its outcome
        counted."""
        from rekv_jax.handoff.check import check_cache
        from rekv_jax.handoff.receiver import receive_handoff
        from rekv_jax.mode import Mode
        from rekv_jax.transport import TransportError, TransportTimeout

        action, tally = self.actions[step.action], self.tally
        try:
            result = receive_handoff(self.transport, self.cfg, self.params,
                                     Mode.of(action, step.schedule), 1, self.seq_len, tag,
                                     step.fallback, timeout=timeout)
        except TransportTimeout as e:
            tally.counts["hangs"] += 1
            tally.hung.append(f"{tag}: {e}")
            return
        except TransportError:
            outcome = "failed_clean"
        else:
            good = (np.array_equal(result.first_token, self.first)
                    and not check_cache(self.reference, action, result).startswith("MISMATCH"))
            tally.counts["wrong"] += not good
            outcome = "recovered" if result.fallback else "ok"
            if step.fault is None and measured is not None:
                key = step.action + f"/{step.schedule}" * (action.kind == "joint")
                tally.latency.setdefault(key, []).append((measured, result.total_ms))
        if measured is not None:
            tally.counts[outcome] += 1
            tally.counts["unexpected"] += outcome != step.expected


def run_side(side: Member, args: argparse.Namespace) -> dict | None:
    """One process of the pair (`launch.group.run_pair`): the warm-up (one fault-free handoff per
    action and schedule), then the plan, vitals read between and after; the decode side returns
    the report."""
    from rekv_jax.mode import PAPER_SCHEDULES

    soak = SoakSide.open(side, args.seq_len)
    steps = plan(args.handoffs, args.fault_rate, args.seed)
    warmup = [Step(a, s, "error", None) for a in ACTIONS for s in PAPER_SCHEDULES]
    for i, step in enumerate(warmup):
        soak.handoff(i, step, WARMUP_TIMEOUT, None)
    start = vitals()
    for j, step in enumerate(steps):
        soak.handoff(len(warmup) + j, step, HANDOFF_TIMEOUT, j)
    end = vitals()
    transport, injected = soak.transport, soak.hooks.injected
    if side.role == "prefill":
        transport.send_meta("soak/prefill", {"start": start, "end": end, "injected": injected})
        transport.close()
        return None
    prefill_vitals = transport.recv_meta("soak/prefill", HANDOFF_TIMEOUT)
    prefill_injected = prefill_vitals.pop("injected")
    transport.close()
    return {
        "handoffs": args.handoffs, "fault_rate": args.fault_rate, "seq_len": args.seq_len,
        "faults": {f: sum(s.fault == f for s in steps) for f in FAULTS},
        "injected": {f: prefill_injected[f] + injected[f] for f in FAULTS},
        **soak.tally.counts, "hung": soak.tally.hung,
        "vitals": {"decode": {"start": start, "end": end}, "prefill": prefill_vitals},
        "latency_ms": latency_report(soak.tally.latency, args.handoffs),
    }


def percentiles(xs: list[float]) -> dict[str, float | None]:
    """p50 and p99 of `xs` (None if empty) and their count."""
    return {"p50": float(np.percentile(xs, 50)) if xs else None,
            "p99": float(np.percentile(xs, 99)) if xs else None, "n": len(xs)}


def latency_report(latency: dict[str, list[tuple[int, float]]], handoffs: int) -> dict:
    """Per key, the percentiles over the first and the last tenth of the measured handoffs."""
    tenth = max(1, handoffs // 10)
    return {key: {"first_tenth": percentiles([t for j, t in xs if j < tenth]),
                  "last_tenth": percentiles([t for j, t in xs if j >= handoffs - tenth])}
            for key, xs in sorted(latency.items())}


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
