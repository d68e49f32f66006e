"""The cost model of a ReKV handoff (paper §2.1, §2.3): the one place its equations live.

Phases of an action `(b, c)`, in ms: `Q_b(c)` quantize the prefix, `H` send the boundary `h_c`,
`X_b(c)` send and restore the prefix, `R(c)` run the suffix (to the first token's logits), `J`
join (assemble the cache, pick the token; it differs by action kind): the fields of a
`phases.Phases`.

    T_seq = Q + H + X + R + J          (Eq. 8)      T_ov = Q + H + max(X, R) + J   (Eq. 9)
    T_seq - T_ov = min(X, R)           (Eq. 10)

A `Profile` holds per-layer costs for one model, prompt length and batch on one machine and link:
`Q_b(c) = q0 + c α_b`; `X_b(c) = m + x0_b + c β_b` with `β_b = B_KV,b / W + restore_b`, where a
prefix format's `B_KV,b` is `sizes.format_layer_bytes` of the paper's (the formats' transforms
are not timed apart: a profile's α_b and restore_b are the paper format's);
`H = h0 + (B_tok + B_H) / W`; `R(c) = r0 + (L - c) γ`. Transfer terms are bytes / bandwidth
plus a fixed per-message latency `m`, so a profile measured at one link can be re-targeted to
another (`Profile.at_link`). With the fixed terms at zero this is the paper's linear model, whose
balanced cut is Eq. 11.

As `rekv_jax.handoff` does, the int32 token IDs (`B_tok` bytes) always cross first, in one
message with `h_c`, and count in the `boundary` phase, whose fixed part `h0` also holds the start
of the handoff. Transfer-only
(`c = L`) then sends the full KV and no `h_c`; full recomputation (`c = 0`) sends nothing more and
runs the embedding and all `L` layers (the `suffix` phase). Byte counts come from
`rekv_jax.sizes`; times are in ms, bandwidth in GB/s (1e9 bytes/s, as the transports' pacing).

A prediction (`predicted_ms`, `handoff_ends`) plays the handoff's plan against the profile
(`Mode.plan`, `planning.play`): each step at its cost, each device one step at a time. The
formulas below are its closed forms for the modes that have one, with equal token chunks: a
handoff's `Mode` names its formula (`Mode.formula`, `closed_form_ends`), and a test checks each
against the played plan.

Served among other requests (`Contention`, `handoff_ends`), each formula holds the handoff's
first message until the link is free, starts its decode-side compute (suffix, each suffix chunk,
or the recomputation) no earlier than the decode device is free, and stretches that compute by
the running decodes it is interleaved with; an idle link and device give the formulas here.
`planning.queueing` adds the queues' waits around them.

Timed from the prompt's arrival at the prefill worker (`interval="prompt"`), the prefill's own
compute joins the sum. It runs the same per-layer program as the decode side's suffix, on the
same kind of device, so a prompt layer costs `γ` too and a call `r0`; `E` is the embedding.

* Full prefill (paper Fig. 3): all L layers, then the handoff as above:
      T_full = E + r0 + L γ + T_ov (or T_seq).
* Split, streamed prefill (`prefill="split"`): only layers 0..c-1 run, one
  call each (`g = r0 + γ`; the first also embeds), each followed by its quantize call
  (`a = q0 + α_b`, 0 for BF16) and sent as its own message (`β' = m + x0_b + β_b`). The token ids
  leave at once (`τ = h0 + B_tok / W`); `h_c` leaves when layer c-1 is computed (`H' = m + B_H / W`)
  and overtakes that layer's payload. With time 0 at the prompt's arrival:
      C_l = E + (l+1) g + l a            layer l computed        P_l = C_l + a   its payload ready
  and on the FIFO link (messages in the order sent: ids, layers 0..c-2, h_c, layer c-1):
      D_-1 = τ,  D_l = max(P_l, D_{l-1}) + β'  (l <= c-2)
      D_H = max(C_{c-1}, D_{c-2}) + H',   D_{c-1} = max(P_{c-1}, D_H) + β'
      T_split,ov = max(D_{c-1}, D_H + R(c)) + J        T_split,seq = D_{c-1} + R(c) + J
  The recursion is a two-stage flow line, so `D_k = max(τ + (k+1) β', E + (g+a) + (k+1) β',
  E + (k+1)(g+a) + β')`: the link either drains a backlog (β' > g + a) or keeps up, and then `h_c`
  waits only `max(0, β' - g)` behind the last streamed layer. Keeping up, with the fixed terms
  at zero, split is never slower than full (tested): it skips the prefill's `(L - c) γ` and hides
  all but one layer's quantize and transfer under the prompt's compute. Transfer-only (`c = L`)
  sends the first token in place of `h_c`; full recomputation (`c = 0`) sends only the ids.

Token chunks (`chunks` N). The prompt program's attention covers all S positions (masked);
chunk i of T_i tokens attends over the w_i positions of its bucket (`sizes.attention_width`), so
a layer on it costs `γ_i = γ ((1 - s) T_i/S + s T_i w_i/S²) + [i > 0] κ` (`chunk_share`): `s` is
the attention's share of γ (from FLOPs, `sizes.attention_share`, or measured over two lengths,
`profile_fit.attention_shares`), and κ the fitted cost each extra chunk adds per layer (one more
pass over the weights; `Σ_i γ_i <= γ + (N - 1) κ`, equal for s = 0). A chunk call costs `r0`
plus its layers; each extra message costs `m`.
* Chunked boundary, ready interval (`schedule="chunked"`): after Q, the ids leave with the first
  of N pieces of `h_c` and the prefix follows on the FIFO link. Piece i arrives at
      A_i = Q + h0 + B_tok / W + (i+1) B_H / (N W) + i m
  and the decode side runs chunk i through layers c..L-1 (`R_i = r0 + (L - c) γ_i`) once it has
  arrived and chunk i-1 is done, so the suffix ends at F = max_k (A_k + Σ_{i>=k} R_i) (a flow
  line) and the prefix at A_{N-1} + X:
      T_chunked = max(A_{N-1} + X, F) + J
  N = 1 is T_ov. With Σ R_i = R + (N - 1)(r0 + (L - c) κ), T_chunked <= T_ov + (N - 1)(m + r0
  + (L - c) κ); the gain is up to (N - 1)/N of the boundary's transfer, hidden under the suffix.
  Transfer-only and full recomputation have no boundary to chunk: T_ov.
* Pipelined prefill, prompt interval (`prefill="pipelined"`): the prefill side runs chunk i
  through layers 0..c-1 in one call (`g_i = E/N + r0 + c γ_i`), hands its piece of `h_c` to the
  link, quantizes its prefix (`a = q0 + c α_b / N`) and sends it (`m + x0_b + c β_b / N`); the
  decode side runs chunk i through c..L-1 when its piece has arrived. On the FIFO link (ids, then
  per chunk its `h_c` piece and its prefix):
      C_i = P_{i-1} + g_i,  P_i = C_i + a   (P_{-1} = 0)
      D^H_i = max(C_i, D^P_{i-1}) + m + B_H / (N W),  D^P_i = max(P_i, D^H_i) + m + x0_b + c β_b/N
      F_i = max(F_{i-1}, D^H_i) + R_i   (D^P_{-1} = τ, F_{-1} = 0)
      T_pipelined = max(D^P_{N-1}, F_{N-1}) + J
  a three-stage pipeline (prefill compute -> link -> decode compute). N = 1 with c = 1 is T_split.
  Full recomputation (c = 0) sends the ids only; the decode side's chunked prefill of all L
  layers costs τ + E + Σ_i (r0 + L γ_i) + J.
  Without per-call and per-chunk costs it never loses to the full prefill; more chunks can lose
  to fewer where a chunk's quantize delays the next chunk's compute, or a late chunk's attention
  (s > 0) outweighs what it hides (tested).
  Transfer-only sends the first token after the last chunk is computed; c = 0 is T_split.
"""

