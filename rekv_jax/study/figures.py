"""The paper's figures from measured `Summary` records (matplotlib's object API: no global pyplot
state, no display)."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rekv_jax.planning.costmodel import Profile, predicted_ms
from rekv_jax.planning.planner import crossovers
from rekv_jax.study.records import Summary
from rekv_jax.study.tables import (
    FAMILIES,
    _best,
    _cells,
    _crossover_groups,
    _predicted_preference,
    setup_label,
)

TITLE_PT = 10.0  # the titles' font size
# A title line's characters per inch of figure width at TITLE_PT: DejaVu Sans averages about
# 0.55 em a character; 0.65 leaves room for wide ones (capitals, "m", "w")
CHARS_PER_INCH = 72 / (0.65 * TITLE_PT)
SEPARATOR = " · "  # between the parts of a setup's label, where a title may break


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure  # object API: no global pyplot state, no display

    return Figure(figsize=(width, height), layout="constrained")


def wrapped(text: str, width_in: float) -> str:
    """`text` broken into lines that fit `width_in` inches at TITLE_PT: each line of it packed
    part by part (parts end at SEPARATOR), a part wider than a line broken at its spaces."""
    limit = max(20, int(width_in * CHARS_PER_INCH))
    out = []
    for line in text.splitlines():
        current = ""
        for part in line.split(SEPARATOR):
            joined = f"{current}{SEPARATOR}{part}" if current else part
            if len(joined) <= limit:
                current = joined
                continue
            if current:
                out.append(current)
            *full, current = textwrap.wrap(part, limit) or [""]
            out += full
        out.append(current)
    return "\n".join(out)


def _title(fig: Any, text: str) -> None:
    """The figure's title, wrapped to its width."""
    fig.suptitle(wrapped(text, fig.get_figwidth()), fontsize=TITLE_PT)


def fig2(records: Sequence[Summary], path: str | Path) -> Path:
    """Fig.-2-style PNG for one setup: each family's best median over BF16 transfer, per length,
    one panel per model; the setup in the title."""
    fig = fig2_figure(records)
    fig.savefig(path, dpi=120)
    return Path(path)


def fig2_figure(records: Sequence[Summary]) -> Any:
    """`fig2`'s figure, not yet saved."""
    cells = _cells(records)
    if len(cells) != 1:
        raise ValueError(f"fig2 draws one setup at a time, records span {len(cells)}")
    (setup, cell), = cells.items()
    models = list(dict.fromkeys(m for m, _ in cell))
    fig = _figure(max(3.6 * len(models), 6.0), 3.8)
    axes = fig.subplots(1, len(models), squeeze=False)[0]
    for ax, model in zip(axes, models, strict=True):
        lengths = sorted(s for m, s in cell if m == model)
        fams: dict[str, list[float]] = {}
        for i, s in enumerate(lengths):
            best = _best(cell[model, s].values())
            base = best.get("BF16 transfer")
            for f, r in best.items():
                if f != "BF16 transfer" and base is not None:
                    fams.setdefault(f, [math.nan] * len(lengths))[i] = (r.median_ms
                                                                        / base.median_ms)
        for f, ys in fams.items():
            ax.plot(range(len(lengths)), ys, marker="o", color=f"C{FAMILIES.index(f)}", label=f)
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="BF16 transfer")
        ax.set_xticks(range(len(lengths)), [str(s) for s in lengths])
        ax.set_xlabel("prompt tokens")
        ax.set_title(model)
    axes[0].set_ylabel("latency / BF16 transfer")
    handles = {h.get_label(): h for ax in axes for h in ax.get_lines()}
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncols=3,
               fontsize="small")
    _title(fig, f"Handoff latency relative to BF16 transfer (lower is better)\n"
                f"{setup_label(setup)}")
    return fig


def crossover_figure(records: Sequence[Summary], path: str | Path,
                     profile: Profile | None = None, n_grid: int = 60) -> Path:
    """Latency of each family's best action vs paced link bandwidth for one (hardware, transport,
    batch, model, length) group: measured points; lines and predicted crossovers from `profile`;
    the group in the title."""
    fig = crossover_plot(records, profile, n_grid)
    fig.savefig(path, dpi=120)
    return Path(path)


def crossover_title(key: tuple) -> str:
    """The group a crossover figure draws, in words: model, length, batch, hardware, transport."""
    hardware, transport, batch, model, seq_len = key
    return (f"{model}, {seq_len} tokens, batch {batch}{SEPARATOR}hardware: {hardware}"
            f"{SEPARATOR}transport: {transport}")


def crossover_plot(records: Sequence[Summary], profile: Profile | None = None,
                   n_grid: int = 60) -> Any:
    """`crossover_figure`'s figure, not yet saved."""
    groups = _crossover_groups(records)
    if len(groups) != 1:
        raise ValueError(f"crossover_figure draws one group at a time, records give "
                         f"{list(groups)}")
    (key, by_link), = groups.items()
    fig = _figure(7.5, 4.5)
    ax = fig.subplots()
    grid = np.geomspace(min(by_link) / 2, max(by_link) * 2, n_grid)
    for f in FAMILIES:
        pts = [(w, r.median_ms) for w, acts in by_link.items()
               if (r := _best(acts.values()).get(f)) is not None]
        if not pts:
            continue
        color = f"C{FAMILIES.index(f)}"
        ax.plot(*zip(*pts, strict=True), "o", color=color, label=f)
        if profile is not None:
            fam = {a: r for acts in by_link.values() for a, r in acts.items() if r.family == f}
            ys = [min(predicted_ms(profile.at_link(w), r.mode) for r in fam.values()) for w in grid]
            ax.plot(grid, ys, "-", color=color, alpha=0.6)
    if profile is not None:
        for c in crossovers(_predicted_preference(profile, by_link)):
            ax.axvline(math.sqrt(math.prod(c.between_gbps)), color="gray", linestyle=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("paced link bandwidth (GB/s)")
    ax.set_ylabel("median handoff latency (ms)")
    fig.legend(fontsize="small", loc="outside right upper")
    pred = (f"\npoints: measured{SEPARATOR}lines: {profile.source} prediction{SEPARATOR}"
            "dotted: crossover" if profile else "")
    _title(fig, crossover_title(key) + pred)
    return fig
