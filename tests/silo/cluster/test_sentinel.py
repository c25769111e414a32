"""Redis URLs (Sentinel, Cluster refused), fencing tokens across a promotion, silos on a Sentinel URL.

The failover under load is in tests/chaos/test_sentinel_soak.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import redis.exceptions as redis_exceptions

from grains.ids import GrainId, SiloAddress
from silo import errors
from silo.client import ClusterClient
from silo.cluster.directory import COUNTER_DIGITS, RedisGrainDirectory
from silo.cluster.membership import RedisMembershipTable
from silo.keys import Keys
from silo.records.membership import MemberRow, SiloStatus
from silo.redis_url import parse_redis_url, redact
from silo.redis_util import (
    connect_redis,
    fence_epoch_hint,
    replication_statistics,
    sync_twin,
    verify_redis,
)
from silo.settings import SiloSettings, StorageSettings
from silo.silo import Silo
from silo.storage.store import RedisStateStore
from silo.testing.embedded import RedisServer, free_port
from silo.testing.sentinel import SentinelGroup
from tests.conftest import FAST_MEMBERSHIP
from tests.sample_grains import Counter

A, B = SiloAddress("127.0.0.1", 7100, 1), SiloAddress("127.0.0.1", 7101, 1)
KEYS = Keys("fence")
SPLIT = 10**COUNTER_DIGITS

# --- URLs ------------------------------------------------------------------------


def test_sentinel_url_names_its_sentinels_service_and_db() -> None:
    t = parse_redis_url("redis+sentinel://:pw%2Fx@10.0.0.1:26380,10.0.0.2,[::1]:5000/mymaster/3")
    assert t.sentinel is not None and t.direct_url is None
    assert t.sentinel.sentinels == (("10.0.0.1", 26380), ("10.0.0.2", 26379), ("::1", 5000))
    assert (t.sentinel.service, t.sentinel.db, t.sentinel.tls) == ("mymaster", 3, False)
    assert (t.sentinel.username, t.sentinel.password) == (None, "pw/x")
    assert (t.wait_replicas, t.wait_timeout_ms) == (1, 100)


def test_tls_sentinel_url_keeps_its_certificates_and_sentinel_credentials() -> None:
    t = parse_redis_url(
        "rediss+sentinel://app:secret@h:1/svc?ssl_ca_certs=/ca.pem&sentinel_password=s&wait_replicas=2"
        "&wait_timeout_ms=250&db=2"
    )
    assert t.sentinel is not None
    assert t.sentinel.tls and t.sentinel.connection_options == {"ssl_ca_certs": "/ca.pem"}
    assert (t.sentinel.username, t.sentinel.password, t.sentinel.sentinel_password) == ("app", "secret", "s")
    assert (t.sentinel.db, t.wait_replicas, t.wait_timeout_ms) == (2, 2, 250)


def test_plain_url_loses_only_our_options_before_redis_py_sees_it() -> None:
    t = parse_redis_url("rediss://u:p@h:6380/1?ssl_ca_certs=%2Fca.pem&wait_replicas=1")
    assert t.sentinel is None and t.wait_replicas == 1
    assert t.direct_url == "rediss://u:p@h:6380/1?ssl_ca_certs=%2Fca.pem"
    assert parse_redis_url("redis://h:1/0").wait_replicas == 0


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+sentinel://h:1", "names its service"),
        ("redis+sentinel://h:1/", "names its service"),
        ("redis+sentinel:///svc", "at least one sentinel"),
        ("redis+sentinel://h:x/svc", "bad port"),
        ("redis+sentinel://h:1/svc/zero", "not a number"),
        ("redis+sentinel://h:1/svc/0/extra", "/service[/db]"),
        ("redis+sentinel://h:1/svc?sentinel_pasword=x", "unknown option(s) sentinel_pasword"),
        ("redis+sentinel://h:1/svc?wait_replicas=-1", "whole number"),
        ("redis+cluster://h:1/3", "only database 0"),
        ("rediss+cluster://u:pw@h:1?ssl_ca_cert=x", "unknown option(s) ssl_ca_cert"),
        ("redis+cluster://u:pw@", "at least one node"),
        ("memcached://h:1", "unknown Redis URL scheme"),
        ("h:6379", "no scheme"),
    ],
)
def test_bad_or_unsupported_url_is_a_config_error_that_says_why(url: str, says: str) -> None:
    with pytest.raises(errors.ConfigError) as info:
        parse_redis_url(url)
    assert says in str(info.value)
    assert "pw" not in str(info.value).replace("pasword", "")


def test_redact_hides_passwords_only() -> None:
    assert redact("redis+sentinel://u:pw@h:1,h:2/s") == "redis+sentinel://u:***@h:1,h:2/s"
    assert redact("redis://h:1/0") == "redis://h:1/0"


def test_a_cluster_url_names_its_startup_nodes() -> None:
    t = parse_redis_url("rediss+cluster://u:p%40w@h1:7000,h2?ssl_ca_certs=/ca.pem&wait_replicas=1")
    assert t.cluster is not None and t.sentinel is None and t.direct_url is None
    assert t.cluster.nodes == (("h1", 7000), ("h2", 6379))
    assert (t.cluster.tls, t.cluster.username, t.cluster.password) == (True, "u", "p@w")
    assert t.cluster.connection_options == {"ssl_ca_certs": "/ca.pem"} and t.wait_replicas == 1
    assert parse_redis_url("redis+cluster://h:1").wait_replicas == 0


async def test_a_cluster_node_that_serves_no_slots_is_a_clear_error(tmp_path: Path) -> None:
    # A redis:// URL of a node in cluster mode is taken as its cluster; one whose cluster
    # covers no slots (never created) fails to connect, saying so.
    # The cluster bus listens on port + 10000: pick a port with room above it.
    port = next(p for p in iter(free_port, 0) if p <= 55535)
    server = RedisServer(
        port=port,
        data_dir=tmp_path / "cluster-node",
        extra_args=("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"),
    )
    with server:
        with pytest.raises(errors.StorageError, match="Redis Cluster"):
            await ClusterClient.connect(server.url, cluster="c")
        settings = SiloSettings(redis_url=server.url, cluster="c", grains=("tests.sample_grains",))
        with pytest.raises(errors.StorageError, match="Redis Cluster"):
            await Silo(settings).start()


# --- fencing tokens across a promotion ---------------------------------------------------


async def _members(redis: aioredis.Redis) -> None:
    table = RedisMembershipTable(redis, KEYS)
    for s in (A, B):
        await table.join(MemberRow(address=str(s), host=s.host, port=s.port, generation=s.generation))
        await table.set_status(str(s), SiloStatus.ACTIVE)


@pytest.fixture
async def master_and_replica(tmp_path: Path) -> AsyncIterator[tuple[RedisServer, RedisServer]]:
    # No 5 s wait for more replicas before the first full sync.
    master = RedisServer(data_dir=tmp_path / "master", extra_args=("--repl-diskless-sync-delay", "0")).start()
    replica = RedisServer(
        data_dir=tmp_path / "replica", extra_args=("--replicaof", "127.0.0.1", str(master.port))
    ).start()
    probe, on_master = aioredis.Redis.from_url(replica.url), aioredis.Redis.from_url(master.url)
    try:
        while (await probe.info("replication")).get("master_link_status") != "up":
            await asyncio.sleep(0.02)  # another process: nothing to await
        # And online as the master sees it: a write's WAIT counts it only then (and the
        # replica-wait policy does not wait on a master whose replicas are not online).
        while (await on_master.info("replication")).get("slave0", {}).get("state") != "online":
            await asyncio.sleep(0.02)
    finally:
        await probe.aclose()
        await on_master.aclose()
    try:
        yield master, replica
    finally:
        replica.stop()
        master.stop()


async def test_promoted_replica_never_hands_out_a_token_the_old_master_gave(
    master_and_replica: tuple[RedisServer, RedisServer],
) -> None:
    master, replica = master_and_replica
    old, new = connect_redis(master.url + "?wait_replicas=1&wait_timeout_ms=1000"), connect_redis(replica.url)
    try:
        await _members(old)
        # Registered and replicated (the WAIT of run_replicated): both nodes know the fencing term.
        before = await RedisGrainDirectory(old, KEYS).register(GrainId("Counter", "early"), A, "act-0")
        stats = replication_statistics(old)
        assert stats is not None and stats.waits >= 1 and stats.short_waits == 0
        # The failover: the replica is promoted, and the old master takes one more registration
        # that never reaches it (the write a SIGKILLed master acknowledged and took along).
        await new.execute_command("REPLICAOF", "NO", "ONE")
        g = GrainId("Counter", "g")
        lost = await RedisGrainDirectory(old, KEYS).register(g, A, "act-zombie")
        won = await RedisGrainDirectory(new, KEYS).register(g, B, "act-new")
        # A bare counter repeats itself here (both nodes INCR from the same value) ...
        assert lost.token % SPLIT == won.token % SPLIT
        # ... the epoch does not: the promoted master's tokens sort above all of the old one's.
        assert won.token > lost.token > before.token
        assert won.token // SPLIT == before.token // SPLIT + 1
        store = RedisStateStore(new, KEYS, StorageSettings())
        with pytest.raises(errors.StateConflictError, match="fencing"):
            await store.write_stream(g, [memoryview(b"zombie")], "*", lost.token)
        await store.write_stream(g, [memoryview(b"owner")], "*", won.token)
    finally:
        await old.aclose()
        await new.aclose()


async def test_tokens_keep_rising_across_a_restart_and_a_full_counter(fresh_redis: RedisServer) -> None:
    # Counter and epoch are per hash slot (the grain's): a grain's tokens keep rising.
    a = GrainId("Counter", "a")
    redis = connect_redis(fresh_redis.url)
    try:
        await _members(redis)
        first = await RedisGrainDirectory(redis, KEYS).register(a, A, "a1")
        assert first.token == 1000 * SPLIT + 1  # epoch 1000 * (config epoch 0 + 1), counter 1
        assert await RedisGrainDirectory(redis, KEYS).unregister(a, A, "a1")
        await redis.aclose()
        fresh_redis.kill()
        fresh_redis.start()
        redis = connect_redis(fresh_redis.url)
        second = await RedisGrainDirectory(redis, KEYS).register(a, A, "a2")
        assert second.token > first.token
        assert await RedisGrainDirectory(redis, KEYS).unregister(a, A, "a2")
        # A counter about to spill into the epoch's digits moves on to the next epoch.
        await redis.set(KEYS.fencing_counter(), SPLIT - 1)
        third = await RedisGrainDirectory(redis, KEYS).register(a, A, "a3")
        assert third.token == (second.token // SPLIT + 1) * SPLIT + 1
    finally:
        await redis.aclose()


async def test_an_acl_user_without_dangerous_commands_still_registers(redis_server: RedisServer) -> None:
    # docs/security.md recommends -@dangerous, which denies INFO (the cluster check, the replid).
    admin = aioredis.Redis.from_url(redis_server.url)
    await admin.flushall()
    await admin.execute_command("ACL", "SETUSER", "narrow", "on", ">pw", "~*", "&*", "+@all", "-@dangerous")
    url = f"redis://narrow:pw@{redis_server.host}:{redis_server.port}/0"
    redis = connect_redis(url)
    try:
        with pytest.raises(redis_exceptions.NoPermissionError):
            await redis.info("replication")
        await verify_redis(redis, "check")
        await _members(redis)
        entry = await RedisGrainDirectory(redis, KEYS).register(GrainId("Counter", "n"), A, "n1")
        assert entry.token // SPLIT == 1000
    finally:
        await redis.aclose()
        await admin.execute_command("ACL", "DELUSER", "narrow")
        await admin.aclose()


# --- silos and clients on a Sentinel URL ---------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_silos_and_client_work_through_a_sentinel_url(tmp_path: Path, cluster_name: str) -> None:
    with SentinelGroup(tmp_path / "sentinel") as group:
        settings = SiloSettings(
            redis_url=group.url, cluster=cluster_name, grains=("tests.sample_grains",), membership=FAST_MEMBERSHIP
        )
        silos = [await Silo(settings).start() for _ in range(2)]
        try:
            for s in silos:
                await s.view.refresh()
            async with await ClusterClient.connect(group.url, cluster=cluster_name) as client:
                totals = await asyncio.gather(*(client.get_grain(Counter, f"k{i}").add(2) for i in range(10)))
                assert totals == [2] * 10
            waits = [replication_statistics(s.redis) for s in silos]
            assert sum(w.waits for w in waits if w) > 0, waits
            assert all(w is not None and w.short_waits == 0 for w in waits), waits
            assert all(s.heartbeat.statistics().beats > 0 for s in silos)
            await verify_redis(silos[0].redis, "check")
            assert fence_epoch_hint(silos[0].redis) == group.config_epoch()
            twin = sync_twin(silos[0].redis, timeout_s=2.0)
            assert twin is not None
            try:
                assert twin.ping()
                assert twin.info("replication")["role"] == "master"
            finally:
                twin.close()
        finally:
            for s in silos:
                await s.stop(graceful=False)