from __future__ import annotations

import dataclasses

from rekv_jax import sizes
from rekv_jax.action import Action, ActionKind
from rekv_jax.config import ModelConfig
from rekv_jax.mode import Formula, Mode
from rekv_jax.phases import Phases
from rekv_jax.planning.play import (  # noqa: F401 (this module's API too)
    IDLE,
    Contention,
    Device,
    Ends,
    busy_ms,
    play,
)
from rekv_jax.planning.profile import (  # noqa: F401 (this module's API too)
    Profile,
    balanced_cut,
    chunk_share,
    load_profiles,
    transfer_ms,
)


def t_seq(q: float, h: float, x: float, r: float, j: float) -> float:
    """Eq. 8: receive everything, then recompute."""
    return q + h + x + r + j


def t_ov(q: float, h: float, x: float, r: float, j: float) -> float:
    """Eq. 9: boundary first, suffix concurrent with the prefix transfer and restore."""
    return q + h + max(x, r) + j


def saved(x: float, r: float) -> float:
    """Eq. 10: what the overlap saves, T_seq - T_ov."""
    return min(x, r)


def prop1_holds(cfg: ModelConfig) -> bool:
    """Proposition 1's condition `n_h >= 2 n_kv`: sending a hidden state cannot beat its KV."""
    return cfg.num_heads >= 2 * cfg.num_kv_heads


