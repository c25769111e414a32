"""The deterministic simulator (silo/testing/sim): replay, the seeds CI runs, broken promises found.

Each run goes through the command line, as CI and a developer replaying a
seed use it (``python -m silo.testing.sim``): it fixes PYTHONHASHSEED itself,
which is part of what makes a seed replay in any process.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from silo import errors
from silo.testing.sim.checks import (
    History,
    Op,
    linearizable,
    one_way_delivered,
    one_way_order,
    single_writer,
)
from silo.testing.sim.runner import run_seed, scenario_for

REPO = Path(__file__).resolve().parents[3]


def _sim(*args: str, cwd: Path = REPO, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env["PYTHONPATH"] = os.pathsep.join([str(cwd), *filter(None, [os.environ.get("PYTHONPATH")])])
    return subprocess.run(
        [sys.executable, "-m", "silo.testing.sim", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def _all_pass(seeds: str, count: int, *, scenario: str | None = None, timeout: float = 180) -> str:
    """Runs ``seeds`` (of ``scenario``, or every scenario in turn) with 2 jobs and asserts all
    ``count`` kept every promise; the run's output."""
    which = ("--scenario", scenario) if scenario else ()
    result = _sim("run", "--seeds", seeds, *which, "--jobs", "2", timeout=timeout)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert f"{count} seeds, 0 failed" in result.stdout, result.stdout[-2000:]
    return result.stdout


def _digest(out: str) -> str:
    found = re.search(r"digest ([0-9a-f]{64})", out)
    assert found, out
    return found.group(1)


@pytest.mark.timeout(300)
def test_the_same_seeds_give_the_same_digest_in_two_processes_and_other_seeds_another() -> None:
    first, second = _sim("run", "--seeds", "1-6"), _sim("run", "--seeds", "1-6")
    assert first.returncode == second.returncode == 0, first.stdout + first.stderr
    assert _digest(first.stdout) == _digest(second.stdout)
    other = _sim("run", "--seeds", "7-12")
    assert other.returncode == 0, other.stdout + other.stderr
    assert _digest(other.stdout) != _digest(first.stdout)


def test_two_seeds_of_one_scenario_run_different_traces() -> None:
    scenario = scenario_for(0, "mixed")
    a, b = run_seed(3, scenario), run_seed(4, scenario)
    assert a.violation is None and b.violation is None
    assert a.digest != b.digest
    assert a.calls > 100 and b.calls > 100  # a real workload ran, not an empty world


@pytest.mark.timeout(400)
def test_two_hundred_seeds_across_every_scenario_keep_every_promise() -> None:
    started = time.monotonic()
    _all_pass("1-200", 200, timeout=380)
    print(f"200 seeds in {time.monotonic() - started:.1f} s")


# --- the simulator finds promises broken on purpose -------------------------------------------

_MUTANTS = {
    # The directory twin lets a second silo take a live owner's grain.
    "directory": ("silo/testing/directory.py", "            if self._is_alive(cur.silo):\n                return cur\n", ""),
    # The state twin accepts a fenced-off writer.
    "fence": (
        "silo/testing/store.py",
        'if (token and owner != token) or (not token and etag != "*" and owner):',
        "if False:",
    ),
    # Queued calls are dropped at deactivation instead of re-routed.
    "reroute": ("silo/catalog/catalog.py", "        if queued:\n            self.on_reroute(act, queued)", "        if queued:\n            pass"),
}


def _mutant(tmp_path: Path, edits: list[tuple[str, str, str]]) -> Path:
    """A copy of the code in ``tmp_path`` with each (path, old, new) edit made; an anchor that
    moved fails the test rather than leaving the promise unbroken."""
    for package in ("silo", "grains"):
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    for path, old, new in edits:
        source = (tmp_path / path).read_text()
        assert old in source, f"the mutant's anchor moved: {path}"
        (tmp_path / path).write_text(source.replace(old, new))
    return tmp_path


def _first_failure(cwd: Path, scenario: str, seeds: str = "1-40") -> str:
    """The FAIL line of the first failing seed of ``scenario`` (the test fails when none fails)."""
    found = _sim("run", "--seeds", seeds, "--scenario", scenario, "--first-failure", cwd=cwd, timeout=200)
    line = next((ln for ln in found.stdout.splitlines() if " FAIL " in ln), None)
    assert found.returncode == 1 and line is not None, found.stdout[-3000:]
    return line


