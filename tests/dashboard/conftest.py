"""Fixtures for the dashboard tests: a TestClient over a real cluster's Redis."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from dashboard.app import create_app
from silo.settings import MembershipSettings

ADMIN_TOKEN = "s3cret-token"


@pytest.fixture
def api(redis_url: str, cluster_name: str) -> Iterator[TestClient]:
    """The dashboard app (no cache, admin token set) under FastAPI's TestClient."""
    app = create_app(redis_url, cluster_name, admin_token=ADMIN_TOKEN, cache_s=0.0)
    with TestClient(app) as client:
        yield client


# Failure detection at its defaults: these tests are about what silos publish,
# and FAST_MEMBERSHIP can declare a silo dead when a busy test machine stalls
# it for a second, which would take its numbers out of the dashboard.
CALM = MembershipSettings.model_validate({})