def prop1_delta_ms(cfg: ModelConfig, seq_len: int, link_gbps: float, proj_ms: float = 0.0,
                   batch: int = 1) -> float:
    """Eq. 4: (send h and project K, V) minus (send that layer's KV), both BF16, in ms."""
    if proj_ms < 0:
        raise ValueError(f"projection time must be >= 0, got {proj_ms}")
    extra = sizes.boundary_bytes(cfg, seq_len, batch) - sizes.kv_layer_bytes(cfg, seq_len, batch)
    return transfer_ms(extra, link_gbps) + proj_ms


def phase_ms(profile: Profile, action: Action) -> Phases:
    """Predicted `Q, H, X, R, J` of `action` under `profile` (ready interval: no prefill)."""
    p = profile
    if action.num_layers != p.num_layers:
        raise ValueError(f"action {action} is for {action.num_layers} layers, "
                         f"profile of {p.model} has {p.num_layers}")
    c, L, W = action.cut, p.num_layers, p.link_gbps
    interior = 0 < c < L
    # token IDs, always first, with h_c in the same message for a joint action
    boundary = p.boundary_fixed_ms + transfer_ms(p.token_bytes + interior * p.boundary_bytes, W)
    if c == 0:  # the decode side embeds the tokens and runs all L layers
        return Phases(quantize=0.0, boundary=boundary, prefix=0.0,
                      suffix=p.embed_ms + p.suffix_fixed_ms + L * p.suffix_layer_ms,
                      join=p.join_ms[ActionKind.RECOMPUTE])
    p._check_bits(action.bits)
    return Phases(
        quantize=(p.quantize_fixed_ms + c * p.quantize_ms[action.bits]
                  if action.bits < 16 else 0.0),
        boundary=boundary,
        prefix=p.prefix_ms(action.bits, c, action.format),
        suffix=p.suffix_fixed_ms + (L - c) * p.suffix_layer_ms if interior else 0.0,
        join=p.join_ms[action.kind],
    )


@dataclasses.dataclass(frozen=True)
class Prediction:
    """The cost model's phases, T_seq, T_ov and the overlap saving (ms) of one action."""

    action: Action
    phases_ms: Phases
    t_seq_ms: float  # Eq. 8
    t_ov_ms: float  # Eq. 9
    saved_ms: float  # Eq. 10


def predict(profile: Profile, action: Action) -> Prediction:
    """Phase times, T_seq, T_ov and the overlap saving (ms) of `action` under `profile`."""
    ph = phase_ms(profile, action)
    return Prediction(action, ph, t_seq(*ph.ready), t_ov(*ph.ready), saved(ph.prefix, ph.suffix))


def predicted_ms(profile: Profile, mode: Mode) -> float:
    """The predicted total of a handoff run as `mode`, timed from its interval: its plan played
    against `profile` (`planning.play`)."""
    return handoff_ends(profile, mode).end_ms


def handoff_ends(profile: Profile, mode: Mode, contention: Contention = IDLE) -> Ends:
    """When a handoff run as `mode` ends (and its link and decode-side parts do), timed from its
    interval, on a link and decode device that `contention` shares with other requests: its plan
    played against `profile`."""
    _check_chunks(profile, mode)
    phase_ms(profile, mode.action)  # validates the action against the profile
    return play(mode.plan(profile.seq_len, profile.num_layers), profile, contention)


