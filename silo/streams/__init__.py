"""Streams on Redis Streams: publishing and explicit subscriptions (``stream.py``), delivery to
``@subscribes`` grains (``agent.py``: one agent per subscribed namespace and grain type on each
silo, holding per-key leases), and the turn a delivery runs (``turn.py``)."""

from silo.streams.stream import RedisStream, RedisSubscription, Streams

__all__ = ["RedisStream", "RedisSubscription", "Streams"]
