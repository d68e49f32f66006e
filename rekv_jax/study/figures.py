"""The paper's figures from measured `Summary` records (matplotlib's object API: no global pyplot
state, no display)."""

from __future__ import annotations

import math
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


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure  # object API: no global pyplot state, no display

    return Figure(figsize=(width, height), layout="constrained")


def fig2(records: Sequence[Summary], path: str | Path) -> Path:
    """Fig.-2-style PNG for one setup: each family's best median over BF16 transfer, per length,
    one panel per model."""
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
    fig.suptitle(f"Handoff latency relative to BF16 transfer (lower is better)\n"
                 f"{setup_label(setup)}", fontsize="medium")
    fig.savefig(path, dpi=120)
    return Path(path)


def crossover_figure(records: Sequence[Summary], path: str | Path,
                     profile: Profile | None = None, n_grid: int = 60) -> Path:
    """Latency of each family's best action vs paced link bandwidth for one (hardware, transport,
    batch, model, length) group: measured points; lines and predicted crossovers from `profile`."""
    groups = _crossover_groups(records)
    if len(groups) != 1:
        raise ValueError(f"crossover_figure draws one group at a time, records give "
                         f"{list(groups)}")
    ((hardware, transport, batch, model, seq_len), by_link), = groups.items()
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
    pred = (f"\npoints: measured · lines: {profile.source} prediction · dotted: crossover"
            if profile else "")
    ax.set_title(f"{model}, {seq_len} tokens, batch {batch}\nhardware: {hardware} · transport: "
                 f"{transport}{pred}", fontsize="medium")
    fig.savefig(path, dpi=120)
    return Path(path)