def closed_form_ends(profile: Profile, mode: Mode, contention: Contention = IDLE) -> Ends:
    """`handoff_ends` by the closed form the mode names (`Mode.formula`; the module docstring),
    which the played plan equals where its token chunks are equal. The closed forms price the
    prefill device at the profile's costs (a prefill stretch of 1)."""
    _check_chunks(profile, mode)
    if contention.prefill_stretch != 1:
        raise ValueError("the closed forms take the prefill device at the profile's costs; "
                         f"play the plan for a prefill stretch of {contention.prefill_stretch}")
    if contention.link_gbps is not None:
        profile = profile.at_link(contention.link_gbps)
    action, formula = mode.action, mode.formula
    if formula == Formula.PIPELINED:
        return _pipelined(profile, action, mode.chunks, contention)
    if formula == Formula.SPLIT:
        return _streamed(profile, action, mode.suffix_waits_for_prefix, contention)
    lead = prompt_compute_ms(profile, profile.num_layers) if mode.from_prompt else 0
    seen = contention.after(lead)  # the full prefill runs before anything is sent
    if formula == Formula.CHUNKED:
        return _chunked(profile, action, mode.chunks, seen).shifted(lead)
    return _ready(profile, action, formula == Formula.SEQUENTIAL, seen).shifted(lead)


def _check_chunks(profile: Profile, mode: Mode) -> None:
    if mode.chunks > profile.seq_len:
        raise ValueError(f"{mode.chunks} chunks need at least as many tokens, the profile has "
                         f"{profile.seq_len}")


def _ready(profile: Profile, action: Action, sequential: bool, contention: Contention) -> Ends:
    """Eq. 8 (`sequential`) or Eq. 9 (ready interval) under `contention`: the boundary leaves
    once quantized and the link is free; the suffix starts once it has arrived (Eq. 8: the
    prefix too) and the decode device is free."""
    ph, k = phase_ms(profile, action), contention.stretch
    at_boundary = max(ph.quantize, contention.link_free_ms) + ph.boundary
    at_prefix = at_boundary + ph.prefix
    if not ph.suffix:  # transfer-only: nothing to compute on the decode side
        return Ends(at_prefix + ph.join, at_prefix)
    begin = max(at_prefix if sequential else at_boundary, contention.decode_free_ms)
    done = begin + ph.suffix * k
    return Ends(max(at_prefix, done) + ph.join, at_prefix)


def chunked_ms(profile: Profile, action: Action, chunks: int) -> float:
    """T_chunked of `action` (ready interval): the flow line of the module docstring."""
    return _chunked(profile, action, chunks, IDLE).end_ms


def _chunked(profile: Profile, action: Action, chunks: int, contention: Contention) -> Ends:
    """The chunked boundary's flow line: chunk i's suffix runs once its piece has arrived and
    chunk i-1 is done (the first once the decode device is free)."""
    p, ph = profile, phase_ms(profile, action)
    c, L, k = action.cut, p.num_layers, contention.stretch
    if not 0 < c < L:  # no boundary to chunk
        return _ready(p, action, False, contention)
    start = (max(ph.quantize, contention.link_free_ms) + p.boundary_fixed_ms
             + transfer_ms(p.token_bytes, p.link_gbps))
    piece = transfer_ms(p.boundary_bytes, p.link_gbps) / chunks
    arrive = [start + (i + 1) * piece + i * p.message_ms for i in range(chunks)]  # A_i
    done = contention.decode_free_ms  # F_{i-1}
    for i, at in enumerate(arrive):
        done = max(done, at) + (p.suffix_fixed_ms + (L - c) * p.chunk_layer(i, chunks)) * k
    at_prefix = arrive[-1] + ph.prefix
    return Ends(max(at_prefix, done) + ph.join, at_prefix)


def pipelined_ms(profile: Profile, action: Action, chunks: int) -> float:
    """T_pipelined of `action` (ms from the prompt's arrival): the recursion of the module
    docstring (the decode side runs each chunk as it arrives)."""
    return _pipelined(profile, action, chunks, IDLE).end_ms


