"""TCP messaging: length-prefixed frames, request ids, deadlines, zero-copy bulk.

A frame is::

    <u32 header_len> <u32 meta_len> <u16 nbuf> <u64 buffer_len> * nbuf
    header (msgpack list)  meta (codec msgpack)  buffer * nbuf (raw bytes)

Tensors travel as raw buffers. Sending hands the transport memoryviews of the
tensor's own memory (``writelines``); receiving uses ``BufferedProtocol`` and
lets the kernel write each large buffer straight into its final bytearray,
which the codec then wraps as a tensor without another copy. On a 2-core box
``StreamReader.readexactly`` moved 0.39 GB/s where this path moves several.

Every connection starts with a HELLO from the server; when a cluster secret
is set it carries a nonce the client must answer with an HMAC before any
other frame is accepted.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import heapq
import hmac
import itertools
import logging
import os
import socket
import struct
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import msgpack
import numpy as np

from silo import errors
from silo.codec import Codec, Encoded
from silo.messaging import local_socket
from silo.settings import TransportSettings

log = logging.getLogger("redgrain.transport")

PREFIX = struct.Struct("<IIH")
BUFLEN = struct.Struct("<Q")

# Frame kinds (first item of every header).
REQUEST, RESPONSE, ERROR, CANCEL, PING, PONG, HELLO, AUTH, AUTH_OK, ONEWAY = range(1, 11)

_STAGING = 256 * 1024
# Buffers at least this big are received straight into their own bytearray.
_DIRECT = 64 * 1024
_PRE_AUTH_MAX = 4096
_SLICE = 1 << 20
# Same-host sockets: room for a few MB in flight (the kernel caps it at net.core.wmem_max).
_UNIX_BUFFER = 4 << 20
# Small frames queued for one write are flushed once this many are waiting, so that a
# burst of calls reaches the peer while the rest of it is still being produced.
_BATCH_FRAMES = 256
_ALIGN = 64
_packb = msgpack.Packer(use_bin_type=True).pack
_unpackb = msgpack.unpackb


@dataclass(slots=True)
class Frame:
    header: list[Any]
    meta: bytes
    buffers: list[bytearray | memoryview]


class RequestHandler(Protocol):
    def __call__(self, conn: Connection, frame: Frame) -> None: ...


@dataclass(slots=True)
class _Counters:
    frames_in: int = 0
    frames_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    bad_frames: int = 0
    refused: int = 0
    overloaded: int = 0
    connections_opened: int = 0


@dataclass(frozen=True, slots=True)
class TransportStatistics:
    connections: int
    """Open connections (both directions)."""
    frames_in: int
    """Frames received since start."""
    frames_out: int
    """Frames sent since start."""
    bytes_in: int
    """Bytes received since start."""
    bytes_out: int
    """Bytes sent since start."""
    bad_frames: int
    """Frames refused as malformed or oversized."""
    refused: int
    """Connections refused by the cluster-secret check."""
    overloaded: int
    """Requests refused because their connection already had max_in_flight being served."""
    pending_calls: int
    """Requests sent and not yet answered."""


def error_body(exc: BaseException) -> dict[str, Any]:
    """How an exception crosses the wire: a code for our own, type/message/traceback for the rest."""
    from silo.catalog.catalog import format_remote_traceback

    if isinstance(exc, errors.RemoteGrainError):
        return {"code": "remote", "type": exc.type_name, "message": exc.message, "tb": exc.traceback_text}
    if isinstance(exc, errors.RedgrainError) and type(exc) in errors.CODE_OF:
        fields = {k: v for k, v in vars(exc).items() if isinstance(v, (str, int, float, list))}
        return {"code": errors.CODE_OF[type(exc)], "message": str(exc), "fields": fields}
    return {
        "code": "remote",
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins."),
        "message": str(exc),
        "tb": format_remote_traceback(exc),
    }


def error_from_body(body: Any) -> errors.RedgrainError:
    if not isinstance(body, dict):
        return errors.CodecError(f"malformed error response: {body!r:.200}")
    code = body.get("code")
    if code == "remote":
        return errors.RemoteGrainError(str(body.get("type")), str(body.get("message")), str(body.get("tb", "")))
    cls = errors.WIRE_CODES.get(str(code))
    if cls is None:
        return errors.RemoteGrainError(str(code), str(body.get("message")))
    exc = cls.__new__(cls)
    Exception.__init__(exc, str(body.get("message", "")))
    for k, v in (body.get("fields") or {}).items():
        setattr(exc, k, v)
    return exc


class Connection(asyncio.BufferedProtocol):
    """One TCP connection; either side may send requests."""

    def __init__(
        self,
        *,
        codec: Codec,
        settings: TransportSettings,
        counters: _Counters,
        handler: RequestHandler | None,
        server_side: bool,
        on_close: Callable[[Connection], None] | None = None,
    ) -> None:
        self.codec = codec
        self._settings = settings
        self._n = counters
        self._handler = handler
        self._server_side = server_side
        self._on_close = on_close
        self._secret = (
            settings.cluster_secret.get_secret_value().encode() if settings.cluster_secret else None
        )
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_event_loop()
        self._ids = itertools.count(1)
        # label: "grain.method", or (grain, method) so a call need not format it.
        self._pending: dict[int, tuple[asyncio.Future[Any], str | tuple[object, str]]] = {}
        self._serving = 0
        """Requests from the peer being served now (bounded by max_in_flight)."""
        # One timer for the earliest deadline instead of one per request:
        # a libuv/asyncio timer per call costs more than the call itself.
        self._deadlines: list[tuple[float, int]] = []
        self._sweeper: asyncio.TimerHandle | None = None
        self._sweep_at = float("inf")
        self._out: deque[bytes | memoryview] = deque()
        self._flush_scheduled = False
        self._big: asyncio.Task[None] | None = None
        self._paused: asyncio.Future[None] | None = None
        self.ready: asyncio.Future[None] = self._loop.create_future()
        self.closed = False
        self.peer = "?"
        self._nonce = b""
        self._authenticated = False
        # receive state
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

    # --- asyncio protocol --------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio.Transport subclass
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else (str(peer) or "same-host socket")
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family == socket.AF_UNIX:
            # The default 200 KB buffers make a multi-MB tensor take many wake-ups.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _UNIX_BUFFER)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _UNIX_BUFFER)
        self._n.connections_opened += 1
        if self._server_side:
            self._nonce = os.urandom(16) if self._secret else b""
            self._authenticated = self._secret is None
            self._send_frame([HELLO, self._nonce])
            self._flush()
            if self._authenticated and not self.ready.done():
                self.ready.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._direct = None
        err = errors.SiloUnavailableError(self.peer, f"connection lost ({exc or 'closed by peer'})")
        for fut, _ in self._pending.values():
            if not fut.done():
                fut.set_exception(err)
        self._pending.clear()
        self._deadlines.clear()
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._big is not None:
            self._big.cancel()
        if not self.ready.done():
            self.ready.set_exception(err)
            self.ready.exception()
        if self._paused is not None and not self._paused.done():
            self._paused.set_result(None)
        if self._on_close is not None:
            self._on_close(self)

    def pause_writing(self) -> None:
        if self._paused is None or self._paused.done():
            self._paused = self._loop.create_future()

    def resume_writing(self) -> None:
        if self._paused is not None and not self._paused.done():
            self._paused.set_result(None)

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
                limit = self._settings.max_frame_bytes if self._authenticated or not self._server_side else _PRE_AUTH_MAX
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
                if size >= _DIRECT or size > avail:
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
        kind = frame.header[0]
        if not self._authenticated:
            self._on_handshake(frame)
            return
        if kind == RESPONSE or kind == ERROR:
            self._on_response(frame)
        elif kind in (REQUEST, ONEWAY, CANCEL):
            if self._handler is None:
                self._n.bad_frames += 1
                return
            if kind == REQUEST:
                # The serving side's own bound: a peer that ignores its
                # max_in_flight still cannot make us hold unbounded calls.
                if self._serving >= self._settings.max_in_flight:
                    self._n.overloaded += 1
                    req_id = frame.header[1] if len(frame.header) > 1 else 0
                    self._send_error_frame(
                        req_id, errors.OverloadedError(f"connection from {self.peer}", self._settings.max_in_flight)
                    )
                    return
                self._serving += 1
            self._handler(self, frame)
        elif kind == PING:
            self._send_frame([PONG, frame.header[1] if len(frame.header) > 1 else 0])
        elif kind == PONG:
            self._on_response(frame)
        else:
            raise errors.CodecError(f"unknown frame kind {kind!r}")

    def _on_handshake(self, frame: Frame) -> None:
        kind = frame.header[0]
        if self._server_side:
            ok = False
            if kind == AUTH and len(frame.header) > 1 and isinstance(frame.header[1], bytes) and self._secret:
                expected = hmac.new(self._secret, self._nonce, hashlib.sha256).digest()
                ok = hmac.compare_digest(expected, frame.header[1])
            if not ok:
                self._n.refused += 1
                log.warning("refused connection from %s: cluster secret missing or wrong", self.peer)
                self.abort()
                return
            self._authenticated = True
            self._send_frame([AUTH_OK])
            if not self.ready.done():
                self.ready.set_result(None)
            return
        if kind == HELLO:
            nonce = frame.header[1] if len(frame.header) > 1 else b""
            if not nonce and self._secret is not None:
                # A peer that asks for no secret cannot prove it is part of our
                # cluster: talking to it would hand our calls to a stranger.
                self._fail_ready(errors.AuthenticationError(self.peer, "silo does not use the cluster secret"))
                return
            if not nonce:
                self._authenticated = True
                if not self.ready.done():
                    self.ready.set_result(None)
                return
            if self._secret is None:
                self._fail_ready(errors.AuthenticationError(self.peer, "silo requires a cluster secret"))
                return
            self._send_frame([AUTH, hmac.new(self._secret, nonce, hashlib.sha256).digest()])
        elif kind == AUTH_OK:
            self._authenticated = True
            if not self.ready.done():
                self.ready.set_result(None)
        else:
            self._fail_ready(errors.CodecError(f"unexpected frame kind {kind} before handshake"))

    def _fail_ready(self, exc: Exception) -> None:
        if not self.ready.done():
            self.ready.set_exception(exc)
            self.ready.exception()
        self.abort()

    def _on_response(self, frame: Frame) -> None:
        req_id = frame.header[1] if len(frame.header) > 1 else None
        entry = self._pending.pop(req_id, None) if isinstance(req_id, int) else None
        if entry is None:
            return  # answered after its deadline: the caller already gave up
        fut, _ = entry
        if fut.done():
            return
        kind = frame.header[0]
        if kind == PONG:
            fut.set_result(None)
            return
        try:
            value = self.codec.decode(frame.meta, frame.buffers)
        except errors.CodecError as exc:
            fut.set_exception(exc)
            return
        if kind == ERROR:
            fut.set_exception(error_from_body(value))
        else:
            fut.set_result(value)

    # --- send --------------------------------------------------------------
    def _send_frame(self, header: list[Any], encoded: Encoded | None = None) -> None:
        if self._transport is None or self.closed:
            raise errors.SiloUnavailableError(self.peer, "connection closed")
        h = _packb(header)
        meta = encoded.meta if encoded is not None else b""
        bufs = encoded.buffers if encoded is not None else []
        if not bufs:
            frame = PREFIX.pack(len(h), len(meta), 0) + h + meta
            self._out.append(frame)
            self._n.frames_out += 1
            self._n.bytes_out += len(frame)
            # A lone call (nothing else in flight on this connection either way) goes out now:
            # deferring it to batch with others would only cost the sequential caller a loop turn.
            if len(frame) >= _DIRECT or len(self._pending) + self._serving <= 1 or len(self._out) >= _BATCH_FRAMES:
                self._flush()
            elif not self._flush_scheduled:
                self._flush_scheduled = True
                self._loop.call_soon(self._flush)
            return
        ctl = [PREFIX.pack(len(h), len(meta), len(bufs))]
        ctl.extend(BUFLEN.pack(b.nbytes) for b in bufs)
        ctl.append(h)
        ctl.append(meta)
        self._out.append(b"".join(ctl))
        size = sum(len(c) for c in ctl)
        if bufs:
            self._out.extend(bufs)
            size += sum(b.nbytes for b in bufs)
        self._n.frames_out += 1
        self._n.bytes_out += size
        if size >= _DIRECT:
            self._flush()
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Write queued frames; hand big buffers to a task that writes them in slices."""
        self._flush_scheduled = False
        if self._big is not None or self._transport is None or self.closed:
            return
        out = self._out
        if len(out) == 1 and len(out[0]) <= _SLICE:
            self._transport.write(out.popleft())
            return
        # Small frames are joined into one write (one syscall, and uvloop's writelines
        # handles each item separately); big buffers go as they are, without a copy.
        batch: list[bytes | memoryview] = []
        small: list[bytes | memoryview] = []
        while out:
            part = out.popleft()
            if len(part) < _DIRECT:
                small.append(part)
                continue
            if small:
                batch.append(b"".join(small) if len(small) > 1 else small[0])
                small = []
            if len(part) > _SLICE and isinstance(part, memoryview):
                if batch:
                    self._transport.writelines(batch)
                self._big = self._loop.create_task(self._write_big(part.cast("B")))
                return
            batch.append(part)
        if small:
            batch.append(b"".join(small) if len(small) > 1 else small[0])
        if len(batch) == 1:
            self._transport.write(batch[0])
        elif batch:
            self._transport.writelines(batch)

    async def _write_big(self, part: memoryview) -> None:
        # Writing a huge buffer at once makes asyncio copy the unsent rest and
        # then memmove it down after every send (quadratic); slices keep each
        # copy small and let the kernel take the rest zero-copy.
        try:
            for off in range(0, part.nbytes, _SLICE):
                if self.closed or self._transport is None:
                    return
                self._transport.write(part[off : off + _SLICE])
                if self._paused is not None and not self._paused.done():
                    await self._paused
        finally:
            self._big = None
        self._flush()

    async def drain(self) -> None:
        """Wait while the kernel's send buffer is full (back-pressure for big tensors)."""
        if self._paused is not None and not self._paused.done():
            await self._paused

    def request(
        self, header: list[Any], body: Any, timeout_s: float | None, label: str | tuple[object, str] = ""
    ) -> asyncio.Future[Any]:
        """Send a request; the future gets the decoded result or the error."""
        if self.closed:
            raise errors.SiloUnavailableError(self.peer, "connection closed")
        if len(self._pending) >= self._settings.max_in_flight:
            raise errors.OverloadedError(f"connection to {self.peer}", self._settings.max_in_flight)
        req_id = next(self._ids)
        header[1] = req_id
        encoded = self.codec.encode(body)
        fut: asyncio.Future[Any] = self._loop.create_future()
        self._pending[req_id] = (fut, label)
        if timeout_s is not None:
            self._arm(req_id, timeout_s)
        self._send_frame(header, encoded)
        return fut

    def ping(self, timeout_s: float) -> asyncio.Future[Any]:
        req_id = next(self._ids)
        fut: asyncio.Future[Any] = self._loop.create_future()
        self._pending[req_id] = (fut, "ping")
        self._arm(req_id, timeout_s)
        self._send_frame([PING, req_id])
        return fut

    def _arm(self, req_id: int, timeout_s: float) -> None:
        at = self._loop.time() + timeout_s
        heapq.heappush(self._deadlines, (at, req_id))
        if at < self._sweep_at:
            if self._sweeper is not None:
                self._sweeper.cancel()
            self._sweep_at = at
            self._sweeper = self._loop.call_at(at, self._sweep)
        if len(self._deadlines) > 2 * len(self._pending) + 1024:
            # Drop entries of answered requests so the heap stays proportional.
            self._deadlines = [d for d in self._deadlines if d[1] in self._pending]
            heapq.heapify(self._deadlines)

    def _sweep(self) -> None:
        self._sweeper = None
        self._sweep_at = float("inf")
        now = self._loop.time()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, req_id = heapq.heappop(self._deadlines)
            self._expire(req_id)
        while self._deadlines and self._deadlines[0][1] not in self._pending:
            heapq.heappop(self._deadlines)
        if self._deadlines:
            self._sweep_at = self._deadlines[0][0]
            self._sweeper = self._loop.call_at(self._sweep_at, self._sweep)

    def _expire(self, req_id: int) -> None:
        entry = self._pending.pop(req_id, None)
        if entry is None:
            return
        fut, label = entry
        if not fut.done():
            if isinstance(label, tuple):
                target, method = str(label[0]), label[1]
            else:
                target, _, method = label.rpartition(".")
            fut.set_exception(errors.GrainTimeoutError(target, method, 0.0))
        try:
            self._send_frame([CANCEL, req_id])
        except errors.SiloError:
            pass

    def send_response(self, req_id: int, value: Any) -> None:
        """Answer a request (exactly once per request received)."""
        if self._serving:
            self._serving -= 1
        if self.closed:
            return
        try:
            encoded = self.codec.encode(value)
        except errors.CodecError as exc:
            self._send_error_frame(req_id, exc)
            return
        self._send_frame([RESPONSE, req_id], encoded)

    def send_error(self, req_id: int, exc: BaseException) -> None:
        """Answer a request with an error (exactly once per request received)."""
        if self._serving:
            self._serving -= 1
        self._send_error_frame(req_id, exc)

    def _send_error_frame(self, req_id: int, exc: BaseException) -> None:
        if self.closed:
            return
        try:
            encoded = self.codec.encode(error_body(exc))
        except errors.CodecError:
            encoded = self.codec.encode({"code": "remote", "type": type(exc).__name__, "message": repr(exc)})
        self._send_frame([ERROR, req_id], encoded)

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def close(self) -> None:
        if self._transport is not None and not self.closed:
            self._flush()
            self._transport.close()

    @property
    def pending(self) -> int:
        return len(self._pending)


