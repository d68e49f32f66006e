"""`rekv serve`: its flags, their checks, and the run they describe (`serving.serve.ServeConfig`).

Every flag is checked before any process starts or any weight loads: its syntax by argparse (one
line, exit 2), the rest while the config is built (a ValueError: one line, exit 2).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from rekv_jax.cli.flags import PAPER_LINK

DEFAULT_POLICIES = "bf16:full,q8:full,q8:balanced,adaptive"  # of a generated load
HTTP_POLICY = "adaptive"  # of --http
PROMPTS = ("synthetic", "wikitext")
REQUESTS = 100  # per rate, unless --requests or --duration
MAX_NEW_TOKENS = 32  # --prompts: uniform ids, or WikiText-2 test windows
PROFILE_REPS = 5  # timed handoffs per action of a profile measured at the start


def _rates(text: str) -> tuple[float, ...]:
    """argparse type of `--rate R` / `--rates a,b,c`: positive requests per second."""
    try:
        rates = tuple(float(r) for r in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected requests per second like 2 or 0.5,1,2, got "
                                         f"{text!r}") from None
    if not all(r > 0 and r != float("inf") for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be positive and finite, got {text!r}")
    return rates


def _host_port(text: str) -> tuple[str, int]:
    """argparse type of `--http HOST:PORT` (an IPv6 host in brackets: [::1]:8000)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT like 127.0.0.1:8000, got {text!r}")
    return host.strip("[]"), int(port)


def _positive(kind: type) -> Callable[[str], int | float]:
    """argparse type of a positive `kind`."""
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value
    return parse


def add_flags(p: argparse.ArgumentParser) -> None:
    """The flags of `rekv serve` beyond the shared model, link, transport, failure, attention,
    pin and json groups."""
    load = p.add_argument_group("the generated load (or --http)")
    rate = load.add_mutually_exclusive_group()
    rate.add_argument("--rate", type=_positive(float), default=None,
                      help="Poisson arrivals per second")
    rate.add_argument("--rates", type=_rates, default=None,
                      help="a comma list of rates, each served under every policy")
    count = load.add_mutually_exclusive_group()
    count.add_argument("--requests", type=_positive(int), default=None,
                       help=f"requests per rate (default {REQUESTS} unless --duration)")
    count.add_argument("--duration", type=_positive(float), default=None,
                       help="seconds of arrivals per rate")
    load.add_argument("--seed", type=int, default=0, help="of the arrivals and the prompts")
    load.add_argument("--prompt-lens", default="256,512",
                      help="prompt lengths, each equally likely: a list like 256,512 or a range "
                           "like 128..1024")
    load.add_argument("--prompts", choices=PROMPTS, default=PROMPTS[0],
                      help="uniform token ids, or windows of WikiText-2's test split tokenized "
                           "by the model's tokenizer (else the shipped model's)")
    load.add_argument("--max-new-tokens", type=_positive(int), default=None,
                      help=f"tokens each request generates (default {MAX_NEW_TOKENS})")
    p.add_argument("--policy", default=None,
                   help="comma list of bf16:full, q8:full, bf16:recompute, any PREC:CUT, "
                        f"q8:balanced (Prop. 2's cut) and adaptive (default {DEFAULT_POLICIES}; "
                        f"--http: one, default {HTTP_POLICY})")
    p.add_argument("--adaptive-bits", default="16,8",
                   help="the prefix precisions adaptive weighs, e.g. 16,8,4")
    p.add_argument("--profile", default=None,
                   help="cost-model profiles (JSON/JSONL, e.g. `rekv profile --json`; one per "
                        "prompt length); default: measured when the workers start")
    p.add_argument("--quality", default=None,
                   help="gate results (`rekv quality --json`): adaptive chooses only eligible "
                        "actions (default: Q8/Q4 actions are unchecked, and it says so)")
    p.add_argument("--slo-ttft-ms", type=_positive(float), default=1000.0,
                   help="a request meets the SLO within this time to first token")
    p.add_argument("--slo-tpot-ms", type=_positive(float), default=100.0,
                   help="... and this mean time per later token")
    p.add_argument("--plot", default=None, metavar="DIR", help="write the figures' PNGs here")
    p.add_argument("--http", type=_host_port, default=None, metavar="HOST:PORT",
                   help="answer the OpenAI completions API here instead of a generated load")
    p.add_argument("--api-key", default=None,
                   help="with --http: clients send Authorization: Bearer KEY (required beyond "
                        "loopback)")
    p.add_argument("--prefill-workers", type=_positive(int), default=1)
    p.add_argument("--decode-workers", type=_positive(int), default=1)


