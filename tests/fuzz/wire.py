"""Raw frames over a plain socket, for fuzzing a live silo (layout: silo/messaging/frame.py docstring)."""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence

import msgpack

PREFIX = struct.Struct("<IIH")
BUFLEN = struct.Struct("<Q")
REQUEST, RESPONSE, ERROR, CANCEL, PING, PONG, HELLO, AUTH, AUTH_OK, ONEWAY = range(1, 11)


def pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def frame(
    header: bytes,
    meta: bytes = b"",
    buffers: Sequence[bytes] = (),
    *,
    declared: Sequence[int] | None = None,
) -> bytes:
    """One frame; ``declared`` overrides the buffer lengths written in the frame (lies allowed)."""
    lens = list(declared) if declared is not None else [len(b) for b in buffers]
    parts = [PREFIX.pack(len(header), len(meta), len(lens))]
    parts += [BUFLEN.pack(n) for n in lens]
    parts += [header, meta, *buffers]
    return b"".join(parts)


def request(
    req_id: int,
    type_name: object,
    key: object,
    method: object,
    body: bytes,
    *,
    timeout_ms: int = 5000,
) -> bytes:
    return frame(pack([REQUEST, req_id, type_name, key, method, timeout_ms, [], 0]), body)


class RawPeer:
    """A socket that has read the silo's HELLO, ready to send anything."""

    def __init__(self, endpoint: str, timeout_s: float = 5.0) -> None:
        host, _, port = endpoint.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        self._buf = b""
        hello = self.read_frame()
        if hello is None or hello[0] != HELLO:
            raise AssertionError(f"expected HELLO first, got {hello!r}")

    def send(self, data: bytes) -> bool:
        """False when the silo already closed the connection."""
        try:
            self.sock.sendall(data)
            return True
        except OSError:
            return False

    def _fill(self, n: int) -> bool:
        while len(self._buf) < n:
            try:
                chunk = self.sock.recv(1 << 16)
            except OSError:
                return False
            if not chunk:
                return False
            self._buf += chunk
        return True

    def read_frame(self) -> list[object] | None:
        """The next frame's header (meta and buffers skipped), or None once the silo closed."""
        if not self._fill(PREFIX.size):
            return None
        hlen, mlen, nbuf = PREFIX.unpack_from(self._buf)
        ctl = PREFIX.size + nbuf * BUFLEN.size
        if not self._fill(ctl):
            return None
        lens = [
            BUFLEN.unpack_from(self._buf, PREFIX.size + i * BUFLEN.size)[0] for i in range(nbuf)
        ]
        total = ctl + hlen + mlen + sum(lens)
        if not self._fill(total):
            return None
        header = msgpack.unpackb(self._buf[ctl : ctl + hlen])
        self._buf = self._buf[total:]
        return header  # type: ignore[no-any-return]

    def closed_by_peer(self, timeout_s: float = 5.0) -> bool:
        """Read until the silo closes (True) or goes quiet for ``timeout_s`` (False)."""
        self.sock.settimeout(timeout_s)
        try:
            while True:
                chunk = self.sock.recv(1 << 16)
                if not chunk:
                    return True
        except TimeoutError:
            return False
        except OSError:
            return True

    def close(self) -> None:
        self.sock.close()