def _aligned(size: int) -> memoryview:
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


class Transport:
    """A listener (for silos) plus a pool of outgoing connections, one per endpoint."""

    def __init__(self, settings: TransportSettings, codec: Codec, handler: RequestHandler | None = None) -> None:
        self.settings = settings
        self.codec = codec
        self._handler = handler
        self._n = _Counters()
        self._server: asyncio.base_events.Server | None = None
        self._local_server: asyncio.base_events.Server | None = None
        self._local_path: Path | None = None
        self._out: dict[str, Connection] = {}
        self._connecting: dict[str, asyncio.Future[Connection]] = {}
        self._inbound: set[Connection] = set()
        self.closed = False

    def set_handler(self, handler: RequestHandler) -> None:
        self._handler = handler

    def _connection(self, server_side: bool) -> Connection:
        return Connection(
            codec=self.codec,
            settings=self.settings,
            counters=self._n,
            handler=self._handler,
            server_side=server_side,
            on_close=self._forget,
        )

    def _forget(self, conn: Connection) -> None:
        self._inbound.discard(conn)
        for ep, c in list(self._out.items()):
            if c is conn:
                del self._out[ep]

    def _accepted(self) -> Connection:
        conn = self._connection(server_side=True)
        self._inbound.add(conn)
        return conn

    async def listen(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._accepted, host, port, reuse_address=True, backlog=1024)
        sock = self._server.sockets[0]
        return int(sock.getsockname()[1])

    async def listen_local(self, endpoint: str) -> Path | None:
        """Also accept same-host peers on a Unix socket found by ``endpoint`` (the advertised
        ``host:port``); None when turned off or not possible here (TCP serves them then)."""
        path = local_socket.socket_path(endpoint) if self.settings.local_sockets else None
        if path is None:
            return None
        loop = asyncio.get_running_loop()
        try:
            local_socket.prepare(path)
            local_socket.sweep(path.parent)
            self._local_server = await loop.create_unix_server(self._accepted, str(path), backlog=1024)
        except OSError as exc:
            log.info("no same-host socket at %s (%s); peers use TCP", path, exc)
            return None
        self._local_path = path
        return path

    def connection_nowait(self, endpoint: str) -> Connection | None:
        """The open pooled connection to ``host:port``, or None (then ``await connect()``)."""
        conn = self._out.get(endpoint)
        return conn if conn is not None and not conn.closed else None

    async def connect(self, endpoint: str) -> Connection:
        """The pooled connection to ``host:port``, opened (and authenticated) if needed."""
        if self.closed:
            raise errors.SiloClosedError("transport")
        conn = self._out.get(endpoint)
        if conn is not None and not conn.closed:
            return conn
        pending = self._connecting.get(endpoint)
        if pending is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future[Connection] = asyncio.get_running_loop().create_future()
        self._connecting[endpoint] = fut
        try:
            conn = await self._open(endpoint)
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()
            raise
        finally:
            self._connecting.pop(endpoint, None)
        fut.set_result(conn)
        self._out[endpoint] = conn
        return conn

    async def _open(self, endpoint: str) -> Connection:
        host, _, port = endpoint.rpartition(":")
        loop = asyncio.get_running_loop()
        timeout = self.settings.connect_timeout_s

        def factory() -> Connection:
            return self._connection(server_side=False)

        path = local_socket.socket_path(endpoint) if self.settings.local_sockets else None
        try:
            conn = None
            if path is not None and path.exists():
                try:
                    conn = (await asyncio.wait_for(loop.create_unix_connection(factory, str(path)), timeout))[1]
                except (OSError, TimeoutError):
                    pass  # stale (its silo is gone) or not ours to use: TCP decides
            if conn is None:
                conn = (await asyncio.wait_for(loop.create_connection(factory, host, int(port)), timeout))[1]
            await asyncio.wait_for(conn.ready, timeout)
        except (OSError, TimeoutError) as exc:
            raise errors.SiloUnavailableError(endpoint, f"cannot connect ({exc or 'timed out'})") from exc
        return conn

    def drop(self, endpoint: str) -> None:
        conn = self._out.pop(endpoint, None)
        if conn is not None:
            conn.abort()

    def _close_local(self) -> None:
        if self._local_server is not None:
            self._local_server.close()
        if self._local_path is not None:
            with contextlib.suppress(OSError):
                self._local_path.unlink()
            self._local_path = None

    async def close(self) -> None:
        self.closed = True
        self._close_local()
        if self._server is not None:
            self._server.close()
        for conn in [*self._out.values(), *self._inbound]:
            conn.close()
        self._out.clear()
        if self._server is not None:
            try:
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            except TimeoutError:
                pass
        for conn in list(self._inbound):
            conn.abort()

    def abort_all(self) -> None:
        """Drop every connection at once (a silo declared dead must stop serving)."""
        self.closed = True
        self._close_local()
        if self._server is not None:
            self._server.close()
        for conn in [*self._out.values(), *self._inbound]:
            conn.abort()
        self._out.clear()

    def statistics(self) -> TransportStatistics:
        conns = [*self._out.values(), *self._inbound]
        n = self._n
        return TransportStatistics(
            connections=len(conns),
            frames_in=n.frames_in,
            frames_out=n.frames_out,
            bytes_in=n.bytes_in,
            bytes_out=n.bytes_out,
            bad_frames=n.bad_frames,
            refused=n.refused,
            overloaded=n.overloaded,
            pending_calls=sum(c.pending for c in conns),
        )
