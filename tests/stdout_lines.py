"""A subprocess's stdout as lines, read on a thread so a test can wait for the next one with a
bound (the CLI tests of `rekv serve` read its banner and its records this way)."""

from __future__ import annotations

import queue
import subprocess
import threading


class StdoutLines:
    """The lines `process` writes on stdout (opened with `stdout=PIPE, text=True`)."""

    def __init__(self, process: subprocess.Popen) -> None:
        self._lines: queue.Queue[str | None] = queue.Queue()  # None: stdout closed
        threading.Thread(target=self._read, args=(process,), daemon=True).start()

    def _read(self, process: subprocess.Popen) -> None:
        for line in process.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def next(self, timeout: float) -> str | None:
        """The next line, or None if none came within `timeout` s or stdout closed."""
        try:
            return self._lines.get(timeout=timeout)
        except queue.Empty:
            return None

    def rest(self, timeout: float) -> list[str]:
        """Every line up to the end of stdout (each waited for at most `timeout` s)."""
        lines = []
        while (line := self._lines.get(timeout=timeout)) is not None:
            lines.append(line)
        return lines
