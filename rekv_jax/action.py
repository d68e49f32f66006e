"""The handoff action `a = (b, c)`: prefix precision and layer cut (paper §2.2, §2.4), and the
format a Q8/Q4 prefix travels in.

`cut = c` is the first recomputed layer, so the suffix length is `r = L - c`:
  * `c = L`      transfer-only: the full KV at precision `b`, no boundary state;
  * `c = 0`      full recomputation: only token IDs cross the link (`b` is irrelevant, kept as 16);
  * `0 < c < L`  joint: the `b`-bit prefix KV of layers `0..c-1` plus the BF16 boundary `h_c`.

A Q8/Q4 prefix travels in a format (`PREFIX_FORMATS`): the paper's groups of 64 along head_dim,
or with its keys transformed around that quantizer (`handoff/prefix_format.py`):
  * `debias`       keys travel as `K - RoPE(b_k, pos)` (the k_proj bias both sides hold);
  * `hadamard`     each 64-channel group of a key is rotated by a normalized Hadamard matrix;
  * `per-channel`  keys are grouped along tokens (64 tokens per group, a scale per channel);
and `debias+hadamard`, `debias+per-channel`. Values always travel in the paper's groups.

Text form, used by the CLI and in every result: `PREC:CUT[/FORMAT]` with `PREC` in `bf16|q8|q4`,
`CUT` an integer `c`, `full` (`c = L`), `recompute` (`c = 0`) or `r=N` (`c = L - N`), and
`FORMAT` one of `PREFIX_FORMATS` (a Q8/Q4 prefix only; `paper`, the default, is never written).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator, Sequence

BITS = (16, 8, 4)


class ActionKind(enum.StrEnum):
    """What an action sends (`Action.kind`)."""

    TRANSFER = "transfer"  # c = L: the full KV
    RECOMPUTE = "recompute"  # c = 0: the token ids only
    JOINT = "joint"  # 0 < c < L: the prefix KV and h_c


ACTION_KINDS = tuple(k.value for k in ActionKind)  # the values, as plain strings


class Transform(enum.StrEnum):
    """A transform of the prefix's keys around the paper's quantizer (a part of a format)."""

    DEBIAS = "debias"  # K - RoPE(b_k, pos) travels; the decode side adds RoPE(b_k, pos) back
    HADAMARD = "hadamard"  # each 64-channel group times a normalized 64x64 Hadamard matrix
    PER_CHANNEL = "per-channel"  # groups of 64 tokens of one channel, not 64 channels of a token


PAPER = "paper"  # the paper's format: no transform
# Every format: the paper's, each transform alone, and debias with either of the others (a
# rotation before per-channel groups would spread one channel's outlier over every channel,
# which is what per-channel scales avoid). Parts are joined by `+` in Transform's order.
PREFIX_FORMATS = (PAPER, "debias", "hadamard", "per-channel", "debias+hadamard",
                  "debias+per-channel")
_PREC_NAME = {16: "bf16", 8: "q8", 4: "q4"}
_PREC_BITS = {v: k for k, v in _PREC_NAME.items()}


@dataclasses.dataclass(frozen=True, order=True)
class Action:
    """Precision `bits` of the transmitted prefix and layer `cut` (0..L) of an L-layer model,
    and the `format` of a Q8/Q4 prefix (`PREFIX_FORMATS`)."""

    bits: int
    cut: int
    num_layers: int
    format: str = PAPER

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {self.bits!r}")
        if not 0 <= self.cut <= self.num_layers:
            raise ValueError(f"cut must be in 0..{self.num_layers}, got {self.cut}")
        if self.cut == 0 and self.bits != 16:
            raise ValueError("full recomputation sends token IDs only; write it as bf16:recompute")
        check_format(self.format)
        if self.format != PAPER and (self.bits == 16 or self.cut == 0):
            what = "full recomputation" if self.cut == 0 else "a BF16 prefix"
            raise ValueError(f"prefix format {self.format!r} applies to a Q8/Q4 prefix, not to "
                             f"{what}")

    @property
    def transforms(self) -> frozenset[Transform]:
        """The key transforms of the format (empty for the paper's)."""
        return transforms_of(self.format)

    @property
    def suffix_len(self) -> int:
        """r = L - c: layers the decode side recomputes."""
        return self.num_layers - self.cut

    @property
    def kind(self) -> ActionKind:
        """`transfer`, `recompute` or `joint`."""
        if self.cut == self.num_layers:
            return ActionKind.TRANSFER
        return ActionKind.RECOMPUTE if self.cut == 0 else ActionKind.JOINT

    @property
    def precision(self) -> str:
        return _PREC_NAME[self.bits]

    def __str__(self) -> str:
        if self.kind == ActionKind.RECOMPUTE:
            return "bf16:recompute"
        cut = "full" if self.kind == ActionKind.TRANSFER else f"r={self.suffix_len}"
        return f"{self.precision}:{cut}" + (f"/{self.format}" if self.format != PAPER else "")

    @classmethod
    def parse(cls, text: str, num_layers: int) -> Action:
        """Parse `PREC:CUT[/FORMAT]` for a model with `num_layers` layers."""
        text, _, fmt = text.strip().partition("/")
        try:
            check_format(fmt or PAPER)
        except ValueError as e:
            raise ValueError(f"action {text}/{fmt}: {e}") from None
        prec, sep, cut_text = text.partition(":")
        if not sep or prec not in _PREC_BITS:
            raise ValueError(f"action {text!r}: expected PREC:CUT with PREC in {list(_PREC_BITS)}")
        bits = _PREC_BITS[prec]
        if cut_text == "full":
            cut = num_layers
        elif cut_text == "recompute":
            cut = 0
        elif cut_text.startswith("r="):
            suffix = _int(cut_text[2:], text)
            if not 0 <= suffix <= num_layers:
                raise ValueError(f"action {text!r}: the suffix length r must be in "
                                 f"0..{num_layers} for a {num_layers}-layer model, got {suffix}")
            cut = num_layers - suffix
        else:
            cut = _int(cut_text, text)
            if not 0 <= cut <= num_layers:
                raise ValueError(f"action {text!r}: the cut must be in 0..{num_layers} for a "
                                 f"{num_layers}-layer model, got {cut}")
        if cut == 0 and bits != 16:
            raise ValueError(f"action {text!r}: full recomputation is written bf16:recompute")
        return cls(bits, cut, num_layers, fmt or PAPER)


def _int(s: str, text: str) -> int:
    try:
        return int(s)
    except ValueError:
        raise ValueError(f"action {text!r}: {s!r} is not an integer") from None


def check_format(fmt: str) -> str:
    """`fmt` if it is one of `PREFIX_FORMATS`, else a ValueError naming them."""
    if fmt not in PREFIX_FORMATS:
        raise ValueError(f"unknown prefix format {fmt!r}; expected one of {PREFIX_FORMATS}")
    return fmt


def transforms_of(fmt: str) -> frozenset[Transform]:
    """The key transforms a format applies (none for the paper's)."""
    return frozenset() if check_format(fmt) == PAPER else frozenset(map(Transform,
                                                                         fmt.split("+")))


def parse_formats(spec: str) -> tuple[str, ...]:
    """A comma list of `PREFIX_FORMATS`, or `all`."""
    if spec.strip() == "all":
        return PREFIX_FORMATS
    return tuple(dict.fromkeys(check_format(f.strip()) for f in spec.split(",")))


def with_formats(actions: Sequence[Action], formats: Sequence[str]) -> list[Action]:
    """Each action in each of `formats` (in that order) where it has a Q8/Q4 prefix; an action
    without one (BF16, full recomputation) once, as it is."""
    out: list[Action] = []
    for a in actions:
        quantized = a.bits != 16 and a.cut > 0
        out += ([dataclasses.replace(a, format=f) for f in formats] if quantized else [a])
    return list(dict.fromkeys(out))


def parse_actions(spec: str | Sequence[str], num_layers: int,
                  formats: Sequence[str] | None = None) -> list[Action]:
    """A comma list (or sequence) of `PREC:CUT[/FORMAT]`, or `all` for the whole action space;
    with `formats`, each Q8/Q4 action in each of them (`with_formats`)."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    if [s.strip() for s in items] == ["all"]:
        actions = list(action_space(num_layers))
    else:
        actions = [Action.parse(s, num_layers) for s in items]
    return actions if formats is None else with_formats(actions, formats)


def action_space(num_layers: int, bits: Sequence[int] = BITS,
                 formats: Sequence[str] = (PAPER,)) -> Iterator[Action]:
    """Every action of a model: each precision at every cut 1..L (a Q8/Q4 one in each of
    `formats`, in order), then full recomputation."""
    for b in bits:
        for c in range(1, num_layers + 1):
            for f in formats if b != 16 else (PAPER,):
                yield Action(b, c, num_layers, f)
    yield Action(16, 0, num_layers)