def _pipelined(profile: Profile, action: Action, chunks: int, contention: Contention) -> Ends:
    p, k = profile, contention.stretch
    phase_ms(p, action)  # validates the action against the profile
    c, L, b, n = action.cut, p.num_layers, action.bits, chunks
    tokens = contention.link_free_ms + p.boundary_fixed_ms + transfer_ms(p.token_bytes,
                                                                         p.link_gbps)  # τ
    if c == 0:  # only the ids cross: the decode side's chunked prefill of all L layers
        done = (max(tokens, contention.decode_free_ms) + p.embed_ms * k
                + sum(p.suffix_fixed_ms + L * p.chunk_layer(i, n) for i in range(n)) * k)
        return Ends(done + p.join_ms[ActionKind.RECOMPUTE], tokens)
    quantize = p.quantize_fixed_ms + c * p.quantize_ms[b] / n if b < 16 else 0  # a
    payload = p.message_ms + p.restore_fixed_ms[b] + c * p.beta(b, action.format) / n
    piece = p.message_ms + (transfer_ms(p.boundary_bytes, p.link_gbps) / n if c < L else 0)
    link, ready, suffix_done = tokens, 0, contention.decode_free_ms  # D^P_{-1}, P_{-1}, F_{-1}
    for i in range(n):
        computed = ready + p.embed_ms / n + p.suffix_fixed_ms + c * p.chunk_layer(i, n)  # C_i
        if c < L or i == n - 1:  # the piece of h_c (transfer-only: the first token, once)
            link = max(computed, link) + piece  # D^H_i
        if c < L:
            run = p.suffix_fixed_ms + (L - c) * p.chunk_layer(i, n)  # R_i
            suffix_done = max(suffix_done, link) + run * k
        ready = computed + quantize
        link = max(ready, link) + payload  # D^P_i
    if c == L:
        return Ends(link + p.join_ms[action.kind], link)
    return Ends(max(link, suffix_done) + p.join_ms[action.kind], link)


def prompt_compute_ms(profile: Profile, layers: int) -> float:
    """The prefill worker's compute of `layers` prompt layers in one call: E + r0 + layers γ."""
    return profile.embed_ms + profile.suffix_fixed_ms + layers * profile.suffix_layer_ms


def streamed_ms(profile: Profile, action: Action, sequential: bool = False) -> float:
    """T_split of `action` (ms from the prompt's arrival): the recursion of the module
    docstring; `sequential`: the suffix waits for the whole prefix."""
    return _streamed(profile, action, sequential, IDLE).end_ms


def _streamed(profile: Profile, action: Action, sequential: bool, contention: Contention
              ) -> Ends:
    p, k = profile, contention.stretch
    phase_ms(p, action)  # validates the action against the profile
    c, L, W = action.cut, p.num_layers, p.link_gbps
    tokens = contention.link_free_ms + p.boundary_fixed_ms + transfer_ms(p.token_bytes, W)  # τ
    if c == 0:
        done = max(tokens, contention.decode_free_ms) + prompt_compute_ms(p, L) * k
        return Ends(done + p.join_ms[ActionKind.RECOMPUTE], tokens)
    g = p.suffix_fixed_ms + p.suffix_layer_ms
    a = p.quantize_fixed_ms + p.quantize_ms[action.bits] if action.bits < 16 else 0
    link = (p.message_ms + p.restore_fixed_ms[action.bits]
            + p.beta(action.bits, action.format))  # β'
    boundary = p.message_ms + (transfer_ms(p.boundary_bytes, W) if c < L else 0)  # H'
    done = tokens  # D_{l-1}: when the link is free again
    for layer in range(c - 1):
        done = max(p.embed_ms + (layer + 1) * (g + a), done) + link
    computed = p.embed_ms + c * g + (c - 1) * a  # C_{c-1}
    at_boundary = max(computed, done) + boundary  # D_H
    at_prefix = max(computed + a, at_boundary) + link  # D_{c-1}
    if c == L:
        return Ends(at_prefix + p.join_ms[action.kind], at_prefix)
    begin = max(at_prefix if sequential else at_boundary, contention.decode_free_ms)
    suffix_done = begin + (p.suffix_fixed_ms + (L - c) * p.suffix_layer_ms) * k  # R(c)
    return Ends(max(at_prefix, suffix_done) + p.join_ms[action.kind], at_prefix)


def prefill_busy_ms(profile: Profile, mode: Mode) -> float:
    """How long a handoff run as `mode` occupies the prefill worker's device: its plan's steps
    there (a full prefill runs all L layers; a split or pipelined one stops at the cut, and
    sends only the ids at c = 0)."""
    return _busy_ms(profile, mode, Device.PREFILL)


def decode_busy_ms(profile: Profile, mode: Mode) -> float:
    """The decode device's compute of a handoff run as `mode`, alone: its plan's steps there
    (the suffix in its token chunks or, at c = 0, the embedding and all L layers; nothing for
    transfer-only)."""
    return _busy_ms(profile, mode, Device.DECODE)


def _busy_ms(profile: Profile, mode: Mode, device: Device) -> float:
    _check_chunks(profile, mode)
    return busy_ms(mode.plan(profile.seq_len, profile.num_layers), profile, device)
