"""What `rekv` prints: `--json` records, one per line, and sizes for a person."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any


def emit_json(records: Iterable[dict[str, Any]]) -> None:
    for r in records:
        print(json.dumps(r), flush=True)


def mib(n: float) -> str:
    from rekv_jax.sizes import MIB

    return f"{n / MIB:.2f} MiB"
