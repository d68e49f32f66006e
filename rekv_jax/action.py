"""The handoff action `a = (b, c)`: prefix precision and layer cut (paper §2.2, §2.4).

`cut = c` is the first recomputed layer, so the suffix length is `r = L - c`:
  * `c = L`      transfer-only: the full KV at precision `b`, no boundary state;
  * `c = 0`      full recomputation: only token IDs cross the link (`b` is irrelevant, kept as 16);
  * `0 < c < L`  joint: the `b`-bit prefix KV of layers `0..c-1` plus the BF16 boundary `h_c`.

Text form, used by the CLI and in every result: `PREC:CUT` with `PREC` in `bf16|q8|q4` and `CUT`
an integer `c`, `full` (`c = L`), `recompute` (`c = 0`) or `r=N` (`c = L - N`).
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
_PREC_NAME = {16: "bf16", 8: "q8", 4: "q4"}
_PREC_BITS = {v: k for k, v in _PREC_NAME.items()}


@dataclasses.dataclass(frozen=True, order=True)
class Action:
    """Precision `bits` of the transmitted prefix and layer `cut` (0..L) of an L-layer model."""

    bits: int
    cut: int
    num_layers: int

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {self.bits!r}")
        if not 0 <= self.cut <= self.num_layers:
            raise ValueError(f"cut must be in 0..{self.num_layers}, got {self.cut}")
        if self.cut == 0 and self.bits != 16:
            raise ValueError("full recomputation sends token IDs only; write it as bf16:recompute")

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
        if self.kind == ActionKind.TRANSFER:
            return f"{self.precision}:full"
        if self.kind == ActionKind.RECOMPUTE:
            return "bf16:recompute"
        return f"{self.precision}:r={self.suffix_len}"

    @classmethod
    def parse(cls, text: str, num_layers: int) -> Action:
        """Parse `PREC:CUT` for a model with `num_layers` layers."""
        prec, sep, cut_text = text.strip().partition(":")
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
        return cls(bits, cut, num_layers)


def _int(s: str, text: str) -> int:
    try:
        return int(s)
    except ValueError:
        raise ValueError(f"action {text!r}: {s!r} is not an integer") from None


def parse_actions(spec: str | Sequence[str], num_layers: int) -> list[Action]:
    """A comma list (or sequence) of `PREC:CUT`, or `all` for the whole action space."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    if [s.strip() for s in items] == ["all"]:
        return list(action_space(num_layers))
    return [Action.parse(s, num_layers) for s in items]


def action_space(num_layers: int, bits: Sequence[int] = BITS) -> Iterator[Action]:
    """Every action of a model: each precision at every cut 1..L, then full recomputation."""
    for b in bits:
        for c in range(1, num_layers + 1):
            yield Action(b, c, num_layers)
    yield Action(16, 0, num_layers)
