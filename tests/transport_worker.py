"""One end of a two-process transport test: `main(side, kind, scenario)`, the job of a launched
pair (`launch.group.Job`), returns {step: [outcome, message]} where outcome is "ok" or the
exception's class name; tests/test_transport.py launches both ends and checks the events."""

from __future__ import annotations

import os
import signal
import threading
import time

import jax
import ml_dtypes
import numpy as np

from rekv_jax.launch.child import Member
from rekv_jax.transport import Paced

TIMEOUT = 30.0
PREFETCHED = ("pre0", "pre1")  # sent back to back, taken with compute between
PACED_S, COMPUTE_S = 0.5, 1.0


def payload(rows: int = 8) -> list[np.ndarray]:
    """The test phase: a bf16 boundary [2, rows, 16], quantized values and fp16 scales."""
    rng = np.random.default_rng(0)
    return [
        rng.standard_normal((2, rows, 16)).astype(ml_dtypes.bfloat16),  # h_c [B, S, D]
        rng.integers(0, 256, (2, 3, 2, 8, 2, 4), dtype=np.uint8),  # [2, c, B, S, K, H/2]
        rng.standard_normal((2, 3, 2, 8, 2)).astype(np.float16),  # scales
    ]


def specs(arrays: list[np.ndarray]) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]


def main(side: Member, kind: str, scenario: str) -> dict[str, list]:
    role = side.role
    t = side.link(kind, timeout=TIMEOUT, heartbeat_s=3)
    events: list[list] = []

    def step(name: str, fn) -> None:
        t0 = time.monotonic()
        try:
            result = fn()
            elapsed = round(time.monotonic() - t0, 3)
            events.append([name, "ok", elapsed if result is None else result])
        except Exception as e:  # the test checks which error each side saw
            events.append([name, type(e).__name__, f"{e} [{time.monotonic() - t0:.2f}s]"])

    expected = payload()
    send = [jax.device_put(a) for a in expected]

    def send_phase(tag: str, arrays: list) -> None:
        t.send(tag, arrays, timeout=TIMEOUT)
        t.wait_ack(tag, timeout=TIMEOUT)

    def recv_phase(tag: str, want: list[np.ndarray], link=t) -> None:
        check(tag, want, link.recv(tag, specs(want), TIMEOUT).result())

    def check(tag: str, want: list[np.ndarray], got: list) -> None:
        for g, w in zip(got, want, strict=True):
            if not np.array_equal(np.asarray(g), w):
                raise AssertionError(f"{tag}: received buffer differs from what was sent")

    def prefetched(want: list[np.ndarray]) -> float:
        """Seconds to take PREFETCHED (both received at once) over a link that takes PACED_S
        per message, computing COMPUTE_S between taking the first and the second."""
        link = Paced(t, sum(a.nbytes for a in want) / PACED_S / 1e9)
        arrivals = [link.recv(tag, specs(want), TIMEOUT) for tag in PREFETCHED]
        start = time.monotonic()
        check(PREFETCHED[0], want, arrivals[0].result())
        time.sleep(COMPUTE_S)
        check(PREFETCHED[1], want, arrivals[1].result())
        link.stop()
        return round(time.monotonic() - start, 3)

    if scenario == "protocol":
        step("agree", lambda: t.agree("run", {"config": "tiny", "cut": 2, "shape": (2, 8)}))
        step("disagree", lambda: t.agree("bad", {"config": "tiny", "cut": 2 + (role == "decode")}))
        if role == "prefill":
            step("phase", lambda: send_phase("phase", send))
            step("meta", lambda: t.recv_meta("result", TIMEOUT))
            original = t._send

            def corrupt_on_the_wire(tag: str, buffers: list, header: str, deadline: float
                                    ) -> None:
                flipped = np.asarray(buffers[1]).copy()
                flipped.reshape(-1)[5] ^= 0x10
                original(tag, [buffers[0], jax.device_put(flipped), *buffers[2:]], header,
                         deadline)

            t._send = corrupt_on_the_wire
            step("corrupt", lambda: send_phase("corrupt", send))
            t._send = original
            step("truncated", lambda: send_phase("truncated", [jax.device_put(a)
                                                             for a in payload(rows=7)]))
            step("after", lambda: send_phase("after", send))
            step("prefetched", lambda: [t.send(tag, send, TIMEOUT) for tag in PREFETCHED]
                 and [t.wait_ack(tag, TIMEOUT) for tag in PREFETCHED] and None)
        else:
            step("phase", lambda: recv_phase("phase", expected))
            step("meta", lambda: t.send_meta("result", {"first_token": 5}))
            step("corrupt", lambda: recv_phase("corrupt", expected))
            step("truncated", lambda: recv_phase("truncated", expected))
            step("after", lambda: recv_phase("after", expected))
            step("prefetched", lambda: prefetched(expected))
    elif scenario == "kill-prefill":  # the prefill side dies once the decode side is receiving
        if role == "prefill":
            def die(tag: str, buffers: list, header: str, deadline: float) -> None:
                # nothing leaves: the decode side (already receiving) waits, then we die
                threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()

            t._send = die
            t.send("doomed", send, timeout=TIMEOUT)
            time.sleep(TIMEOUT)
        else:
            step("recv", lambda: recv_phase("doomed", expected))
    elif scenario == "kill-decode":  # the decode side dies after reading the header
        if role == "prefill":
            step("send", lambda: send_phase("doomed", send))
        else:
            t._channel.get("doomed/header", TIMEOUT)
            os.kill(os.getpid(), signal.SIGKILL)
    else:
        raise ValueError(f"unknown scenario {scenario!r}")
    t0 = time.monotonic()
    t.close()
    events.append(["close", "ok", round(time.monotonic() - t0, 3)])
    return {e[0]: e[1:] for e in events}


def sleep_side(side: Member, seconds: float) -> None:
    """A side that does nothing for `seconds` (the launcher's timeout tests)."""
    time.sleep(seconds)
