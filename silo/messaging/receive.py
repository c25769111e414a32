"""The receive path: frames parsed out of the byte stream, tensor buffers received in place.

:class:`FrameReceiver` is the ``BufferedProtocol`` half of a connection. The
kernel writes into a staging buffer (256 KB, grown when one frame's control
part needs more); a small frame wholly in it (the common case: a call) is
parsed right there, with no parser state kept between reads. A frame with
buffers is read in steps: prefix, control part (lengths, header, meta), then
each buffer. Every buffer gets a 64-byte aligned array of its own; one of
64 KB or more, or one not yet wholly in the staging buffer, is completed by
the kernel itself (``get_buffer`` hands it the rest of that array), so its
bytes land where the codec wraps them as a tensor without another copy. On a 2-core box ``StreamReader.readexactly``
moved 0.39 GB/s where this path moves several.

Limits are checked before anything is allocated: a frame larger than
``max_frame_bytes`` (and, on either side before the handshake is done, a
frame over 4 KB) is a :class:`~silo.errors.CodecError`; the connection
is then aborted and counted in ``bad_frames``. What a frame means is the
subclass's business (:class:`~silo.messaging.connection.Connection`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from silo import errors
from silo.messaging import frame as _frame
from silo.messaging.frame import DIRECT_MIN, Frame
from silo.messaging.frame import aligned as _aligned
from silo.messaging.frame import unpackb as _unpackb
from silo.settings import TransportSettings

log = logging.getLogger("redgrain.transport")

# The structs are bound here, not imported by name: CPython 3.11 compiles ``NAME.method()``
# on a from-imported NAME as an attribute load that makes a bound method (it takes NAME for
# a module) instead of LOAD_METHOD, which cost ~3% of the per-frame time.
PREFIX = _frame.PREFIX
BUFLEN = _frame.BUFLEN

_STAGING = 256 * 1024
_PRE_AUTH_MAX = 4096


@dataclass(slots=True)
class Counters:
    """What the connections of one transport count (the transport reports them)."""

    frames_in: int = 0
    frames_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    bad_frames: int = 0
    refused: int = 0
    overloaded: int = 0
    connections_opened: int = 0


class FrameReceiver(asyncio.BufferedProtocol):
    """Turns received bytes into :class:`Frame` s for :meth:`_on_frame` (see module docstring)."""

    def __init__(self, settings: TransportSettings, counters: Counters, server_side: bool) -> None:
        self._settings = settings
        self._n = counters
        self._server_side = server_side
        self.peer = "?"
        self._authenticated = False
        """Set by the subclass once the handshake is done; until then no frame takes the fast
        path, and frames are held to 4 KB (on both sides: a fake silo gets no more room)."""
        self._buf = bytearray(_STAGING)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self._need_prefix = True
        self._ctl_len = 0
        self._hlen = self._mlen = self._nbuf = 0
        self._header: list[Any] = []
        self._meta = b""
        self._lens: list[int] = []
        self._bufs: list[bytearray | memoryview] = []
        self._direct: memoryview | None = None
        self._direct_pos = 0

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._direct is not None:
            return self._direct[self._direct_pos :]
        if self._end == len(self._buf):
            self._compact(0)
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        self._n.bytes_in += nbytes
        try:
            if self._direct is not None:
                self._direct_pos += nbytes
                if self._direct_pos < len(self._direct):
                    return
                self._direct = None
                self._bufs[-1] = self._bufs[-1]  # completed in place
            else:
                self._end += nbytes
            self._parse()
        except errors.CodecError as exc:
            self._n.bad_frames += 1
            log.warning("closing connection from %s: %s", self.peer, exc)
            self.abort()

    # --- receive -----------------------------------------------------------
    def _compact(self, need: int) -> None:
        """Move unread bytes to the front; grow the staging buffer if a control part needs it."""
        avail = self._end - self._start
        size = max(len(self._buf), need, _STAGING)
        if size > len(self._buf):
            new = bytearray(size)
            new[:avail] = self._view[self._start : self._end]
            self._view.release()
            self._buf = new
            self._view = memoryview(new)
        elif self._start:
            self._view[:avail] = self._view[self._start : self._end]
        self._start, self._end = 0, avail

    def _parse(self) -> None:
        while True:
            if self._direct is not None:
                return
            avail = self._end - self._start
            if self._need_prefix:
                if avail < PREFIX.size:
                    break
                hlen, mlen, nbuf = PREFIX.unpack_from(self._buf, self._start)
                ctl = hlen + mlen
                if (
                    nbuf == 0
                    and avail - PREFIX.size >= ctl
                    and self._authenticated
                    and ctl <= self._settings.max_frame_bytes
                ):
                    # The common case, a small frame wholly in the buffer: no parser state.
                    pos = self._start + PREFIX.size
                    header = self._header_at(pos, hlen)
                    meta = bytes(self._view[pos + hlen : pos + ctl])
                    self._start = pos + ctl
                    self._n.frames_in += 1
                    self._on_frame(Frame(header, meta, []))
                    continue
                self._hlen, self._mlen, self._nbuf = hlen, mlen, nbuf
                self._start += PREFIX.size
                self._ctl_len = self._nbuf * BUFLEN.size + self._hlen + self._mlen
                # Before the handshake, from either side: a fake silo gets no more room than a stranger.
                limit = self._settings.max_frame_bytes if self._authenticated else _PRE_AUTH_MAX
                if self._ctl_len > limit:
                    raise errors.CodecError(f"frame control part of {self._ctl_len} bytes exceeds {limit}")
                self._need_prefix = False
                self._bufs = []
                continue
            if not self._bufs and not self._lens_read():
                if avail < self._ctl_len:
                    if self._start + self._ctl_len > len(self._buf):
                        self._compact(self._ctl_len)
                    break
                self._read_control()
                if self._nbuf == 0:
                    self._deliver()
                    continue
            # buffers
            while len(self._bufs) < self._nbuf:
                size = self._lens[len(self._bufs)]
                avail = self._end - self._start
                if size >= DIRECT_MIN or size > avail:
                    # np.empty: no zero-fill, and with retain_freed_memory() no
                    # fresh page faults either; the codec wraps it as a tensor.
                    target = _aligned(size)
                    take = min(avail, size)
                    target[:take] = self._view[self._start : self._start + take]
                    self._start += take
                    self._bufs.append(target)
                    if take < size:
                        self._direct = target
                        self._direct_pos = take
                        return
                else:
                    small = _aligned(size)
                    small[:] = self._view[self._start : self._start + size]
                    self._bufs.append(small)
                    self._start += size
            self._deliver()
        if self._start == self._end:
            self._start = self._end = 0

    def _lens_read(self) -> bool:
        return bool(self._lens) and len(self._lens) == self._nbuf and self._header != []

    def _read_control(self) -> None:
        pos = self._start
        lens = [BUFLEN.unpack_from(self._buf, pos + i * BUFLEN.size)[0] for i in range(self._nbuf)]
        pos += self._nbuf * BUFLEN.size
        total = self._ctl_len + sum(lens)
        if not self._authenticated and total > _PRE_AUTH_MAX:
            raise errors.CodecError(f"frame of {total} bytes before the handshake exceeds {_PRE_AUTH_MAX}")
        if total > self._settings.max_frame_bytes:
            raise errors.CodecError(
                f"frame of {total} bytes exceeds max_frame_bytes={self._settings.max_frame_bytes}"
            )
        header = self._header_at(pos, self._hlen)
        pos += self._hlen
        self._meta = bytes(self._view[pos : pos + self._mlen])
        self._start = pos + self._mlen
        self._header = header
        self._lens = lens

    def _header_at(self, pos: int, hlen: int) -> list[Any]:
        try:
            header = _unpackb(self._view[pos : pos + hlen])
        except Exception as exc:
            raise errors.CodecError(f"malformed frame header: {exc}") from exc
        if type(header) is not list or not header or type(header[0]) is not int:
            raise errors.CodecError(f"malformed frame header: {header!r:.100}")
        return header

    def _deliver(self) -> None:
        frame = Frame(self._header, self._meta, self._bufs)
        self._need_prefix = True
        self._header = []
        self._lens = []
        self._bufs = []
        self._n.frames_in += 1
        self._on_frame(frame)

    def _on_frame(self, frame: Frame) -> None:
        """A whole frame arrived; its buffers are its own (kept by whoever decodes them)."""
        raise NotImplementedError

    def abort(self) -> None:
        """Drop the connection at once (after a malformed or oversized frame)."""
        raise NotImplementedError
