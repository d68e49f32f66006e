"""How a failed command is told to its user: one line and an exit status, no traceback.

Bad input (ValueError: a file, a flag, a model that does not fit) exits 2; a run that failed
(a dead or unreachable peer, a timeout, a device out of memory, two sides whose software or
devices differ) exits 1. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import dataclasses
import re
import signal


class TransportError(RuntimeError):
    """A phase did not arrive intact: the peer died or failed, or the payload was corrupted."""


class TransportTimeout(TransportError, TimeoutError):
    """A wait ran past its timeout."""


class RuntimeMismatch(RuntimeError):
    """The two sides run different JAX/jaxlib versions, XLA flags, device kinds or attention
    backends, so their bits may differ: a failed run (exit 1), not bad input."""


@dataclasses.dataclass(frozen=True)
class Told:
    status: int  # the process's exit status
    line: str  # what the user reads


def first_line(text: str) -> str:
    """The first line of `text`, stripped ("" if it has none)."""
    lines = text.strip().splitlines()
    return lines[0] if lines else ""


def one_line(error: BaseException) -> str:
    """An error in one line: its type and its message's first line."""
    return f"{type(error).__name__}: {first_line(str(error))}"


def describe(e: BaseException) -> Told | None:
    """The one line for an expected failure; None for anything else (a bug)."""
    text = str(e).strip()
    first = first_line(text) or type(e).__name__
    if isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in text:
        size = re.search(r"(\d+) bytes", text)
        detail = f"{int(size[1]) / 2**30:.1f} GiB requested; " if size else ""
        return Told(1, f"out of memory ({detail}{first})")
    if isinstance(e, ValueError):
        return Told(2, first)
    if isinstance(e, TransportError | TimeoutError | RuntimeMismatch):
        return Told(1, first)
    return None


def exit_text(returncode: int) -> str:
    """`subprocess` return code in words: "was killed by SIGKILL", "exited with status 1"."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"
