"""Fixtures for the dashboard tests: a TestClient over a real cluster's Redis."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from dashboard.app import create_app

ADMIN_TOKEN = "s3cret-token"


@pytest.fixture
def api(redis_url: str, cluster_name: str) -> Iterator[TestClient]:
    """The dashboard app (no cache, admin token set) under FastAPI's TestClient."""
    app = create_app(redis_url, cluster_name, admin_token=ADMIN_TOKEN, cache_s=0.0)
    with TestClient(app) as client:
        yield client




# DEBUG-TEMP
import asyncio as _asyncio  # noqa: E402
import sys as _sys  # noqa: E402

from silo.silo import Silo as _Silo  # noqa: E402

_orig_stop = _Silo.stop


async def _stop(self, *, graceful=True):  # type: ignore[no-untyped-def]
    def dump() -> None:
        print("HANG stopping", self.address, self.status, file=_sys.stderr)
        for t in _asyncio.all_tasks():
            print("TASK", t.get_name(), file=_sys.stderr)
            t.print_stack(file=_sys.stderr)

    h = _asyncio.get_running_loop().call_later(15, dump)
    try:
        await _orig_stop(self, graceful=graceful)
    finally:
        h.cancel()


_Silo.stop = _stop  # type: ignore[method-assign]