def cmd_serve(args: argparse.Namespace) -> None:
    import dataclasses

    from rekv_jax.serving.serve import serve

    config = serve_config(args)
    if not config.profiles:
        config = dataclasses.replace(config, profiles=measured_profiles(config, args))
    link = config.workers.link_gbps
    if link == PAPER_LINK:  # the calibrated link the profiles were measured over
        link = min(config.profiles, key=lambda p: p.seq_len).link_gbps
        config = dataclasses.replace(config, workers=dataclasses.replace(config.workers,
                                                                        link_gbps=link))
    progress = Progress(sum(len(s.requests) for s in config.streams) * len(config.policies),
                        sys.stderr)
    run = serve(config, progress.on_event)
    progress.close()
    if run is not None:
        report(run, config)


def measured_profiles(config, args: argparse.Namespace) -> tuple:
    """The cost model's profiles, measured now (`rekv profile` at the shortest and the longest
    prompt length), over the calibrated link when --link-gbps is `paper`."""
    from rekv_jax.study import sweep

    lengths = sorted({r.prompt_len for s in config.streams for r in s.requests}) or [512]
    lengths = sorted({lengths[0], lengths[-1]})
    link = config.workers.link_gbps
    if link == PAPER_LINK:
        link = sweep.calibrate_pair_link(config.model, lengths[0], args.transport).link_gbps
    print(f"rekv serve: measuring the cost model's profiles at {lengths} tokens "
          "(give --profile to skip)", file=sys.stderr, flush=True)
    return tuple(sweep.profile(config.model, n, args.transport, link, PROFILE_REPS)
                 for n in lengths)


class Progress:
    """A one-line progress bar on `out`: requests ended of `total`."""

    def __init__(self, total: int, out) -> None:
        self._total, self._done, self._out = total, 0, out

    def on_event(self, event) -> None:
        from rekv_jax.launch.group import Emitted
        from rekv_jax.serving.requests import Finished

        if isinstance(event, Emitted) and isinstance(event.item, Finished) and self._total:
            self._done += 1
            filled = 30 * min(self._done, self._total) // self._total
            self._out.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] "
                            f"{self._done}/{self._total} requests")
            self._out.flush()

    def close(self) -> None:
        if self._done:
            self._out.write("\n")
            self._out.flush()


def report(run, config) -> None:
    """The run's table and capacities (`--json`: a record per request, then the summaries),
    and its figures with --plot."""
    from rekv_jax.cli.render import emit_json
    from rekv_jax.serving import metrics

    if config.json:
        emit_json(s.to_json(config.slo) for s in run.served)
        emit_json(s.to_json() for s in run.summaries)
        emit_json(c.to_json() for c in run.capacities)
    else:
        print(metrics.table(run.summaries))
        print("\n".join(metrics.capacity_lines(run.capacities)))
    if config.plot_dir is not None:
        for path in metrics.plot(run.summaries, run.served, config.plot_dir):
            print(f"wrote {path}", file=sys.stderr)


def serve_config(args: argparse.Namespace):
    """The run `args` describe, every flag checked (a ValueError names the first bad one)."""
    from rekv_jax.model.loader import SHIPPED_MODEL, load_config
    from rekv_jax.serving.metrics import Slo
    from rekv_jax.serving.policy import check_policy_names
    from rekv_jax.serving.serve import HttpBind, ServeConfig, Workers

    model = args.model or str(SHIPPED_MODEL)  # one that takes text, as `rekv generate`'s
    cfg = load_config(model)
    if args.api_key is not None and args.http is None:
        raise ValueError("--api-key guards the HTTP API: give --http HOST:PORT")
    http = None if args.http is None else HttpBind(*args.http, args.api_key)
    policies = check_policy_names(args.policy or (DEFAULT_POLICIES if http is None
                                                  else HTTP_POLICY), cfg.num_layers)
    bits = _adaptive_bits(args.adaptive_bits)
    streams = _streams(args, model, cfg) if http is None else _no_load(args)
    workers = Workers(args.prefill_workers, args.decode_workers, args.transport, args.link_gbps,
                      args.fallback, args.timeout, not args.no_pin)
    return ServeConfig(model, policies, Slo(args.slo_ttft_ms, args.slo_tpot_ms), workers,
                       streams, http, _profiles(args.profile, cfg, bits), _gate(args.quality, cfg),
                       bits, args.json, args.plot)


