"""Sentinel failover under load (see tests/chaos/failover.py and docs/reliability.md, "Redis failover").

The short form (one SIGKILL of the master) runs in ``make test``; the long form
is ``make soak`` (``REDGRAIN_SENTINEL_FAILOVERS`` rounds, default 8; figures
printed, and with ``REDGRAIN_SENTINEL_REPORT=path`` written as JSON).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.chaos.failover import FailoverConfig, FailoverReport, run_failover_load

ROUNDS = int(os.environ.get("REDGRAIN_SENTINEL_FAILOVERS", "8"))


def _verdict(report: FailoverReport) -> None:
    print("\nsentinel failover figures:", report.figures())
    out = os.environ.get("REDGRAIN_SENTINEL_REPORT")
    if out:
        Path(out).write_text(json.dumps(report.figures(), indent=2, sort_keys=True))
    assert report.rounds and report.increments_acked > 0 and report.transfers_done > 0, report.figures()
    assert report.accepted_writes_logged > 0, "the activation log is empty: the double-writer check saw nothing"
    assert report.waits > 0, "no write waited for the replica: WAIT is not wired in"
    assert (report.increments_lost, report.money_delta, report.double_writers) == (0, 0, 0), report.figures()
    assert report.violations == [], "\n".join(report.violations[:30])


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_master_killed_under_load_loses_no_acknowledged_write(cluster_name: str, tmp_path: Path) -> None:
    _verdict(await run_failover_load(FailoverConfig(failovers=1), cluster_name, tmp_path))


@pytest.mark.soak
@pytest.mark.timeout(120 + 60 * ROUNDS)
async def test_repeated_failovers_under_load_lose_no_acknowledged_write(cluster_name: str, tmp_path: Path) -> None:
    cfg = FailoverConfig(failovers=ROUNDS, load_after_s=8.0, silos=3)
    _verdict(await run_failover_load(cfg, cluster_name, tmp_path))
