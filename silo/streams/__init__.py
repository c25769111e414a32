"""Streams on Redis Streams: publishing and explicit subscriptions (``stream.py``), delivery to
``@subscribes`` grains (``agent.py``: one agent per subscribed namespace and grain type on each
silo, holding per-key leases; attempts, dead letters, gaps), and retention by age on a timer
with pruning of what streams leave behind (``retention.py``)."""

from silo.streams.retention import StreamRetention
from silo.streams.stream import RedisStream, RedisSubscription, Streams

__all__ = ["RedisStream", "RedisSubscription", "StreamRetention", "Streams"]