def _adaptive_bits(text: str) -> tuple[int, ...]:
    from rekv_jax.action import BITS

    try:
        bits = tuple(int(b) for b in text.split(","))
    except ValueError:
        bits = ()
    if not bits or not set(bits) <= set(BITS) or 16 not in bits:
        raise ValueError(f"--adaptive-bits {text!r}: a comma list of {BITS} holding 16")
    return bits


def _no_load(args: argparse.Namespace) -> tuple:
    """With --http: no generated load may be asked for."""
    given = [f for f, v in (("--rate", args.rate), ("--rates", args.rates),
                            ("--requests", args.requests), ("--duration", args.duration),
                            ("--max-new-tokens", args.max_new_tokens)) if v is not None]
    if given:
        raise ValueError(f"--http serves clients' requests (each with its max_tokens); "
                         f"{', '.join(given)} ask for a generated load: give one or the other")
    return ()


def _streams(args: argparse.Namespace, model: str, cfg) -> tuple:
    """One request stream per rate (every policy serves the same streams)."""
    from rekv_jax.serving.load_gen import LoadSpec, PromptLens, generate
    from rekv_jax.serving.serve import Stream

    rates = args.rates or ((args.rate,) if args.rate is not None else None)
    if rates is None:
        raise ValueError("give --rate R or --rates a,b,c (requests per second), or --http")
    lens, new = PromptLens.parse(args.prompt_lens), args.max_new_tokens or MAX_NEW_TOKENS
    if lens.longest + new > cfg.max_position_embeddings:
        raise ValueError(f"--prompt-lens up to {lens.longest} plus --max-new-tokens {new} need "
                         f"{lens.longest + new} positions; {cfg.name} holds "
                         f"{cfg.max_position_embeddings}")
    corpus = _corpus(model, cfg) if args.prompts == "wikitext" else None
    requests = args.requests if args.duration is None else None
    specs = [LoadSpec(rate, lens, new, args.seed,
                      REQUESTS if requests is None and args.duration is None else requests,
                      args.duration) for rate in rates]
    return tuple(Stream(s.rate, tuple(generate(s, cfg.vocab_size, corpus))) for s in specs)


def _corpus(model: str, cfg):
    """WikiText-2's test split as token ids of the model's tokenizer, else the shipped one's."""
    from rekv_jax.model.loader import SHIPPED_MODEL, load_tokenizer, tokenizer_of
    from rekv_jax.quality import data

    tok = tokenizer_of(model) or load_tokenizer(SHIPPED_MODEL)
    if tok.get_vocab_size() > cfg.vocab_size:
        raise ValueError(f"--prompts wikitext: the tokenizer's {tok.get_vocab_size()} ids do not "
                         f"fit {cfg.name}'s vocabulary of {cfg.vocab_size}; use --prompts "
                         "synthetic")
    return data.encode(tok, data.read_split("test"))


def _profiles(path: str | None, cfg, bits: tuple[int, ...]) -> tuple:
    from rekv_jax.planning.costmodel import load_profiles

    if path is None:
        return ()
    profiles = tuple(load_profiles(path))
    other = sorted({p.model for p in profiles} - {cfg.name})
    if other:
        raise ValueError(f"--profile {path}: profiles of {other}, not of {cfg.name}")
    short = sorted({b for p in profiles for b in bits if b not in p.quantize_ms})
    if short:
        raise ValueError(f"--profile {path}: no costs for {short}-bit prefixes (--adaptive-bits)")
    return profiles


def _gate(path: str | None, cfg) -> tuple | None:
    from rekv_jax.gate_result import load_gate

    if path is None:
        return None
    gate = tuple(load_gate(path))
    if not any(g.model == cfg.name for g in gate):
        raise ValueError(f"--quality {path}: no results for {cfg.name} (it has "
                         f"{sorted({g.model for g in gate})})")
    return gate
