"""JSON-lines files (one record per line, as every command's `--json` writes them): the one reader,
shared by the library and the study."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file; a line that is not JSON is a ValueError naming it."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror})") from None
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
    return out
