"""The Redis-backed torch.distributed Store: torch's semantics, one prefix per group generation."""

from __future__ import annotations

import datetime
import threading

import pytest
import redis
import redis.asyncio as aioredis
import torch
import torch.distributed as dist

from grains.training.strategies.allreduce.rendezvous import (
    GroupAbandonedError,
    RedisStore,
    sync_client_like,
)


@pytest.fixture
def client(redis_url: str):
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


def test_store_follows_torch_semantics_under_its_prefix(client):
    s = RedisStore(client, "rg:{t}:rdzv:job:1:", timeout_s=5.0)
    other = RedisStore(client, "rg:{t}:rdzv:job:2:", timeout_s=5.0)
    s.set("a", b"1")
    assert s.get("a") == b"1" and s.check(["a"]) and not other.check(["a"])
    assert s.add("n", 2) == 2 and s.add("n", 3) == 5
    assert s.compare_set("c", b"", b"x") == b"x"  # missing key, empty expected: set
    assert s.compare_set("c", b"y", b"z") == b"x"  # mismatch: the current value, unchanged
    assert s.compare_set("c", b"x", b"z") == b"z"
    assert s.compare_set("missing", b"y", b"z") == b"y"  # missing key, expected given: not set
    assert s.num_keys() == 3 and other.num_keys() == 0
    assert s.delete_key("a") and not s.delete_key("a")
    assert s.clear() == 2 and s.num_keys() == 0


def test_wait_gives_up_at_its_timeout_or_at_once_when_abandoned(client):
    s = RedisStore(client, "rg:{t}:rdzv:job:3:", timeout_s=5.0)
    with pytest.raises(TimeoutError):
        s.wait(["never"], datetime.timedelta(milliseconds=50))
    abandon = threading.Event()
    abandoned = RedisStore(client, "rg:{t}:rdzv:job:3:", timeout_s=60.0, abandon=abandon)
    threading.Timer(0.05, abandon.set).start()
    with pytest.raises(GroupAbandonedError):
        abandoned.get("never")


def test_two_ranks_form_a_gloo_group_on_it_and_all_reduce(redis_url: str):
    async_client = aioredis.Redis.from_url(redis_url)
    results: dict[int, torch.Tensor] = {}

    def rank(r: int) -> None:
        c = sync_client_like(async_client)  # what a trainer grain does with its silo's client
        store = RedisStore(c, "rg:{t}:rdzv:job:4:", timeout_s=30.0)
        pg = dist.ProcessGroupGloo(store, r, 2, datetime.timedelta(seconds=30))
        t = torch.full((3,), float(r + 1))
        pg.allreduce([t]).wait()
        results[r] = t
        c.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert torch.equal(results[0], torch.full((3,), 3.0)) and torch.equal(results[1], results[0])
