"""The paper's tables from measured `Summary` records: rows (with bootstrap speedups) and their
markdown, predictions beside measurements, crossovers."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

from rekv_jax import sizes, stats
from rekv_jax.mode import Formula, paper_timing, timed_from_prompt
from rekv_jax.planning.costmodel import Profile, predicted_ms, t_ov
from rekv_jax.planning.planner import LinkChoice, crossovers, find_profile, preferred_by_link
from rekv_jax.study.records import (
    BatchRow,
    CrossoverRow,
    Fig3Row,
    PredictionRow,
    ScheduleGain,
    Setup,
    Speedup,
    Summary,
    Table1Row,
    Table3Row,
)

FAMILIES = ("BF16 transfer", "Q8 transfer", "Q4 transfer", "BF16 recompute", "joint Q8", "joint Q4")


def suffix_label(rec: Summary) -> str:
    """Suffix length `r` of an action (`all` for full recomputation, 0 for transfer-only)."""
    return "all" if rec.action.cut == 0 else str(rec.action.suffix_len)


def link_label(link_gbps: float | None) -> str:
    return "unpaced" if link_gbps is None else f"paced {link_gbps:g} GB/s"


def setup_label(setup: Setup) -> str:
    s = setup
    timed = f" · timed from the prompt, {s.prefill} prefill" * timed_from_prompt(s.interval)
    devices = ("" if (s.prefill_devices, s.decode_devices) == (1, 1)
               else f" · devices {s.prefill_devices}->{s.decode_devices}")
    return (f"hardware: {s.hardware} · transport: {s.transport} · link: "
            f"{link_label(s.link_gbps)} · batch {s.batch}{timed}{devices}"
            + f" · {s.pinning}" * bool(s.pinning))


def _cells(records: Sequence[Summary]) -> dict[Setup, dict[tuple, dict[str, Summary]]]:
    """setup -> (model, seq_len) -> action text -> the overlapped record. Transfer-only and full
    recomputation have nothing to overlap (schedule `n/a`; a sequential record serves too);
    chunked records are left out."""
    chosen: dict[tuple, Summary] = {}
    for r in records:
        formula = r.mode.formula
        if formula == Formula.CHUNKED:  # past the paper: `chunked_rows`
            continue
        key = (r.setup, (r.model, r.seq_len), str(r.action))
        if formula != Formula.SEQUENTIAL or (not r.mode.joint and key not in chosen):
            chosen[key] = r
    out: dict[Setup, dict[tuple, dict[str, Summary]]] = {}
    for (setup, cell, action), r in sorted(chosen.items(), key=lambda i: i[0][0].sort_key()):
        out.setdefault(setup, {}).setdefault(cell, {})[action] = r
    return {s: dict(sorted(c.items())) for s, c in out.items()}


def _best(recs: Iterable[Summary]) -> dict[str, Summary]:
    """family -> its fastest record (by median), in the order of FAMILIES."""
    best: dict[str, Summary] = {}
    for r in recs:
        if r.family not in best or r.median_ms < best[r.family].median_ms:
            best[r.family] = r
    return {f: best[f] for f in FAMILIES if f in best}


def _speedup(base: Summary | None, new: Summary | None, seed: int) -> Speedup | None:
    if base is None or new is None:
        return None
    point, ci = stats.ratio_ci(base.reps_ms, new.reps_ms, seed=seed)
    return Speedup(point, tuple(ci), str(base.action))


def _joint_family(bits: int) -> str:
    return f"joint Q{bits}"


def table1_rows(records: Sequence[Summary], joint_bits: int = 8, seed: int = 0
                ) -> list[Table1Row]:
    """Per setup, model and length: BF16 and Q8 transfer, the best BF16 recompute, the best joint
    action at `joint_bits`, its speedups over BF16 and over the best single mechanism."""
    rows = []
    for setup, cells in _cells(records).items():
        for (model, seq_len), acts in cells.items():
            fam = _best(acts.values())
            bf16, q8 = fam.get("BF16 transfer"), fam.get("Q8 transfer")
            recompute, joint = fam.get("BF16 recompute"), fam.get(_joint_family(joint_bits))
            singles = [r for r in (q8, recompute) if r is not None]
            single = min(singles, key=lambda r: r.median_ms) if singles else None
            rows.append(Table1Row(
                setup, model, seq_len, len(next(iter(acts.values())).reps_ms),
                bf16, q8, recompute, joint, min(acts.values(), key=lambda r: r.median_ms),
                joint_vs_bf16=_speedup(bf16, joint, seed),
                joint_vs_single=_speedup(single, joint, seed),
                clean=all(r.first_token_match and not r.fallbacks for r in acts.values())))
    return rows


def _ms(r: Summary | None, with_r: bool = False) -> str:
    if r is None:
        return "–"
    return f"{r.median_ms:.2f}" + (f" (r={suffix_label(r)})" if with_r else "")


def _x(s: Speedup | None) -> str:
    return "–" if s is None else s.text()


def table1_markdown(records: Sequence[Summary], joint_bits: int = 8, seed: int = 0) -> str:
    """Table-1-style markdown, one table per setup."""
    jp = f"Q{joint_bits}"
    out = []
    rows = table1_rows(records, joint_bits, seed)
    for setup in dict.fromkeys(r.setup for r in rows):
        sel = [r for r in rows if r.setup == setup]
        out += [f"### Handoff latency, median ms ({setup_label(setup)}, {sel[0].reps} reps, "
                "overlapped schedule)", "",
                f"| model | S | BF16 | Q8 | Recomp. (r) | Joint {jp} (r) | joint vs BF16 "
                "[95% CI] | joint vs best single [95% CI] | fastest measured |",
                "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        for r in sel:
            flag = "" if r.clean else " ⚠ a first-token mismatch or fallback in this cell"
            out.append(f"| {r.model} | {r.seq_len} | {_ms(r.bf16)} | {_ms(r.q8)} | "
                       f"{_ms(r.recompute, True)} | {_ms(r.joint, True)} | "
                       f"{_x(r.joint_vs_bf16)} | {_x(r.joint_vs_single)} | "
                       f"{r.best.action} ({_ms(r.best)}){flag} |")
        out += ["", "Recomp.: fastest BF16 action with a recomputed suffix (r = suffix length; "
                "`all` = token IDs only). Best single = faster of Q8 transfer-only and Recomp. "
                "CIs: independent bootstrap of the reps of the two actions.", ""]
    return "\n".join(out)


def _profile_for(profiles: Sequence[Profile], r: Summary) -> Profile | None:
    """The profile that can predict record `r` (`planner.find_profile`): one that timed its
    prefix's quantizer, re-targeted to its paced link."""
    return find_profile(profiles, r.model, r.action.num_layers, r.seq_len, r.batch, r.link_gbps,
                        r.action.bits if r.action.cut else None)


