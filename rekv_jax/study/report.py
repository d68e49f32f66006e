"""Tables, figures and conclusions of handoff measurements (paper Table 1, Fig. 2, Table 3, §4.4).

Input: `Summary` records, one per action, schedule and setup (`rekv handoff --json` lines, the
sweep's `sweep.jsonl`). A *setup* is (hardware, transport, link, batch); every table and figure is
made per setup and says which. Speedup CIs resample the two actions' reps independently (they are
executed separately), except Fig. 3's, whose schedules ran as paired reps.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rekv_jax import sizes
from rekv_jax.action import ActionKind
from rekv_jax.mode import timed_from_prompt
from rekv_jax.phases import PHASES, PROMPT_PHASES
from rekv_jax.planning.costmodel import Profile
from rekv_jax.study.chunked_table import chunked_markdown
from rekv_jax.study.figures import crossover_figure, crossover_title, fig2
from rekv_jax.study.records import Speedup, Summary, Table1Row
from rekv_jax.study.tables import (
    _crossover_groups,
    _profile_of,
    _speedup,
    batch_markdown,
    crossover_markdown,
    fig3_markdown,
    link_label,
    predictions_markdown,
    setup_label,
    table1_markdown,
    table1_rows,
    table3_markdown,
    table3_rows,
)


def figure_name(stem: str, index: int) -> str:
    """The file of a report's `index`-th figure of a kind (0-based): fig2.png, fig2-2.png, ...
    What it shows is in the figure's title and in figures.md, not in its name."""
    return f"{stem}.png" if index == 0 else f"{stem}-{index + 1}.png"


def write_report(records: Sequence[Summary], out_dir: str | Path,
                 profiles: Sequence[Profile] = (), joint_bits: int = 8, seed: int = 0
                 ) -> list[Path]:
    """Write table1.md, predictions.md, table3.md, crossover.md, the PNGs (fig2.png per setup,
    crossover.png per group of paced links) and figures.md, which says what each PNG shows, into
    `out_dir`, and chunked.md / fig3.md / batch.md when the records hold chunked runs /
    prompt-interval pairs / batches."""
    if not records:
        raise ValueError("no summary records to report")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in (("table1.md", table1_markdown(records, joint_bits, seed)),
                       ("predictions.md", predictions_markdown(records, profiles)),
                       ("table3.md", table3_markdown(records, joint_bits, seed)),
                       ("crossover.md", crossover_markdown(records, profiles))):
        (out / name).write_text(text)
        written.append(out / name)
    for name, text in (("chunked.md", chunked_markdown(records, seed)),
                       ("fig3.md", fig3_markdown(records, seed)),
                       ("batch.md", batch_markdown(records, joint_bits, seed))):
        if text:
            (out / name).write_text(text)
            written.append(out / name)
    figures = _write_figures(records, out, profiles)
    (out / "figures.md").write_text(figures_markdown(figures))
    return [*written, *(path for path, _ in figures), out / "figures.md"]


def _write_figures(records: Sequence[Summary], out: Path, profiles: Sequence[Profile]
                   ) -> list[tuple[Path, str]]:
    """Each figure's PNG, and what it shows: Fig. 2 per setup, a crossover per group."""
    figures = []
    for i, setup in enumerate(dict.fromkeys(r.setup for r in records)):
        sel = [r for r in records if r.setup == setup]
        figures.append((fig2(sel, out / figure_name("fig2", i)),
                        f"Fig. 2, latency relative to BF16 transfer: {setup_label(setup)}"))
    for i, key in enumerate(_crossover_groups(records)):
        sel = [r for r in records
               if (r.hardware, r.transport, r.batch, r.model, r.seq_len) == key]
        figures.append((crossover_figure(sel, out / figure_name("crossover", i),
                                         _profile_of(profiles, key)),
                        f"Latency against the paced link: {crossover_title(key)}"))
    return figures


def figures_markdown(figures: Sequence[tuple[Path, str]]) -> str:
    """figures.md: each figure's file, what it shows, and the figure."""
    out = ["# Figures", ""]
    for path, what in figures:
        out += [f"**{path.name}**: {what}", "", f"![{path.name}]({path.name})", ""]
    return "\n".join(out)


