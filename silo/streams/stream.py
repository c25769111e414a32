"""Publishing to a stream and reading it explicitly, on Redis Streams.

One Redis stream per ``(namespace, key)`` (``keys.stream``); each item is one
entry whose field ``v`` holds the item as a codec blob (``Codec.dumps``: the
wire's rules, never pickle), and whose entry id is the item's *token*. A
publish is one pipeline: the namespace into ``keys.stream_namespaces``, the
key into ``keys.stream_keys(namespace)`` (how silos find keys to deliver to
``@subscribes`` grains: ``agent.py``), the ``XADD`` with ``MAXLEN`` and, with
a max age, an ``XTRIM MINID`` (retention: ``StreamSettings``; the silos also
trim by age on a timer, ``retention.py``), then both sets again. The sets come
first, so a key is never in a stream without being findable, and again last,
so a retention sweep pruning them meanwhile cannot leave the key out; the
pipeline is not a transaction, so a future Redis Cluster may put the stream in
a slot of its own.

An explicit subscription is a plain reader (``XREAD BLOCK`` from a position it
keeps): no consumer group, nothing stored in Redis, nothing to clean up when
the subscriber leaves. Starting "from now" pins the stream's last id at the
first read, so nothing published between two reads is skipped.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any, Self

import redis.asyncio as aioredis

from grains import request_context
from grains.ids import _key_str
from grains.streams import StreamItem, check_namespace, token_order
from silo import errors
from silo.codec import Codec
from silo.keys import Keys
from silo.redis_util import redis_errors
from silo.settings import StreamSettings

ITEM_FIELD = b"v"
CONTEXT_FIELD = b"c"
"""The publisher's request context (grains/request_context.py) as JSON, when it had one: the
@subscribes grain's turn runs with it, as a call's would."""
"""The entry field holding the item's codec blob."""

# KEYS: stream.  ARGV: position, count.  {entries-added, length, first id, XREAD reply}, in one
# step, so the counters describe the stream the entries were read from (see RedisSubscription).
_READ_COUNTED = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {0, 0, '0-0', false} end
local flat = redis.call('XINFO', 'STREAM', KEYS[1])
local s = {}
for i = 1, #flat, 2 do s[flat[i]] = flat[i + 1] end
local got = redis.call('XREAD', 'COUNT', ARGV[2], 'STREAMS', KEYS[1], ARGV[1])
return {s['entries-added'], s['length'], s['recorded-first-entry-id'], got}
"""

# KEYS: stream.  {last entry id or '0-0', entries-added}: "from now", and how many came before it.
_PIN = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'0-0', 0} end
local flat = redis.call('XINFO', 'STREAM', KEYS[1])
local s = {}
for i = 1, #flat, 2 do s[flat[i]] = flat[i + 1] end
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if #last == 0 then return {'0-0', s['entries-added']} end
return {last[1][1], s['entries-added']}
"""


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _fields(flat: list[bytes] | dict[bytes, bytes] | None) -> dict[bytes, bytes]:
    """An entry's fields as a dict (a script returns them flat)."""
    if flat is None:
        return {}
    if isinstance(flat, dict):
        return flat
    return dict(zip(flat[::2], flat[1::2], strict=True))


def stream_key_str(key: Any) -> str:
    """A stream key as the grain key of its ``@subscribes`` grain (str, int or UUID, as str)."""
    try:
        return _key_str(key)
    except TypeError as exc:
        raise ValueError(str(exc).replace("grain key", "stream key")) from None


def check_token(token: str) -> str:
    """A token is a Redis stream entry id, ``<ms>-<seq>``."""
    ms, sep, seq = token.partition("-") if isinstance(token, str) else ("", "", "")
    if not (sep and ms.isdigit() and seq.isdigit()):
        raise ValueError(f"a stream token is an entry id like '1700000000000-0', not {token!r}")
    return token


