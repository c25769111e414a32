"""The simulator's ``silo`` scenario: :class:`silo.silo.Silo` itself, every stage and service, on fakeredis.

Through the command line, as tests/silo/testing/test_sim.py runs the other
scenarios (it fixes PYTHONHASHSEED itself). The long form is ``make sim``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from silo.silo import Silo
from silo.testing.sim.runner import run_seed
from silo.testing.sim.world import SCENARIOS
from tests.silo.testing.test_sim import _all_pass, _digest, _first_failure, _mutant, _sim

# fakeredis and lupa are dev dependencies (`make install`): missing, these tests fail, not skip.


@pytest.mark.timeout(200)
def test_eight_seeds_of_the_silo_scenario_keep_every_promise() -> None:
    # With the replay test's seeds 3-4, seeds 1-10 in make test; make sim runs 1-500.
    _all_pass("1-2,5-10", 8, scenario="silo", timeout=180)


def _seed_digests(out: str) -> dict[str, str]:
    return dict(re.findall(r"seed (\d+) silo ok .* digest ([0-9a-f]{16})", out))


@pytest.mark.timeout(120)
def test_a_silo_seed_replays_to_the_same_digest_and_another_seed_does_not() -> None:
    first = _sim("run", "--seeds", "3-4", "--scenario", "silo", "-v")
    second = _sim("run", "--seeds", "3-4", "--scenario", "silo", "-v")
    assert first.returncode == second.returncode == 0, first.stdout + first.stderr
    assert _digest(first.stdout) == _digest(second.stdout)
    digests = _seed_digests(first.stdout)
    assert digests == _seed_digests(second.stdout) and digests["3"] != digests["4"], first.stdout


def test_the_silos_are_the_production_class_and_the_cluster_they_form_fails_over_and_rebalances() -> None:
    # Seed 7: two crashes; the survivors declare each dead, the rebalancer's leader purges its
    # entries and, once a new process joined empty, orders moves to it.
    built: list[object] = []
    original = Silo.start

    async def start(self: Silo) -> Silo:
        built.append(self)
        return await original(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Silo, "start", start)
        out = run_seed(7, SCENARIOS["silo"])
    assert out.violation is None, out.violation
    assert len(built) >= 5 and all(type(s) is Silo for s in built)  # three, and one after each crash
    events = out.cluster_events
    assert events.get("dead", 0) >= 1 and events.get("failover", 0) >= 1, events
    assert events.get("moved", 0) >= 1, events
    assert out.calls > 300


# Seeds that found defects, replayed clean (each is also pinned without the simulator):
# 89: s2 restarted gracefully while its failure detector's shielded probe was still connecting
#     to a paused peer; the connect ran on past the stop (and would have pooled a connection
#     nobody closed). The transport now opens connections in tasks of its own that close() ends
#     (tests/silo/messaging/test_transport_contract.py, both transports).
# 144: a zombie's refused state write started a deactivation; the silo, back from its pause,
#     learnt it was dead, and the deactivation (its unregister in Redis) outlived the stop.
#     drop_all_nowait and Catalog.stop end deactivations in flight
#     (tests/silo/catalog/test_deactivation.py).
# 181: the network twin kept the listener's end of a handshake lost on a cut link after the
#     listener stopped (a twin defect: over TCP no socket exists for an unanswered SYN;
#     tests/silo/messaging/test_transport_twin.py).
@pytest.mark.timeout(120)
def test_seeds_of_the_silo_scenario_that_found_defects_replay_clean() -> None:
    _all_pass("89,144,181", 3, scenario="silo")


# The "stops" scenario: stops that skip the hand-off (stop(graceful=False), as test fixtures and a
# loop's shutdown stop a silo) beside graceful restarts. 13 and 19: the stop left the activations
# live, a turn running (and in a CI run a serving grain's poll timer ticking on past the loop's
# end); Catalog.stop now drops them (tests/silo/test_silo_lifecycle.py,
# tests/silo/catalog/test_deactivation.py). 47: a one-way call turned away unrun after the
# dispatcher had closed was sent again in a new task, which outlived the stop; a closed
# dispatcher now fails it (logged and counted).
@pytest.mark.timeout(120)
def test_seeds_of_the_stops_scenario_that_found_defects_replay_clean() -> None:
    _all_pass("13,19,47", 3, scenario="stops")


_MUTANTS = {
    # The directory's register script lets a second silo take a grain a live silo holds.
    "register": ("silo/cluster/directory.py", "if cur[1] and not (cur[1] == ARGV[3] and cur[3] == ARGV[4]) then return cur end\n", ""),
    # The state store's write script accepts a writer whose fencing token the directory no longer names.
    "fence": (
        "silo/storage/store.py",
        "  return redis.call('HGET', entry, 'token') == token\nend\n\"\"\"\n\n# KEYS: head",
        "  return true\nend\n\"\"\"\n\n# KEYS: head",
    ),
}


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("mutant", "invariant"), [("register", "single_activation"), ("fence", "single_writer")])
def test_a_redis_script_broken_on_purpose_fails_a_silo_seed_whose_replay_fails_the_same_way(
    mutant: str, invariant: str, tmp_path: Path
) -> None:
    _mutant(tmp_path, [_MUTANTS[mutant]])
    line = _first_failure(tmp_path, "silo", seeds="1-6")
    seed, found = re.search(r"seed (\d+) FAIL (\w+):", line).groups()  # type: ignore[union-attr]
    assert found == invariant, line
    again = _sim("run", "--seeds", seed, "--scenario", "silo", cwd=tmp_path, timeout=120)
    assert again.returncode == 1
    assert f"seed {seed} FAIL {invariant}:" in again.stdout, again.stdout


def test_a_crashed_silo_sends_nothing_more_to_redis_and_is_declared_dead_by_its_peers() -> None:
    from silo.testing.sim import silos
    from silo.testing.sim.world import Fault
    from tests.silo.testing.test_sim import _world_run

    sent_at_crash: dict[str, int] = {}
    crash = silos.RealSilo.crash

    async def counted(self: silos.RealSilo) -> None:
        await crash(self)
        sent_at_crash[self.name] = self.link.commands

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(silos.RealSilo, "crash", counted)
        world, out = _world_run(5, "silo", [Fault(3.0, "crash", 1)])
    assert out.violation is None, str(out.violation)
    (name,) = sent_at_crash
    # Its undos (the leave, the event log's flush, the leases handed back) never ran: not even tried.
    assert world.redis_links[name].commands == sent_at_crash[name] > 0
    assert out.cluster_events.get("dead", 0) >= 1 and out.cluster_events.get("join", 0) == 4, out.cluster_events
