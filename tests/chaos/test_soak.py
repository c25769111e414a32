"""The chaos soak (see tests/chaos/soak.py and docs/reliability.md).

The short form runs in ``make test``; the long form is ``make soak``
(``REDGRAIN_SOAK_S`` seconds of faults, default 600; the figures are printed
and, with ``REDGRAIN_SOAK_REPORT=path``, written as JSON).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.chaos.soak import SoakConfig, run_soak, soak_redis, summary

LONG_S = float(os.environ.get("REDGRAIN_SOAK_S", "600"))


async def _soak(cfg: SoakConfig, cluster_name: str, tmp_path: Path) -> None:
    with soak_redis(tmp_path / "redis") as redis_server:
        report = await run_soak(cfg, redis_server, cluster_name, tmp_path)
    print("\nsoak figures:", summary(report))
    out = os.environ.get("REDGRAIN_SOAK_REPORT")
    if out:
        Path(out).write_text(report.to_json())
    assert report.kills + report.pauses > 0 and report.redis_restarts + report.kills > 0, summary(
        report
    )
    assert report.calls_ok > 0 and report.increments_acked > 0 and report.transfers_done > 0, (
        summary(report)
    )
    assert report.violations == [], "\n".join(report.violations[:30])


# Three processes start and restart: slow on a loaded 2-core CI box.
@pytest.mark.timeout(240)
async def test_short_soak_keeps_every_invariant(cluster_name: str, tmp_path: Path) -> None:
    await _soak(SoakConfig(silos=3, chaos_s=15.0, seed=11), cluster_name, tmp_path)


@pytest.mark.soak
@pytest.mark.timeout(LONG_S + 300)
async def test_long_soak_keeps_every_invariant(cluster_name: str, tmp_path: Path) -> None:
    await _soak(
        SoakConfig(silos=4, chaos_s=LONG_S, seed=int(os.environ.get("REDGRAIN_SOAK_SEED", "1"))),
        cluster_name,
        tmp_path,
    )
