"""The shared vocabulary of a handoff's timing: phase names and the modes that decide what is timed
and how the decode side runs."""

from __future__ import annotations

PHASES = ("quantize", "boundary", "prefix", "suffix", "join")
PROMPT_PHASES = ("prefill", *PHASES)  # a measured handoff also reports the prefill's own compute
INTERVALS = ("ready", "prompt")  # timed from the prefill state being ready, or from the prompt
PIPELINED = "pipelined"  # token chunks through 0..c-1, each streamed as computed
PREFILL_MODES = ("full", "split", PIPELINED)  # all L layers, only 0..c-1, or 0..c-1 in chunks
CHUNKED = "chunked"  # the boundary in token chunks, each run through c..L-1 as it arrives
SCHEDULES = ("overlapped", "sequential", CHUNKED)  # what the model predicts (handoff runs them)


def check_modes(interval: str, prefill_mode: str) -> None:
    """ValueError unless (interval, prefill mode) is a valid pair (split, pipelined need the
    prompt)."""
    if interval not in INTERVALS or prefill_mode not in PREFILL_MODES:
        raise ValueError(f"interval must be one of {INTERVALS} and prefill one of "
                         f"{PREFILL_MODES}, got {interval!r}, {prefill_mode!r}")
    if prefill_mode != "full" and interval != "prompt":
        raise ValueError(f"a {prefill_mode} prefill streams while it computes, so its interval "
                         "starts at the prompt: use interval 'prompt'")


def check_chunks(schedule: str, prefill_mode: str, chunks: int, seq_len: int) -> None:
    """ValueError unless `chunks` suits the schedule: N > 1 only for the chunked schedule or a
    pipelined prefill (not with a split one), and at most one chunk per token."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or not 1 <= chunks <= seq_len:
        raise ValueError(f"chunks must be an integer in 1..{seq_len} (the tokens), got {chunks!r}")
    if schedule == CHUNKED and prefill_mode == "split":
        raise ValueError("a split prefill streams per layer; chunk the boundary with a full "
                         "prefill, or use prefill 'pipelined'")
    if chunks > 1 and schedule != CHUNKED and prefill_mode != PIPELINED:
        raise ValueError(f"{chunks} chunks need schedule {CHUNKED!r} or prefill {PIPELINED!r}")


# SCHEDULES: these, and chunked: the suffix runs on each token chunk of `h_c` as it arrives
PAPER_SCHEDULES = SCHEDULES[:2]  # overlapped, sequential (Eqs. 8-9)
FALLBACKS = ("error", "recompute")
