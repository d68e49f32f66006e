"""A third-party benchmark client against `rekv serve --http`: NVIDIA's AIPerf, installed from
PyPI into its own environment and run unmodified, sends Poisson arrivals to the completions API
and then to the chat API of one server started here with `--json`; its per-request time to first
token (TTFT) and inter-token latency (ITL) are set beside rekv's own records of the same requests.

    python3.11 -m venv .benchvenv && .benchvenv/bin/pip install aiperf==0.13.0
    python scripts/bench_third_party.py --aiperf .benchvenv/bin/aiperf --out results/third_party

What each side measures, per request:
- AIPerf: TTFT from just before it sends the request to the first streamed chunk that carries
  text; ITL = (last such chunk - first) / (completion tokens - 1), the tokens from the server's
  `usage` (`--use-server-token-count`). Its times hold the HTTP exchange: the connection, the
  request's parse, the event framing and its own parse of each chunk.
- rekv: TTFT from the request's arrival at the router to its first token reaching the router;
  TPOT (its ITL) = (last token - first) / (tokens - 1), on the router's clock.

The requests pair up in arrival order (each API's warm-up requests, which AIPerf leaves out of its
figures, come first and are skipped); a pair agrees when rekv's prompt and generated token counts
equal the `usage` AIPerf read. Every request asks `ignore_eos`, so each generates its
`max_tokens`. The one JSON document printed says, per API, both sides' median and p90 and whether
the client's median is within the tolerance of rekv's; `--out` gets it with every request's pair
(`comparison.json`), rekv's records (`rekv.jsonl`) and AIPerf's own summary, console table and
request bodies (`aiperf-API/`).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

APIS = ("completions", "chat")  # AIPerf's endpoint types, run in this order on one server
TOLERANCE = 0.10  # the client's median may differ from rekv's by this share
KEPT = ("profile_export_aiperf.json", "profile_export_console.txt", "inputs.json")
REKV_FIELDS = ("id", "arrival_s", "prompt_len", "ttft_ms", "tpot_ms", "completed")  # kept
STOP_WAIT_S = 30.0  # after SIGINT, then after SIGTERM, before the next signal


def aiperf_command(args: argparse.Namespace, api: str, url: str, model: str, tokenizer: Path,
                   artifacts: Path) -> list[str]:
    """One AIPerf run: `args.requests` streamed requests of `api` at Poisson arrivals of
    `args.rate` per second after `args.warmup` warm-up requests, prompts of
    `args.prompt_tokens` tokens (the tokenizer's count) and `args.output_tokens` generated."""
    return [args.aiperf, "profile", "--model", model, "--url", url, "--endpoint-type", api,
            "--streaming", "--tokenizer", str(tokenizer),
            "--request-rate", str(args.rate), "--arrival-pattern", "poisson",
            "--request-count", str(args.requests), "--warmup-request-count", str(args.warmup),
            "--random-seed", str(args.seed),
            "--isl", str(args.prompt_tokens), "--isl-stddev", "0",
            "--osl", str(args.output_tokens), "--osl-stddev", "0",
            "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
            "--export-level", "records", "--artifact-dir", str(artifacts),
            "--ui", "none", "--no-server-metrics", "--no-gpu-telemetry"]


def tokenizer_folder(model: str | None, into: Path) -> Path:
    """An HF tokenizer folder AIPerf loads offline: the model's `tokenizer.json`, and its
    `tokenizer_config.json` (the chat template) where it has one, naming the fast tokenizer."""
    from rekv_jax.model.loader import SHIPPED_MODEL

    folder = Path(model.removeprefix("hf:")) if model else SHIPPED_MODEL
    if not (folder / "tokenizer.json").is_file():
        raise SystemExit(f"{folder} holds no tokenizer.json: AIPerf makes text prompts, so the "
                         "model must take text")
    into.mkdir(parents=True)
    shutil.copy(folder / "tokenizer.json", into / "tokenizer.json")
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    (into / "tokenizer_config.json").write_text(json.dumps(config))
    return into


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5.0) as answer:
        return json.loads(answer.read())


def wait_ready(url: str, server: subprocess.Popen, stderr: Path, timeout_s: float) -> str:
    """Wait until the server answers `/health`; the id of the model it serves."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            tail = "\n".join(stderr.read_text().splitlines()[-10:])
            raise SystemExit(f"rekv serve ended at start (exit {server.returncode}):\n{tail}")
        try:
            get_json(f"{url}/health")
            return get_json(f"{url}/v1/models")["data"][0]["id"]
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"rekv serve did not answer {url}/health within {timeout_s:.0f} s")


def stop(server: subprocess.Popen) -> str:
    """End the server as Ctrl-C would, then harder; the signal that ended it."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        if server.poll() is not None:
            return "none"
        server.send_signal(sig)
        try:
            server.wait(STOP_WAIT_S)
            return sig.name
        except subprocess.TimeoutExpired:
            continue
    server.kill()
    server.wait()
    return "SIGKILL"


