"""The chaos soak: silo processes and clients under SIGKILL, SIGSTOP and Redis restarts.

Clients run bank transfers (sagas) and idempotent counter increments while a
chaos loop, one fault at a time, SIGKILLs and restarts silos, SIGSTOPs and
resumes them, and kills Redis (AOF, ``appendfsync always``) and starts it
again. Afterwards the cluster is healed, unfinished transfers are run to
completion, and the invariants are checked (see :func:`check_invariants` and
docs/reliability.md). The result is a :class:`SoakReport`; its
``violations`` must be empty.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter as Tally
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from silo import errors
from silo.client import ClusterClient
from silo.cluster.membership import RedisMembershipTable
from silo.codec import Codec, TypeRegistry
from silo.keys import Keys
from silo.messaging.frame import REQUEST
from silo.messaging.transport import Transport
from silo.records.membership import SiloStatus
from silo.settings import TransportSettings
from silo.testing.embedded import RedisServer
from tests.chaos.grains import (
    INITIAL_BALANCE,
    ChaosAccount,
    ChaosTransfer,
    OpCounter,
    activation_log_key,
)
from tests.conftest import FAST_ENV
from tests.helpers import SiloProcess

T = TypeVar("T")

# The errors a call may end with under chaos (docs/reliability.md). Anything
# else reaching a client is a violation.
DOCUMENTED = (
    errors.GrainTimeoutError,
    errors.SiloUnavailableError,  # includes SiloNotServingError
    errors.SiloClosedError,
    errors.GrainDeactivatedError,
    errors.OverloadedError,
    errors.StorageError,  # includes StateConflictError
)


@dataclass(frozen=True)
class SoakConfig:
    silos: int = 3
    chaos_s: float = 20.0
    """How long faults are injected; the run takes longer (start, heal, checks)."""
    call_timeout_s: float = 4.0
    slack_s: float = 3.0
    """How far past its deadline a call may be answered (a loaded 2-core box) before it counts."""
    accounts: int = 8
    counters: int = 8
    transfer_workers: int = 3
    counter_workers: int = 3
    fault_gap_s: tuple[float, float] = (1.0, 2.5)
    seed: int = 1


@dataclass
class SoakReport:
    duration_s: float = 0.0
    chaos_s: float = 0.0
    silos: int = 0
    kills: int = 0
    pauses: int = 0
    pauses_declared_dead: int = 0
    redis_restarts: int = 0
    silo_restarts: int = 0
    calls: int = 0
    calls_ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    slowest_call_s: float = 0.0
    transfers_done: int = 0
    transfers_rejected: int = 0
    increments_acked: int = 0
    accepted_writes_logged: int = 0
    activations_logged: int = 0
    violations: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)


class Soak:
    def __init__(
        self, cfg: SoakConfig, redis_server: RedisServer, cluster: str, workdir: Path
    ) -> None:
        self.cfg = cfg
        self.redis_server = redis_server
        self.url = redis_server.url
        self.cluster = cluster
        self.workdir = workdir
        self.rng = random.Random(cfg.seed)
        self.report = SoakReport(silos=cfg.silos)
        self.errors: Tally[str] = Tally()
        self.stop = asyncio.Event()
        self.procs: list[SiloProcess] = []
        self.pending_transfers: dict[str, tuple[str, str, int]] = {}
        self.transfer_outcome: dict[str, str] = {}
        self.acked: dict[str, set[str]] = {f"c{i}": set() for i in range(cfg.counters)}
        self.client: ClusterClient | None = None
        self.probe_transport = Transport(
            TransportSettings(connect_timeout_s=1.0), Codec(TypeRegistry())
        )

    def note(self, text: str) -> None:
        """A progress line in workdir/soak.log (what a hung or failed run was doing)."""
        with open(self.workdir / "soak.log", "a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} {text}\n")

    # --- setup ---------------------------------------------------------------
    def _new_proc(self) -> SiloProcess:
        env = {
            **FAST_ENV,
            "REDGRAIN_CHAOS_REDIS": self.url,
            "REDGRAIN_CHAOS_LOG": activation_log_key(self.cluster),
        }
        return SiloProcess(
            self.url, self.cluster, self.workdir, grains="tests.chaos.grains", env=env
        )

    async def run(self) -> SoakReport:
        started = time.monotonic()
        self.procs = [self._new_proc() for _ in range(self.cfg.silos)]
        await asyncio.gather(*(asyncio.to_thread(p.start, 120.0) for p in self.procs))
        self.client = await ClusterClient.connect(self.url, cluster=self.cluster)
        try:
            workers = [
                asyncio.create_task(self._transfers(w)) for w in range(self.cfg.transfer_workers)
            ]
            workers += [
                asyncio.create_task(self._increments(w)) for w in range(self.cfg.counter_workers)
            ]
            chaos_start = time.monotonic()
            self.note("chaos")
            await self._chaos(chaos_start + self.cfg.chaos_s)
            self.note("stopping workers")
            self.stop.set()
            await asyncio.gather(*workers)
            self.report.chaos_s = round(time.monotonic() - chaos_start, 1)
            self.note("healing")
            await self._heal()
            await self._finish_transfers()
            self.note("checking invariants")
            await self.check_invariants()
            self.note("done")
        finally:
            await self.client.close()
            await self.probe_transport.close()
            for p in self.procs:
                if p.alive():
                    p.resume()
                    p.kill()
        self.report.errors = dict(self.errors)
        self.report.duration_s = round(time.monotonic() - started, 1)
        return self.report

    # --- clients ---------------------------------------------------------------
    async def _call(self, what: str, fn: Callable[[], Awaitable[T]]) -> T | BaseException:
        self.report.calls += 1
        t0 = time.monotonic()
        hung_after = self.cfg.call_timeout_s + self.cfg.slack_s + 10.0
        try:
            # Our own bound: a call the runtime never answers is a violation, not a hung soak.
            result: T | BaseException = await asyncio.wait_for(fn(), hung_after)
            self.report.calls_ok += 1
        except TimeoutError as exc:
            self.errors["never answered"] += 1
            self.report.violations.append(f"{what}: no answer at all within {hung_after:.0f}s")
            result = exc
        except DOCUMENTED as exc:
            self.errors[type(exc).__name__] += 1
            result = exc
        except Exception as exc:  # noqa: BLE001 - anything undocumented is what we are looking for
            self.errors[type(exc).__name__] += 1
            self.report.violations.append(
                f"{what}: undocumented error {type(exc).__name__}: {exc!s:.300}"
            )
            result = exc
        elapsed = time.monotonic() - t0
        self.report.slowest_call_s = max(self.report.slowest_call_s, round(elapsed, 2))
        if elapsed > self.cfg.call_timeout_s + self.cfg.slack_s:
            self.report.violations.append(
                f"{what}: answered after {elapsed:.1f}s, deadline {self.cfg.call_timeout_s}s "
                f"(+{self.cfg.slack_s}s slack); outcome {result!r:.200}"
            )
        return result

    async def _transfers(self, worker: int) -> None:
        assert self.client is not None
        i = 0
        while not self.stop.is_set():
            i += 1
            tx = f"tx-{worker}-{i}"
            a, b = self.rng.sample(range(self.cfg.accounts), 2)
            args = (f"a{a}", f"a{b}", self.rng.randint(1, 400))
            self.pending_transfers[tx] = args
            ref = self.client.get_grain(ChaosTransfer, tx).with_timeout(self.cfg.call_timeout_s)
            out = await self._call(f"transfer {tx}", lambda ref=ref, args=args: ref.run(*args))
            if isinstance(out, str):
                self.transfer_outcome[tx] = out
                if out in ("done", "rejected"):
                    del self.pending_transfers[tx]
            else:
                await asyncio.sleep(0.05)

    async def _increments(self, worker: int) -> None:
        assert self.client is not None
        i = 0
        while not self.stop.is_set():
            i += 1
            op = f"op-{worker}-{i}"
            key = f"c{self.rng.randrange(self.cfg.counters)}"
            ref = self.client.get_grain(OpCounter, key).with_timeout(self.cfg.call_timeout_s)
            out = await self._call(f"add {key} {op}", lambda ref=ref, op=op: ref.add(op))
            if isinstance(out, int):
                self.acked[key].add(op)
                self.report.increments_acked += 1
            else:
                await asyncio.sleep(0.05)

    # --- faults ----------------------------------------------------------------
    async def _chaos(self, until: float) -> None:
        """Start a fault every few seconds; faults overlap, but at least two silos stay untouched."""
        faults: set[asyncio.Task[None]] = set()
        busy: set[int] = set()
        redis_busy = False
        plan: list[str] = []

        async def on_silo(fault: Callable[[SiloProcess], Awaitable[None]], i: int) -> None:
            try:
                await fault(self.procs[i])
            finally:
                busy.discard(i)

        async def on_redis() -> None:
            nonlocal redis_busy
            try:
                await self._restart_redis()
            finally:
                redis_busy = False

        while time.monotonic() < until:
            await asyncio.sleep(self.rng.uniform(*self.cfg.fault_gap_s))
            if time.monotonic() >= until:
                break
            free = [i for i in range(len(self.procs)) if i not in busy]
            if not plan:
                # Every round has each kind of fault, in a random order; pauses
                # alternate short (may go unnoticed) and long (declared dead).
                plan = ["kill", "pause-short", "pause-long", "redis"]
                self.rng.shuffle(plan)
            kind = plan.pop()
            if kind == "redis":
                if redis_busy:
                    plan.insert(0, kind)  # later, not never
                    continue
                redis_busy = True
                task = asyncio.create_task(on_redis())
            else:
                if len(free) <= 2:
                    plan.insert(0, kind)
                    continue
                i = self.rng.choice(free)
                busy.add(i)
                fault = {
                    "kill": self._kill,
                    "pause-short": self._pause_short,
                    "pause-long": self._pause_long,
                }[kind]
                task = asyncio.create_task(on_silo(fault, i))
            self.note(f"fault {kind} (silos under a fault: {sorted(busy)})")
            faults.add(task)
            task.add_done_callback(faults.discard)
        await asyncio.gather(*faults)

    async def _kill(self, victim: SiloProcess) -> None:
        await asyncio.to_thread(victim.kill)
        self.report.kills += 1
        await asyncio.sleep(self.rng.uniform(0.2, 1.5))
        await self._start(victim)

    async def _start(self, proc: SiloProcess) -> None:
        for _ in range(4):
            try:
                await asyncio.to_thread(proc.start, 45.0)
                self.report.silo_restarts += 1
                return
            except (RuntimeError, TimeoutError):
                await asyncio.sleep(0.5)  # Redis was down while it started: try again
        self.report.violations.append(f"silo {proc.address} could not be restarted")

    async def _pause_short(self, victim: SiloProcess) -> None:
        await self._pause(victim, self.rng.uniform(0.2, 1.0))

    async def _pause_long(self, victim: SiloProcess) -> None:
        await self._pause(victim, self.rng.uniform(2.5, 4.0))

    async def _pause(self, victim: SiloProcess, seconds: float) -> None:
        address = victim.address
        victim.pause()
        self.report.pauses += 1
        await asyncio.sleep(seconds)
        victim.resume()
        await self._check_not_serving_if_dead(victim, str(address))

    async def _restart_redis(self) -> None:
        await asyncio.to_thread(self.redis_server.kill)
        await asyncio.sleep(self.rng.uniform(0.2, 1.5))
        await asyncio.to_thread(self.redis_server.start)
        self.report.redis_restarts += 1

    async def _status(self, address: str) -> SiloStatus | None:
        assert self.client is not None
        for _ in range(20):
            try:
                _, rows = await RedisMembershipTable(
                    self.client.redis, Keys(self.cluster)
                ).read_all()
                row = rows.get(address)
                return row.status if row is not None else None
            except errors.StorageError:
                await asyncio.sleep(0.25)
        return None

    async def _check_not_serving_if_dead(self, proc: SiloProcess, address: str) -> None:
        """A resumed silo the cluster declared dead must exit or refuse calls, never answer one."""
        if await self._status(address) is not SiloStatus.DEAD:
            return
        self.report.pauses_declared_dead += 1
        endpoint = address.rpartition("@")[0]
        try:
            conn = await self.probe_transport.connect(endpoint)
            answer = await conn.request(
                [REQUEST, 0, "ChaosProbe", "p", "ping", 2000, [], 0], (), 2.0
            )
        except errors.RedgrainError:
            answer = None  # refused, closed, not serving: all fine
        finally:
            self.probe_transport.drop(endpoint)
        if answer is not None:
            self.report.violations.append(
                f"silo {address} answered a call after it was declared dead"
            )
        deadline = time.monotonic() + 10.0
        while proc.alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)  # another process: nothing to await
        if proc.alive():
            self.report.violations.append(
                f"silo {address} still running 10 s after it was declared dead"
            )
            await asyncio.to_thread(proc.kill)
        await self._start(proc)

    # --- heal and check ----------------------------------------------------------
    async def _heal(self) -> None:
        if not self.redis_server.running:
            await asyncio.to_thread(self.redis_server.start)
        for p in self.procs:
            if p.alive():
                p.resume()
            else:
                await self._start(p)

    async def _retry(self, what: str, fn: Callable[[], Awaitable[T]], budget_s: float = 30.0) -> T:
        deadline = time.monotonic() + budget_s
        while True:
            try:
                return await asyncio.wait_for(
                    fn(), self.cfg.call_timeout_s + self.cfg.slack_s + 10.0
                )
            except (*DOCUMENTED, TimeoutError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)

    async def _finish_transfers(self) -> None:
        assert self.client is not None
        client = self.client
        self.note(f"finishing {len(self.pending_transfers)} transfers")
        limit = asyncio.Semaphore(8)

        async def finish(tx: str, args: tuple[str, str, int]) -> None:
            ref = client.get_grain(ChaosTransfer, tx).with_timeout(self.cfg.call_timeout_s)
            async with limit:
                try:
                    self.transfer_outcome[tx] = await self._retry(
                        f"finish {tx}", lambda: ref.run(*args)
                    )
                except (*DOCUMENTED, TimeoutError) as exc:
                    self.report.violations.append(
                        f"transfer {tx} could not be completed after the chaos: {exc!r:.200}"
                    )

        await asyncio.gather(*(finish(tx, a) for tx, a in list(self.pending_transfers.items())))
        outcomes = Tally(self.transfer_outcome.values())
        self.report.transfers_done = outcomes["done"]
        self.report.transfers_rejected = outcomes["rejected"]

    async def check_invariants(self) -> None:
        assert self.client is not None
        client, v = self.client, self.report.violations
        # 1. Money is neither made nor lost.
        balances = [
            await self._retry(
                "balance", lambda i=i: client.get_grain(ChaosAccount, f"a{i}").balance()
            )
            for i in range(self.cfg.accounts)
        ]
        if sum(balances) != self.cfg.accounts * INITIAL_BALANCE:
            v.append(
                f"total balance {sum(balances)} != {self.cfg.accounts * INITIAL_BALANCE} ({balances})"
            )
        # 2. Every acknowledged increment is there, exactly once.
        for key, acked in self.acked.items():
            ops = await self._retry("ops", lambda key=key: client.get_grain(OpCounter, key).ops())
            dupes = [op for op, n in Tally(ops).items() if n > 1]
            if dupes:
                v.append(f"counter {key}: operations applied twice: {dupes[:5]}")
            lost = acked - set(ops)
            if lost:
                v.append(
                    f"counter {key}: {len(lost)} acknowledged increments lost, e.g. {sorted(lost)[:5]}"
                )
        # 3. One activation at a time: accepted writes, ordered by the state's own
        #    sequence, come from activations that never interleave.
        await self._check_activation_log()

    async def _check_activation_log(self) -> None:
        assert self.client is not None
        redis, key = self.client.redis, activation_log_key(self.cluster)
        writes: dict[str, dict[int, set[str]]] = {}
        last = "-"
        while True:
            batch: list[Any] = await redis.xrange(key, min=last, max="+", count=10_000)
            if last != "-":
                batch = batch[1:]
            if not batch:
                break
            for _, raw in batch:
                f = {k.decode(): val.decode() for k, val in raw.items()}
                if f["event"] == "activate":
                    self.report.activations_logged += 1
                elif f["event"] == "write":
                    self.report.accepted_writes_logged += 1
                    writes.setdefault(f["grain"], {}).setdefault(int(f["seq"]), set()).add(f["act"])
            last = bytes(batch[-1][0]).decode()
        v = self.report.violations
        for grain, by_seq in writes.items():
            for seq, acts in by_seq.items():
                if len(acts) > 1:
                    v.append(
                        f"{grain}: write #{seq} accepted from {len(acts)} activations {sorted(acts)}"
                    )
            finished: set[str] = set()
            current = None
            for seq in sorted(by_seq):
                (act,) = sorted(by_seq[seq])[:1]
                if act != current:
                    if act in finished:
                        v.append(
                            f"{grain}: activation {act} wrote again (#{seq}) after another activation wrote"
                        )
                    if current is not None:
                        finished.add(current)
                    current = act


async def run_soak(
    cfg: SoakConfig, redis_server: RedisServer, cluster: str, workdir: Path
) -> SoakReport:
    return await Soak(cfg, redis_server, cluster, workdir).run()


def soak_redis(data_dir: Path) -> RedisServer:
    """Redis with AOF fsynced on every write, so a SIGKILLed Redis loses nothing it acknowledged."""
    return RedisServer(appendonly=True, data_dir=data_dir, extra_args=("--appendfsync", "always"))


def summary(report: SoakReport) -> dict[str, Any]:
    return {k: v for k, v in asdict(report).items() if k != "violations"} | {
        "violations": len(report.violations)
    }
