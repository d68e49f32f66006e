"""Past the paper's tables: the token-chunked boundary beside the paper's overlapped schedule,
from the same summary records as `tables`."""

from __future__ import annotations

from collections.abc import Sequence

from rekv_jax.mode import Formula
from rekv_jax.study.records import ChunkedRow, Summary
from rekv_jax.study.tables import _ms, _speedup, setup_label


def chunked_rows(records: Sequence[Summary], seed: int = 0) -> list[ChunkedRow]:
    """Past the paper: per setup, model, length and N, the best joint action under the chunked
    schedule against the best one under the overlapped schedule."""
    best: dict[tuple, Summary] = {}
    for r in records:
        mode = r.mode
        if not (mode.joint and r.first_token_match and not mode.from_prompt) or (
                mode.formula not in (Formula.OVERLAPPED, Formula.CHUNKED)):
            continue
        key = (r.setup, r.model, r.seq_len, mode.formula, mode.chunks)
        if key not in best or r.median_ms < best[key].median_ms:
            best[key] = r
    rows = []
    for (setup, model, seq_len, formula, chunks), ch in sorted(
            best.items(), key=lambda i: (i[0][0].sort_key(), i[0][1:3], i[0][4])):
        ov = best.get((setup, model, seq_len, Formula.OVERLAPPED, 1))
        if formula == Formula.CHUNKED and ov is not None:
            rows.append(ChunkedRow(setup, model, seq_len, chunks, ov, ch,
                                   _speedup(ov, ch, seed)))
    return rows


def chunked_markdown(records: Sequence[Summary], seed: int = 0) -> str:
    """The chunked schedule beside the paper's overlapped one, one table per setup."""
    out = []
    rows = chunked_rows(records, seed)
    for setup in dict.fromkeys(r.setup for r in rows):
        out += [f"### Past the paper: the token-chunked boundary, median ms "
                f"({setup_label(setup)})", "",
                "| model | S | N | best overlapped joint | best chunked joint | chunked vs "
                "overlapped [95% CI] |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
        out += [f"| {r.model} | {r.seq_len} | {r.chunks} | {r.overlapped.action} "
                f"({_ms(r.overlapped)}) | {r.chunked.action} ({_ms(r.chunked)}) | "
                f"{r.speedup.text()} |" for r in rows if r.setup == setup]
        out += ["", "Both: the fastest joint action of the setup whose first token matched. CI: "
                "independent bootstrap of the two actions' reps.", ""]
    return "\n".join(out)
