"""A paced link is the same FIFO link from both ends: the prefill side hears each message's
verdict no sooner than the paced link delivers its bytes, as the decode side receives it, and a
verdict not yet due is not there for a wait that ends first. (A served handoff's reported send
time is at least its bytes over the paced bandwidth: `test_prefill_worker`.)"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import pytest

from rekv_jax.errors import TransportTimeout
from rekv_jax.transport import LocalTransport, Paced

GBPS, NBYTES = 0.01, 1_000_000  # 0.1 s a message
PER_S = NBYTES / (GBPS * 1e9)


def specs(arrays):
    return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]


def test_the_prefill_side_hears_each_verdict_no_sooner_than_the_paced_link_delivers():
    """Three messages sent at once: the k-th verdict comes k n / W after the first send (each
    waits for the ones before it on the link), and not much later; a wait that ends before a
    verdict is due times out, and a later one gets it."""
    sent = [jnp.zeros((NBYTES,), jnp.uint8)]
    warm, cold = LocalTransport.pair()  # checksum outside the timing
    warm.send("w", sent)
    cold.recv("w", specs(sent), timeout=60).result(timeout=60)
    prefill, decode = LocalTransport.pair(link_gbps=GBPS)
    assert isinstance(prefill, Paced) and isinstance(decode, Paced)
    arrivals = [decode.recv(t, specs(sent), timeout=10) for t in "abc"]
    t0 = time.monotonic()
    for t in "abc":
        prefill.send(t, sent)
    arrivals[0].result(timeout=10)  # the transport's own verdict on "a" is in by now ...
    with pytest.raises(TransportTimeout):
        prefill.wait_ack("c", timeout=0.0)  # ... but "c" is not due before 3 n / W
    heard, came = [], []
    for t in "abc":
        came.append(prefill.wait_ack(t, timeout=10) - t0)  # when its verdict came ...
        heard.append(time.monotonic() - t0)
    for k, (c, h) in enumerate(zip(came, heard, strict=True)):
        assert (k + 1) * PER_S <= c <= h  # ... is when the paced link delivered it
    assert heard[-1] <= 3 * PER_S + 0.3  # and not much later (a loaded machine wakes late)
    for a in arrivals:
        a.result(timeout=10)
    prefill.close(), decode.close()

