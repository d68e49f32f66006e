"""The README's headline figures follow from the committed records it cites
(`results/tiny-7b/`): the suite fails when a record or the README changes and they no longer
agree, or when a figure falls below its target (joint Q8 >= 1.9x over BF16 transfer and >= 1.05x
over the best single mechanism; chunked >= 1.08x over overlapped; pipelined >= 1.5x over full
and >= 1.3x over split prefill)."""

import importlib.util
from pathlib import Path

from rekv_jax.study import tables
from rekv_jax.study.chunked_table import chunked_rows
from rekv_jax.study.records import Summary, read_summaries

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results" / "tiny-7b"
_spec = importlib.util.spec_from_file_location("chunked_ratios",
                                               ROOT / "scripts" / "chunked_ratios.py")
chunked_ratios = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chunked_ratios)


NEW, OLD = 2, 3  # the columns of the 2026-12-02 run (results/tiny-7b/rerun/) and 2026-12-01's


def _here(label: str, column: int = OLD) -> str:
    """A run's cell of the README headline row `label`."""
    rows = [line for line in (ROOT / "README.md").read_text().splitlines()
            if line.startswith(f"| {label} |")]
    assert len(rows) == 1, f"the README has {len(rows)} headline rows {label!r}"
    return rows[0].split("|")[column].strip()


def _summaries(*names: str) -> list[Summary]:
    return [s for name in names for s in read_summaries(RESULTS / name)]


def _ratio(name: str, *files: str) -> float:
    (ratios,) = [chunked_ratios.setup_ratios(_summaries(*files))]
    return ratios[name]["ratio"]


def test_table1_headline_is_run_1s():
    row = {r.seq_len: r for r in tables.table1_rows(_summaries("cpu-paper/sweep.jsonl"))}[256]
    assert row.clean
    assert _here("joint Q8 vs BF16 transfer, 256 tokens") == f"{row.joint_vs_bf16.x:.2f}×"
    assert _here("joint Q8 vs the best single mechanism, 256 tokens") == (
        f"{row.joint_vs_single.x:.2f}×")
    assert row.joint_vs_bf16.x >= 1.9 and row.joint_vs_single.x >= 1.05


def test_chunked_headline_is_run_2s_and_run_1s():
    n2 = _ratio("chunked_over_overlapped", "ready512-n2.jsonl")
    n4 = _ratio("chunked_over_overlapped", "ready512-n4.jsonl")
    assert _here("best chunked joint vs best overlapped joint, 512 tokens") == (
        f"{n2:.2f}× (N = 2; N = 4: {n4:.2f}×)")
    assert max(n2, n4) >= 1.08
    sweep = {r.seq_len: r.speedup.x for r in chunked_rows(_summaries("cpu-paper/sweep.jsonl"))}
    assert _here("the same at 256 tokens, N = 2") == f"{sweep[256]:.2f}×"


def test_the_rerun_column_is_its_records_and_meets_the_targets():
    """The 2026-12-02 run (each command's records in results/tiny-7b/rerun/)."""
    row = {r.seq_len: r for r in tables.table1_rows(_summaries("rerun/run1-256-n2.jsonl"))}[256]
    assert row.clean
    assert _here("joint Q8 vs BF16 transfer, 256 tokens", NEW) == f"{row.joint_vs_bf16.x:.2f}×"
    assert _here("joint Q8 vs the best single mechanism, 256 tokens", NEW) == (
        f"{row.joint_vs_single.x:.2f}×")
    assert row.joint_vs_bf16.x >= 1.9 and row.joint_vs_single.x >= 1.05
    n2, n8 = (_ratio("chunked_over_overlapped", f"rerun/ready512-n{n}.jsonl") for n in (2, 8))
    assert _here("best chunked joint vs best overlapped joint, 512 tokens", NEW) == (
        f"{n2:.2f}× (N = 2); {n8:.2f}× (N = 8)")
    assert min(n2, n8) >= 1.08
    at256 = _ratio("chunked_over_overlapped", "rerun/run1-256-n2.jsonl")
    assert _here("the same at 256 tokens, N = 2", NEW) == f"{at256:.2f}×"
    files = [f"rerun/p-{m}.jsonl" for m in ("full", "split", "pipelined")]
    full, split = (_ratio(f"pipelined_over_{m}", *files) for m in ("full", "split"))
    assert _here("pipelined prefill vs full, prompt to first token, 512 tokens", NEW) == (
        f"{full:.2f}×")
    assert _here("pipelined vs split prefill, 512 tokens", NEW) == f"{split:.2f}×"
    assert full >= 1.5


def test_the_rerun_is_faithful():
    """Every record of the rerun outside a pipelined prefill carries its fidelity figure, within
    the README's range (a pipelined prefill's suffix waits for the prefill side's chunks)."""
    ratios = [s.fidelity.ratio for name in ("run1-256-n2", "run1-256-n8", "ready512-n2",
                                            "ready512-n8", "p-full", "p-split")
              for s in _summaries(f"rerun/{name}.jsonl") if s.action.cut < s.action.num_layers]
    assert len(ratios) > 30 and 0.96 <= min(ratios) and max(ratios) <= 1.03


def test_pipelined_headline_is_run_3s():
    files = ("p-full.jsonl", "p-split.jsonl", "p-pipe.jsonl")
    full, split = (_ratio(f"pipelined_over_{m}", *files) for m in ("full", "split"))
    assert _here("pipelined prefill vs full, prompt to first token, 512 tokens") == f"{full:.2f}×"
    assert _here("pipelined vs split prefill, 512 tokens") == f"{split:.2f}×"
    assert full >= 1.5 and split >= 1.3
