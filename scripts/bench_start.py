"""The first and the second start of `rekv serve --http`: how long each takes from the command
to `/health` answering, the first in an empty cache folder (`REKV_CACHE_DIR`, a fresh
temporary folder), the second in the folder the first filled (its start profile and the
compiled programs of the router and every worker, `rekv_jax.compile_cache`).

    python scripts/bench_start.py --out results/serve/start_times.json
    python scripts/bench_start.py -- --link-gbps unpaced --no-pin   # flags for `rekv serve`

Each start is stopped by SIGTERM once it answers, before the next begins. The one JSON document
printed (and written to `--out`) holds both times, their ratio, whether the second is at most
`TARGET` of the first, and what each start said of its caches on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET = 1 / 3  # the second start takes at most this share of the first
START_S = 900.0  # the most one start may take
CACHE_WORDS = ("profile:",)  # the start's lines about its caches


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
            return answer.status == 200
    except OSError:
        return False


def timed_start(cache: Path, serve_args: list[str], log: Path) -> float:
    """Seconds from starting `rekv serve --http` to its `/health` answering 200; the server
    is then stopped by SIGTERM."""
    env = os.environ | {"REKV_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO)}
    start = time.monotonic()
    with open(log, "w") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "rekv_jax.cli", "serve", "--http", "127.0.0.1:0", "--json",
             *serve_args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True,
            start_new_session=True)
    try:
        banner = process.stdout.readline()
        if not banner:
            raise RuntimeError(f"the server ended before it answered: {log.read_text()[-2000:]}")
        url = json.loads(banner)["url"].removesuffix("/v1")
        while not _healthy(url):
            if time.monotonic() - start > START_S:
                raise TimeoutError(f"no /health within {START_S:g} s")
            time.sleep(0.05)
        took = time.monotonic() - start
        process.send_signal(signal.SIGTERM)
        process.wait(60)
        return took
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="write the JSON document here too")
    p.add_argument("serve_args", nargs="*", help="flags for `rekv serve` (after --)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cache, said = Path(tmp) / "cache", {}
        times = {}
        for name in ("first", "second"):
            log = Path(tmp) / f"{name}.txt"
            times[name] = timed_start(cache, args.serve_args, log)
            said[name] = [line for line in log.read_text().splitlines()
                          if any(w in line for w in CACHE_WORDS)]
    ratio = times["second"] / times["first"]
    doc = {"kind": "start_times", "serve_args": args.serve_args,
           "first_start_s": round(times["first"], 2), "second_start_s": round(times["second"], 2),
           "ratio": round(ratio, 3), "target_ratio": round(TARGET, 3), "meets": ratio <= TARGET,
           "cpus": len(os.sched_getaffinity(0)), "said": said}
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
