"""Small helpers shared by tests (import as ``from tests.helpers import ...``)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path

from silo.testing.embedded import free_port as _free_port
from silo.testing.local import LocalSilo, SiloLaunch

REPO = Path(__file__).resolve().parent.parent

_names = itertools.count()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    return _free_port(host)


class SiloProcess(LocalSilo):
    """A :class:`~silo.testing.local.LocalSilo` with the tests' defaults.

    Grains from ``tests.sample_grains``, imported from the repository; the
    process runs in ``workdir`` (the test's tmp_path) and has a name unique in
    this test process, so several share one ``workdir``. Kill, pause, resume,
    stop (SIGTERM), restart with ``start()`` and read ``output()`` as on any
    LocalSilo.
    """

    def __init__(
        self,
        redis_url: str,
        cluster: str,
        workdir: Path,
        *,
        grains: str = "tests.sample_grains",
        roles: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        launch = SiloLaunch(env=dict(env or {}), extra_args=tuple(extra_args), cwd=workdir, import_path=(REPO,))
        super().__init__(
            redis_url, cluster, grains, workdir, name=f"silo-{next(_names)}", roles=roles, launch=launch
        )
