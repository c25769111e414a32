"""The simulator's ``services`` scenario: reminders, timers and stream delivery on the fakeredis twin.

Through the command line, as tests/silo/testing/test_sim.py runs the other
scenarios (it fixes PYTHONHASHSEED itself). The long form is ``make sim``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.silo.testing.test_sim import REPO, _all_pass, _digest, _sim

# fakeredis and lupa are dev dependencies (`make install`): missing, these tests fail, not skip.


@pytest.mark.timeout(300)
def test_thirty_seeds_of_the_services_scenario_keep_every_promise() -> None:
    # 30, not 50: make test's 20 minutes (make sim runs 1,000 of them).
    _all_pass("1-30", 30, scenario="services", timeout=280)


@pytest.mark.timeout(120)
def test_a_services_seed_replays_to_the_same_digest() -> None:
    first = _sim("run", "--seeds", "1-2", "--scenario", "services")
    second = _sim("run", "--seeds", "1-2", "--scenario", "services")
    assert first.returncode == second.returncode == 0, first.stdout + first.stderr
    assert _digest(first.stdout) == _digest(second.stdout)


@pytest.mark.timeout(120)
def test_a_stream_holder_cut_from_redis_past_its_lease_stops_delivering() -> None:
    # Seed 90: a Redis cut outlasted the holder's lease of k1; another silo took the key and
    # read on, while the old holder, back, read and delivered one more item: the grain got
    # item 67 before 66. The agent now stops at a lease it could not renew (agent._leased).
    result = _sim("run", "--seeds", "90", "--scenario", "services")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


_MUTANTS = {
    # The ack schedules the next tick three periods on: reminders fall silent between.
    "reminder": ("silo/cluster/reminders.py", "local nxt = tonumber(ARGV[3]) + period\n", "local nxt = tonumber(ARGV[3]) + 3 * period\n"),
    # The agent acknowledges an item without delivering it.
    "stream": (
        "silo/streams/agent.py",
        "            delivered = await self._attempt(k, call, token, blob)\n",
        "            delivered = True\n",
    ),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("mutant", "invariant"), [("reminder", "reminder_ticks"), ("stream", "stream_delivered")])
def test_a_service_broken_on_purpose_fails_a_seed(mutant: str, invariant: str, tmp_path: Path) -> None:
    for package in ("silo", "grains"):
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    path, old, new = _MUTANTS[mutant]
    source = (tmp_path / path).read_text()
    assert old in source, f"the mutant's anchor moved: {path}"
    (tmp_path / path).write_text(source.replace(old, new))
    found = _sim("run", "--seeds", "1-20", "--scenario", "services", "--first-failure", cwd=tmp_path, timeout=200)
    assert found.returncode == 1, found.stdout[-3000:] + found.stderr[-3000:]
    assert f" FAIL {invariant}:" in found.stdout, found.stdout[-3000:]