@pytest.mark.timeout(420)
@pytest.mark.parametrize("mutant", sorted(_MUTANTS))
def test_a_promise_broken_on_purpose_fails_a_seed_whose_replay_fails_the_same_way(mutant: str, tmp_path: Path) -> None:
    _mutant(tmp_path, [_MUTANTS[mutant]])
    started = time.monotonic()
    found = _sim("run", "--seeds", "1-400", "--first-failure", cwd=tmp_path, timeout=200)
    took = time.monotonic() - started
    line = next((ln for ln in found.stdout.splitlines() if " FAIL " in ln), None)
    assert found.returncode == 1 and line is not None, found.stdout[-3000:] + found.stderr[-3000:]
    assert took < 150, f"found only after {took:.0f} s: {line}"
    seed, invariant = re.search(r"seed (\d+) FAIL (\w+):", line).groups()  # type: ignore[union-attr]
    # The fence is found within the first seeds: the zombie workload brings a zombie's write to
    # the store on most pause and mixed seeds (before it: ~1% of them, first at seed 40).
    assert mutant != "fence" or int(seed) <= 10, line
    replay = re.search(r"replay: python -m silo\.testing\.sim (run --seeds \d+ --scenario \w+)", line)
    assert replay is not None, line

    again = _sim(*replay.group(1).split(), cwd=tmp_path, timeout=120)
    assert again.returncode == 1
    assert f"seed {seed} FAIL {invariant}:" in again.stdout, again.stdout


@pytest.mark.timeout(200)
def test_twenty_four_seeds_of_the_results_scenario_keep_every_promise() -> None:
    _all_pass("1-24", 24, scenario="results", timeout=180)


@pytest.mark.timeout(300)
def test_a_cancel_that_never_reaches_the_generator_fails_a_results_seed(tmp_path: Path) -> None:
    # Leaving a stream early must stop its generator on the callee. The mutant drops what a
    # CANCEL does on the serving side, on the connection (the stream's sink) and in the
    # dispatcher (the turn): the generator then waits for credit that never comes.
    _mutant(tmp_path, [
        ("silo/messaging/connection.py", "if kind == CANCEL and self._served and", "if False and self._served and"),
        ("silo/messaging/dispatcher.py", ("                inv.cancelled = True\n                if inv.activation is not None:\n"
                                          "                    inv.activation.cancel_call(inv)\n"), "                pass\n"),
    ])  # fmt: skip
    line = _first_failure(tmp_path, "results")
    assert "FAIL stream_results:" in line, line
    assert "still runs on" in line, line
    seed = re.search(r"seed (\d+) FAIL", line).group(1)  # type: ignore[union-attr]
    again = _sim("run", "--seeds", seed, "--scenario", "results", cwd=tmp_path, timeout=120)
    assert again.returncode == 1 and f"seed {seed} FAIL stream_results:" in again.stdout, again.stdout


@pytest.mark.timeout(300)
def test_an_observer_call_sent_twice_fails_a_results_seed(tmp_path: Path) -> None:
    # An observer call is not retried: its handler runs at most once. The mutant sends every
    # call to a client's observer twice, as a retry after an unknown outcome would.
    old = "        if back is not None:\n            return await self._send(back, key, method, args, kwargs, deadline, one_way, 0)\n"
    _mutant(tmp_path, [("silo/messaging/observer_hub.py", old, old.replace("return await", "await") + old.split("\n", 1)[1])])
    line = _first_failure(tmp_path, "results")
    assert "FAIL observer_notes:" in line, line
    assert "twice" in line, line


@pytest.mark.timeout(200)
def test_twenty_four_seeds_of_the_versions_scenario_keep_every_promise() -> None:
    _all_pass("1-24", 24, scenario="versions", timeout=180)


@pytest.mark.timeout(300)
def test_an_old_version_that_drops_fields_it_does_not_know_fails_a_versions_seed(tmp_path: Path) -> None:
    # Issue 36's rolling-upgrade loss as a mutant: a version-1 activation writes its state
    # without the tag version 2 stored, and the tag's register loses acknowledged writes.
    old = "        if extra:\n            fields.update(extra)\n"
    _mutant(tmp_path, [("silo/catalog/state.py", old, old.replace("if extra:", "if False:"))])
    line = _first_failure(tmp_path, "versions")
    assert "FAIL linearizable: register ver" in line, line
    assert "#tag" in line, line