def record_prediction(r: Summary, profiles: Sequence[Profile] = ()) -> float | None:
    """`r`'s own `predicted_ms`, else the matching profile's prediction for its mode
    (re-targeted to its paced link); None when no profile matches."""
    if r.predicted_ms is not None or (p := _profile_for(profiles, r)) is None:
        return r.predicted_ms
    return predicted_ms(p, r.mode)


def prediction_rows(records: Sequence[Summary], profiles: Sequence[Profile] = ()
                    ) -> list[PredictionRow]:
    """Every record with a prediction (`record_prediction`) and the error in % of the
    measurement."""
    rows = []
    for r in records:
        if (pred := record_prediction(r, profiles)) is not None:
            rows.append(PredictionRow(
                r.model, r.seq_len, r.schedule, r.link_gbps, r.hardware, r.transport, r.batch,
                str(r.action), measured_ms=r.median_ms, predicted_ms=pred,
                error_pct=100 * (pred - r.median_ms) / r.median_ms))
    return rows


def error_summary(rows: Sequence[PredictionRow]) -> dict[str, float]:
    """Median |error| % per action text (across models, lengths, links and schedules)."""
    by: dict[str, list[float]] = {}
    for r in rows:
        by.setdefault(r.action, []).append(abs(r.error_pct))
    return {a: float(np.median(v)) for a, v in sorted(by.items())}