class Streams:
    """Makes stream handles for one silo or client (its Redis, keys, codec and settings)."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        codec: Codec,
        settings: StreamSettings,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.redis, self.keys, self.codec, self.settings = redis, keys, codec, settings
        self.clock = clock
        """Wall clock for max-age trimming (injected by tests)."""
        self.read_script = redis.register_script(_READ_COUNTED)
        self.pin_script = redis.register_script(_PIN)

    def stream(self, namespace: str, key: Any) -> RedisStream:
        return RedisStream(self, check_namespace(namespace), stream_key_str(key))


class RedisStream:
    """A handle on one stream (see ``grains.streams.Stream``); holds nothing open."""

    __slots__ = ("_key", "_namespace", "_redis_key", "_streams")

    def __init__(self, streams: Streams, namespace: str, key: str) -> None:
        self._streams = streams
        self._namespace, self._key = namespace, key
        self._redis_key = streams.keys.stream(namespace, key)

    @property
    def namespace(self) -> str:
        return self._namespace

    @property
    def key(self) -> str:
        return self._key

    def __repr__(self) -> str:
        return f"<stream {self._namespace}/{self._key}>"

    async def publish(self, item: Any) -> str:
        s = self._streams
        try:
            blob = s.codec.dumps(item)
        except errors.CodecError as exc:
            raise errors.CodecError(f"cannot publish to stream {self._namespace}/{self._key}: {exc}") from exc
        cfg = s.settings
        pipe = s.redis.pipeline(transaction=False)
        pipe.sadd(s.keys.stream_namespaces, self._namespace)
        pipe.sadd(s.keys.stream_keys(self._namespace), self._key)
        context = request_context.outgoing()
        fields: dict[Any, Any] = {ITEM_FIELD: blob}  # redis-py's parameter type is invariant
        if context is not None:
            fields[CONTEXT_FIELD] = context
        pipe.xadd(self._redis_key, fields, maxlen=cfg.maxlen, approximate=cfg.approximate_trim)
        if cfg.max_age_s is not None:
            oldest_ms = int((s.clock() - cfg.max_age_s) * 1000)
            pipe.xtrim(self._redis_key, minid=f"{max(oldest_ms, 0)}-0", approximate=cfg.approximate_trim)
        # Again after the XADD: a retention sweep (retention.py) that removed them meanwhile,
        # finding no stream yet, cannot leave this one out of its sets.
        pipe.sadd(s.keys.stream_keys(self._namespace), self._key)
        pipe.sadd(s.keys.stream_namespaces, self._namespace)
        with redis_errors(f"publish to stream {self._namespace}/{self._key}"):
            replies = await pipe.execute()
        token = replies[2]
        return token.decode() if isinstance(token, bytes) else str(token)

    def subscribe(self, *, from_start: bool = False, from_token: str | None = None) -> RedisSubscription:
        if from_start and from_token is not None:
            raise ValueError("subscribe takes from_start or from_token, not both")
        position = "0-0" if from_start else None if from_token is None else check_token(from_token)
        return RedisSubscription(self._streams, self._namespace, self._key, position)

    async def length(self) -> int:
        """Items the stream keeps now (after trimming)."""
        with redis_errors(f"read length of stream {self._namespace}/{self._key}"):
            return int(await self._streams.redis.xlen(self._redis_key))


class RedisSubscription:
    """Items of one stream after a position, in order, as :class:`~grains.streams.StreamItem`.

    ``async for ev in sub`` waits for new items (``XREAD BLOCK``, at most
    ``StreamSettings.block_ms`` per wait). Without a start, "from now" means
    from ``async with`` (or the first read); leaving the loop stops it, and
    ``close()`` from another task ends the loop after the read in progress. An
    item this process cannot decode raises ``CodecError`` naming its token (a
    new subscription ``from_token=`` it goes on after it).

    **Gaps.** Items that retention trimmed before the subscription read them
    raise ``StreamGapError`` (the tokens either side, and how many) where they
    were; iterating again goes on after them. Each read takes the stream's
    counters with the entries, in one script: the items ever added less those
    kept were trimmed, and the subscription counts the items up to its
    position (from the pin for "from now", from what was kept at the first read
    for ``from_start``), so what was trimmed beyond it is the gap. Resumed
    ``from_token`` it has no such count until its first gap: then the error says
    items were trimmed past the token without a number (possibly none, if
    trimming stopped exactly there).
    """

    def __init__(self, streams: Streams, namespace: str, key: str, position: str | None) -> None:
        self._streams = streams
        self._namespace, self._key = namespace, key
        self._redis_key = streams.keys.stream(namespace, key)
        self._position = position
        """Token of the last item handed out (None: not pinned yet, 'from now')."""
        self._counted: int | None = None
        """Items the stream ever had up to ``_position`` (None: not known, resumed from a token)."""
        self._ready: collections.deque[tuple[str, bytes | None] | errors.StreamGapError] = collections.deque()
        self._closed = False

    @property
    def position(self) -> str | None:
        """Token of the last item handed out (where a new subscription would resume)."""
        return self._position

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> StreamItem:
        while not self._ready or self._closed:
            if self._closed:
                raise StopAsyncIteration
            await self._read()
        ready = self._ready.popleft()
        if isinstance(ready, errors.StreamGapError):
            raise ready
        token, blob = ready
        self._position = token
        if blob is None:
            raise errors.CodecError(f"stream {self._namespace}/{self._key} item {token} has no {ITEM_FIELD!r} field")
        try:
            item = self._streams.codec.loads(blob)
        except errors.CodecError as exc:
            raise errors.CodecError(f"stream {self._namespace}/{self._key} item {token}: {exc}") from exc
        return StreamItem(item, token)

    async def pin(self) -> None:
        """Fix "from now" to the stream's last item (done by ``async with`` and the first read)."""
        if self._position is None:
            with redis_errors(f"read stream {self._namespace}/{self._key}"):
                last, added = await self._streams.pin_script(keys=[self._redis_key])
            self._position, self._counted = _text(last), int(added)

    async def _read(self) -> None:
        """Read what came after our position (and any gap before it); else wait for an item."""
        s = self._streams
        await self.pin()  # two reads never skip what was published between them
        assert self._position is not None
        with redis_errors(f"read stream {self._namespace}/{self._key}"):
            added, length, first, reply = await s.read_script(
                keys=[self._redis_key], args=[self._position, s.settings.batch]
            )
        entries = [(_text(e), _fields(f).get(ITEM_FIELD)) for _, es in reply or () for e, f in es]
        self._note_gap(int(added), int(length), _text(first), entries[0][0] if entries else None)
        if self._counted is not None:
            self._counted += len(entries)
        self._ready.extend(entries)
        if not self._ready:
            # Caught up: a wake-up only (no count comes with it); the next read takes the items.
            with redis_errors(f"read stream {self._namespace}/{self._key}"):
                await s.redis.xread({self._redis_key: self._position}, count=1, block=s.settings.block_ms)

    def _note_gap(self, added: int, length: int, first: str, before: str | None) -> None:
        assert self._position is not None
        trimmed = added - length
        if self._counted is not None and added < self._counted:
            self._counted = trimmed  # the stream was deleted (empty) and made again
        if self._counted is None and self._position == "0-0":
            self._counted = trimmed  # from the start: what the stream keeps now is what we are owed
        if trimmed <= 0 or (length and token_order(first) <= token_order(self._position)):
            return  # nothing trimmed, or trimming has not passed our position
        lost = None if self._counted is None else trimmed - self._counted
        if lost is None or lost > 0:
            self._ready.append(errors.StreamGapError(self._namespace, self._key, self._position, before, lost))
        self._counted = trimmed

    async def close(self) -> None:
        self._closed = True

    async def __aenter__(self) -> Self:
        await self.pin()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
