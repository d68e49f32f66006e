"""A handoff as data: the typed steps of one handoff (`Mode.plan` builds them), what each step
needs, and the order of the messages that follows from them.

A plan is a sequence of steps in an order every side can run them in: each step names the
earlier steps it needs (`after`, their indices), and the steps of one kind of device run in the
plan's order (one FIFO link, one prefill device, one decode device). The prefill side computes
(`Prefill`) and quantizes (`Quantize`); each `Receive` is one message crossing the link, sent in
the plan's order once the steps it carries are done; the decode side restores what a prefix
message carries (`Restore`), runs layers on a boundary piece or the token ids (`Suffix`) and joins
the cache (`Join`, the last step). The decode side executes a plan (`handoff.receiver`), the
cost model plays one against a profile (`planning.play`); the wire order is `Plan.messages`.
"""

from __future__ import annotations

import dataclasses
import enum

from rekv_jax.action import Action
from rekv_jax.sizes import token_chunks

Span = tuple[int, int]  # a [start, stop) range of layers or token positions


class Part(enum.StrEnum):
    """What a message carries."""

    TOKENS = "tokens"  # the token ids [B, S] int32
    FIRST = "first"  # the prefill side's first token [B] int32
    BOUNDARY = "boundary"  # h_c of a token range [B, T, D]
    PREFIX = "prefix"  # the (quantized) KV of a range of layers and tokens


@dataclasses.dataclass(frozen=True)
class Message:
    """One message of a handoff: its tag (under the handoff's), what it carries in order, and the
    token and layer ranges of its h_c and prefix parts."""

    name: str
    parts: tuple[Part, ...]
    tokens: Span  # the token range [start, stop) of a BOUNDARY or PREFIX part
    layers: Span = (0, 0)  # the layer range [start, stop) of a PREFIX part
    chunk: int = 0  # the token chunk it belongs to (its boundary chunk or prefix chunk)


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Token chunk `index` of `of` (`sizes.token_chunks`): positions [tokens[0], tokens[1])."""

    index: int
    of: int
    tokens: Span

    @property
    def last(self) -> bool:
        return self.index == self.of - 1


def chunks_of(seq_len: int, count: int) -> list[Chunk]:
    """The `count` token chunks of a prompt of `seq_len` tokens."""
    return [Chunk(i, count, span) for i, span in enumerate(token_chunks(seq_len, count))]


@dataclasses.dataclass(frozen=True)
class Prefill:
    """The prefill side runs prompt layers [layers) on a token chunk (embedding it first when
    the layers start at 0)."""

    layers: Span
    chunk: Chunk
    after: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Quantize:
    """The prefill side quantizes the KV of prefix layers [layers) on a token chunk."""

    layers: Span
    chunk: Chunk
    after: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Receive:
    """`message` crosses the link: sent once the steps it carries are done, in the plan's order,
    and received in that order."""

    message: Message
    after: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Restore:
    """The decode side restores the prefix part `message` carries (its layers and tokens)."""

    message: Message
    after: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Suffix:
    """The decode side runs layers [layers) on a token chunk: from a piece of h_c, or from the
    token ids when the layers start at 0 (a recomputation). After the last chunk, the head on the
    last position."""

    layers: Span
    chunk: Chunk
    after: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Join:
    """The complete cache and the first token, once every decode-side step is done."""

    after: tuple[int, ...] = ()


Step = Prefill | Quantize | Receive | Restore | Suffix | Join


@dataclasses.dataclass(frozen=True)
class Plan:
    """The steps of one handoff of `action` on a prompt of `seq_len` tokens, in a runnable order
    (each step needs only earlier ones), ending with its `Join`."""

    action: Action
    seq_len: int
    steps: tuple[Step, ...]

    def __post_init__(self) -> None:
        for i, step in enumerate(self.steps):
            if not all(0 <= j < i for j in step.after):
                raise ValueError(f"step {i} ({step}) needs a step that does not come before it")
        if not self.steps or not isinstance(self.steps[-1], Join):
            raise ValueError("a plan ends with its join")
        object.__setattr__(self, "_hash", hash((self.action, self.seq_len, self.steps)))

    def __hash__(self) -> int:  # the cost model's cache key: hashed once, not step by step
        return self._hash

    @property
    def messages(self) -> list[Message]:
        """Every message in the order the prefill side sends it (a FIFO link delivers them in
        that order)."""
        return [s.message for s in self.steps if isinstance(s, Receive)]


class Builder:
    """Appends steps to a plan, each added step's index returned for later steps' `after`."""

    def __init__(self, action: Action, seq_len: int) -> None:
        self.action, self.seq_len = action, seq_len
        self.steps: list[Step] = []

    def add(self, step: Step) -> int:
        self.steps.append(step)
        return len(self.steps) - 1

    def prefix(self, message: Message, after: tuple[int, ...]) -> int:
        """A prefix message crossing, then its restore; the restore's index."""
        return self.add(Restore(message, (self.add(Receive(message, after)),)))

    def suffixes(self, first: int, chunks: list[Chunk], inputs: list[int],
                 waits: tuple[int, ...] = ()) -> None:
        """Layers first..L-1 on each chunk, once its input (`inputs[i]`), the chunk before and
        `waits` are done."""
        before: tuple[int, ...] = ()
        for chunk, given in zip(chunks, inputs, strict=True):
            layers = (first, self.action.num_layers)
            before = (self.add(Suffix(layers, chunk, (given, *before, *waits))),)

    def plan(self) -> Plan:
        """The plan, its join after every decode-side step."""
        ends = tuple(i for i, s in enumerate(self.steps)
                     if isinstance(s, Receive | Restore | Suffix))
        return Plan(self.action, self.seq_len, (*self.steps, Join(ends)))
