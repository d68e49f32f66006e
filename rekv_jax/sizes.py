"""Byte and FLOP accounting of a ReKV handoff (paper Eqs. 1, 2, 5, 7): the one place they live.

Every payload size used by the cost model, the planner, the CLI and the tables comes from here.
A KV layer holds `E = 2 * B * S * K * H` elements (keys and values, `[B, S, K, H]` each). At 16
bits it costs `2E` bytes; at `b` in {8, 4} bits it is sent as packed codes plus one float16 scale
per group of `G = 64` elements along head_dim: `E * (b/8 + 2/G)` bytes (Eq. 7). A prefix format
that groups keys per channel along tokens (`per-channel`: 64 tokens of one channel share a scale)
has the same count of scales per element, but pads the keys' tokens to a whole group
(`key_tokens`); every other format sends exactly the paper's bytes. The boundary
state `h_c` is always BF16 (`B * S * D * 2` bytes, Eq. 1); full recomputation sends int32 token IDs.
Model FLOPs count 2 per weight per token plus the two attention matmuls over the keys each
query sees (the roofline of `planner.analytic_profile` and `scripts/bench_model.py` use them).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from rekv_jax.action import BITS, PAPER, Action, ActionKind, Transform, transforms_of
from rekv_jax.config import ModelConfig

GROUP_SIZE = 64  # elements sharing one scale (paper §2.2)
SCALE_BYTES = 2  # float16 scale
BOUNDARY_ELEM_BYTES = 2  # h_c is sent in BF16
TOKEN_ID_BYTES = 4  # int32 token IDs
WEIGHT_BYTES = 2  # BF16 weights
MIB = 2**20


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")


def _check_bits(bits: int) -> int:
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}")
    return bits


def quantized_bytes(num_elements: int, last_dim: int, bits: int,
                    group_size: int = GROUP_SIZE) -> int:
    """Bytes of `num_elements` values (last axis `last_dim`) at `bits`: codes plus scales."""
    _check_bits(bits)
    if bits == 16:
        return num_elements * 2
    if last_dim % group_size:
        raise ValueError(f"last dim {last_dim} is not divisible by the group size {group_size}")
    return num_elements * bits // 8 + num_elements // group_size * SCALE_BYTES


def boundary_bytes(cfg: ModelConfig, seq_len: int, batch: int = 1) -> int:
    """B_H (Eq. 1): the BF16 residual state h_c `[B, S, D]`."""
    _check_positive(seq_len=seq_len, batch=batch)
    return batch * seq_len * cfg.hidden_size * BOUNDARY_ELEM_BYTES


def kv_layer_elements(cfg: ModelConfig, seq_len: int, batch: int = 1) -> int:
    """E: elements of one layer's keys and values, `2 x [B, S, K, H]`."""
    _check_positive(seq_len=seq_len, batch=batch)
    return 2 * batch * seq_len * cfg.num_kv_heads * cfg.head_dim