def handoff_table(records: Sequence[Summary], header: bool = True) -> str:
    """One line per summary, for a person: median, CI, phase medians, payload and checks (the
    prefill side's own compute too when timed from the prompt)."""
    prompt = any(timed_from_prompt(r.interval) for r in records)
    phases = PROMPT_PHASES if prompt else PHASES
    lines = [f"{'action':<16}{'schedule':<12}{'median ms':>10}{'95% CI':>18}"
             + "".join(f"{p[:8]:>10}" for p in phases) + f"{'MiB':>9}  first  cache"] * header
    for r in records:
        ci = f"[{r.ci95_ms[0]:.2f}, {r.ci95_ms[1]:.2f}]"
        times = "".join(f"{getattr(r.phases_ms, p):>10.2f}" for p in phases)
        schedule = "serialized" if r.serialized else r.schedule
        lines.append(f"{str(r.action):<16}{schedule:<12}{r.median_ms:>10.2f}{ci:>18}{times}"
                     f"{r.payload_bytes / sizes.MIB:>9.2f}  {str(r.first_token_match):<6} "
                     f"{r.cache_check}")
    return "\n".join(lines)


def _speedup_text(s: Speedup | None) -> str:
    return "–" if s is None else f"{s.text()} over {s.over}"


def conclusion(records: Sequence[Summary], seed: int = 0) -> list[str]:
    """A few lines per setup, model and length: the fastest action, its and the best joint
    action's speedups over BF16 transfer and over the best single mechanism (bootstrap 95% CIs),
    the schedule gain, and, when nothing beats BF16 transfer, why."""
    out = []
    gains = {(r.setup, r.model, r.seq_len): r.schedule for r in table3_rows(records, seed=seed)}
    rows = table1_rows(records, seed=seed)
    for row in rows:
        best, bf16, joint = row.best, row.bf16, row.joint
        if len(rows) > 1:
            out.append(f"{row.model}, {row.seq_len} tokens, {setup_label(row.setup)}:")
        out.append(f"Fastest: {best.action} at {best.median_ms:.2f} ms "
                   f"[{best.ci95_ms[0]:.2f}, {best.ci95_ms[1]:.2f}].")
        if bf16 is not None and best not in (bf16, joint):
            out.append(f"  {best.action} vs BF16 transfer: "
                       f"{_speedup_text(_speedup(bf16, best, seed))}.")
        if joint is not None:
            out.append(f"  joint {joint.action} vs BF16 transfer: "
                       f"{_speedup_text(row.joint_vs_bf16)}; vs the best single mechanism: "
                       f"{_speedup_text(row.joint_vs_single)}.")
        gain = gains.get((row.setup, row.model, row.seq_len))
        if gain is not None:
            out.append(f"  Schedule gain at {gain.action}: sequential "
                       f"{gain.sequential_ms:.2f} ms -> overlapped {gain.overlapped_ms:.2f} ms, "
                       f"{gain.gain:.2f}× [{gain.gain_ci95[0]:.2f}, {gain.gain_ci95[1]:.2f}].")
        if best is bf16 or row.setup.link_gbps is None:  # nothing beat BF16, or an unpaced link
            out.append("  " + _why_little(row, records))
    return out


def _why_little(row: Table1Row, records: Sequence[Summary]) -> str:
    """Why an unpaced or fast link shows little: the transfer ReKV shrinks or hides is small
    next to the suffix it would overlap."""
    bf16 = row.bf16
    suffix = [r for r in records if (r.setup, r.model, r.seq_len) ==
              (row.setup, row.model, row.seq_len) and r.action.kind == ActionKind.JOINT]
    if bf16 is None or not suffix:
        return "(Too few actions measured to say why BF16 transfer is not beaten.)"
    r = min(suffix, key=lambda r: r.action.cut)
    per_layer = r.phases_ms.suffix / r.action.suffix_len
    gbps = row.setup.link_gbps
    link = "unpaced loopback" if gbps is None else link_label(gbps)
    return (f"Why so little: over {link} the whole BF16 prefix moves in "
            f"{bf16.phases_ms.prefix:.2f} ms ({bf16.phases_ms.prefix / bf16.action.cut:.2f}"
            f" ms per layer) while one suffix layer costs {per_layer:.2f} ms here, so there is "
            "little link time to save by quantizing or to hide behind recomputation; the paper's "
            "regime is a link whose per-layer time is comparable to a suffix layer "
            "(`--link-gbps paper`).")