# --- the checkers on histories written by hand ------------------------------------------------


def _op(method: str, arg: object, start: float, end: float | None, result: object = None, ok: bool = True) -> Op:
    return Op("c", "g", method, arg, start, 5.0, end, ok, result if method == "read" else arg)


def test_the_linearizability_check_accepts_overlapping_operations_and_refuses_a_lost_write() -> None:
    overlapping = History(ops=[_op("write", 1, 0, 2), _op("read", None, 1, 3, result=1), _op("read", None, 1, 1.5, result=0)])
    assert linearizable(overlapping) is None
    lost = History(ops=[_op("write", 1, 0, 1), _op("write", 2, 2, 3), _op("read", None, 4, 5, result=1)])
    found = linearizable(lost)
    assert found is not None and found.invariant == "linearizable"
    # A write whose outcome is unknown may have happened after all: a read may see it.
    unknown = History(ops=[_op("write", 1, 0, 1), _op("write", 2, 2, None, ok=False), _op("read", None, 4, 5, result=2)])
    assert linearizable(unknown) is None


def test_the_fencing_check_refuses_a_write_from_a_token_the_directory_no_longer_names() -> None:
    assert single_writer(History(writes=[(1.0, "g", 3, 3), (2.0, "g", 4, 4)])) is None
    found = single_writer(History(writes=[(1.0, "g", 3, 3), (2.0, "g", 3, 4)]))
    assert found is not None and "token 3" in found.detail


def test_the_streamed_results_check_refuses_reordered_short_or_late_streams_and_left_generators() -> None:
    from silo.testing.sim.checks import StreamOp, stream_results

    def history(op: StreamOp, left: list[tuple[str, str]] | None = None) -> History:
        return History(streams=[op], generators_left=left or [])

    whole = StreamOp("c", "s", 3, None, 0.0, 5.0, [0, 1, 2], [0.1, 0.2, 0.3], 0.3)
    assert stream_results(history(whole)) is None
    assert stream_results(history(StreamOp("c", "s", 3, 2, 0.0, 5.0, [0, 1], [0.1, 0.2], 0.2))) is None
    failed = StreamOp("c", "s", 3, None, 0.0, 5.0, [0], [0.1], 0.2, "SiloUnavailableError: gone")
    assert stream_results(history(failed)) is None
    for bad in (
        StreamOp("c", "s", 3, None, 0.0, 5.0, [0, 2, 1], [0.1, 0.2, 0.3], 0.3),  # out of order
        StreamOp("c", "s", 3, None, 0.0, 5.0, [0, 0, 1], [0.1, 0.2, 0.3], 0.3),  # an item twice
        StreamOp("c", "s", 3, None, 0.0, 5.0, [0, 1], [0.1, 0.2], 0.3),  # short, yet no error
        StreamOp("c", "s", 3, None, 0.0, 5.0, [0, 1, 2], [0.1, 7.0, 7.1], 7.1),  # a step past its deadline
    ):
        found = stream_results(history(bad))
        assert found is not None and found.invariant == "stream_results", bad
    left = stream_results(history(whole, [("s", "s1.1")]))
    assert left is not None and "still runs on s1.1" in left.detail


def test_the_observer_check_refuses_a_handler_run_twice_or_an_answer_nobody_received() -> None:
    from silo.testing.sim.checks import observer_notes

    assert observer_notes(History(notes=[("c0", 1), ("c1", 1)], said=[(1, ["c0", "c1"])])) is None
    twice = observer_notes(History(notes=[("c0", 1), ("c0", 1)]))
    assert twice is not None and "twice" in twice.detail
    phantom = observer_notes(History(notes=[("c0", 1)], said=[(1, ["c0", "c1"])]))
    assert phantom is not None and "never ran" in phantom.detail


def test_one_way_order_allows_an_overtaking_only_across_a_fault_or_a_new_activation() -> None:
    h = History(applied=[("g", 1, "c", 2), ("g", 1, "c", 1)], applied_at=[1.0, 2.0], sent={("c", 1): 0.5, ("c", 2): 0.6})
    assert one_way_order(h) is not None
    h.disruptions.append(1.5)
    assert one_way_order(h) is None