def key_tokens(seq_len: int, fmt: str = PAPER) -> int:
    """Tokens a prefix's keys occupy on the wire: `seq_len`, or, in a format grouping keys per
    channel along tokens, `seq_len` rounded up to a whole group of `GROUP_SIZE`: the last, partial
    group is padded with zeros (they change no group's max, and the decode side drops them)."""
    _check_positive(seq_len=seq_len)
    if Transform.PER_CHANNEL in transforms_of(fmt):
        return -(-seq_len // GROUP_SIZE) * GROUP_SIZE
    return seq_len


def format_layer_bytes(kv_bytes: int, seq_len: int, fmt: str) -> int:
    """One KV layer's Q8/Q4 payload in format `fmt`, from its payload `kv_bytes` in the paper's
    (keys and values of `seq_len` tokens each, the same bytes per token): the keys' half carries
    `key_tokens` tokens. Exact for `kv_layer_bytes`; rounded up for a share of it per link."""
    padding = key_tokens(seq_len, fmt) - seq_len
    return kv_bytes + -(-kv_bytes // 2 * padding // seq_len) if padding else kv_bytes


def kv_layer_bytes(cfg: ModelConfig, seq_len: int, batch: int = 1, bits: int = 16,
                   fmt: str = PAPER) -> int:
    """B_KV (Eq. 2) at 16 bits; at 8/4 bits the packed codes plus float16 group scales (Eq. 7),
    in prefix format `fmt` (`format_layer_bytes`)."""
    paper = quantized_bytes(kv_layer_elements(cfg, seq_len, batch), cfg.head_dim, bits)
    if bits == 16:
        if fmt != PAPER:
            raise ValueError(f"prefix format {fmt!r} applies to a Q8/Q4 prefix, not to BF16")
        return paper
    return format_layer_bytes(paper, seq_len, fmt)


def prefix_bytes(cfg: ModelConfig, seq_len: int, cut: int, bits: int, batch: int = 1,
                 fmt: str = PAPER) -> int:
    """KV payload of layers `0..cut-1` at `bits` in format `fmt` (without the boundary state)."""
    return cfg.check_cut(cut) * kv_layer_bytes(cfg, seq_len, batch, bits, fmt)


def token_bytes(seq_len: int, batch: int = 1) -> int:
    """Payload of full recomputation: the int32 token IDs `[B, S]`."""
    _check_positive(seq_len=seq_len, batch=batch)
    return batch * seq_len * TOKEN_ID_BYTES


@dataclasses.dataclass(frozen=True)
class HandoffBytes:
    """What one action `(bits, cut)` sends (Eqs. 5, 7): the prefix at `bits`, the BF16 boundary
    `h_c` (joint only) or the token IDs (full recomputation only)."""

    model: str
    seq_len: int  # S
    batch: int  # B
    bits: int
    cut: int  # c
    suffix_len: int  # r = L - c
    kind: ActionKind
    boundary_bytes: int  # B_H, 0 unless joint
    kv_layer_bytes_bf16: int  # B_KV: one BF16 KV layer (for scale)
    prefix_payload_bytes: int  # layers 0..c-1 at `bits`
    token_bytes: int  # int32 token IDs, 0 unless full recomputation
    total_bytes: int
    format: str = PAPER  # the prefix format (action.PREFIX_FORMATS)

    @property
    def total_mib(self) -> float:
        return self.total_bytes / MIB

    def to_json(self) -> dict[str, int | float | str]:
        """The fields (the format only when not the paper's) and four of them in MiB
        (`rekv bytes --json`)."""
        fields = dataclasses.asdict(self)
        if self.format == PAPER:
            del fields["format"]
        return fields | {mib: getattr(self, field) / MIB for mib, field in _IN_MIB.items()}


# HandoffBytes.to_json's sizes in MiB: key -> field
_IN_MIB = {"boundary_mib": "boundary_bytes", "kv_layer_mib_bf16": "kv_layer_bytes_bf16",
           "prefix_payload_mib": "prefix_payload_bytes", "total_mib": "total_bytes"}


def handoff_bytes(cfg: ModelConfig, seq_len: int, bits: int, cut: int, batch: int = 1,
                  fmt: str = PAPER) -> HandoffBytes:
    """Bytes sent by the action (bits, cut): `cut == L` full KV at `bits` (no boundary),
    `cut == 0` token IDs only (bits ignored), else the `bits` prefix plus the BF16 boundary (Eq. 7);
    a Q8/Q4 prefix in format `fmt`.
    """
    _check_bits(bits)
    cfg.check_cut(cut)
    L = cfg.num_layers
    if cut == 0:
        kind, prefix, boundary, tokens = ActionKind.RECOMPUTE, 0, 0, token_bytes(seq_len, batch)
    else:
        kind = ActionKind.TRANSFER if cut == L else ActionKind.JOINT
        prefix = prefix_bytes(cfg, seq_len, cut, bits, batch, fmt)
        boundary = 0 if cut == L else boundary_bytes(cfg, seq_len, batch)
        tokens = 0
    return HandoffBytes(cfg.name, seq_len, batch, bits, cut, L - cut, kind, boundary,
                        kv_layer_bytes(cfg, seq_len, batch), prefix, tokens,
                        prefix + boundary + tokens, fmt)


def action_bytes(cfg: ModelConfig, action: Action, seq_len: int, batch: int = 1
                 ) -> HandoffBytes:
    """`handoff_bytes` of an `Action` (checked against the config's layer count)."""
    if action.num_layers != cfg.num_layers:
        raise ValueError(f"action {action} is for {action.num_layers} layers, "
                         f"{cfg.name} has {cfg.num_layers}")
    return handoff_bytes(cfg, seq_len, action.bits, action.cut, batch, action.format)


@dataclasses.dataclass(frozen=True)
class ModelSizes:
    """Per-layer and whole-model payload sizes of one model, length and batch (Eqs. 1-3, 7)."""

    seq_len: int  # S
    batch: int  # B
    boundary_bytes: int  # B_H
    kv_layer_bytes_bf16: int  # B_KV
    kv_layer_bytes_q8: int
    kv_layer_bytes_q4: int
    full_kv_bytes_bf16: int  # L B_KV
    token_bytes: int

    @property
    def boundary_to_kv_layer(self) -> float:
        """B_H / B_KV = n_h / (2 n_kv) when D = n_h * H (Eq. 3)."""
        return self.boundary_bytes / self.kv_layer_bytes_bf16

    @property
    def min_saving_suffix_bf16(self) -> int:
        """The smallest r with r * B_KV > B_H (Eq. 6): a BF16 cut's suffix that saves bytes."""
        return self.boundary_bytes // self.kv_layer_bytes_bf16 + 1

    def to_json(self) -> dict[str, int | float]:
        """The fields and the break-even (`rekv info --json`)."""
        return dataclasses.asdict(self) | {
            "boundary_to_kv_layer": self.boundary_to_kv_layer,
            "min_saving_suffix_bf16": self.min_saving_suffix_bf16}


def model_sizes(cfg: ModelConfig, seq_len: int, batch: int = 1) -> ModelSizes:
    """Per-layer and whole-model payload sizes, and the boundary break-even (Eqs. 3, 6)."""
    b_kv = kv_layer_bytes(cfg, seq_len, batch)
    return ModelSizes(seq_len, batch, boundary_bytes(cfg, seq_len, batch), b_kv,
                      *(kv_layer_bytes(cfg, seq_len, batch, bits) for bits in (8, 4)),
                      cfg.num_layers * b_kv, token_bytes(seq_len, batch))


def layer_weight_count(cfg: ModelConfig) -> int:
    """Weights of one decoder layer: attention projections and the SwiGLU MLP (norms ignored)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return cfg.hidden_size * (2 * q + 2 * kv + 3 * cfg.intermediate_size)


def head_weight_count(cfg: ModelConfig) -> int:
    """Weights of the LM head `[D, V]` (the embedding matrix when tied)."""
    return cfg.hidden_size * cfg.vocab_size


def layer_flops(cfg: ModelConfig, seq_len: int, batch: int = 1, past: int = 0) -> float:
    """FLOPs of one layer on `seq_len` new tokens after `past` cached ones: 2 per weight per
    token, plus QK^T and PV over the keys each query sees (`past + t`, the causal half ~ S^2/2)."""
    keys_seen = seq_len * past + seq_len * seq_len / 2
    attention = 4 * keys_seen * cfg.num_heads * cfg.head_dim  # 2 matmuls of 2 FLOPs per MAC
    return batch * (2 * seq_len * layer_weight_count(cfg) + attention)


def attention_share(cfg: ModelConfig, seq_len: int) -> float:
    """The causal attention's share of a prompt layer's FLOPs (`layer_flops`, no past): the part
    of a layer whose cost per token grows with the token's position."""
    return 1 - 2 * seq_len * layer_weight_count(cfg) / layer_flops(cfg, seq_len)


def token_chunks(seq_len: int, chunks: int) -> list[tuple[int, int]]:
    """The (start, stop) ranges of `chunks` contiguous token chunks covering 0..seq_len-1, sizes
    differing by at most one (larger first): how every chunked path splits a prompt."""
    if not 1 <= chunks <= seq_len:
        raise ValueError(f"chunks must be in 1..{seq_len} (the prompt's tokens), got {chunks}")
    size, extra = divmod(seq_len, chunks)
    stops = list(itertools.accumulate(size + (i < extra) for i in range(chunks)))
    return list(zip([0, *stops[:-1]], stops, strict=True))


def attention_width(end: int, capacity: int) -> int:
    """Cache positions a step ending at `end` attends over: the power of two covering `end`,
    at most the capacity. One program per bucket, not per step, and (on a GPU) attention never
    reads the cache past the bucket, so a step costs O(end), not O(capacity)."""
    return min(capacity, 1 << max(end - 1, 0).bit_length())


def head_flops(cfg: ModelConfig, positions: int = 1, batch: int = 1) -> float:
    """FLOPs of the LM head on `positions` positions per prompt."""
    return 2 * batch * positions * head_weight_count(cfg)


# ---------------------------------------------------------------------------- sharded sides


def kv_shards(cfg: ModelConfig, devices: int) -> int:
    """KV-head shards of a side with `devices` tensor-parallel devices: gcd(K, devices) (each
    shard is replicated over the rest, `rekv_jax.sharding.make_mesh`)."""
    _check_positive(devices=devices)
    return math.gcd(cfg.num_kv_heads, devices)


@dataclasses.dataclass(frozen=True)
class Links:
    """Parallel links a handoff between sharded sides uses at once, per part."""

    prefix: int
    boundary: int


def parallel_links(cfg: ModelConfig, prefill_devices: int = 1, decode_devices: int = 1) -> Links:
    """Links a handoff between sharded sides uses at once, counting one link per receiving decode
    device: the prefix crosses as lcm of both sides' KV shards pieces (cut along K, each piece to
    a decode device holding it), `h_c` as lcm(N, M) pieces cut along D."""
    prefix = math.lcm(kv_shards(cfg, prefill_devices), kv_shards(cfg, decode_devices))
    boundary = math.lcm(prefill_devices, decode_devices)
    return Links(min(prefix, decode_devices), min(boundary, decode_devices))


def link_bytes(nbytes: int, links: int) -> int:
    """Bytes on the busiest of `links` parallel links carrying `nbytes` in equal pieces."""
    _check_positive(links=links)
    return -(-nbytes // links)
