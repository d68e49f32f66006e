"""Transport (b): `jax.experimental.transfer` (a TCP pull of device buffers). The prefill side
registers the buffers with `await_pull` and returns; the decode side pulls them by uuid at once,
without waiting for the header (a pull that comes before the registration waits for it, and one
of other shapes than registered fails or brings a checksums buffer whose `spec_word` differs; the
header is read then). A uuid is keyed by a key derived from the job's key (`PURPOSE`), so a
process that can reach the transfer server, the coordinator and the control port, but does not
hold the job's key, cannot name a buffer (see the threat model in docs/reliability.md)."""

from __future__ import annotations

import concurrent.futures
import hashlib
import time

import jax
from jax.experimental import transfer
from jax.sharding import SingleDeviceSharding

from rekv_jax.errors import TransportError
from rekv_jax.transport import distributed
from rekv_jax.transport.base import Role, Transport
from rekv_jax.transport.checksums import verdict_collect, verdict_dispatch
from rekv_jax.transport.secret import JobKey
from rekv_jax.transport.workers import Worker, wait_for

PURPOSE = "transfer-server pull ids"  # the key pull ids are keyed by (`JobKey.derive`)


def pull_key(key: JobKey | None) -> bytes:
    """The key of a job's pull ids (none without a job key: `--insecure`)."""
    return b"" if key is None else key.derive(PURPOSE)


def _uuid(tag: str, secret: bytes) -> int:
    """The pull id of a tag in the job whose pull ids `secret` keys (63 bits): the same on both
    sides, unguessable without the key (a keyed BLAKE2b)."""
    digest = hashlib.blake2b(tag.encode(), digest_size=8, key=secret).digest()
    return int.from_bytes(digest, "big") >> 1


class TransferServerTransport(Transport):
    """Both sides start a transfer server on the interface that routes to the coordinator and
    swap addresses through the control channel; the decode side connects to the prefill side."""

    kind = "transfer-server"
    pull_first = True

    def __init__(self, role: Role, channel: distributed.PeerChannel, key: JobKey | None,
                 link_gbps: float | None = None, timeout: float = 60.0) -> None:
        super().__init__(role, channel, link_gbps)
        self._device = jax.local_devices()[0]
        ip = distributed.local_ip()
        address = f"[{ip}]:0" if ":" in ip else f"{ip}:0"
        self._server = transfer.start_transfer_server(self._device.client, address, [address])
        channel.put(f"transfer-server/{role}", self._server.address())
        self._secret = pull_key(key)  # each side derives it: nothing crosses for it
        self._connection = None
        if role == "decode":
            self._connection = self._server.connect(channel.get("transfer-server/prefill", timeout))
        self._pending: dict[str, list[jax.Array]] = {}  # sent, not yet acknowledged
        # a pull returns at once and its buffers fill in from the server's threads: the decode
        # side blocks on them here, bounded, instead of polling `is_ready`; one waiter per
        # receiving thread (the caller's, `background`), so that a receive on one does not queue
        # behind the other's wait for its bytes
        self._waiters = {False: Worker("rekv-pull"), True: Worker("rekv-pull-background")}
        self._lander = Worker("rekv-landing")  # notes when prefetched pulls land, in send order

    def _push(self, tag: str, arrays: list[jax.Array], deadline: float) -> None:
        self._pending[tag] = arrays = self._with_checksums(tag, arrays)
        self._server.await_pull(_uuid(tag, self._secret), arrays)

    def _pull(self, tag: str, specs: list[jax.ShapeDtypeStruct], deadline: float
              ) -> list[jax.Array]:
        default = SingleDeviceSharding(self._device)  # unless a spec names its device
        avals = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=s.sharding or default)
                 for s in specs]
        try:
            # returns at once, fills in later
            return self._connection.pull(_uuid(tag, self._secret), avals)
        except jax.errors.JaxRuntimeError as e:
            raise TransportError(f"{tag}: pull failed: {e}") from e

    def _watch(self, pulled: list[jax.Array]) -> concurrent.futures.Future[float]:
        return self._lander.submit(_landed_at, pulled)

    def _unwatch(self) -> None:
        self._lander.abandon()

    def _landed_verdict(self, tag: str, arrays: list[jax.Array], sums: jax.Array,
                        deadline: float, landing: concurrent.futures.Future[float] | None
                        ) -> tuple[list[int], list[int], float | None]:
        """On the waiter thread (bounded): wait for the pulled bytes, note when they landed, then
        checksum them. The landing time is the paced link's: the checksum program queues behind
        whatever the device computes meanwhile (the overlapped suffix), the bytes do not."""
        waiter = self._waiters[self.background.on_thread()]
        try:
            return wait_for(waiter.submit(_landed_then_verdict, arrays, sums, landing),
                            deadline, self._channel.peer_alive, tag)
        except TransportError:  # timed out or the peer died: the waiter is stuck on the pull
            waiter.abandon()
            raise
        except jax.errors.JaxRuntimeError as e:  # a failed pull materializes as an error buffer
            raise TransportError(f"{tag}: transfer failed: {e}") from e

    def _acked(self, tag: str) -> None:
        self._pending.pop(tag, None)

    def _close(self, timeout: float) -> None:
        self._pending.clear()
        for waiter in self._waiters.values():
            waiter.close()
        self._lander.close()
        distributed.shutdown(self._channel, timeout)


def _landed_at(arrays: list[jax.Array]) -> float:
    jax.block_until_ready(arrays)
    return time.monotonic()


def _landed_then_verdict(arrays: list[jax.Array], sums: jax.Array,
                         landing: concurrent.futures.Future[float] | None
                         ) -> tuple[list[int], list[int], float]:
    """Wait for the pulled bytes; then checksum them. When they landed: `landing`'s time if it
    noted it by now (a prefetched pull, watched from its issue), else now."""
    landed = _landed_at([*arrays, sums])
    if landing is not None:  # done with the same bytes, but bounded: it may be an old thread's
        concurrent.futures.wait([landing], timeout=0.05)
        landed = landing.result() if landing.done() and not landing.exception() else landed
    return *verdict_collect(verdict_dispatch(arrays, sums)), landed
