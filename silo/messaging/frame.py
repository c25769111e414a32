"""Frames: how every message between silos and clients is laid out on the wire.

A frame is::

    <u32 header_len> <u32 meta_len> <u16 nbuf> <u64 buffer_len> * nbuf
    header (msgpack list)  meta (codec msgpack)  buffer * nbuf (raw bytes)

The header's first item is the frame kind (below); requests, answers,
cancels and pings carry the request id second. ``meta`` is the codec's
encoding of the body, and tensors travel as raw buffers beside it: the sender
hands the transport memoryviews of the tensor's own memory, the receiver lets
the kernel write each large buffer straight into a bytearray of its own
(:mod:`silo.messaging.connection`), which the codec then wraps as a tensor
without another copy. That is why received buffers are 64-byte aligned
(:func:`aligned`) and why silos keep freed memory (:func:`retain_freed_memory`).
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

PREFIX = struct.Struct("<IIH")
BUFLEN = struct.Struct("<Q")

# Frame kinds (first item of every header). CLIENT ([CLIENT, 0, client id]): a client with observers
# names itself on a connection it opened, so the silo knows where to send calls to them.
REQUEST, RESPONSE, ERROR, CANCEL, PING, PONG, HELLO, AUTH, AUTH_OK, ONEWAY, CLIENT = range(1, 12)
# Streamed results (silo/messaging/results.py): STREAM is a REQUEST whose method is an async
# generator (same header); the callee answers with ITEM frames ([ITEM, id] + one item as the
# body), each sent only against credit the caller granted ([CREDIT, id, n]; the first CREDIT
# follows the STREAM frame at once), and ends the stream with the RESPONSE or ERROR that
# answers any request. CANCEL stops it, as it stops any call.
STREAM, ITEM, CREDIT = range(12, 15)

# Buffers at least this big go on their own: received straight into their own array,
# written without being joined to other frames.
DIRECT_MIN = 64 * 1024
_ALIGN = 64
packb = msgpack.Packer(use_bin_type=True).pack
unpackb = msgpack.unpackb


@dataclass(slots=True)
class Frame:
    header: list[Any]
    meta: bytes
    buffers: list[bytearray | memoryview]


def aligned(size: int) -> memoryview:
    """A writable buffer starting on a 64-byte boundary.

    The codec wraps received buffers as tensors in place; a float buffer at an
    odd offset makes vectorised kernels take other code paths, which can change
    a matmul's last bits. np.empty does not zero-fill (and with
    retain_freed_memory() the pages are already mapped).
    """
    raw = np.empty(size + _ALIGN, np.uint8)
    off = -raw.__array_interface__["data"][0] % _ALIGN
    return memoryview(raw[off : off + size])  # type: ignore[arg-type]


def retain_freed_memory() -> bool:
    """Ask glibc to keep freed large blocks instead of returning them to the OS.

    Every received tensor needs a fresh buffer; by default glibc serves big
    ones with mmap and unmaps them on free, so each 64 MB message pays ~16k
    page faults (30-50 ms here, more than the copy itself). Keeping the heap
    lets the next message reuse the pages. Called by silo processes; clients
    may opt in. Returns False where glibc's mallopt is unavailable.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, 1 << 31))
    except (OSError, AttributeError):
        return False
