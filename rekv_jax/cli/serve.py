"""`rekv serve`: its flags, their checks, and the run they describe
(`serving.serve_config.ServeConfig`).

Every flag is checked before any process starts or any weight loads: its syntax by argparse (one
line, exit 2), the rest while the config is built (a ValueError: one line, exit 2).

With `--role` the process is one of a run across nodes (`launch.nodes`): the router runs the
config as on one machine, its workers joining from their nodes; a worker joins the router and
runs what it is handed.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from rekv_jax.cli.flags import PAPER_LINK
from rekv_jax.cli.start_cache import use_caches

if TYPE_CHECKING:
    from rekv_jax.launch.nodes import Rendezvous

DEFAULT_POLICIES = "bf16:full,q8:full,q8:balanced,adaptive"  # of a generated load
HTTP_POLICY = "adaptive"  # of --http
PROMPTS = ("synthetic", "wikitext")
REQUESTS = 100  # per rate, unless --requests or --duration
MAX_NEW_TOKENS = 32  # --prompts: uniform ids, or WikiText-2 test windows
PROFILE_REPS = 5  # timed handoffs per action of a profile measured at the start
API_KEY_ENV = "REKV_API_KEY"  # the API key, when neither --api-key nor --api-key-file is given
AUTO = "auto"  # --role: this process's rank in the cluster picks its role (`nodes.node_names`)


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


def _address(text: str) -> str:
    """argparse type of `--coordinator HOST:PORT`, kept as given."""
    _host_port(text)
    return text


def _role(text: str) -> str:
    """argparse type of `--role`: router, a worker's name (decode-0, prefill-1, ...) or auto."""
    from rekv_jax.launch.child import parse_member
    from rekv_jax.launch.nodes import ROUTER

    if text not in (ROUTER, AUTO):
        try:
            parse_member(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {ROUTER}, a worker's name like decode-0 "
                                             f"or prefill-1, or {AUTO}; got {text!r}") from None
    return text


def _stretch(text: str) -> float | None:
    """argparse type of `--tpot-stretch`: a factor of at least 1, or none."""
    from rekv_jax.planning.queueing import check_tpot_stretch

    if text == "none":
        return None
    try:
        value = float(text)
        check_tpot_stretch(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a factor like 1.25, or none; got {text!r} "
                                         f"({e})") from None
    return value


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
    from rekv_jax.planning.queueing import TPOT_STRETCH

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
    p.add_argument("--tpot-stretch", type=_stretch, default=TPOT_STRETCH, metavar="F|none",
                   help="the suffix compute chosen beside a decoding request, with the batch "
                        "it decodes in, may stretch its TPOT to at most this factor of its step "
                        f"alone (default {TPOT_STRETCH}; none: no bound)")
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
    _http_flags(p)
    p.add_argument("--prefill-workers", type=_positive(int), default=1)
    p.add_argument("--decode-workers", type=_positive(int), default=1)
    _node_flags(p)


def _http_flags(p: argparse.ArgumentParser) -> None:
    """`--http`, its API key and its body limit."""
    from rekv_jax.serving.serve_config import MAX_BODY_BYTES

    p.add_argument("--http", type=_host_port, default=None, metavar="HOST:PORT",
                   help="answer the OpenAI API (completions, chat, /metrics) here instead of a "
                        "generated load")
    p.add_argument("--max-body-bytes", type=_positive(int), default=None, metavar="N",
                   help="with --http: a larger request body is refused with a 413 before it is "
                        f"read (default {MAX_BODY_BYTES})")
    api_key = p.add_mutually_exclusive_group()
    api_key.add_argument("--api-key-file", default=None, metavar="PATH",
                         help="with --http: clients send Authorization: Bearer KEY, KEY the "
                              "file's text (readable by its owner only; required beyond "
                              f"loopback; default: ${API_KEY_ENV})")
    api_key.add_argument("--api-key", default=None,
                         help="--api-key-file's KEY on the command line, where `ps` shows it "
                              "to every user of the node")


def _node_flags(p: argparse.ArgumentParser) -> None:
    """`--role` and `--coordinator`: one process per node."""
    nodes = p.add_argument_group("across nodes: one process per node, each given the job's key")
    nodes.add_argument("--role", type=_role, default=None,
                       metavar=f"router|decode-I|prefill-I|{AUTO}",
                       help="this process: the router (it takes the flags above) or a worker "
                            f"(it takes --coordinator, the key and --timeout); {AUTO}: the "
                            "cluster's process id picks (0 the router, then decode-0.., then "
                            "prefill-0..); default: the router here and every worker spawned "
                            "on this machine")
    nodes.add_argument("--coordinator", type=_address, default=None, metavar="HOST:PORT",
                       help="with --role: where the router listens for its workers (default: "
                            "the cluster's coordinator, e.g. SLURM's first node)")


def cmd_serve(args: argparse.Namespace) -> None:
    import dataclasses

    from rekv_jax.launch.nodes import ROUTER
    from rekv_jax.serving.serve import serve

    node = across_nodes(args)
    if node is not None and node[0] != ROUTER:
        return _run_worker(*node, args.timeout)
    use_caches()
    config = serve_config(args, node and node[1])
    if args.api_key is not None:  # checked: the server will take it
        print("rekv serve: warning: --api-key is on the command line, which `ps` shows to every "
              f"user of this node; give it in --api-key-file PATH or ${API_KEY_ENV}",
              file=sys.stderr, flush=True)
    if not config.profiles:
        config = dataclasses.replace(config, profiles=measured_profiles(config, args))
    link = config.workers.link_gbps
    if link == PAPER_LINK:  # the calibrated link the profiles were measured over
        link = min(config.profiles, key=lambda p: p.seq_len).link_gbps
        config = dataclasses.replace(config, workers=dataclasses.replace(config.workers,
                                                                        link_gbps=link))
    progress = Progress(sum(len(s.requests) for s in config.streams) * len(config.policies),
                        sys.stderr)
    pinning = config.workers.pinning()
    if pinning:  # the cores each CPU worker computes on, as its own GPU
        print(f"rekv serve: workers {pinning}", file=sys.stderr, flush=True)
    if node is not None:
        workers = config.workers
        print(f"rekv serve: the router takes {workers.prefill} prefill and {workers.decode} "
              f"decode workers at {node[1].address} (for up to {workers.timeout:g} s)",
              file=sys.stderr, flush=True)
    run = serve(config, progress.on_event)
    progress.close()
    if run is not None:
        report(run, config)


