"""Transport (a): one cross-process `ppermute` program per phase over a 2-device mesh (one device
per process; gloo on CPU, NCCL on GPU). Both sides run the same program with the same shapes."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rekv_jax.transport import distributed
from rekv_jax.transport.base import Role, Transport, TransportError, poll_until


class CollectiveTransport(Transport):
    """Each buffer [n, ...] becomes the local block of a global [2n, ...] array sharded over the
    process axis; the program moves the prefill block to the decode device (the decode side
    contributes a cached zero block). The decode side confirms the header before either side
    enters the program, so mismatched shapes never reach the collective."""

    kind = "collective"

    def __init__(self, role: Role, channel: distributed.KVChannel,
                 link_gbps: float | None = None) -> None:
        super().__init__(role, channel, link_gbps)
        me = jax.process_index()
        devices = [min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
                   for p in range(2)]
        self._device = devices[me]
        mesh = Mesh(np.array(devices), ("p",))
        src = me if role == "prefill" else 1 - me
        perm = [(src, 1 - src)]
        self._sharding = NamedSharding(mesh, P("p"))
        self._program = jax.jit(jax.shard_map(
            lambda *xs: [jax.lax.ppermute(x, "p", perm) for x in xs],
            mesh=mesh, in_specs=P("p"), out_specs=P("p")))
        # The program blocks its calling thread until the peer joins: run it on a worker thread
        # so that every wait stays bounded. One worker keeps the programs in call order.
        self._runner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rekv-collective")
        self._blanks: dict[tuple, jax.Array] = {}
        self._broken: str | None = None

    def _push(self, tag: str, arrays: list[jax.Array], deadline: float) -> None:
        ready = self._channel.get(f"{tag}/ready", max(0.0, deadline - time.monotonic()))
        if ready != "ok":
            raise ValueError(ready.removeprefix("mismatch: "))
        self._exchange(tag, [jax.device_put(a, self._device) for a in arrays], deadline)

    def _pull(self, tag: str, specs: list[jax.ShapeDtypeStruct], deadline: float
              ) -> list[jax.Array]:
        return self._exchange(tag, [self._blank(s) for s in specs], deadline)

    def _blank(self, spec: jax.ShapeDtypeStruct) -> jax.Array:
        key = (tuple(spec.shape), jnp.dtype(spec.dtype))
        if key not in self._blanks:
            self._blanks[key] = jnp.zeros(spec.shape, spec.dtype, device=self._device)
        return self._blanks[key]

    def _exchange(self, tag: str, local: list[jax.Array], deadline: float) -> list[jax.Array]:
        """Run the program on this side's blocks; the result is this side's received blocks."""
        if self._broken:
            raise TransportError(f"{tag}: collective link unusable after {self._broken}")

        def run() -> list[jax.Array]:
            inputs = [jax.make_array_from_single_device_arrays(
                (2 * a.shape[0], *a.shape[1:]), self._sharding, [a]) for a in local]
            out = [o.addressable_shards[0].data for o in self._program(*inputs)]
            return jax.block_until_ready(out)

        future = self._runner.submit(run)
        try:
            poll_until(future.done, deadline, self._channel.peer_alive, tag)
            return future.result()
        except TransportError:  # timed out or the peer died before joining: the worker is stuck
            self._broken = f"{tag} did not complete"
            raise
        except Exception as e:  # gloo/NCCL report a peer that died inside the program
            self._broken = f"{tag} failed"
            raise TransportError(f"{tag}: collective failed (peer died?): {e}") from e

    def _close(self, timeout: float) -> None:
        self._runner.shutdown(wait=False, cancel_futures=True)
        distributed.shutdown(self._channel, timeout)
