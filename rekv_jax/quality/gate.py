"""Output-quality gate of a handoff action (paper §2.4) and the selection rule of Eq. 13.

The first token after a handoff comes from suffix logits computed from the exact `h_c`, so it
matches BF16 by construction; an action changes outputs only once later tokens attend to the
restored prefix KV. Every metric is therefore taken on a continuation run on top of the
reconstructed cache and compared with the same continuation on the BF16 cache:
  * top-1 agreement and mean KL(BF16 || action) of the next-token distributions at each
    teacher-forced continuation position of WikiText-2 `test.txt` windows (context of S tokens
    handed off, the next T tokens scored);
  * continuation perplexity over those T tokens, and its change relative to BF16;
  * their measured noise: the standard errors over the windows of the mean KL and of the
    log-perplexity change (per-window means; windows are independent text);
  * NIAH: the greedy passkey decoded on the reconstructed cache must equal the answer exactly.
An action is eligible when every top-1 agrees, every NIAH prompt passes and the perplexity rises
by at most `EPSILON` relative to BF16.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer

from rekv_jax.action import Action
from rekv_jax.config import ModelConfig
from rekv_jax.gate_result import GateMetrics, GateResult
from rekv_jax.handoff.payload import round_trip
from rekv_jax.handoff.prefix_format import PrefixCodec
from rekv_jax.kv import KVCache
from rekv_jax.model.transformer import (
    Params,
    extend,
    greedy_decode,
    prefill,
    run_prefix,
    run_suffix,
    token_chunks,
)
from rekv_jax.quality import niah
from rekv_jax.quality.data import windows

EPSILON = 0.01  # largest allowed relative perplexity increase (paper §2.4)
NIAH_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)

# tokens [B, S] -> (complete KV cache [L, B, S, K, H], logits of the last position [B, V])
CacheBuilder = Callable[[jax.Array], tuple[KVCache, jax.Array]]


def reconstruct_cache(cfg: ModelConfig, params: Params, tokens: jax.Array, action: Action,
                      chunks: int = 1, pipelined: bool = False) -> tuple[KVCache, jax.Array]:
    """The decode side's cache after `action`, computed in-process (no transport).

    Prefix layers 0..c-1 are quantized and restored in the action's format; layers c..L-1 are
    recomputed from the exact boundary state h_c, whose suffix also gives the first token's
    logits [B, V]. With `chunks` > 1: the chunked schedule's cache (the suffix in token chunks),
    or, `pipelined`, the pipelined prefill's (every layer in token chunks, the prefix sent and
    restored chunk by chunk).
    """
    if action.num_layers != cfg.num_layers:
        raise ValueError(f"action {action} is for {action.num_layers} layers, the model has "
                         f"{cfg.num_layers}")
    c, L = action.cut, cfg.num_layers
    codec = PrefixCodec.of(cfg, params, action)
    if pipelined:
        kv, logits = prefill(cfg, params, tokens, chunks)
        prefix, suffix = kv.layers(0, c), kv.layers(c, L)
        if c > 0:
            prefix = KVCache.join_spans(*(round_trip(prefix.span(a, b), codec, a)
                                          for a, b in token_chunks(tokens.shape[1], chunks)))
        return KVCache.concat(prefix, suffix), logits
    h_c, prefix = run_prefix(cfg, params, tokens, c)  # [B, S, D], [c, B, S, K, H]
    suffix, logits = run_suffix(cfg, params, h_c, c, chunks=chunks)  # [L - c, ...], [B, V]
    return KVCache.concat(round_trip(prefix, codec), suffix), logits


@dataclasses.dataclass(frozen=True)
class EvalSet:
    """The fixed quality set of one prompt length."""

    context: np.ndarray  # [N, S] WikiText-2 test windows handed off
    continuation: np.ndarray  # [N, T] the tokens that follow each window, scored
    prompts: list[niah.NiahPrompt]  # NIAH prompts of S tokens

    @property
    def seq_len(self) -> int:
        return self.context.shape[1]


def eval_set(tok: Tokenizer, test_ids: np.ndarray, seq_len: int, cont_len: int = 64,
             num_windows: int = 8, depths: tuple[float, ...] = NIAH_DEPTHS, seed: int = 0
             ) -> EvalSet:
    """Windows from the start of the test tokens; NIAH haystacks from the tokens after them."""
    span = windows(test_ids, seq_len + cont_len, num_windows)  # [N, S + T]
    haystack = test_ids[span.size:]
    return EvalSet(span[:, :seq_len], span[:, seq_len:],
                   niah.niah_set(tok, haystack, seq_len, depths, seed))


@dataclasses.dataclass(frozen=True)
class Outputs:
    """What one cache builder produces on an EvalSet."""

    logits: np.ndarray  # [N, T, V] float32: next-token logits at each continuation position
    niah_ok: np.ndarray  # [P] bool: greedy answer equals the passkey


def run_outputs(cfg: ModelConfig, params: Params, build: CacheBuilder, evals: EvalSet,
                batch: int = 4) -> Outputs:
    """Continuation logits and NIAH results when every prompt's cache comes from `build`."""
    logits = []
    for i in range(0, len(evals.context), batch):
        kv, first = build(jnp.asarray(evals.context[i:i + batch]))
        # position S - 1 predicts continuation[0]; feeding continuation[:-1] predicts the rest
        feed = jnp.asarray(evals.continuation[i:i + batch, :-1])  # [b, T - 1]
        rest, _ = extend(cfg, params, kv.pad(kv.seq_len + feed.shape[1]), feed, kv.seq_len)
        logits.append(np.concatenate([np.asarray(first)[:, None], np.asarray(rest)], axis=1))
    ok = []
    for i in range(0, len(evals.prompts), batch):
        group = evals.prompts[i:i + batch]
        steps = max(p.answer.size for p in group)
        kv, first = build(jnp.asarray(np.stack([p.tokens for p in group])))
        decoded = np.asarray(greedy_decode(cfg, params, kv, first, steps))  # [b, steps]
        ok += [np.array_equal(d[:p.answer.size], p.answer) for d, p in zip(decoded, group,
                                                                            strict=True)]
    return Outputs(np.concatenate(logits), np.array(ok, dtype=bool))


