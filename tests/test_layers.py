"""The layers of DESIGN.md §2 hold: import-linter's contracts (.importlinter), and lazy imports."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

REPO = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).with_name("lint-imports")


def lint(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(LINT), "--config", str(root / ".importlinter"), "--no-cache"],
        cwd=root, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_import_contracts_hold() -> None:
    proc = lint(REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


@pytest.fixture
def tree_copy(tmp_path: Path) -> Path:
    for name in ("grains", "silo", "dashboard"):
        shutil.copytree(REPO / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / ".importlinter", tmp_path / ".importlinter")
    return tmp_path


@pytest.mark.parametrize(
    ("module", "line", "broken"),
    [
        ("silo/keys.py", "import dashboard.reader", "Faces > workloads > runtime"),
        ("silo/catalog/catalog.py", "import grains.training.api.job", "Faces > workloads > runtime"),
        ("grains/base.py", "import silo.client", "Faces > workloads > runtime"),
        ("dashboard/reader.py", "import silo.cluster.membership", "The dashboard reads only"),
        ("dashboard/reader.py", "import grains.training.coordinator", "Faces > workloads > runtime"),
        ("silo/records/stats.py", "import torch", "Published records import no torch"),
        ("silo/records/events.py", "import silo.records.membership", "Each published record stands alone"),
        ("silo/catalog/timer.py", "import silo.catalog.activation", "Catalog: catalog | runtime"),
        ("silo/catalog/activation.py", "import silo.catalog.catalog", "Catalog: catalog | runtime"),
        ("grains/ids.py", "import numpy", "The programming model imports no runtime"),
        ("silo/messaging/dispatcher.py", "import silo.cluster.reminders", "Messaging is below the cluster"),
        ("silo/messaging/router.py", "import silo.streams.agent", "Messaging is below the cluster"),
    ],
)
def test_a_forbidden_import_breaks_a_contract(tree_copy: Path, module: str, line: str, broken: str) -> None:
    path = tree_copy / module
    path.write_text(path.read_text() + f"\n{line}  # injected by tests/test_layers.py\n")
    proc = lint(tree_copy)
    assert proc.returncode != 0, proc.stdout[-3000:]
    broken_section = proc.stdout.split("Broken contracts", 1)[-1]
    assert " ".join(broken.split()[:3]) in broken_section, proc.stdout[-3000:]
    assert line.split()[-1] in proc.stdout


def test_the_activation_names_no_catalog_even_for_types() -> None:
    """It reaches its catalog through ``ActivationHost``; lint-imports skips TYPE_CHECKING imports."""
    graph = grimp.build_graph("silo", exclude_type_checking_imports=False, cache_dir=None)
    chain = graph.find_shortest_chain(importer="silo.catalog.activation", imported="silo.catalog.catalog")
    assert chain is None, f"silo.catalog.activation imports the catalog: {' -> '.join(chain)}"


def test_records_errors_and_the_dashboard_load_without_torch_or_the_whole_runtime() -> None:
    code = (
        "import sys\n"
        "from silo import errors\n"
        "import silo.keys, silo.settings, grains, grains.training.api.records, dashboard.app\n"
        "import silo.records.control, silo.records.events, silo.records.logs, silo.records.membership\n"
        "import silo.records.progress, silo.records.reminders, silo.records.stats, silo.records.streams\n"
        "heavy = [m for m in ('torch', 'numpy', 'silo.silo', 'silo.messaging.transport', 'silo.catalog.catalog',\n"
        "                     'grains.training.coordinator') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "", f"imported eagerly: {proc.stdout.strip()}"


def test_the_runtime_alone_loads_without_torch_or_the_dashboard() -> None:
    code = (
        "import sys\n"
        "from silo import ClusterClient, Silo\n"
        "import silo.process, silo.testing.local\n"
        "print(','.join(m for m in ('torch', 'fastapi', 'uvicorn', 'dashboard', 'grains.training') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "", f"imported eagerly: {proc.stdout.strip()}"


IGNORES = [
    line.strip()
    for line in (REPO / ".importlinter").read_text().splitlines()
    if "->" in line and not line.strip().startswith(";")
]


@pytest.mark.parametrize("ignored", IGNORES)
def test_every_allowed_exception_is_needed(tree_copy: Path, ignored: str) -> None:
    """Dropping one of the contracts' ignore_imports lines breaks a contract: none is stale."""
    config = tree_copy / ".importlinter"
    lines = config.read_text().splitlines()
    config.write_text("\n".join(line for line in lines if line.strip() != ignored) + "\n")
    proc = lint(tree_copy)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "BROKEN" in proc.stdout
