"""HTTP/2's wire pieces that the gRPC server writes and reads (RFC 9113, RFC 7541).

Frames are a 9-byte header (24-bit length, type, flags, 31-bit stream id)
and a payload; the server parses and builds the few kinds a gRPC unary call
uses with ``int.from_bytes`` and slices. Header blocks it reads are decoded
by ``hpack`` (the python-hyper library: Huffman codes and the dynamic table
are its business); header blocks it writes are HPACK literals *without
indexing*, which leave the peer's dynamic table untouched, so the same bytes
are valid on every stream and the common ones are built once (:data:`RESPONSE`,
:data:`TRAILERS_OK`).
"""

from __future__ import annotations

import enum

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DEFAULT_WINDOW = 65_535
DEFAULT_MAX_FRAME = 16_384
MAX_WINDOW = 2**31 - 1


class Frame(enum.IntEnum):
    DATA = 0
    HEADERS = 1
    PRIORITY = 2
    RST_STREAM = 3
    SETTINGS = 4
    PUSH_PROMISE = 5
    PING = 6
    GOAWAY = 7
    WINDOW_UPDATE = 8
    CONTINUATION = 9


class Setting(enum.IntEnum):
    HEADER_TABLE_SIZE = 1
    ENABLE_PUSH = 2
    MAX_CONCURRENT_STREAMS = 3
    INITIAL_WINDOW_SIZE = 4
    MAX_FRAME_SIZE = 5
    MAX_HEADER_LIST_SIZE = 6


class ErrorCode(enum.IntEnum):
    NO_ERROR = 0
    PROTOCOL_ERROR = 1
    INTERNAL_ERROR = 2
    FLOW_CONTROL_ERROR = 3
    STREAM_CLOSED = 5
    FRAME_SIZE_ERROR = 6
    REFUSED_STREAM = 7
    CANCEL = 8
    COMPRESSION_ERROR = 9
    ENHANCE_YOUR_CALM = 11


END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20


class ProtocolError(Exception):
    """The peer broke HTTP/2: the connection ends with a GOAWAY carrying ``code``."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def frame(kind: Frame, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream_id.to_bytes(4, "big") + payload


def settings(values: dict[Setting, int]) -> bytes:
    return frame(Frame.SETTINGS, 0, 0, b"".join(k.to_bytes(2, "big") + v.to_bytes(4, "big") for k, v in values.items()))


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(Frame.WINDOW_UPDATE, 0, stream_id, increment.to_bytes(4, "big"))


def rst_stream(stream_id: int, code: ErrorCode) -> bytes:
    return frame(Frame.RST_STREAM, 0, stream_id, code.to_bytes(4, "big"))


def goaway(last_stream_id: int, code: ErrorCode, debug: bytes = b"") -> bytes:
    return frame(Frame.GOAWAY, 0, 0, last_stream_id.to_bytes(4, "big") + code.to_bytes(4, "big") + debug)


def _integer(value: int, prefix_bits: int, first: int) -> bytes:
    """An HPACK integer (RFC 7541, 5.1) in a first byte whose high bits are ``first``."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _string(data: bytes) -> bytes:
    return _integer(len(data), 7, 0) + data  # not Huffman-coded: the H bit is 0


def literal(name: bytes, value: bytes) -> bytes:
    """A header as an HPACK literal without indexing, new name (RFC 7541, 6.2.2)."""
    return b"\x00" + _string(name) + _string(value)


def literal_indexed_name(index: int, value: bytes) -> bytes:
    """A header as an HPACK literal without indexing whose name is the static table's ``index``."""
    return _integer(index, 4, 0) + _string(value)


RESPONSE = b"\x88" + literal_indexed_name(31, b"application/grpc")
""":status 200 (static entry 8) and content-type: application/grpc (name: static entry 31)."""
TRAILERS_OK = literal(b"grpc-status", b"0")