def predictions_markdown(records: Sequence[Summary], profiles: Sequence[Profile] = ()) -> str:
    rows = prediction_rows(records, profiles)
    if not rows:
        return ("### Cost model vs measurement\n\nNo predictions: no record has `predicted_ms` "
                "and no profile matches.\n")
    out = ["### Cost model vs measurement (median ms; error = (predicted - measured) / measured)",
           "", "| hardware | transport | link | model | S | schedule | action | measured | "
           "predicted | error % |",
           "| --- | --- | --- | --- | ---: | --- | --- | ---: | ---: | ---: |"]
    for r in rows:
        out.append(f"| {r.hardware} | {r.transport} | {link_label(r.link_gbps)} | "
                   f"{r.model} | {r.seq_len} | {r.schedule} | {r.action} | "
                   f"{r.measured_ms:.2f} | {r.predicted_ms:.2f} | {r.error_pct:+.1f} |")
    summary = error_summary(rows)
    out += ["", "| action | median abs error % |", "| --- | ---: |"]
    out += [f"| {a} | {e:.1f} |" for a, e in summary.items()]
    out += ["", f"Overall median abs error: "
            f"{np.median([abs(r.error_pct) for r in rows]):.1f} % over {len(rows)} records.", ""]
    return "\n".join(out)


def table3_rows(records: Sequence[Summary], joint_bits: int = 8, seed: int = 0
                ) -> list[Table3Row]:
    """Per setup, model and length: payload MiB per configuration, and sequential vs overlapped
    at one cut (BF16 at the best joint cut, as the paper's Table 3, else any cut run both ways)."""
    both = _by_schedule(records)
    rows = []
    for setup, cells in _cells(records).items():
        for (model, seq_len), acts in cells.items():
            fam = _best(acts.values())
            joint = fam.get(_joint_family(joint_bits))
            payload = {f"{f} ({r.action})" if "joint" in f else f:
                       r.payload_bytes / sizes.MIB
                       for f, r in fam.items() if "recompute" not in f}
            paired = {a: s for (st, m, n, a), s in both.items()
                      if (st, m, n) == (setup, model, seq_len)
                      and len(s) == 2}
            prefer = [f"bf16:r={suffix_label(joint)}"] if joint else []
            prefer += sorted(paired, key=lambda a: paired[a][False].median_ms)
            pick = next((a for a in prefer if a in paired), None)
            gain = None
            if pick is not None:
                seq, ov = paired[pick][True], paired[pick][False]
                x, ci = stats.ratio_ci(seq.reps_ms, ov.reps_ms, seed=seed)
                # Eq. 9's ideal from the uncontended phases of the sequential run (the
                # overlapped run's own phases are segments of its timeline: ~1 by construction)
                ideal = t_ov(*seq.phases_ms.ready)
                gain = ScheduleGain(pick, seq.median_ms, ov.median_ms, x, tuple(ci),
                                    efficiency_sequential_phases=ov.median_ms / ideal)
            rows.append(Table3Row(setup, model, seq_len, payload, gain))
    return rows


def _by_schedule(records: Iterable[Summary]) -> dict[tuple, dict[bool, Summary]]:
    """(setup, model, length, action) -> whether the suffix waited for the prefix (sequential)
    -> the record, for the joint actions run under the paper's two schedules, unchunked."""
    both: dict[tuple, dict[bool, Summary]] = {}
    for r in records:
        if r.mode.joint and r.mode.chunks == 1:
            both.setdefault((r.setup, r.model, r.seq_len, str(r.action)),
                            {})[r.mode.suffix_waits_for_prefix] = r
    return both


def table3_markdown(records: Sequence[Summary], joint_bits: int = 8, seed: int = 0) -> str:
    out = []
    for r in table3_rows(records, joint_bits, seed):
        out += [f"### {r.model}, {r.seq_len} tokens: payload and schedule "
                f"({setup_label(r.setup)})", "", "| payload configuration | MiB |",
                "| --- | ---: |"]
        out += [f"| {k} | {v:.2f} |" for k, v in r.payload_mib.items()]
        s = r.schedule
        if s is None:
            out += ["", "No action was run under both schedules.", ""]
            continue
        out += ["", f"| {s.action} schedule | median ms |", "| --- | ---: |",
                f"| sequential transfer and recomputation | {s.sequential_ms:.2f} |",
                f"| overlapped transfer and recomputation | {s.overlapped_ms:.2f} |", "",
                f"Schedule gain {s.gain:.2f}× [{s.gain_ci95[0]:.2f}, "
                f"{s.gain_ci95[1]:.2f}] (independent bootstrap). Overlap efficiency "
                f"T_ov / (Q + H + max(X, R) + J): {s.efficiency_sequential_phases:.3f} with "
                "the uncontended phases of the sequential run (1 = ideal Eq. 9).", ""]
    return "\n".join(out)


