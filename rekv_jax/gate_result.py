"""`GateResult`: one action's verdict at the output-quality gate (paper §2.4), a line of
`rekv quality --json`. The gate (`quality/`) writes it; the planner and Eq. 13's selection
(`planning/`, `study/`) read it, so it is shared vocabulary."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from rekv_jax.jsonl import read_jsonl


@dataclasses.dataclass(frozen=True)
class GateMetrics:
    """An action's continuation against BF16's on the same prompts (`quality.gate.compare`)."""

    top1_agree: float  # share of continuation positions whose top-1 token equals BF16's
    top1_flips: int  # positions whose top-1 token differs
    top1_flip_margin: float | None  # widest BF16 top-1/top-2 logit gap among the flips
    kl: float  # mean KL(BF16 || action) of the next-token distributions
    ppl_bf16: float  # continuation perplexity on the BF16 cache
    ppl: float  # ... and on the action's cache
    ppl_rel_change: float  # ppl / ppl_bf16 - 1
    niah_pass: int  # NIAH prompts whose greedy passkey is exact on the action's cache
    niah_total: int
    niah_pass_bf16: int
    # the measured noise of kl and of the log-perplexity change: standard errors over the
    # windows (None where not measured)
    kl_se: float | None = None
    log_ppl_change_se: float | None = None


@dataclasses.dataclass(frozen=True)
class GateResult:
    """One action's verdict at the quality gate, with the metrics it rests on."""

    model: str
    seq_len: int
    action: str  # Action in its text form, e.g. "q8:r=13"
    eligible: bool
    chunks: int = 1  # the token chunks of the scored cache (1: unchunked)
    pipelined: bool = False  # the pipelined prefill's cache (with chunks > 1)
    metrics: GateMetrics | None = None  # None: a verdict without them (e.g. the paper's)

    def to_json(self) -> dict[str, Any]:
        """The `rekv quality --json` line; inverse of `from_json`."""
        chunked = {"chunks": self.chunks, "pipelined": self.pipelined} if self.chunks > 1 else {}
        metrics = {} if self.metrics is None else {  # an unmeasured noise is left out
            f.name: getattr(self.metrics, f.name) for f in dataclasses.fields(GateMetrics)
            if f.default is dataclasses.MISSING or getattr(self.metrics, f.name) is not None}
        return {"model": self.model, "seq_len": self.seq_len, "action": self.action, **chunked,
                **metrics, "eligible": self.eligible}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> GateResult:
        """Parse a line; its metrics only when it holds all that have no default (a transcribed
        verdict may hold a few, or none)."""
        fields = dataclasses.fields(GateMetrics)
        names = [f.name for f in fields if f.default is dataclasses.MISSING]
        given = {f.name: d[f.name] for f in fields if f.name in d}
        try:
            metrics = GateMetrics(**given) if set(names) <= d.keys() else None
            return cls(d["model"], int(d["seq_len"]), d["action"], bool(d["eligible"]),
                       int(d.get("chunks", 1)), bool(d.get("pipelined", False)), metrics)
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a quality gate result ({e!r} in {sorted(d)})") from None


def load_gate(path: str | Path) -> list[GateResult]:
    """The gate results of a `rekv quality --json` file."""
    try:
        return [GateResult.from_json(d) for d in read_jsonl(path)]
    except ValueError as e:
        raise ValueError(f"quality {path}: {e}") from None