def test_one_way_delivered_allows_only_counted_losses_and_only_without_faults() -> None:
    h = History(applied=[("g", 1, "c", 1)], applied_at=[1.0], sent={("c", 1): 0.5, ("c", 2): 0.6, ("c", 3): 0.7})
    found = one_way_delivered(h)
    assert found is not None and "2 one-way calls never ran and 0 were counted lost" in found.detail
    h.one_way_counted = 1
    assert one_way_delivered(h) is not None  # one counted, two missing: one went silently
    h.one_way_counted = 2
    assert one_way_delivered(h) is None
    assert one_way_delivered(History(sent={("c", 1): 0.5}, faults=1)) is None  # a fault may lose it uncounted


def test_the_shed_scenario_finds_one_way_calls_shed_without_being_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue 36's first defect, as a mutant: the callee sheds a one-way call and nobody counts it.
    from silo.messaging import dispatcher

    counted = dispatcher.Dispatcher.one_way_failed

    def silent_on_shed(self: Any, label: str, peer: str, exc: BaseException) -> None:
        if not isinstance(exc, errors.LoadShedError):
            counted(self, label, peer, exc)

    monkeypatch.setattr(dispatcher.Dispatcher, "one_way_failed", silent_on_shed)
    out = run_seed(9, scenario_for(9, "shed"))
    assert out.violation is not None and out.violation.invariant == "one_way_delivered", out.violation
    monkeypatch.undo()
    assert run_seed(9, scenario_for(9, "shed")).violation is None


def test_a_silo_that_stops_with_a_connection_open_fails_no_connection_left(monkeypatch: pytest.MonkeyPatch) -> None:
    # A mutant of Transport.close that closes the connections it opened but not those it
    # accepted: another silo's connection to the stopped one stays open on its side.
    from silo.messaging.transport import Transport

    async def close_outbound_only(self: Transport) -> None:
        self.closed = True
        for conn in self._out.values():
            conn.close()
        self._out.clear()

    monkeypatch.setattr(Transport, "close", close_outbound_only)
    out = run_seed(3, scenario_for(3, "calls"))
    assert out.violation is not None and out.violation.invariant == "no_connection_left", out.violation
    assert "stopped with a connection still open" in out.violation.detail
    monkeypatch.undo()
    assert run_seed(3, scenario_for(3, "calls")).violation is None


# --- defects the simulator found, kept as seeds ------------------------------------------------


@pytest.mark.parametrize(
    ("seed", "scenario"),
    [
        # A deactivation that emptied the mailbox itself waited its whole timeout (10 s) for an
        # idle signal that never came: the re-routed calls timed out. (The other defect it found,
        # a read served from memory after a failed state write, is pinned down without the
        # simulator: tests/silo/catalog/test_failed_write.py.)
        (1, "churn"),
    ],
)
def test_seeds_that_found_defects_replay_clean(seed: int, scenario: str) -> None:
    out = run_seed(seed, scenario_for(seed, scenario))
    assert out.violation is None, str(out.violation)


@pytest.mark.timeout(300)
def test_scale_on_virtual_time_declares_the_killed_silos_dead_and_no_other() -> None:
    result = _sim("scale", "--silos", "60", "--kill", "2", timeout=280)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "false deaths 0" in result.stdout
    times = [float(t) for t in re.findall(r"detected in ([0-9.]+) s", result.stdout)]
    assert len(times) == 2 and all(t < 10 for t in times), result.stdout
    per_silo = float(re.search(r"commands per silo per second ([0-9.]+)", result.stdout).group(1))  # type: ignore[union-attr]
    assert per_silo > 0


