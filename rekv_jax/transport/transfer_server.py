"""Transport (b): `jax.experimental.transfer` (a TCP pull of device buffers). The prefill side
registers the buffers with `await_pull` and returns; the decode side pulls them by uuid at once,
without waiting for the header (a pull that comes before the registration waits for it, and one
of other shapes than registered fails or brings a checksums buffer whose `spec_word` differs; the
header is read then). A uuid is keyed by a key derived from the job's key (`PURPOSE`), so a
process that can reach the transfer server, the coordinator and the control port, but does not
hold the job's key, cannot name a buffer (see the threat model in docs/reliability.md)."""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable

import jax
from jax.experimental import transfer
from jax.sharding import SingleDeviceSharding

from rekv_jax.errors import TransportError
from rekv_jax.transport import distributed
from rekv_jax.transport.base import Arrival, Endpoint, Role, spec_of
from rekv_jax.transport.secret import JobKey
from rekv_jax.transport.verdicts import Verdicts
from rekv_jax.transport.workers import Watchdog, Worker

PURPOSE = "transfer-server pull ids"  # the key pull ids are keyed by (`JobKey.derive`)


def pull_key(key: JobKey | None) -> bytes:
    """The key of a job's pull ids (none without a job key: `--insecure`)."""
    return b"" if key is None else key.derive(PURPOSE)


def _uuid(tag: str, secret: bytes) -> int:
    """The pull id of a tag in the job whose pull ids `secret` keys (63 bits): the same on both
    sides, unguessable without the key (a keyed BLAKE2b)."""
    digest = hashlib.blake2b(tag.encode(), digest_size=8, key=secret).digest()
    return int.from_bytes(digest, "big") >> 1


class TransferServerTransport(Endpoint):
    """Both sides start a transfer server on the interface that routes to the coordinator and
    swap addresses through the control channel; the decode side connects to the prefill side."""

    kind = "transfer-server"

    def __init__(self, role: Role, channel: distributed.PeerChannel, key: JobKey | None,
                 timeout: float = 60.0) -> None:
        super().__init__(role, channel)
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
        # a pull returns at once and its buffers fill in from the server's threads: a lander
        # waits for them, checksums them and settles the receive; two take the receives in
        # turn, so a message's bytes are waited for while the one before it is checked. The
        # watchdog bounds each receive by its deadline and its peer's liveness (its lander,
        # stuck on bytes that never come, is then abandoned)
        self._landers = [Worker("rekv-landing"), Worker("rekv-landing")]
        self._received = 0
        self._watchdog = Watchdog("rekv-receive-watchdog", channel.peer_alive)
        self._verdicts = Verdicts(self._post_verdict)

    def _send(self, tag: str, buffers: list[jax.Array], header: str, deadline: float) -> None:
        self._pending[tag] = buffers
        self._server.await_pull(_uuid(tag, self._secret), buffers)
        self._channel.post(f"{tag}/header", header)

    def _receive(self, arrival: Arrival, specs: list[jax.ShapeDtypeStruct],
                 wire: list[jax.ShapeDtypeStruct]) -> None:
        """Pull at once, without waiting for the header (a pull that comes before the sender's
        registration waits for it; one of other shapes fails or brings a checksums buffer whose
        spec word differs, and the header is read then)."""
        self._verdicts.expect(arrival.tag)
        default = SingleDeviceSharding(self._device)  # unless a spec names its device
        avals = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=s.sharding or default)
                 for s in wire]
        try:
            pulled = self._connection.pull(_uuid(arrival.tag, self._secret), avals)
        except jax.errors.JaxRuntimeError as e:
            pulled = TransportError(f"{arrival.tag}: pull failed: {e}")
        lander = self._landers[self._received % len(self._landers)]
        self._received += 1
        lander.submit(self._land, arrival, specs, pulled)
        self._bound(arrival, lander, self._watchdog)

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

    def _verdict(self, tag: str, verdict: str, settle: Callable[[], None]) -> None:
        self._verdicts.give(tag, verdict, settle)  # a handoff's "ok"s together (`verdicts`)

    def _acked(self, tag: str) -> None:
        self._pending.pop(tag, None)

    def _close(self, timeout: float) -> None:
        self._pending.clear()
        for lander in self._landers:
            lander.close()
        self._watchdog.close()
        self._verdicts.flush()
        distributed.shutdown(self._channel, timeout)