def run_aiperf(command: list[str], artifacts: Path) -> None:
    """Run AIPerf (its tokenizer is an absolute local folder, which it loads without the hub;
    HF_HUB_OFFLINE would send it to the hub's cache instead, where the folder is not); if it
    fails, say why, with the server's answer to the first failed request."""
    log = artifacts.with_suffix(".log")
    with log.open("w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode == 0:
        return
    export = artifacts / "profile_export.jsonl"
    lines = export.read_text().splitlines() if export.is_file() else []
    errors = [e for e in (json.loads(line).get("error") for line in lines) if e]
    first = f"; the first failed request: {errors[0]}" if errors else ""
    tail = "\n".join(log.read_text().splitlines()[-12:])
    raise SystemExit(f"aiperf exited {done.returncode}{first}\n{tail}")


def metric(metrics: dict, tag: str) -> float | None:
    """One of AIPerf's per-request metrics, in ms or tokens (None: it has none)."""
    if tag not in metrics:
        return None
    if metrics[tag]["unit"] not in ("ms", "tokens"):
        raise ValueError(f"aiperf's {tag} is in {metrics[tag]['unit']}, expected ms or tokens")
    return metrics[tag]["value"]


def client_records(export: Path) -> list[dict]:
    """AIPerf's measured requests (not its warm-up) from its per-request export, in the order it
    sent them: when it sent each, its TTFT and ITL (ms), the server's token counts, and how many
    chunks carried text."""
    out = []
    for line in export.read_text().splitlines():
        d = json.loads(line)
        meta, m = d["metadata"], d.get("metrics", {})
        if meta["benchmark_phase"] != "profiling":
            continue
        gaps = m.get("inter_chunk_latency", {}).get("value", [])
        out.append({"x_request_id": meta["x_request_id"], "sent_s": meta["request_start_ns"] / 1e9,
                    "ttft_ms": metric(m, "time_to_first_token"),
                    "itl_ms": metric(m, "inter_token_latency"),
                    "prompt_tokens": metric(m, "usage_prompt_tokens"),
                    "completion_tokens": metric(m, "usage_completion_tokens"),
                    "text_chunks": len(gaps) + 1, "error": d.get("error")})
    return sorted(out, key=lambda r: r["sent_s"])


def rekv_records(stdout: str) -> list[dict]:
    """rekv's record of each served request (`--json`), in arrival order."""
    records = []
    for line in stdout.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            if d.get("kind") == "served_request":
                records.append(d)
    return sorted(records, key=lambda r: r["arrival_s"])


def pair(client: list[dict], rekv: list[dict]) -> list[dict]:
    """Each measured request's two records side by side, and whether their counts agree."""
    pairs = []
    for c, r in zip(client, rekv, strict=True):
        tokens = len(r.get("tokens") or ())
        agree = r["prompt_len"] == c["prompt_tokens"] and tokens == c["completion_tokens"]
        pairs.append({"client": c, "rekv": {k: r[k] for k in REKV_FIELDS} | {"tokens": tokens},
                      "agree": agree})
    return pairs


def figures(client: list[float], rekv: list[float], tolerance: float) -> dict:
    """Both sides' median and p90, the client's over rekv's, and whether the medians agree."""
    c, r = np.asarray(client, float), np.asarray(rekv, float)
    out = {"client_p50": float(np.median(c)), "client_p90": float(np.quantile(c, 0.9)),
           "rekv_p50": float(np.median(r)), "rekv_p90": float(np.quantile(r, 0.9)),
           "client_minus_rekv_p50": float(np.median(c - r))}
    out["ratio_p50"] = out["client_p50"] / out["rekv_p50"]
    out["ratio_p90"] = out["client_p90"] / out["rekv_p90"]
    out["within"] = abs(out["ratio_p50"] - 1.0) <= tolerance
    return out


def compare(pairs: list[dict], tolerance: float) -> dict:
    """One API's verdict over its pairs (every request must have completed on both sides)."""
    failed = [p for p in pairs if p["client"]["error"] or not p["rekv"]["completed"]]
    if failed:
        raise SystemExit(f"{len(failed)} of {len(pairs)} requests failed, e.g. {failed[0]}")
    offsets = np.array([p["client"]["sent_s"] - p["rekv"]["arrival_s"] for p in pairs])
    c, r = [p["client"] for p in pairs], [p["rekv"] for p in pairs]
    return {"requests": len(pairs), "pairs_agree": all(p["agree"] for p in pairs),
            "arrival_spread_ms": float(np.max(np.abs(offsets - np.median(offsets))) * 1e3),
            "short_of_text_chunks": sum(x["text_chunks"] != x["completion_tokens"] for x in c),
            "ttft_ms": figures([x["ttft_ms"] for x in c], [x["ttft_ms"] for x in r], tolerance),
            "itl_ms": figures([x["itl_ms"] for x in c], [x["tpot_ms"] for x in r], tolerance)}


def split(rekv: list[dict], runs: list[list[dict]], warmup: int) -> list[list[dict]]:
    """rekv's records of each AIPerf run's measured requests: the runs came one after another,
    each after its warm-up requests."""
    want = sum(warmup + len(run) for run in runs)
    if len(rekv) != want:
        raise SystemExit(f"rekv recorded {len(rekv)} requests; the client sent {want} "
                         f"({len(runs)} runs of {warmup} warm-up and the measured ones)")
    out, start = [], 0
    for run in runs:
        out.append(rekv[start + warmup:start + warmup + len(run)])
        start += warmup + len(run)
    return out


def serve_command(args: argparse.Namespace, port: int) -> list[str]:
    model = ["--model", args.model] if args.model else []
    policy = ["--policy", args.policy] if args.policy else []
    return [*shlex.split(args.rekv), "serve", "--http", f"127.0.0.1:{port}", "--json", *model,
            *policy, *shlex.split(args.serve_args)]


def measure(args: argparse.Namespace, work: Path) -> dict:
    """Start the server, run AIPerf on each API, stop the server; both sides' records."""
    tokenizer = tokenizer_folder(args.model, work / "tokenizer")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server_cmd = serve_command(args, port)
    raw, log = work / "rekv.stdout", work / "rekv.stderr"
    with raw.open("w") as out, log.open("w") as err:
        server = subprocess.Popen(server_cmd, stdout=out, stderr=err, start_new_session=True)
    runs, commands = [], {}
    try:
        model = wait_ready(url, server, log, args.start_timeout)
        for api in args.apis:
            commands[api] = aiperf_command(args, api, url, model, tokenizer, work / api)
            run_aiperf(commands[api], work / api)
            runs.append(client_records(work / api / "profile_export.jsonl"))
    finally:
        stopped_by = stop(server)
    return {"server": server_cmd, "stopped_by": stopped_by, "aiperf": commands,
            "client": runs, "rekv": rekv_records(raw.read_text())}


def keep(work: Path, out: Path, apis: list[str], rekv: list[dict]) -> None:
    """What `--out` keeps of the run besides the comparison."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "rekv.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rekv))
    for api in apis:
        (out / f"aiperf-{api}").mkdir(exist_ok=True)
        for name in KEPT:
            shutil.copy(work / api / name, out / f"aiperf-{api}" / name)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--aiperf", default="aiperf", help="the AIPerf executable (its own venv)")
    p.add_argument("--model", default=None, help="rekv serve's --model (default: its default)")
    p.add_argument("--policy", default=None, help="rekv serve's --policy (default: its default)")
    p.add_argument("--serve-args", default="", help="more flags for rekv serve, one string")
    p.add_argument("--rekv", default=f"{shlex.quote(sys.executable)} -m rekv_jax.cli",
                   help="the command that runs rekv")
    p.add_argument("--apis", default=",".join(APIS), type=lambda s: s.split(","))
    p.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals per second")
    p.add_argument("--requests", type=int, default=100, help="measured requests per API")
    p.add_argument("--warmup", type=int, default=10, help="warm-up requests per API")
    p.add_argument("--prompt-tokens", type=int, default=512,
                   help="long enough that TTFT stands well above the HTTP exchange's few ms")
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0, help="AIPerf's prompts and arrivals")
    p.add_argument("--tolerance", type=float, default=TOLERANCE)
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds to wait for it")
    p.add_argument("--out", type=Path, default=None, help="write the records here")
    args = p.parse_args(argv)
    if not set(args.apis) <= set(APIS):
        p.error(f"--apis: a comma list of {APIS}, got {args.apis}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-third-party-") as tmp:
        work = Path(tmp)
        run = measure(args, work)
        rekv = split(run["rekv"], run["client"], args.warmup)
        pairs = {api: pair(c, r) for api, c, r in zip(args.apis, run["client"], rekv,
                                                      strict=True)}
        version = subprocess.run([args.aiperf, "--version"], capture_output=True, text=True,
                                 check=True).stdout.split()[-1]
        doc = {"tool": {"name": "aiperf", "version": version},
               "command": ["python", "scripts/bench_third_party.py", *sys.argv[1:]],
               "server": run["server"], "stopped_by": run["stopped_by"],
               "load": {k: getattr(args, k) for k in ("rate", "requests", "warmup",
                                                      "prompt_tokens", "output_tokens", "seed")},
               "tolerance": args.tolerance,
               "apis": {api: {"aiperf": run["aiperf"][api], **compare(p, args.tolerance)}
                        for api, p in pairs.items()}}
        doc["within"] = all(a["ttft_ms"]["within"] and a["itl_ms"]["within"] and a["pairs_agree"]
                            for a in doc["apis"].values())
        if args.out is not None:
            keep(work, args.out, args.apis, run["rekv"])
            full = doc | {"pairs": pairs}
            (args.out / "comparison.json").write_text(json.dumps(full, indent=1) + "\n")
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
