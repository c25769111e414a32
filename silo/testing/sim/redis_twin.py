"""Redis at the command level for the simulator: one fakeredis server, reached through each silo's link.

The twins of :mod:`silo.testing` stand for Redis at the level of our own
protocols (directory, membership, state). The services that talk to Redis
directly (reminders' Lua scripts, the stream agents' consumer groups, leases
and blocking reads) need Redis itself. ``fakeredis`` is the field's standard
in-memory Redis, and runs Lua through ``lupa``; its contract against a real
redis-server for the commands and scripts these services use is
tests/silo/testing/test_redis_twin_contract.py.

Why it runs on the simulation's terms:

* **One process, the sim's loop.** The async client's connection is a queue in
  memory, and a command runs whole inside the caller's send (under the
  server's lock), so a Lua script or a MULTI is as atomic as on Redis. A
  blocking read (``XREAD BLOCK``) waits on an ``asyncio`` timeout: virtual time.
* **Its clock is the sim's.** ``TIME``, expiries (``PX``) and stream ids read
  ``time.time()`` at each call, which :func:`~silo.testing.sim.runner.deterministic`
  points at the loop's virtual time for a run.
* **The link applies.** Every command a silo sends (a pipeline is one send)
  first passes its :class:`~silo.testing.sim.world.RedisLink`: a latency drawn
  from the seed, and the silo's Redis cut, which fails the send with redis-py's
  own ``ConnectionError``, so redis-py's retries and ``redis_errors`` run as in
  production. Which link: the one of the silo whose code sends (the
  :data:`~silo.testing.sim.loop.SILO` context), looked up in the world.

One deviation of fakeredis 2.41 is mended here (:class:`_ScriptShapes`):
inside a Lua script, ``redis.call('XREADGROUP', ...)`` answers in the
*client's* protocol (RESP3 for redis-py 8: a map, which Lua flattens to
``{stream, entries}``), where Redis answers a script in RESP2 (``{{stream,
entries}}``). The stream agent's read script (``_READ_NEW``) then fails on
every read. The contract test runs that script on both.

fakeredis is a development dependency: only a scenario with ``services=True``
imports this module.
"""

from __future__ import annotations

from typing import Any

import fakeredis
import redis.exceptions
from fakeredis import FakeAsyncRedisConnection
from fakeredis.aioredis import AsyncFakeSocket, FakeReader, FakeWriter

from silo.testing.sim.grains import WORLD
from silo.testing.sim.loop import SILO


class _ScriptShapes(AsyncFakeSocket):
    """fakeredis' socket, answering XREADGROUP inside a script in the script's RESP mode (see above)."""

    def _xreadgroup_reply(self, res: dict[bytes, Any] | None) -> Any:
        if self._resp_version == 2:
            return [[k, v] for k, v in res.items()] if res else None
        return super()._xreadgroup_reply(res)


class TwinConnection(FakeAsyncRedisConnection):
    """A fakeredis connection on :class:`_ScriptShapes` (the twin outside a simulation too)."""

    socket_class: type[_ScriptShapes] = _ScriptShapes
    """The server side of the connection (the ``silo`` scenario's records what the checkers need)."""

    async def _connect(self) -> None:
        # fakeredis' own _connect, with the mended socket class.
        if self._server is None or not self._server.connected:
            raise self._connection_error_class("Connection refused (the twin server is down)")
        self._sock = self.socket_class(
            self._server, self.db, client_class=self._client_class, lua_modules=self._lua_modules,
            client_info=self._client_info,
        )  # fmt: skip
        self._reader = FakeReader(self._sock)
        self._writer = FakeWriter(self._sock)


class LinkedConnection(TwinConnection):
    """A twin connection whose every send passes the sending silo's link first."""

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        world = WORLD.get(None)
        if world is not None:
            link = world.redis_links.get(SILO.get() or "world")
            if link is not None:
                await link.enter("redis", error=redis.exceptions.ConnectionError)
        await super().send_packed_command(command, check_health)


VERSION = (7, 0)
"""The Redis the twin plays: the version the contract test's redis-server is (consumer groups
count ``entries-read`` from 7.0 on, which the stream agent's gap check reads)."""


def new_server() -> fakeredis.FakeServer:
    """One Redis for a whole simulated cluster."""
    return fakeredis.FakeServer(version=VERSION)


def client(
    server: fakeredis.FakeServer, name: str, *, linked: bool = True, connection_class: type[TwinConnection] | None = None
) -> fakeredis.FakeAsyncRedis:
    """A client of ``server`` for the process ``name`` (its own pool, as each silo has);
    ``linked``: its commands pass the sender's link (in a simulation); ``connection_class``
    replaces both."""
    cls = connection_class or (LinkedConnection if linked else TwinConnection)
    return fakeredis.FakeAsyncRedis(server=server, host=f"sim-{name}", version=VERSION, connection_class=cls)