def across_nodes(args: argparse.Namespace) -> tuple[str, Rendezvous] | None:
    """With --role: this process's name in a run across nodes (`nodes.node_names`) and the
    router's `Rendezvous` (its address and the job's key); None without."""
    from rekv_jax import jax_private
    from rekv_jax.launch.nodes import Rendezvous, node_names
    from rekv_jax.transport.secret import job_key

    if args.role is None:
        if args.coordinator is not None:
            raise ValueError("--coordinator names the router of a run across nodes: give --role")
        return None
    key = job_key(args.secret_file, "a run across nodes (--role)")
    cluster, name = jax_private.cluster(), args.role
    if name == AUTO:
        names = node_names(args.prefill_workers, args.decode_workers)
        if cluster is None:
            raise ValueError(f"--role {AUTO} takes this process's rank from the cluster (SLURM, "
                             "Open MPI), and none was found: give --role router, decode-I or "
                             "prefill-I")
        if cluster[1] != len(names):
            raise ValueError(f"--role {AUTO}: the cluster runs {cluster[1]} processes; "
                             f"--prefill-workers {args.prefill_workers} --decode-workers "
                             f"{args.decode_workers} need {len(names)}: {', '.join(names)}")
        name = names[cluster[2]]
    address = args.coordinator or (cluster and cluster[0])
    if not address:
        raise ValueError(f"--role {args.role}: give --coordinator HOST:PORT, where the router "
                         "listens (no cluster was found to name it)")
    return name, Rendezvous(address, key)


def _run_worker(name: str, rendezvous: Rendezvous, timeout: float) -> None:
    """This node's worker: it joins the router and runs what the router hands it."""
    from rekv_jax.launch.environments import scheduled_environment
    from rekv_jax.launch.nodes import run_member

    print(f"rekv serve: {name} joins the router at {rendezvous.address}", file=sys.stderr,
          flush=True)
    run_member(name, rendezvous, timeout, scheduled_environment(os.environ))


def measured_profiles(config, args: argparse.Namespace) -> tuple:
    """The cost model's profiles at the shortest and the longest prompt length: cached, or
    measured now and cached (`start_cache.start_profiles`)."""
    from rekv_jax.cli.start_cache import start_profiles

    return start_profiles(config, args.transport, PROFILE_REPS)


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


def serve_config(args: argparse.Namespace, rendezvous: Rendezvous | None = None):
    """The run `args` describe, every flag checked (a ValueError names the first bad one);
    `rendezvous`: the router's, across nodes (`across_nodes`), where the link is real
    (`--link-gbps paper` is then unpaced, as for `rekv handoff --role`)."""
    from rekv_jax.model.loader import SHIPPED_MODEL, load_config
    from rekv_jax.serving.metrics import Slo
    from rekv_jax.serving.policy import check_policy_names
    from rekv_jax.serving.serve_config import MAX_BODY_BYTES, HttpBind, ServeConfig, Workers

    model = args.model or str(SHIPPED_MODEL)  # one that takes text, as `rekv generate`'s
    cfg = load_config(model)
    http = None if args.http is None else HttpBind(*args.http, _api_key(args),
                                                   args.max_body_bytes or MAX_BODY_BYTES)
    if http is None and (args.api_key or args.api_key_file) is not None:
        flag = "--api-key" if args.api_key is not None else "--api-key-file"
        raise ValueError(f"{flag} guards the HTTP API: give --http HOST:PORT")
    if http is None and args.max_body_bytes is not None:
        raise ValueError("--max-body-bytes bounds the HTTP API's requests: give --http HOST:PORT")
    policies = check_policy_names(args.policy or (DEFAULT_POLICIES if http is None
                                                  else HTTP_POLICY), cfg.num_layers)
    bits = _adaptive_bits(args.adaptive_bits)
    streams = _streams(args, model, cfg) if http is None else _no_load(args)
    link = None if rendezvous is not None and args.link_gbps == PAPER_LINK else args.link_gbps
    workers = Workers(args.prefill_workers, args.decode_workers, args.transport, link,
                      args.fallback, args.timeout, not args.no_pin, rendezvous)
    return ServeConfig(model, policies, Slo(args.slo_ttft_ms, args.slo_tpot_ms), workers,
                       streams, http, _profiles(args.profile, cfg, bits), _gate(args.quality, cfg),
                       bits, args.tpot_stretch, args.json, args.plot)


def _api_key(args: argparse.Namespace) -> str | None:
    """The key HTTP clients must send: --api-key, the text of --api-key-file, else
    $REKV_API_KEY; None: none."""
    from rekv_jax.transport.secret import read_private

    if args.api_key_file is None:
        return args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    key = read_private(args.api_key_file, "the API key file").decode(errors="replace").strip()
    if not key:
        raise ValueError(f"the API key file {args.api_key_file} is empty")
    return key


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
    from rekv_jax.serving.serve_config import Stream

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
