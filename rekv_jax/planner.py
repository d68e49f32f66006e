"""Choose the handoff action: predict every candidate with the cost model and rank them.

A plan uses a `Profile` measured elsewhere (e.g. `rekv profile` on a GPU, possibly re-targeted to
another link), or, without one, an *analytic* profile: a roofline estimate of an H100-class GPU
(`ANALYTIC_TFLOPS` effective dense BF16, `ANALYTIC_HBM_GBPS` memory bandwidth) on the paper's
cross-node TCP path (`PAPER_LINK_GBPS`). The analytic profile is an assumption, not a measurement,
and every plan made from it says so. As the paper notes (§2.3), the model guides the cut sweep;
the final choice is made on measured latency.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rekv_jax import sizes
from rekv_jax.action import Action, action_space
from rekv_jax.config import ModelConfig
from rekv_jax.costmodel import Profile, predict, predicted_ms

# The paper's H100 TCP path moves the 8K Qwen2.5-7B BF16 cache (448 MiB) in 202.13 ms (§4.4).
PAPER_LINK_GBPS = 448 * sizes.MIB / 202.13e-3 / 1e9  # ~2.32 GB/s
ANALYTIC_TFLOPS = 700.0  # assumed effective dense BF16 rate of an H100-class GPU
ANALYTIC_HBM_GBPS = 3350.0  # H100 SXM memory bandwidth


def analytic_profile(cfg: ModelConfig, seq_len: int, batch: int = 1,
                     link_gbps: float = PAPER_LINK_GBPS, tflops: float = ANALYTIC_TFLOPS,
                     hbm_gbps: float = ANALYTIC_HBM_GBPS) -> Profile:
    """A roofline profile: each cost is max(FLOPs / rate, bytes moved / memory bandwidth)."""
    if not (tflops > 0 and hbm_gbps > 0):
        raise ValueError(f"device rates must be positive, got {tflops} TFLOP/s, {hbm_gbps} GB/s")

    def roofline(flops: float, nbytes: float) -> float:  # ms
        return max(flops / (tflops * 1e9), nbytes / (hbm_gbps * 1e6))

    kv16 = sizes.kv_layer_bytes(cfg, seq_len, batch)
    # Quantize reads BF16 and writes codes + scales; restore reads those and writes BF16.
    memory = {16: 0.0} | {b: roofline(0, kv16 + sizes.kv_layer_bytes(cfg, seq_len, batch, b))
                          for b in (8, 4)}
    return Profile.for_config(
        cfg, seq_len, batch, hardware=f"analytic ({tflops:g} TFLOP/s, {hbm_gbps:g} GB/s memory)",
        link=f"analytic {link_gbps:g} GB/s", link_gbps=link_gbps, source="analytic",
        quantize_ms=memory, restore_ms=memory,
        suffix_layer_ms=roofline(sizes.layer_flops(cfg, seq_len, batch),
                                 sizes.layer_weight_count(cfg) * sizes.WEIGHT_BYTES),
        # the first token: LM head of the last position (transfer-only receives it with the KV)
        join_ms={"transfer": 0.0} | dict.fromkeys(("recompute", "joint"), roofline(
            sizes.head_flops(cfg, 1, batch), sizes.head_weight_count(cfg) * sizes.WEIGHT_BYTES)),
        embed_ms=roofline(0, sizes.boundary_bytes(cfg, seq_len, batch)))  # writes [B, S, D] BF16


def select_profile(profiles: Sequence[Profile], cfg: ModelConfig, seq_len: int, batch: int = 1
                   ) -> Profile:
    """The profile of exactly this model, prompt length and batch."""
    for p in profiles:
        if (p.model, p.num_layers, p.seq_len, p.batch) == (cfg.name, cfg.num_layers, seq_len,
                                                            batch):
            return p
    have = sorted({(p.model, p.seq_len, p.batch) for p in profiles})
    raise ValueError(f"no profile for model {cfg.name!r}, seq_len {seq_len}, batch {batch}; "
                     f"have (model, seq_len, batch) {have}")


def plan(cfg: ModelConfig, seq_len: int, profile: Profile | None = None,
         link_gbps: float | None = None, actions: Sequence[Action] | None = None,
         batch: int = 1, schedule: str = "overlapped", interval: str = "ready",
         prefill: str = "full") -> dict[str, Any]:
    """Every candidate action with its predicted latency (ms), the predicted best, and Prop. 2's
    balanced cut per precision. `link_gbps` re-targets the profile's transfer terms; `interval`
    and `prefill` choose the timed interval (the best is then the cut for that interval)."""
    if profile is None:
        profile = analytic_profile(cfg, seq_len, batch,
                                   PAPER_LINK_GBPS if link_gbps is None else link_gbps)
    else:
        profile = select_profile([profile], cfg, seq_len, batch)
        if link_gbps is not None:
            profile = profile.at_link(link_gbps)
    if actions is None:
        actions = list(action_space(cfg.num_layers, sorted(profile.quantize_ms, reverse=True)))
    if not actions:
        raise ValueError("no candidate actions")
    candidates = []
    for a in actions:
        pred = predict(profile, a)
        candidates.append({
            "action": str(a), "kind": a.kind, "bits": a.bits, "cut": a.cut,
            "suffix_len": a.suffix_len,
            "payload_bytes": sizes.action_bytes(cfg, a, seq_len, batch)["total_bytes"],
            "predicted_ms": predicted_ms(profile, a, schedule, interval, prefill),
            "t_seq_ms": pred["t_seq_ms"], "t_ov_ms": pred["t_ov_ms"],
            "phases_ms": pred["phases_ms"]})
    best = min(candidates, key=lambda c: c["predicted_ms"])
    out: dict[str, Any] = {
        "model": cfg.name, "seq_len": seq_len, "batch": batch, "schedule": schedule,
        "interval": interval, "prefill": prefill,
        "profile": {k: v for k, v in profile.to_json().items() if k != "kind"},
        "best": {k: best[k] for k in ("action", "predicted_ms", "kind", "bits", "cut")},
        "balanced_cut": _balanced_cuts(profile) if cfg.num_layers >= 2 else {},
        "candidates": candidates,
    }
    if profile.source == "analytic":
        out["note"] = (f"analytic profile: {profile.hardware} on a {profile.link_gbps:g} GB/s "
                       "link; assumed rates, not a measurement")
    return out


def _balanced_cuts(profile: Profile) -> dict[str, dict[str, Any]]:
    """Per precision: c* (Eq. 11 with the profile's fixed terms) and the cuts Prop. 2 allows."""
    out = {}
    for bits in sorted(profile.quantize_ms, reverse=True):
        c_star, cuts = profile.balanced_cut(bits)
        out[Action(bits, cuts[0], profile.num_layers).precision] = {
            "c_star": c_star, "cuts": list(cuts),
            "suffix_lens": [profile.num_layers - c for c in cuts]}
    return out


def preferred_by_link(profile: Profile, actions: Sequence[Action], links: Sequence[float],
                      schedule: str = "overlapped") -> list[dict[str, Any]]:
    """The predicted fastest of `actions` at each link bandwidth (GB/s), the profile re-targeted."""
    if not actions:
        raise ValueError("no candidate actions")
    out = []
    for w in links:
        p = profile.at_link(w)
        ms = {str(a): predicted_ms(p, a, schedule) for a in actions}
        best = min(ms, key=ms.get)
        out.append({"link_gbps": w, "best": best, "predicted_ms": ms[best]})
    return out


def crossovers(by_link: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Where the preferred action changes between consecutive links of `preferred_by_link`."""
    return [{"from": a["best"], "to": b["best"], "between_gbps": [a["link_gbps"], b["link_gbps"]]}
            for a, b in zip(by_link, by_link[1:], strict=False) if a["best"] != b["best"]]


def plan_text(result: dict[str, Any], top: int = 12) -> str:
    """The readable form of a `plan` result: the profile, Prop. 2's cut per precision, the `top`
    fastest candidates and the fastest of each precision and kind."""
    prof = result["profile"]
    c = sorted(result["candidates"], key=lambda c: c["predicted_ms"])
    best_of = {}
    for cand in c:  # fastest per (precision, kind), beyond the top rows
        best_of.setdefault((cand["bits"], cand["kind"]), cand)
    shown = c[:top] + [x for x in best_of.values() if x not in c[:top]]
    lines = [f"{result['model']}, {result['seq_len']} tokens, batch {result['batch']}, "
             f"{result['schedule']} schedule; {prof['source']} profile: {prof['hardware']}, "
             f"link {prof['link_gbps']:.3g} GB/s",
             f"predicted best: {result['best']['action']} at {result['best']['predicted_ms']:.2f} "
             "ms"]
    lines += [f"balanced cut c* (Prop. 2), {prec}: {b['c_star']:.2f} -> cut(s) {b['cuts']} "
              f"(suffix {b['suffix_lens']})" for prec, b in result["balanced_cut"].items()]
    lines += ["", f"{'action':<16}{'predicted ms':>13}{'T_seq':>10}{'T_ov':>10}{'MiB':>10}"]
    lines += [f"{x['action']:<16}{x['predicted_ms']:>13.2f}{x['t_seq_ms']:>10.2f}"
              f"{x['t_ov_ms']:>10.2f}{x['payload_bytes'] / sizes.MIB:>10.2f}" for x in shown]
    lines.append(f"({len(shown)} of {len(c)} candidates: the {top} fastest and the fastest of "
                 "each precision and kind; --json for all, with phases)")
    if "note" in result:
        lines.append(result["note"])
    return "\n".join(lines)