def test_tasks_of_names_an_owners_unfinished_tasks_in_the_order_made_after_thousands_finished() -> None:
    import asyncio
    import contextvars
    import random

    from silo.testing.sim.loop import SILO, SimLoop

    loop = SimLoop(random.Random(1))

    async def main() -> list[str]:
        gate = asyncio.Event()

        async def wait(tag: str) -> str:
            await gate.wait()
            return tag

        async def done() -> None:
            pass

        def ctx(owner: str) -> contextvars.Context:
            c = contextvars.copy_context()
            c.run(SILO.set, owner)
            return c

        waiting = []
        for i in range(3_000):  # enough finished tasks to prune the map more than once
            await loop.create_task(done(), context=ctx("a"))
            if i % 1_000 == 0:
                waiting.append(loop.create_task(wait(f"a{i}"), context=ctx("a")))
                loop.create_task(wait(f"b{i}"), context=ctx("b"))
        await asyncio.sleep(0)
        names = [t.get_coro().cr_frame.f_locals["tag"] for t in loop.tasks_of("a")]  # type: ignore[union-attr]
        gate.set()
        await asyncio.gather(*waiting)
        assert loop.tasks_of("a") == []
        return names

    try:
        assert loop.run_until_complete(main()) == ["a0", "a1000", "a2000"]
    finally:
        for task in asyncio.all_tasks(loop):
            task.cancel()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()


def test_detectors_that_see_the_same_live_silos_share_one_ring_equal_to_the_real_one() -> None:
    from silo.cluster import failure_detector
    from silo.testing.sim.scale import _shared_rings

    real = failure_detector.Ring
    silos = [f"127.0.0.1:{20_000 + i}@{i}" for i in range(40)]
    with _shared_rings():
        a = failure_detector.Ring(silos, 10)
        b = failure_detector.Ring(list(reversed(silos)), 10)
        fewer = failure_detector.Ring(silos[1:], 10)
    assert a is b and fewer is not a
    for s in silos:
        assert a.successors(s) == real(silos, 10).successors(s)
        assert a.monitors(s) == real(silos, 10).monitors(s)
    assert failure_detector.Ring is real


# --- Redis failover and clock jumps (issue 40) -------------------------------------------------


def test_a_failover_loses_an_acknowledged_write_only_where_wait_was_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    # The promise (docs/reliability.md): a write whose WAIT the replica answered survives a
    # failover. A runtime acknowledging before the replica has the write breaks it, and the
    # failover scenario sees the lost write as a register with no linearization.
    from silo.testing.sim import replication

    async def no_wait(self: Any, replicated_at: float, grain: str) -> None:
        return None

    scenario = scenario_for(0, "failover")
    with monkeypatch.context() as m:
        m.setattr(replication.Replication, "wait", no_wait)
        found = next((seed for seed in range(1, 41) if run_seed(seed, scenario).violation is not None), None)
    assert found is not None, "acknowledging before the replica has the write lost nothing in 40 seeds"
    kept = run_seed(found, scenario)
    assert kept.violation is None and kept.failovers >= 1, kept


def _world_run(seed: int, scenario: str, faults: list[Any]) -> tuple[Any, Any]:
    import asyncio
    import random

    from silo.testing.sim.loop import SimLoop
    from silo.testing.sim.runner import deterministic
    from silo.testing.sim.world import World

    with deterministic(seed):
        loop = SimLoop(random.Random(seed ^ 0x5EED))
        try:
            world = World(seed, scenario_for(seed, scenario), loop, faults=faults)
            return world, loop.run_until_complete(world.run())
        finally:
            for task in asyncio.all_tasks(loop):
                task.cancel()
            loop.run_until_complete(asyncio.sleep(0))
            loop.close()


def test_a_silo_whose_wall_clock_jumped_back_a_minute_rejoins_and_is_not_declared_dead() -> None:
    from silo.testing.sim.world import Fault

    # s1's machine's clock steps back 60 s, then s1 crashes and restarts: the new process stamps
    # its membership row with that clock (as silo/silo.py does with time.time), a minute behind
    # Redis'. Its monitors must judge it by its beats, not by that stamp.
    faults = [Fault(1.0, "clock_jump", 1, length_s=-60.0), Fault(2.0, "crash", 1)]
    world, out = _world_run(5, "crash", faults)
    assert out.violation is None, str(out.violation)
    restarted = world.silos[1]
    row = world.membership.rows[str(restarted.address)]
    assert row.started < 1_000.0 + 2.0 - 50.0  # the jump reached the join: stamped a minute behind
    # Before the run's end (when every silo stops and its row turns Dead): only the crashed process died.
    died = {a for a, at in world.membership.dead_at.items() if at < 1_000.0 + 20.0}
    assert died == {a for a in world.membership.dead_at if a.startswith("127.0.0.1:20001@")}, world.membership.dead_at
    assert str(restarted.address) not in died