def fig3_rows(records: Sequence[Summary], seed: int = 0) -> list[Fig3Row]:
    """Prompt to first token (Fig. 3): per setup, model, length and joint action timed from the
    prompt under both schedules, the medians and the overlap's speedup; its CI resamples rep
    indices jointly when the reps were paired (the paper's method), else independently."""
    both = _by_schedule(r for r in records if r.mode.from_prompt)
    rows = []
    for (setup, model, seq_len, action), by in sorted(
            both.items(), key=lambda i: (i[0][0].sort_key(), i[0][1:])):
        if len(by) < 2:
            continue
        seq, ov = by[True], by[False]
        paired = seq.paired and ov.paired and len(seq.reps_ms) == len(ov.reps_ms)
        x, ci = stats.ratio_ci(seq.reps_ms, ov.reps_ms, paired=paired, seed=seed)
        rows.append(Fig3Row(setup, model, seq_len, action, len(ov.reps_ms), seq.median_ms,
                            ov.median_ms, x, tuple(ci), paired))
    return rows


def fig3_markdown(records: Sequence[Summary], seed: int = 0) -> str:
    """Fig.-3-style markdown, one table per setup."""
    out = []
    rows = fig3_rows(records, seed)
    for setup in dict.fromkeys(r.setup for r in rows):
        out += [f"### Prompt to first token, median ms ({setup_label(setup)})", "",
                "| model | tokens | action | reps | sequential | overlapped | speedup [95% CI] |"
                " CI |", "| --- | ---: | --- | ---: | ---: | ---: | ---: | --- |"]
        out += [f"| {r.model} | {r.seq_len} | {r.action} | {r.reps} | "
                f"{r.sequential_ms:.2f} | {r.overlapped_ms:.2f} | {r.speedup:.2f}× "
                f"[{r.ci95[0]:.2f}, {r.ci95[1]:.2f}] | "
                f"{'paired' if r.paired else 'independent'} bootstrap |"
                for r in rows if r.setup == setup]
        out.append("")
    return "\n".join(out)


def batch_rows(records: Sequence[Summary], joint_bits: int = 8, seed: int = 0
               ) -> list[BatchRow]:
    """Simultaneously ready requests (batch > 1): per setup, model and length, the best joint
    action at `joint_bits` vs its transfer-only action; completion time and requests/s."""
    rows = []
    for setup, cells in _cells(records).items():
        batch = setup.batch
        if batch < 2:
            continue
        for (model, seq_len), acts in cells.items():
            fam = _best(acts.values())
            joint = fam.get(_joint_family(joint_bits))
            transfer = fam.get(f"Q{joint_bits} transfer")
            rows.append(BatchRow(
                setup, model, seq_len, batch, joint, transfer,
                requests_per_s={k: None if r is None else batch * 1e3 / r.median_ms
                                for k, r in (("joint", joint), ("transfer", transfer))},
                joint_vs_transfer=_speedup(transfer, joint, seed)))
    return rows


def batch_markdown(records: Sequence[Summary], joint_bits: int = 8, seed: int = 0) -> str:
    """Batch completion time and requests/s, one table per setup."""
    out = []
    for r in batch_rows(records, joint_bits, seed):
        out += [f"### Batch {r.batch}: {r.model}, {r.seq_len} tokens "
                f"({setup_label(r.setup)})", "",
                "| action | batch completion ms [95% CI] | requests/s |", "| --- | ---: | ---: |"]
        for key, label, rec in (("joint", f"joint Q{joint_bits}", r.joint),
                                ("transfer", f"Q{joint_bits} transfer-only", r.transfer)):
            if rec is not None:
                out.append(f"| {label} ({rec.action}) | {rec.median_ms:.2f} "
                           f"[{rec.ci95_ms[0]:.2f}, {rec.ci95_ms[1]:.2f}] | "
                           f"{r.requests_per_s[key]:.2f} |")
        out += ["", f"Joint vs transfer-only: {_x(r.joint_vs_transfer)} (independent "
                "bootstrap).", ""]
    return "\n".join(out)


