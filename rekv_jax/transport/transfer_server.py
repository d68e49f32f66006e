"""Transport (b): `jax.experimental.transfer` (a TCP pull of device buffers). The prefill side
registers the buffers with `await_pull` and returns; the decode side pulls them by uuid at once,
without waiting for the header (a pull that comes before the registration waits for it, and one
of other shapes than registered fails or brings a checksums buffer whose `spec_word` differs; the
header is read then). A uuid is keyed by a per-run secret, so a process that can reach the
transfer server but not the coordinator cannot name a buffer (see the threat model in
docs/reliability.md)."""

from __future__ import annotations

import contextlib
import hashlib
import secrets
import time

import jax
from jax.experimental import transfer
from jax.sharding import SingleDeviceSharding

from rekv_jax.errors import TransportError
from rekv_jax.transport import distributed
from rekv_jax.transport.base import Arrival, Endpoint, Role, spec_of
from rekv_jax.transport.workers import Worker

SECRET_BYTES = 16


def _uuid(tag: str, secret: bytes) -> int:
    """The pull id of a tag in the run keyed by `secret` (63 bits): the same on both sides,
    unguessable without the secret (a keyed BLAKE2b)."""
    digest = hashlib.blake2b(tag.encode(), digest_size=8, key=secret).digest()
    return int.from_bytes(digest, "big") >> 1


class TransferServerTransport(Endpoint):
    """Both sides start a transfer server on the interface that routes to the coordinator and
    swap addresses through the control channel; the decode side connects to the prefill side."""

    kind = "transfer-server"

    def __init__(self, role: Role, channel: distributed.PeerChannel, timeout: float = 60.0
                 ) -> None:
        super().__init__(role, channel)
        self._device = jax.local_devices()[0]
        ip = distributed.local_ip()
        address = f"[{ip}]:0" if ":" in ip else f"{ip}:0"
        self._server = transfer.start_transfer_server(self._device.client, address, [address])
        channel.put(f"transfer-server/{role}", self._server.address())
        # the run's secret: made by the prefill side (the side that serves buffers), read by the
        # decode side over the control channel, where it already waits for the prefill side's
        # address; the prefill side waits for nothing here
        self._connection = None
        if role == "prefill":
            self._secret = secrets.token_bytes(SECRET_BYTES)
            channel.put("transfer-server/secret", self._secret.hex())
        else:
            self._connection = self._server.connect(channel.get("transfer-server/prefill", timeout))
            self._secret = bytes.fromhex(channel.get("transfer-server/secret", timeout))
        self._pending: dict[str, list[jax.Array]] = {}  # sent, not yet acknowledged
        # a pull returns at once and its buffers fill in from the server's threads: `_lander`
        # waits for them, checksums them and settles the receive, first in, first out; `_guard`
        # bounds each receive by its deadline and its peer's liveness (its lander, stuck on
        # bytes that never come, is then abandoned)
        self._lander = Worker("rekv-landing")
        self._guard_worker = Worker("rekv-receive-guard")

    def _send(self, tag: str, buffers: list[jax.Array], header: str, deadline: float) -> None:
        self._pending[tag] = buffers
        self._server.await_pull(_uuid(tag, self._secret), buffers)
        self._channel.post(f"{tag}/header", header)

    def _receive(self, arrival: Arrival, specs: list[jax.ShapeDtypeStruct],
                 wire: list[jax.ShapeDtypeStruct]) -> None:
        """Pull at once, without waiting for the header (a pull that comes before the sender's
        registration waits for it; one of other shapes fails or brings a checksums buffer whose
        spec word differs, and the header is read then)."""
        default = SingleDeviceSharding(self._device)  # unless a spec names its device
        avals = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=s.sharding or default)
                 for s in wire]
        try:
            pulled = self._connection.pull(_uuid(arrival.tag, self._secret), avals)
        except jax.errors.JaxRuntimeError as e:
            pulled = TransportError(f"{arrival.tag}: pull failed: {e}")
        self._lander.submit(self._land, arrival, specs, pulled)
        self._guard_worker.submit(self._guard, arrival, self._lander)

    def _land(self, arrival: Arrival, specs: list[jax.ShapeDtypeStruct],
              pulled: list[jax.Array] | TransportError) -> None:
        """Wait for the pulled bytes, note when they landed, checksum them, settle."""
        expected = [spec_of(s) for s in specs]
        try:
            if isinstance(pulled, TransportError):
                raise pulled
            try:
                jax.block_until_ready(pulled)
            except jax.errors.JaxRuntimeError as e:  # a failed pull lands as an error buffer
                raise TransportError(f"{arrival.tag}: transfer failed: {e}") from e
            arrival.landed = time.monotonic()
            *arrays, sums = pulled
            if self._verify(arrival, arrays, sums, specs):
                return
            error = TransportError(f"{arrival.tag}: the checksums' spec word is corrupted")
        except TransportError as e:
            error = e
        self._explain(arrival, expected, error)

    def _explain(self, arrival: Arrival, expected: list, error: TransportError) -> None:
        """A pull that failed or brought other buffers: the header says whether the sender's
        specs differ (a ValueError on both sides); one that cannot be read leaves `error`."""
        with contextlib.suppress(TransportError):
            if not self._check_header(arrival, expected):
                return
        self._settle(arrival, error=error)

    def _acked(self, tag: str) -> None:
        self._pending.pop(tag, None)

    def _close(self, timeout: float) -> None:
        self._pending.clear()
        self._lander.close()
        self._guard_worker.close()
        distributed.shutdown(self._channel, timeout)
