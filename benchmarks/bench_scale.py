"""Scale simulator: what N idle silos cost one Redis, and how fast a death is seen among them.

``python -m benchmarks scale [--quick] [--sizes 10,100,300,1000] [--window S] [--workers W]
[--real 3,12]``

N lightweight silos, many per process (``--workers`` processes, asyncio, no
grain work), each running the real membership code (``RedisMembershipTable``:
join, status, the heartbeat script every ``heartbeat_s``), a real
``MembershipView`` (pub/sub, change feed, load sample), a real
``FailureDetector`` probing its ring successors over real TCP (each silo
listens on a socket of its own and answers a one-byte ping; a pooled
connection per target, as the transport pools them), a real
``StatsPublisher`` and real directory registrations, over a redis-server the
benchmark starts itself. What is not real: the heartbeat runs on the event
loop instead of a thread with its own connection (a thousand threads would
measure the GIL), and the probe is a one-byte echo, not the transport's PING
frame.

Per N, over ``--window`` seconds of idleness: Redis commands/s
(``total_commands_processed``), egress bytes/s (``total_net_output_bytes``),
both per silo, Redis CPU, the simulator's CPU per silo, and the detector
rounds each silo achieved (4/s intended: fewer means the machine, not the
design, is the limit). Then one silo's listener and heartbeat are killed and
the time until its row reads Dead is measured (the fast path: a refused
connection). ``--real 3,12`` measures idle egress per silo with real
``python -m silo`` processes too. At the end a cost model extrapolates the
per-silo figures to 1,000 and 5,000 silos and sets them beside today's
(issue 27: 4 whole-table reads a second per silo).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from typing import Any

import psutil

from benchmarks.census import print_census
from benchmarks.common import (
    FIXED_THREADS,
    REPO,
    machine_facts,
    print_header,
    print_table,
    write_result,
)

ROW_BYTES_TODAY = 339
"""A membership row as issue 27 measured it (with load)."""
TODAY_PER_SILO = {"commands_s": 36.0, "egress_base_b_s": 2200.0}
"""Issue 27, measured with the code before this change: commands per idle silo, egress with one silo."""


# --- one process of simulated silos -----------------------------------------------------------


class _Pool:
    """One TCP connection per target endpoint for the whole process; a ping is one byte each way."""

    def __init__(self) -> None:
        self._conns: dict[str, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def probe(self, silo: Any, timeout_s: float) -> Any:
        from silo.cluster.failure_detector import ProbeResult, handshake

        ep = silo.endpoint
        lock = self._locks.setdefault(ep, asyncio.Lock())
        async with lock:
            for _ in range(2):
                conn = self._conns.get(ep)
                if conn is None:
                    host, _, port = ep.rpartition(":")
                    try:
                        conn = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout_s)
                    except (ConnectionRefusedError, ConnectionResetError):
                        return ProbeResult.REFUSED
                    except (OSError, TimeoutError):
                        return await handshake(ep, timeout_s)
                    self._conns[ep] = conn
                reader, writer = conn
                try:
                    writer.write(b"p")
                    await writer.drain()
                    got = await asyncio.wait_for(reader.read(1), timeout_s)
                except TimeoutError:
                    return ProbeResult.TIMEOUT
                except OSError:
                    got = b""
                if got == b"p":
                    return ProbeResult.OK
                self._conns.pop(ep, None)  # closed under us: one fresh connection, then refused
                writer.close()
            return ProbeResult.REFUSED


class SimSilo:
    def __init__(self, redis: Any, keys: Any, settings: Any, pool: _Pool, grains: int) -> None:
        self.redis, self.keys, self.settings, self.pool, self.grains = redis, keys, settings, pool, grains
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: list[asyncio.Task[None]] = []

    async def _echo(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while data := await reader.read(64):
                writer.write(data)
        except OSError:
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def start(self) -> None:
        from grains.ids import GrainId, SiloAddress
        from silo.cluster.directory import RedisGrainDirectory
        from silo.cluster.events import ClusterEvents
        from silo.cluster.failure_detector import FailureDetector
        from silo.cluster.membership import RedisMembershipTable
        from silo.cluster.view import MembershipView
        from silo.records.membership import MemberRow, SiloLoad, SiloStatus
        from silo.stats import StatsPublisher

        s = self.settings
        self.server = await asyncio.start_server(self._echo, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.table = RedisMembershipTable(self.redis, self.keys)
        gen = await self.table.new_generation()
        self.address = SiloAddress("127.0.0.1", port, gen)
        now = time.time()
        await self.table.join(
            MemberRow(
                address=str(self.address), host="127.0.0.1", port=port, generation=gen, started=now,
                heartbeat=now, pid=os.getpid(), hostname="sim", grain_types=["sim.Counter", "sim.Echo"],
            )
        )  # fmt: skip
        # Beating from the join on, as a silo's thread does from start: a slow start (hundreds of
        # silos starting on two cores) must not look like a dead one to its monitors.
        self.load = SiloLoad(activations=self.grains)
        self._tasks.append(asyncio.get_running_loop().create_task(self._heartbeat()))
        self.view = MembershipView(
            self.table, redis=self.redis, keys=self.keys, refresh_s=s.refresh_s, load_sample=s.load_sample
        )
        await self.view.start()
        directory = RedisGrainDirectory(self.redis, self.keys, cache_size=0)
        for i in range(self.grains):
            await directory.register(GrainId("sim.Counter", f"{port}-{i}"), self.address, f"a{i}")
        self.detector = FailureDetector(
            table=self.table, me=self.address, settings=s, probe=self.pool.probe, events=ClusterEvents()
        )
        self.view.on_change(lambda old, new: self.detector.membership_changed())  # as a silo wires it
        await self.table.set_status(str(self.address), SiloStatus.ACTIVE)
        self.stats = StatsPublisher(
            self.redis, self.keys, str(self.address),
            lambda: {"membership": self.view.statistics(), "failure_detector": self.detector.statistics()},
            status=lambda: "Active", started=now, gpus=list,
        )  # fmt: skip
        self.detector.start()
        self.stats.start()

    async def _heartbeat(self) -> None:
        while True:
            await self.table.heartbeat(str(self.address), time.time(), self.load)
            await asyncio.sleep(self.settings.heartbeat_s)

    async def kill(self) -> None:
        """As a SIGKILL looks from outside: the port refuses, the heartbeat stops."""
        self.server.close()
        for w in list(self._writers):
            w.transport.abort()
        for t in self._tasks:
            t.cancel()
        self.stats.stop_nowait()
        await self.detector.stop()
        await self.view.stop()


async def _worker(url: str, cluster: str, count: int, grains: int, settings_json: str) -> None:
    from silo.keys import Keys
    from silo.redis_util import connect_redis
    from silo.settings import MembershipSettings

    settings = MembershipSettings.model_validate_json(settings_json)
    keys = Keys(cluster)
    pool = _Pool()
    # A Redis client (connection pool) each, as each silo process has: a view's subscription
    # holds a connection of its own, so one shared pool would run dry.
    silos = [SimSilo(connect_redis(url), keys, settings, pool, grains) for _ in range(count)]
    for i in range(0, len(silos), 25):  # in batches: each join wakes every view, so fewer waves
        await asyncio.gather(*(s.start() for s in silos[i : i + 25]))
    _say({"ready": [str(s.address) for s in silos]})
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        cmd = json.loads(line)
        if cmd["op"] == "kill":
            victim = next(s for s in silos if str(s.address) == cmd["address"])
            await victim.kill()
            _say({"killed": cmd["address"]})
        elif cmd["op"] == "rounds":
            _say({"rounds": sum(s.detector.rounds for s in silos), "probes": sum(s.detector.probes for s in silos)})
        elif cmd["op"] == "stop":
            break
    os._exit(0)  # thousands of sockets and tasks: nothing to flush, no need to unwind them


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


# --- the driver -------------------------------------------------------------------------------


class Workers:
    def __init__(self, url: str, cluster: str, n: int, workers: int, grains: int, settings: Any) -> None:
        env = {**os.environ, **FIXED_THREADS, "PYTHONPATH": str(REPO)}
        counts = [n // workers + (1 if i < n % workers else 0) for i in range(workers)]
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-m", "benchmarks.bench_scale", "worker", url, cluster, str(c), str(grains),
                 settings.model_dump_json()],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO,
            )
            for c in counts
            if c
        ]
        try:
            self.addresses: list[list[str]] = [json.loads(self._read(p))["ready"] for p in self.procs]
        except BaseException:
            self.stop()
            raise
        self.ps = [psutil.Process(p.pid) for p in self.procs]

    @staticmethod
    def _read(p: subprocess.Popen[str]) -> str:
        assert p.stdout is not None
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"simulator worker {p.pid} exited ({p.wait()})")
        return line

    def ask(self, i: int, op: dict[str, Any]) -> dict[str, Any]:
        p = self.procs[i]
        assert p.stdin is not None
        p.stdin.write(json.dumps(op) + "\n")
        p.stdin.flush()
        return dict(json.loads(self._read(p)))

    def cpu_s(self) -> float:
        return sum(sum(ps.cpu_times()[:2]) for ps in self.ps)

    def rounds(self) -> int:
        return sum(self.ask(i, {"op": "rounds"})["rounds"] for i in range(len(self.procs)))

    def stop(self) -> None:
        for p in self.procs:
            try:
                assert p.stdin is not None
                p.stdin.write(json.dumps({"op": "stop"}) + "\n")
                p.stdin.flush()
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _redis_counters(r: Any) -> dict[str, float]:
    stats, cpu = r.info("stats"), r.info("cpu")
    return {
        "commands": float(stats["total_commands_processed"]),
        "egress": float(stats["total_net_output_bytes"]),
        "ingress": float(stats["total_net_input_bytes"]),
        "redis_cpu": float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]),
        "t": time.monotonic(),
    }


def _per_second(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    dt = b["t"] - a["t"]
    return {k: (b[k] - a[k]) / dt for k in a if k != "t"}


def _measure_sim(url: str, n: int, workers: int, window: float, settle: float, grains: int, settings: Any) -> dict[str, Any]:
    import redis as sync_redis

    r = sync_redis.Redis.from_url(url)
    r.flushall()
    t0 = time.monotonic()
    w = Workers(url, f"scale{n}", n, workers, grains, settings)
    started_s = time.monotonic() - t0
    try:
        time.sleep(settle)  # past the joins: every view caught up, every detector on the final ring
        rounds0, cpu0, c0 = w.rounds(), w.cpu_s(), _redis_counters(r)
        time.sleep(window)
        rounds1, cpu1, c1 = w.rounds(), w.cpu_s(), _redis_counters(r)
        rate = _per_second(c0, c1)
        dt = c1["t"] - c0["t"]
        sim_cpu = (cpu1 - cpu0) / dt
        key = f"rg:{{scale{n}}}:members"
        false_dead = sum(json.loads(raw)["status"] == "Dead" for raw in r.hvals(key))
        victim_worker = random.randrange(len(w.procs))
        victim = random.choice(w.addresses[victim_worker])
        t_kill = time.monotonic()
        w.ask(victim_worker, {"op": "kill", "address": victim})
        detected: float | None = None
        while time.monotonic() - t_kill < 30:
            raw = r.hget(key, victim)
            if raw and json.loads(raw)["status"] == "Dead":
                detected = time.monotonic() - t_kill
                break
            time.sleep(0.01)
    finally:
        w.stop()
    return {
        "n": n,
        "workers": len(w.procs),
        "start_s": round(started_s, 1),
        "commands_per_s": rate["commands"],
        "commands_per_silo_s": rate["commands"] / n,
        "egress_per_s": rate["egress"],
        "egress_per_silo_b_s": rate["egress"] / n,
        "ingress_per_silo_b_s": rate["ingress"] / n,
        "redis_cpu": rate["redis_cpu"],
        "sim_cpu": sim_cpu,
        "sim_cpu_per_silo": sim_cpu / n,
        "rounds_per_silo_s": (rounds1 - rounds0) / dt / n,
        "detect_s": detected,
        "false_dead": false_dead,
    }


def _measure_real(n: int, window: float, settle: float, census_s: float) -> dict[str, Any]:
    """Idle cost per silo with ``n`` real ``python -m silo`` processes (default settings): Redis
    commands (``INFO commandstats`` over ``window``), bytes, CPU, then who sends what (a
    ``census_s`` MONITOR census, benchmarks/census.py)."""
    import redis as sync_redis

    from benchmarks.census import census, commandstats_total
    from benchmarks.common import BenchCluster

    with BenchCluster(n, cluster=f"real{n}") as cluster:
        r = sync_redis.Redis.from_url(cluster.redis_url)
        time.sleep(settle)
        r.config_resetstat()
        c0 = _redis_counters(r)
        cpu0 = sum(sum(psutil.Process(s.pid).cpu_times()[:2]) for s in cluster.silos if s.pid)
        time.sleep(window)
        c1 = _redis_counters(r)
        stats = commandstats_total(r.info("commandstats"))
        cpu1 = sum(sum(psutil.Process(s.pid).cpu_times()[:2]) for s in cluster.silos if s.pid)
        who = census(cluster.redis_url, census_s).per_silo_s(n) if census_s > 0 else []
    rate = _per_second(c0, c1)
    return {
        "n": n,
        "commands_per_silo_s": rate["commands"] / n,
        "commandstats_per_silo_s": stats / (c1["t"] - c0["t"]) / n,
        "census": who,
        "egress_per_silo_b_s": rate["egress"] / n,
        "ingress_per_silo_b_s": rate["ingress"] / n,
        "cpu_per_silo": (cpu1 - cpu0) / (c1["t"] - c0["t"]) / n,
    }


def cost_model(rows: list[dict[str, Any]], settings: Any) -> list[dict[str, Any]]:
    """Extrapolate the largest measured size's per-silo figures (flat in n by design) to 1,000 and
    5,000 silos, and set today's per-silo cost beside them (issue 27: each idle silo reads the
    whole table 4×/s, egress ≈ 2.2 kB/s + 4.5 × n × 339 B/s)."""
    # The largest size the machine ran at (nearly) the intended rate: past it the simulator's
    # rounds slow down, and so would the per-silo figures, flattering the model.
    full = 0.85 / settings.probe_interval_s
    base = max((r for r in rows if r["rounds_per_silo_s"] >= full), key=lambda r: r["n"], default=None)
    base = base or max(rows, key=lambda r: r["n"])
    cpu_per_cmd = base["redis_cpu"] / base["commands_per_s"] if base["commands_per_s"] else 0.0
    out = []
    for n in (1000, 5000):
        cmds = base["commands_per_silo_s"] * n
        egress = base["egress_per_silo_b_s"] * n
        today_egress_silo = TODAY_PER_SILO["egress_base_b_s"] + 4.5 * n * ROW_BYTES_TODAY
        out.append(
            {
                "n": n,
                "from_n": base["n"],
                "commands_per_s": cmds,
                "egress_per_silo_b_s": base["egress_per_silo_b_s"],
                "egress_total_mb_s": egress / 1e6,
                "redis_cpu": cmds * cpu_per_cmd,
                "probes_per_s": n * min(settings.monitors, n - 1) / settings.probe_interval_s,
                "today_egress_per_silo_b_s": today_egress_silo,
                "today_egress_total_mb_s": today_egress_silo * n / 1e6,
                "today_probes_per_s": n * (n - 1) / settings.probe_interval_s,
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    if argv and argv[0] == "worker":
        url, cluster, count, grains, settings_json = argv[1:6]
        asyncio.run(_worker(url, cluster, int(count), int(grains), settings_json))
        return 0
    from silo.settings import MembershipSettings
    from silo.testing.embedded import RedisServer

    parser = argparse.ArgumentParser(prog="python -m benchmarks scale")
    parser.add_argument("--quick", action="store_true", help="10 and 30 silos, short windows (smoke test)")
    parser.add_argument("--sizes", default="10,100,300,1000", help="simulated silo counts")
    parser.add_argument("--window", type=float, default=10.0, help="seconds measured at each size")
    parser.add_argument("--workers", type=int, default=2, help="processes the simulated silos share")
    parser.add_argument("--grains", type=int, default=20, help="directory entries each simulated silo registers")
    parser.add_argument("--real", default="3,12", help="real silo process counts to measure ('' for none)")
    parser.add_argument("--census", type=float, default=5.0,
                        help="seconds of MONITOR per real size to tell which component sends what (0: none)")
    args = parser.parse_args(argv)
    sizes = [10, 30] if args.quick else [int(x) for x in args.sizes.split(",") if x]
    real_sizes = [] if args.quick else [int(x) for x in args.real.split(",") if x]
    window = 1.5 if args.quick else args.window
    settings = MembershipSettings()
    facts = machine_facts()
    print_header("scale: idle Redis cost per silo and failure detection, simulated silos", facts, args.quick)
    print(f"# default membership settings: monitors={settings.monitors}, probe_interval_s={settings.probe_interval_s}, "
          f"heartbeat_s={settings.heartbeat_s}, refresh_s={settings.refresh_s}, load_sample={settings.load_sample}; "
          f"{args.workers} simulator processes; window {window:.0f} s")  # fmt: skip
    rows: list[dict[str, Any]] = []
    stopped = ""
    with RedisServer() as server:
        for n in sizes:
            settle = max(3.0, n / 100)
            print(f"# {n} simulated silos ...", flush=True)
            try:
                row = _measure_sim(server.url, n, args.workers, window, settle, args.grains, settings)
            except (RuntimeError, OSError) as exc:
                stopped = f"stopped at {n} silos: {exc}"
                break
            rows.append(row)
            if row["rounds_per_silo_s"] < 0.5 / settings.probe_interval_s:
                stopped = (
                    f"stopped after {n} silos: the simulator's {args.workers} processes ran "
                    f"{row['rounds_per_silo_s']:.1f} detector rounds a silo a second of the 4 intended "
                    f"({row['sim_cpu']:.2f} CPUs busy on a {os.cpu_count()}-CPU machine): the machine, "
                    "not Redis, is the limit past here"
                )
                break
    real: list[dict[str, Any]] = []
    for n in real_sizes:
        print(f"# {n} real silo processes ...", flush=True)
        real.append(_measure_real(n, window, settle=8.0, census_s=args.census))
    print()
    print_table(
        ["silos", "cmds/s", "cmds/s/silo", "egress/silo", "ingress/silo", "Redis CPU", "sim CPU/silo",
         "rounds/s/silo", "kill -> Dead", "declared dead, alive"],
        [
            [r["n"], f"{r['commands_per_s']:,.0f}", f"{r['commands_per_silo_s']:.1f}",
             f"{r['egress_per_silo_b_s']:,.0f} B/s", f"{r['ingress_per_silo_b_s']:,.0f} B/s",
             f"{100 * r['redis_cpu']:.1f}%", f"{1000 * r['sim_cpu_per_silo']:.1f} ms/s",
             f"{r['rounds_per_silo_s']:.2f}", "-" if r["detect_s"] is None else f"{r['detect_s']:.2f} s",
             r["false_dead"]]
            for r in rows
        ],
    )  # fmt: skip
    if stopped:
        print(f"# {stopped}")
    smallest = min(rows, key=lambda r: r["n"]) if rows else None
    checks: dict[str, Any] = {}
    for big in sorted({300, max((r["n"] for r in rows), default=0)}):
        row = next((r for r in rows if r["n"] == big), None)
        if smallest and row and row is not smallest:
            k = row["egress_per_silo_b_s"] / smallest["egress_per_silo_b_s"]
            checks[f"egress_per_silo_{big}_vs_{smallest['n']}"] = k
            print(f"# idle egress per silo at {big} vs {smallest['n']} simulated silos: {k:.2f}x (must be within 1.5x)")
    if real:
        print()
        print_table(
            ["real silos", "cmds/s/silo", "commandstats/s/silo", "egress/silo", "ingress/silo", "CPU/silo"],
            [[r["n"], f"{r['commands_per_silo_s']:.1f}", f"{r['commandstats_per_silo_s']:.1f}",
              f"{r['egress_per_silo_b_s']:,.0f} B/s", f"{r['ingress_per_silo_b_s']:,.0f} B/s",
              f"{100 * r['cpu_per_silo']:.1f}%"] for r in real],
        )  # fmt: skip
        for r in real:
            if r["census"]:
                print(f"\n# who sends what, {r['n']} idle real silos ({args.census:.0f} s of MONITOR; commands/s per silo, "
                      "a script's inner commands charged to it):")  # fmt: skip
                print_census(r["census"])
        if len(real) >= 2:
            k = real[-1]["egress_per_silo_b_s"] / real[0]["egress_per_silo_b_s"]
            checks[f"real_egress_per_silo_{real[-1]['n']}_vs_{real[0]['n']}"] = k
            print(f"# idle egress per silo, {real[-1]['n']} vs {real[0]['n']} real silos: {k:.2f}x (must be within 1.5x)")
    model = cost_model(rows, settings) if rows else []
    if model:
        print()
        print(f"# cost model from the {model[0]['from_n']}-silo figures (per-silo cost flat in n; Redis CPU "
              "as measured there per command, a command of a script counted):")
        print_table(
            ["silos", "cmds/s", "egress/silo", "egress total", "Redis CPU", "probes/s",
             "today: egress/silo", "today: egress total", "today: probes/s"],
            [[m["n"], f"{m['commands_per_s']:,.0f}", f"{m['egress_per_silo_b_s']:,.0f} B/s",
              f"{m['egress_total_mb_s']:.1f} MB/s", f"{100 * m['redis_cpu']:.0f}%", f"{m['probes_per_s']:,.0f}",
              f"{m['today_egress_per_silo_b_s'] / 1e3:,.0f} kB/s", f"{m['today_egress_total_mb_s']:,.0f} MB/s",
              f"{m['today_probes_per_s']:,.0f}"] for m in model],
        )  # fmt: skip
    write_result(
        "scale",
        {"quick": args.quick, "machine": facts, "settings": settings.model_dump(), "window_s": window,
         "simulated": rows, "stopped": stopped, "real": real, "checks": checks, "model": model},
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
