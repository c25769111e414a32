"""Typed grain references: mypy, with grains.mypy_plugin, checks calls made through them.

Each test runs mypy as a user's project would (this checkout's pyproject.toml, so its
plugins); they share one cache directory, so only the first pays for a cold run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest

from grains import Grain, GrainId
from grains.ref import Caller, Ref, public_methods, ref_class_for, stream_methods
from tests.grains.typing_cases.ref_grains import Counter, Decorated

ROOT = Path(__file__).resolve().parents[2]
CASES = Path(__file__).parent / "typing_cases"
ERROR = re.compile(r"^(?P<path>[^:]+):(?P<line>\d+): error: (?P<message>.*?)  \[(?P<code>[a-z-]+)\]$")
MARK = re.compile(r"#\s*E:\s*\[(?P<code>[a-z-]+)\]\s*(?P<text>.*)$")


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mypy-cache")


def mypy(cache: Path, *args: str, project: Path = ROOT) -> tuple[int, list[tuple[str, int, str, str]]]:
    """mypy's exit status and its errors as (path, line, code, message), run in ``project``
    with its pyproject.toml; this checkout is on the path as an installed redgrain would be."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(project / "pyproject.toml"), "--cache-dir", str(cache),
         "--no-error-summary", "--hide-error-context", "--no-pretty", *args],
        check=False, cwd=project, env=env, capture_output=True, text=True, timeout=300,
    )
    errors = []
    for line in proc.stdout.splitlines():
        if m := ERROR.match(line):
            errors.append((m["path"], int(m["line"]), m["code"], m["message"]))
        else:
            assert ": note: " in line, f"unexpected mypy output: {line}\n{proc.stderr}"
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    return proc.returncode, errors


def test_mypy_passes_on_the_samples(mypy_cache: Path) -> None:
    rc, errors = mypy(mypy_cache, "samples")
    assert (rc, errors) == (0, [])


def test_calls_with_the_grains_signatures_and_with_timeout_type_check(mypy_cache: Path) -> None:
    rc, errors = mypy(mypy_cache, str(CASES / "good_calls.py"))
    assert (rc, errors) == (0, [])


def test_bad_calls_are_reported_on_their_lines_with_their_reasons(mypy_cache: Path) -> None:
    bad = CASES / "bad_calls.py"
    expected = {
        n: (m["code"], m["text"].strip())
        for n, line in enumerate(bad.read_text().splitlines(), 1)
        if (m := MARK.search(line))
    }
    assert len(expected) == 21
    rc, errors = mypy(mypy_cache, str(bad))
    assert rc == 1
    got = {line: (code, message) for _, line, code, message in errors}
    assert len(got) == len(errors), f"two errors on one line: {errors}"
    assert sorted(got) == sorted(expected), errors
    for line, (code, text) in expected.items():
        assert got[line][0] == code, (line, got[line])
        assert text in got[line][1], (line, got[line])


REMOTE: dict[type[Grain], set[str]] = {
    Counter: {"add", "total", "touch"},
    Decorated: {"timed_add", "tagged_touch", "words"},  # not hidden, rewrapped: plain def wrappers
}


@pytest.mark.parametrize("grain", [Counter, Decorated], ids=lambda g: g.__name__)
def test_the_plugin_allows_exactly_the_names_the_runtime_reference_has(
    mypy_cache: Path, tmp_path: Path, grain: type[Grain]
) -> None:
    # Every attribute a grain instance has, through a reference: mypy must accept the
    # remote methods (and the reference's own grain_id/key/with_timeout) and nothing else,
    # and refuse each other one with the reason the run-time reference gives.
    names = sorted(n for n in dir(grain) if not n.startswith("__"))
    own = {n for n in dir(Ref) if not n.startswith("_")}
    program = "\n".join(
        [
            "from silo.client import ClusterClient",
            f"from tests.grains.typing_cases.ref_grains import {grain.__name__}",
            "def probe(client: ClusterClient) -> None:",
            f"    ref = client.get_grain({grain.__name__}, 'c')",
            *(f"    ref.{n}" for n in names),
        ]
    )
    probe = tmp_path / "probe.py"
    probe.write_text(program + "\n")
    _, errors = mypy(mypy_cache, str(probe))
    refused = {names[line - 5]: message for _, line, code, message in errors if code == "attr-defined"}
    assert {code for *_, code, _ in errors} <= {"attr-defined"}, errors
    assert set(names) - set(refused) == set(public_methods(grain)) | (own & set(names))
    assert set(public_methods(grain)) == REMOTE[grain]
    ref = _unsent(grain)
    for name, message in refused.items():
        with pytest.raises(AttributeError) as info:
            getattr(ref, name)
        # The same words at run time: 'Reference to "G" has no attribute "m" (why)'.
        assert str(info.value) == message, name


def _unsent(grain: type[Grain]) -> Any:
    """A reference whose names are looked up, never called (Any: the point is to try the
    names mypy refuses)."""
    return ref_class_for(grain)(cast(Caller, None), GrainId.of(grain.__name__, "k"))


def test_a_method_behind_a_plain_def_wrapper_is_not_remote_and_an_async_wrapper_is() -> None:
    ref = _unsent(Decorated)
    with pytest.raises(AttributeError, match='decorator "logged" makes it a plain function'):
        ref.hidden  # noqa: B018 - the lookup is the point
    assert stream_methods(Decorated) == {"words"}


def test_the_checks_hold_for_grains_read_from_mypys_cache(tmp_path: Path) -> None:
    # mypy's cache keeps no decorators: a grain module read from it must be judged the same
    # (one-way results, plain def wrappers), so the calls are checked after a run that cached it.
    cache = tmp_path / "cache"
    assert mypy(cache, str(CASES / "ref_grains.py")) == (0, [])
    assert mypy(cache, str(CASES / "good_calls.py")) == (0, [])
    _, errors = mypy(cache, str(CASES / "bad_calls.py"))
    assert len(errors) == 21, errors


def test_a_users_project_gets_the_checks_from_the_installed_packages(mypy_cache: Path, tmp_path: Path) -> None:
    # As docs/concepts.md tells a user: one line of configuration. Outside this repository
    # mypy reads grains and silo as installed packages, which needs their py.typed markers.
    (tmp_path / "pyproject.toml").write_text('[tool.mypy]\nplugins = ["grains.mypy_plugin"]\n')
    (tmp_path / "app.py").write_text(
        "from grains import Grain\n"
        "from silo import ClusterClient\n"
        "class Counter(Grain):\n"
        "    async def add(self, n: int) -> int:\n"
        "        return n\n"
        "    def peek(self) -> int:\n"
        "        return 0\n"
        "async def main(client: ClusterClient) -> None:\n"
        "    counter = client.get_grain(Counter, 'c')\n"
        "    total: int = await counter.with_timeout(2).add(1)\n"
        "    counter.peek()\n"
    )
    _, errors = mypy(mypy_cache, "app.py", project=tmp_path)
    assert [(line, code) for _, line, code, _ in errors] == [(11, "attr-defined")], errors
    assert 'has no attribute "peek"' in errors[0][3]
