"""The quality gate over prefix formats as markdown: one table per model and length, each Q8/Q4
action beside its paper-format twin.

  python scripts/format_table.py FILE.jsonl...   # `rekv quality --json --prefix-format all`

Per row: top-1 flips, KL(BF16 || action) with its standard error over the windows, the KL as a
share of the paper format's at the same precision and cut, the perplexity change with its
standard error, NIAH and eligibility. `vs paper` is the larger of the KL and perplexity changes
beyond the paper format's, in units of their combined standard error (sqrt(se^2 + se_paper^2)),
unpaired and so conservative: > 0 is worse than the paper's format.
"""

from __future__ import annotations

import math
import sys

from rekv_jax.gate_result import GateResult, load_gate


def excess(r: GateResult, paper: GateResult) -> float:
    """How far `r` is worse than `paper` in KL or perplexity change, in standard errors."""
    m, p = r.metrics, paper.metrics
    return max((m.kl - p.kl) / math.hypot(m.kl_se, p.kl_se),
               (m.ppl_rel_change - p.ppl_rel_change)
               / math.hypot(m.log_ppl_change_se, p.log_ppl_change_se))


def table(results: list[GateResult]) -> list[str]:
    by_action = {r.action: r for r in results}
    lines = ["| action | flips | KL(BF16‖a) ± se | KL / paper's | PPL change ± se | vs paper (se) "
             "| NIAH | eligible |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        m = r.metrics
        paper = by_action.get(r.action.split("/")[0]) if "/" in r.action else None
        share = f"{m.kl / paper.metrics.kl:.3g}" if paper and paper.metrics.kl else ""
        versus = f"{excess(r, paper):+.1f}" if paper else ""
        se = f" ± {m.kl_se:.1e}" if m.kl_se is not None else ""
        ppl_se = (f" ± {m.log_ppl_change_se:.2%}" if m.log_ppl_change_se is not None else "")
        lines.append(f"| {r.action} | {m.top1_flips} | {m.kl:.2e}{se} | {share} | "
                     f"{m.ppl_rel_change:+.3%}{ppl_se} | {versus} | {m.niah_pass}/{m.niah_total} "
                     f"| {'yes' if r.eligible else 'no'} |")
    return lines


def main() -> None:
    for path in sys.argv[1:]:
        results = [r for r in load_gate(path) if r.metrics is not None]
        groups: dict[tuple[str, int], list[GateResult]] = {}
        for r in results:
            groups.setdefault((r.model, r.seq_len), []).append(r)
        for (model, seq_len), rows in groups.items():
            ppl = rows[0].metrics.ppl_bf16
            print(f"\n### {model}, {seq_len} tokens (BF16 continuation perplexity {ppl:.3f}; "
                  f"`{path}`)\n")
            print("\n".join(table(rows)))


if __name__ == "__main__":
    main()