def token_nll(logp: jax.Array, targets: np.ndarray) -> jax.Array:
    """Next-token NLL [N, T] of targets [N, T] under log-probabilities [N, T, V]."""
    return -jnp.take_along_axis(logp, jnp.asarray(targets)[..., None], axis=-1)[..., 0]


def perplexity(logits: np.ndarray, targets: np.ndarray) -> float:
    """exp(mean next-token NLL) of targets [N, T] under logits [N, T, V]."""
    logp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
    return float(jnp.exp(jnp.mean(token_nll(logp, targets))))


def compare(ref: Outputs, out: Outputs, targets: np.ndarray) -> GateMetrics:
    """The gate's metrics of `out` against the BF16 reference `ref` (targets [N, T])."""
    logp_ref = jax.nn.log_softmax(jnp.asarray(ref.logits, jnp.float32), axis=-1)
    logp = jax.nn.log_softmax(jnp.asarray(out.logits, jnp.float32), axis=-1)
    kl = jnp.sum(jnp.exp(logp_ref) * (logp_ref - logp), axis=-1)  # [N, T]
    nll_change = token_nll(logp, targets) - token_nll(logp_ref, targets)  # [N, T]
    flips = np.asarray(jnp.argmax(logp_ref, -1) != jnp.argmax(logp, -1))  # [N, T]
    top2 = np.asarray(jax.lax.top_k(jnp.asarray(ref.logits), 2)[0])  # [N, T, 2]
    margin = top2[..., 0] - top2[..., 1]  # BF16 logit gap between its top-1 and top-2
    ppl_ref, ppl = perplexity(ref.logits, targets), perplexity(out.logits, targets)
    return GateMetrics(
        top1_agree=1.0 - float(flips.mean()),
        top1_flips=int(flips.sum()),
        # widest BF16 top-1/top-2 gap among the flips: tells near-ties from real changes
        top1_flip_margin=float(margin[flips].max()) if flips.any() else None,
        kl=float(jnp.mean(kl)),
        ppl_bf16=ppl_ref,
        ppl=ppl,
        ppl_rel_change=ppl / ppl_ref - 1.0,
        niah_pass=int(out.niah_ok.sum()),
        niah_total=int(out.niah_ok.size),
        niah_pass_bf16=int(ref.niah_ok.sum()),
        kl_se=window_se(np.asarray(kl)),
        log_ppl_change_se=window_se(np.asarray(nll_change)))


def window_se(x: np.ndarray) -> float | None:
    """The standard error of the mean of x [N, T] over its N windows (None for one window)."""
    means = x.mean(axis=1)
    return float(means.std(ddof=1) / np.sqrt(means.size)) if means.size > 1 else None


def eligible(m: GateMetrics, epsilon: float = EPSILON) -> bool:
    """Paper §2.4: all top-1 agree, all NIAH prompts pass, perplexity rises by <= epsilon."""
    return m.top1_agree == 1.0 and m.niah_pass == m.niah_total and m.ppl_rel_change <= epsilon


def evaluate(cfg: ModelConfig, params: Params, evals: EvalSet, actions: Iterable[Action],
             chunks: int = 1, pipelined: bool = False) -> list[GateResult]:
    """One gate result per action, each against the same BF16 reference outputs (the unchunked
    prefill's); `chunks`, `pipelined`: the chunked caches' (`reconstruct_cache`)."""
    ref = run_outputs(cfg, params, lambda t: prefill(cfg, params, t), evals)
    results = []
    for action in actions:
        out = run_outputs(cfg, params, lambda t, a=action: reconstruct_cache(
            cfg, params, t, a, chunks, pipelined), evals)
        m = compare(ref, out, evals.continuation)
        results.append(GateResult(cfg.name, evals.seq_len, str(action), eligible(m),
                                  chunks, pipelined and chunks > 1, m))
    return results


@dataclasses.dataclass(frozen=True)
class Baseline:
    """BF16's own quality at one prompt length (a trained model's evaluation)."""

    seq_len: int
    ppl: float  # continuation perplexity
    niah_pass: int
    niah_total: int


def bf16_baseline(cfg: ModelConfig, params: Params, tok: Tokenizer, test_ids: np.ndarray,
                  seq_len: int) -> Baseline:
    """BF16 continuation perplexity and NIAH pass count at one prompt length."""
    evals = eval_set(tok, test_ids, seq_len)
    ref = run_outputs(cfg, params, lambda t: prefill(cfg, params, t), evals)
    return Baseline(seq_len, perplexity(ref.logits, evals.continuation),
                    int(ref.niah_ok.sum()), int(ref.niah_ok.size))
