"""Streams as the dashboard shows them: length, consumer groups, lag, holders, dead letters.

silo/streams/ keeps each stream ``(namespace, key)`` in Redis with one consumer
group per ``@subscribes`` grain type; :func:`read_streams` reads them with
their groups and consumers, :func:`read_dead_letters` the items no turn took.
"""

from __future__ import annotations

import redis.asyncio as aioredis
from pydantic import BaseModel, Field

from silo.keys import Keys
from silo.records._decode import text
from silo.redis_util import redis_errors


class StreamConsumerInfo(BaseModel):
    """One consumer (a silo) of a stream's consumer group."""

    name: str = Field(description="The consuming silo's address.")
    pending: int = Field(description="Items it read and has not acknowledged yet.")
    idle_ms: int = Field(description="Since it last read or claimed from this stream.")


class StreamGroupInfo(BaseModel):
    """One implicit subscription of a stream: the consumer group of a ``@subscribes`` grain type."""

    name: str = Field(description="The subscribing grain type (the group's name).")
    lag: int | None = Field(
        default=None, description="Items not yet read by the group (None: Redis cannot tell after trimming)."
    )
    pending: int = Field(description="Items read, not yet acknowledged (their turns running, or to redo).")
    last_delivered: str = Field(description="Token of the last item the group read.")
    holder: str | None = Field(default=None, description="The silo delivering this key now (its lease).")
    consumers: list[StreamConsumerInfo] = Field(default_factory=list)


class StreamInfo(BaseModel):
    """One stream, ``(namespace, key)``, as silo/streams/ keeps it in Redis."""

    namespace: str
    key: str
    length: int = Field(description="Items kept (after trimming).")
    first_token: str | None = None
    last_token: str | None = Field(default=None, description="Token of the newest item.")
    groups: list[StreamGroupInfo] = Field(default_factory=list)


async def read_streams(
    redis: aioredis.Redis, keys: Keys, namespace: str | None = None, limit: int = 200
) -> tuple[list[StreamInfo], list[str], bool]:
    """Streams (of one namespace, or all), their groups, consumers and lag; at most ``limit``
    streams, by namespace and key. Returns (streams, every namespace, whether some were left out)."""
    with redis_errors("read streams"):
        namespaces = sorted(text(n) for n in await redis.smembers(keys.stream_namespaces))
        wanted = [n for n in namespaces if namespace is None or n == namespace]
        names: list[tuple[str, str]] = []
        for ns in wanted:
            names.extend((ns, text(k)) for k in await redis.smembers(keys.stream_keys(ns)))
        names.sort()
        truncated = len(names) > limit
        names = names[:limit]
        async with redis.pipeline(transaction=False) as pipe:
            for ns, key in names:
                pipe.xinfo_stream(keys.stream(ns, key))
                pipe.xinfo_groups(keys.stream(ns, key))
            replies = await pipe.execute(raise_on_error=False)
        out: list[StreamInfo] = []
        consumers_of: list[tuple[StreamGroupInfo, str, str]] = []
        for i, (ns, key) in enumerate(names):
            info, groups = replies[2 * i], replies[2 * i + 1]
            if isinstance(info, Exception):  # listed, but gone (deleted by hand)
                info, groups = {"length": 0}, []
            first, last = info.get("first-entry"), info.get("last-entry")
            stream = StreamInfo(
                namespace=ns, key=key, length=int(info.get("length", 0)),
                first_token=text(first[0]) if first else None,
                last_token=text(last[0]) if last else None,
            )  # fmt: skip
            for g in groups if isinstance(groups, list) else ():
                group = StreamGroupInfo(
                    name=text(g["name"]), pending=int(g["pending"]),
                    lag=None if g.get("lag") is None else int(g["lag"]),
                    last_delivered=text(g.get("last-delivered-id", "")),
                )  # fmt: skip
                stream.groups.append(group)
                consumers_of.append((group, ns, key))
            out.append(stream)
        if consumers_of:
            async with redis.pipeline(transaction=False) as pipe:
                for group, ns, key in consumers_of:
                    pipe.xinfo_consumers(keys.stream(ns, key), group.name)
                    pipe.get(keys.stream_lease(ns, key, group.name))
                replies = await pipe.execute(raise_on_error=False)
            for i, (group, _, _) in enumerate(consumers_of):
                consumers, holder = replies[2 * i], replies[2 * i + 1]
                group.holder = None if holder is None or isinstance(holder, Exception) else text(holder)
                for c in consumers if isinstance(consumers, list) else ():
                    group.consumers.append(
                        StreamConsumerInfo(name=text(c["name"]), pending=int(c["pending"]), idle_ms=int(c["idle"]))
                    )
    return out, namespaces, truncated


class DeadLetter(BaseModel):
    """One item no ``@subscribes`` turn took (``keys.stream_dead_letters``, written by silo/streams/agent.py)."""

    id: str = Field(description="The dead letter's own entry id (when it was written).")
    key: str = Field(description="The stream key the item was published to.")
    group: str = Field(description="The subscribing grain type that did not take it.")
    token: str = Field(description="The item's token in its stream.")
    error: str = Field(description="The last attempt's failure.")
    attempts: int = Field(description="Attempts made (0: the item could not be decoded).")
    silo: str = Field(description="The silo that gave up on it.")


class DeadLetters(BaseModel):
    """The dead-letter stream of one namespace: how many it keeps, and the newest."""

    namespace: str
    count: int = Field(description="Dead letters kept (the stream is capped at streams.dead_letter_maxlen).")
    newest: list[DeadLetter] = Field(default_factory=list, description="Newest first.")


async def read_dead_letters(
    redis: aioredis.Redis, keys: Keys, namespaces: list[str], newest: int = 10
) -> list[DeadLetters]:
    """The dead letters of each namespace that has any: the count and the ``newest`` few."""
    with redis_errors("read stream dead letters"):
        async with redis.pipeline(transaction=False) as pipe:
            for ns in namespaces:
                pipe.xlen(keys.stream_dead_letters(ns))
                pipe.xrevrange(keys.stream_dead_letters(ns), count=newest)
            replies = await pipe.execute()
    out = []
    for i, ns in enumerate(namespaces):
        count, entries = int(replies[2 * i]), replies[2 * i + 1]
        if not count:
            continue
        letters = []
        for entry_id, raw in entries:
            f = {text(k): text(v) for k, v in raw.items() if k not in (b"v", "v")}
            try:
                letters.append(DeadLetter(
                    id=text(entry_id), key=f["key"], group=f["group"], token=f["token"],
                    error=f.get("error", ""), attempts=int(f.get("attempts", 0)), silo=f.get("silo", ""),
                ))  # fmt: skip
            except (KeyError, ValueError):
                continue  # an entry from another version: not ours to show
        out.append(DeadLetters(namespace=ns, count=count, newest=letters))
    return out

