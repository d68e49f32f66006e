"""A stranger's view of the coordinator: every key of its key-value store, read over gRPC by hand.

The coordination service has no authentication: a request only has to name the service's
incarnation, and a request that names the wrong one is answered with the right one in its
error message (`wrong service incarnation: requested 0, currently N`). So anyone who reaches
the coordinator's port reads the store: one request to learn the incarnation, one to list a
directory. Written with the standard library only (HTTP/2 frames, literal HPACK headers, the
protobuf fields of `xla.coordination.GetKeyValueDirRequest`/`Response` as jaxlib 0.10 declares
them), so that it needs no gRPC package and registers as no task (a task that joined would
disturb the run it reads)."""

from __future__ import annotations

import re
import socket
import struct

SERVICE = "/xla.coordination.CoordinationService/"
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS, _SETTINGS = 0, 1, 4
_END_STREAM, _END_HEADERS, _ACK = 0x1, 0x4, 0x1


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") \
        + payload


def _header(name: str, value: str) -> bytes:
    """One HPACK literal header field, not indexed, no Huffman (names and values < 127 B)."""
    n, v = name.encode(), value.encode()
    return b"\x00" + bytes([len(n)]) + n + bytes([len(v)]) + v


def _field(number: int, wire: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire) + (_varint(len(payload)) if wire == 2 else b"") + payload


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append(n & 0x7F | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _fields(data: bytes) -> list[tuple[int, bytes]]:
    """(field number, bytes) of each length-delimited field of a protobuf message."""
    out, i = [], 0
    while i < len(data):
        key, i = _read_varint(data, i)
        if key & 7 == 2:
            size, i = _read_varint(data, i)
            out.append((key >> 3, data[i:i + size]))
            i += size
        elif key & 7 == 0:
            _, i = _read_varint(data, i)
        else:
            i += 8 if key & 7 == 1 else 4
    return out


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        b = data[i]
        n |= (b & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if not b & 0x80:
            return n, i


def call(address: str, method: str, message: bytes, timeout: float = 10.0) -> tuple[bytes, bytes]:
    """One unary gRPC call over plain HTTP/2: (the response message, the raw header blocks)."""
    host, port = address.rsplit(":", 1)
    headers = b"".join(_header(k, v) for k, v in (
        (":method", "POST"), (":scheme", "http"), (":path", SERVICE + method),
        (":authority", address), ("content-type", "application/grpc"), ("te", "trailers")))
    body = b"\x00" + struct.pack(">I", len(message)) + message
    data, blocks = b"", b""
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as s:
        s.sendall(_PREFACE + _frame(_SETTINGS, 0, 0) + _frame(_HEADERS, _END_HEADERS, 1, headers)
                  + _frame(_DATA, _END_STREAM, 1, body))
        buffer = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            buffer += chunk
            while len(buffer) >= 9 and len(buffer) >= 9 + int.from_bytes(buffer[:3], "big"):
                size = int.from_bytes(buffer[:3], "big")
                kind, flags, payload = buffer[3], buffer[4], buffer[9:9 + size]
                buffer = buffer[9 + size:]
                if kind == _SETTINGS and not flags & _ACK:
                    s.sendall(_frame(_SETTINGS, _ACK, 0))
                elif kind == _DATA:
                    data += payload
                elif kind == _HEADERS:
                    blocks += payload
                    if flags & _END_STREAM:
                        return data[5:], blocks
    return data[5:], blocks


def read_dir(address: str, directory: str) -> dict[str, bytes]:
    """Every key and value under `directory` of the store at `address`."""

    def request(incarnation: int) -> bytes:
        return (_field(1, 2, _field(3, 1, struct.pack("<Q", incarnation)))  # incarnations
                + _field(2, 2, directory.encode()))  # directory_key

    _, said = call(address, "GetKeyValueDir", request(0))
    current = re.search(rb"currently (\d+)", said)
    if current is None:
        raise RuntimeError(f"the coordinator did not name its incarnation: {said[:200]!r}")
    answer, _ = call(address, "GetKeyValueDir", request(int(current[1])))
    entries = [dict(_fields(kv)) for number, kv in _fields(answer) if number == 2]
    return {e[1].decode(): e.get(2, b"") for e in entries}
