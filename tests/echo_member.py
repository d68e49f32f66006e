"""The job of the members in tests/test_serve_nodes.py's group across nodes: `echo(member, prefix)`
emits each message the group sends it, prefixed, until the group closes (then returns how many it
echoed); told "die", its process exits with status 3."""

from __future__ import annotations

import os

from rekv_jax.launch.child import CLOSED, Member


def echo(member: Member, prefix: str) -> int:
    echoed = 0
    while True:
        for message in member.receive(1.0):
            if message is CLOSED:
                return echoed
            if message == "die":
                os._exit(3)
            member.emit(f"{prefix}{member.name} {message}")
            echoed += 1
