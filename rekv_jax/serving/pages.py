"""The host side of the paged cache: which pages each request owns, and the inputs of a step.

A pool has `num_pages` pages of `page_size` positions per layer (`model.paged.PagePool`). Page 0
is never given out: it is the null page that a block table's unused entries and a batch's
padding rows point at (padding rows write their K/V there; nothing reads it unmasked). A request
takes all the pages it can ever need when it is admitted (its prompt plus its `max_new_tokens`)
and gives them back when it retires; when too few are free, admission says wait (None), and
nothing is evicted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from rekv_jax.model.layers import ROW_BLOCK
from rekv_jax.sizes import attention_width

NULL_PAGE = 0
PAGE_SIZE = 16  # positions per page, by default


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    """The shape of a page pool: `num_pages` pages (the null page included) of `page_size`."""

    num_pages: int
    page_size: int = PAGE_SIZE

    def __post_init__(self) -> None:
        if self.num_pages < 2 or self.page_size < 1:
            raise ValueError(f"a pool needs at least 2 pages (one is the null page) of at least "
                             f"1 position, got {self.num_pages} of {self.page_size}")

    @classmethod
    def holding(cls, tokens: int, page_size: int = PAGE_SIZE) -> PoolConfig:
        """The smallest pool that holds one request of `tokens` positions."""
        return cls(-(-tokens // page_size) + 1, page_size)

    @property
    def usable_pages(self) -> int:
        """Pages that requests can own (all but the null page)."""
        return self.num_pages - 1

    def pages_for(self, tokens: int) -> int:
        """Pages holding `tokens` positions."""
        return -(-tokens // self.page_size)


@dataclasses.dataclass(frozen=True)
class BlockTable:
    """The pages of one request, in position order: position p is at page
    `pages[p // page_size]`, slot `p % page_size`."""

    pages: tuple[int, ...]
    page_size: int

    @property
    def capacity(self) -> int:
        """Positions the request can hold."""
        return len(self.pages) * self.page_size

    def rows(self, start: int, stop: int) -> np.ndarray:
        """The rows (`page * page_size + slot`) of positions start..stop-1 [stop - start], where
        a layer's contiguous KV of those positions is written (`model.paged.write_layer`)."""
        if not 0 <= start <= stop <= self.capacity:
            raise ValueError(f"positions {start}..{stop - 1} are outside this request's "
                             f"{self.capacity} positions")
        positions = np.arange(start, stop)
        pages = np.asarray(self.pages, np.int32)[positions // self.page_size]
        return (pages * self.page_size + positions % self.page_size).astype(np.int32)

    def padded(self, n: int) -> np.ndarray:
        """The first n page ids [n] int32, the null page past the request's own."""
        out = np.full(n, NULL_PAGE, np.int32)
        own = self.pages[:n]
        out[:len(own)] = own
        return out


class PageAllocator:
    """Hands out a pool's pages (never the null page) and takes them back; one thread."""

    def __init__(self, config: PoolConfig):
        self.config = config
        self._free = list(range(config.num_pages - 1, NULL_PAGE, -1))  # pops page 1 first
        self._owned: set[int] = set()

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return len(self._owned)

    def admit(self, tokens: int) -> BlockTable | None:
        """Pages for a request of `tokens` positions (prompt plus max_new_tokens), or None when
        too few are free now (the request waits). ValueError if it could never fit."""
        need = self.config.pages_for(tokens)
        if tokens < 1 or need > self.config.usable_pages:
            raise ValueError(f"a request of {tokens} positions needs {need} pages; the pool "
                             f"holds {self.config.usable_pages} of {self.config.page_size}")
        if need > len(self._free):
            return None
        pages = tuple(self._free.pop() for _ in range(need))
        self._owned.update(pages)
        return BlockTable(pages, self.config.page_size)

    def retire(self, table: BlockTable) -> None:
        """Take a retired request's pages back. ValueError for pages this pool did not give
        out or already has back (a table retired twice)."""
        stray = [p for p in table.pages if p not in self._owned]
        if stray or table.page_size != self.config.page_size:
            raise ValueError(f"pages {stray} are not held by a request of this pool")
        self._owned.difference_update(table.pages)
        self._free.extend(reversed(table.pages))


# ---------------------------------------------------------------------------- a step's inputs


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """What `model.paged.decode_step` takes for one batch, on the host: one row per slot."""

    tokens: np.ndarray  # [B] int32
    positions: np.ndarray  # [B] int32
    tables: np.ndarray  # [B, n] int32: n = the pages covering `width`
    width: int  # the step's power-of-two attention bucket


@dataclasses.dataclass(frozen=True)
class StepRow:
    """A request in a decode step: its next token, that token's position, and its pages."""

    token: int
    position: int
    table: BlockTable


def batch_bucket(requests: int) -> int:
    """Slots of the step that runs `requests` requests: the multiple of ROW_BLOCK covering
    them (the step's dots run on blocks of that many rows whatever the slots: padding a batch
    further would only add blocks)."""
    return ROW_BLOCK * max(-(-requests // ROW_BLOCK), 1)


def width_bucket(positions: Sequence[int]) -> int:
    """The step's attention bucket: the power of two covering every position + 1, as
    `attention_width` buckets a contiguous decode's (uncapped); each request attends over its
    own bucket inside it."""
    end = max(positions) + 1
    return attention_width(end, 2 * end)


def step_inputs(slots: Sequence[StepRow | None], page_size: int) -> StepInputs:
    """The inputs of one step, slot by slot; an empty slot (None) is a padding row: token 0 at
    position 0 of the null page. Slots past the last are not added: pad with None."""
    real = [s for s in slots if s is not None]
    if not real:
        raise ValueError("a step needs at least one request")
    for s in real:
        if not 0 <= s.position < s.table.capacity:
            raise ValueError(f"position {s.position} is outside the request's "
                             f"{s.table.capacity} positions")
    width = width_bucket([s.position for s in real])
    n = -(-width // page_size)
    null = BlockTable((), page_size)
    rows = [s or StepRow(0, 0, null) for s in slots]
    return StepInputs(np.array([r.token for r in rows], np.int32),
                      np.array([r.position for r in rows], np.int32),
                      np.stack([r.table.padded(n) for r in rows]), width)
