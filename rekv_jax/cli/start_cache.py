"""What makes a second `rekv serve` start fast: JAX's persistent compilation cache in this
process and every worker it starts (`use_caches`), and the start profile read back from the
user cache folder when this model, machine, code and measurement were profiled before
(`start_profiles`; `compile_cache` says where, and what the key holds). The start says which
it did on stderr: "profile: cached at PATH", or "profile: measured, cached at PATH", each with
where the programs are cached.
"""

from __future__ import annotations

import json
import os
import sys

from rekv_jax.cli.flags import PAPER_LINK


def use_caches() -> None:
    """The persistent compilation cache, on before anything compiles (`compile_cache`)."""
    from rekv_jax.compile_cache import use_compile_cache

    use_compile_cache()


def _programs() -> str:
    """Where compiled programs are cached, in words."""
    from rekv_jax.compile_cache import CACHE_ENV, OFF, cache_root

    root = cache_root()
    return f"programs cached in {root / 'jax'}" if root else f"no cache (${CACHE_ENV}={OFF})"


def start_profiles(config, transport: str, reps: int) -> tuple:
    """The cost model's profiles at the shortest and the longest prompt length of `config`'s
    load (512 for clients), `reps` timed handoffs per action: cached, else measured now
    (`rekv profile`, over the calibrated link when the link is `paper`) and cached, the file
    replaced whole so a concurrent start never reads half of one."""
    from rekv_jax.compile_cache import cache_root, profile_path
    from rekv_jax.planning.costmodel import load_profiles

    lengths = sorted({r.prompt_len for s in config.streams for r in s.requests}) or [512]
    lengths = sorted({lengths[0], lengths[-1]})
    root = cache_root()
    path = root and profile_path(root, config.model, {
        "lengths": lengths, "transport": transport, "link": config.workers.link_gbps,
        "reps": reps, "pin": config.workers.pin})
    if path is not None and path.is_file():
        print(f"rekv serve: profile: cached at {path}; {_programs()}", file=sys.stderr,
              flush=True)
        return tuple(load_profiles(path))
    profiles = _measure(config, transport, reps, lengths)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_suffix(f".{os.getpid()}.part")
        part.write_text("".join(json.dumps(p.to_json()) + "\n" for p in profiles))
        part.replace(path)
    print("rekv serve: profile: measured" + (f", cached at {path}" if path else "")
          + f"; {_programs()}", file=sys.stderr, flush=True)
    return profiles


def _measure(config, transport: str, reps: int, lengths: list[int]) -> tuple:
    from rekv_jax.study import sweep

    link = config.workers.link_gbps
    if link == PAPER_LINK:
        link = sweep.calibrate_pair_link(config.model, lengths[0], transport).link_gbps
    print(f"rekv serve: measuring the cost model's profiles at {lengths} tokens "
          "(give --profile to skip)", file=sys.stderr, flush=True)
    return tuple(sweep.profile(config.model, n, transport, link, reps) for n in lengths)