def _crossover_groups(records: Sequence[Summary]
                      ) -> dict[tuple, dict[float, dict[str, Summary]]]:
    """(hardware, transport, batch, model, length) -> paced link -> action -> record, for the
    groups measured at two or more paced links (timed from the prefill state, one device per
    side: the crossover compares links, nothing else)."""
    groups: dict[tuple, dict[float, dict[str, Summary]]] = {}
    for s, cells in _cells(records).items():
        one_device = (s.prefill_devices, s.decode_devices) == (1, 1)
        if s.link_gbps is None or not (paper_timing(s.interval, s.prefill) and one_device):
            continue
        for (model, seq_len), acts in cells.items():
            groups.setdefault((s.hardware, s.transport, s.batch, model, seq_len),
                              {})[s.link_gbps] = acts
    return {k: dict(sorted(v.items())) for k, v in sorted(groups.items()) if len(v) >= 2}


def _profile_of(profiles: Sequence[Profile], key: tuple) -> Profile | None:
    """The profile of a crossover group (`planner.find_profile`; each link re-targets it)."""
    _, _, batch, model, seq_len = key
    return find_profile(profiles, model, None, seq_len, batch)


def _predicted_preference(profile: Profile, by_link: dict[float, dict[str, Summary]],
                          n_grid: int = 200) -> list[LinkChoice]:
    """The profile's preferred action on a fine link grid spanning the measured links."""
    actions = list(dict.fromkeys(r.action for acts in by_link.values() for r in acts.values()))
    grid = np.geomspace(min(by_link) / 2, max(by_link) * 2, n_grid)
    return preferred_by_link(profile, actions, [float(w) for w in grid])


def crossover_rows(records: Sequence[Summary], profiles: Sequence[Profile] = ()
                   ) -> list[CrossoverRow]:
    """Per group measured at >= 2 paced links: the fastest action at each link, measured and
    predicted among the same actions (the matching profile re-targeted to that link)."""
    rows = []
    for key, by_link in _crossover_groups(records).items():
        profile = _profile_of(profiles, key)
        for link, acts in by_link.items():
            best = min(acts.values(), key=lambda r: r.median_ms)
            pred = None if profile is None else preferred_by_link(
                profile, [r.action for r in acts.values()], [link])[0]
            rows.append(CrossoverRow(
                key, link, str(best.action), best.median_ms,
                {f: r.median_ms for f, r in _best(acts.values()).items()},
                *((None, None) if pred is None else (pred.best, pred.ms))))
    return rows


def crossover_markdown(records: Sequence[Summary], profiles: Sequence[Profile] = ()) -> str:
    out = []
    rows = crossover_rows(records, profiles)
    for key, by_link in _crossover_groups(records).items():
        hardware, transport, batch, model, seq_len = key
        sel = [r for r in rows if r.group == key]
        fams = [f for f in FAMILIES if any(f in r.families_ms for r in sel)]
        out += [f"### Preferred action vs link: {model}, {seq_len} tokens (hardware: {hardware} "
                f"· transport: {transport} · batch {batch}; paced links)", "",
                "| link GB/s | measured best | ms | predicted best | ms | "
                + " | ".join(fams) + " |", "| ---: | --- | ---: | --- | ---: |"
                + " ---: |" * len(fams)]
        for r in sel:
            pred = (f"{r.predicted_best} | {r.predicted_ms:.2f}" if r.predicted_best is not None
                    else "– | –")
            out.append(f"| {r.link_gbps:g} | {r.measured_best} | {r.measured_ms:.2f} | "
                       f"{pred} | " + " | ".join(f"{r.families_ms[f]:.2f}" if f in
                                                 r.families_ms else "–" for f in fams) + " |")
        measured = crossovers([LinkChoice(r.link_gbps, r.measured_best, r.measured_ms)
                               for r in sel])
        text = [f"{c.before} → {c.after} between {c.between_gbps[0]:g} and "
                f"{c.between_gbps[1]:g} GB/s" for c in measured]
        out += ["", "Measured crossovers: " + ("; ".join(text) or "none in this range") + "."]
        if (profile := _profile_of(profiles, key)) is not None:
            predicted = crossovers(_predicted_preference(profile, by_link))
            text = [f"{c.before} → {c.after} at ≈ {math.sqrt(math.prod(c.between_gbps)):.3g} "
                    "GB/s" for c in predicted]
            out.append(f"Predicted crossovers ({profile.source} profile, {profile.hardware}, "
                       "among the measured actions): "
                       + ("; ".join(text) or "none in this range") + ".")
        out.append("")
    return "\n".join(out)
