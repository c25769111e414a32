"""An ERROR frame's body and back: a remote error is also an instance of its own class when
that class is known here, and a name the peer sends never makes this side import or run code."""

from __future__ import annotations

import errno

import pytest

from silo import errors
from silo.codec import TypeRegistry
from silo.messaging.wire_errors import error_body, error_from_body
from tests.edge_grains import QuotaError, Raiser


def _registry() -> TypeRegistry:
    registry = TypeRegistry()
    registry.register_annotations(Raiser)  # knows the exceptions of Raiser's module
    return registry


def _across(exc: Exception, registry: TypeRegistry | None = None) -> errors.RemoteGrainError:
    try:
        raise exc
    except Exception as raised:  # noqa: BLE001 - to give it a traceback, as a grain's would have
        got = error_from_body(error_body(raised), registry)
    assert isinstance(got, errors.RemoteGrainError)
    return got


def test_a_builtin_error_is_rebuilt_with_its_args_and_the_remote_traceback() -> None:
    got = _across(KeyError("k"))
    assert isinstance(got, KeyError) and isinstance(got, errors.RemoteGrainError)
    assert got.args == ("k",) and got.type_name == "KeyError" and "_across" in got.traceback_text
    missing = _across(FileNotFoundError(errno.ENOENT, "no such file"))
    assert isinstance(missing, FileNotFoundError) and missing.errno == errno.ENOENT


def test_a_registered_class_is_rebuilt_without_running_its_init() -> None:
    got = _across(QuotaError(7), _registry())
    assert isinstance(got, QuotaError) and got.used == 7 and got.args == ("quota used up: 7",)
    # Unknown here (no registry): the plain RemoteGrainError, naming it.
    plain = _across(QuotaError(7))
    assert type(plain) is errors.RemoteGrainError and plain.type_name == "tests.edge_grains.QuotaError"


def test_a_class_unknown_here_is_caught_as_its_nearest_builtin_base() -> None:
    import json

    with pytest.raises(json.JSONDecodeError) as info:
        json.loads("{")
    got = _across(info.value, _registry())
    assert isinstance(got, ValueError) and not isinstance(got, json.JSONDecodeError)
    assert isinstance(got, errors.RemoteGrainError) and got.type_name == "json.decoder.JSONDecodeError"
    # Passed on by a silo that called it (a chain of calls): still a ValueError.
    again = error_from_body(error_body(got))
    assert isinstance(again, ValueError) and isinstance(again, errors.RemoteGrainError)
    assert again.type_name == "json.decoder.JSONDecodeError"


@pytest.mark.parametrize(
    "body",
    [
        {"code": "remote", "type": "os.system", "message": "x"},
        {"code": "remote", "type": "subprocess.CalledProcessError", "message": "x", "args": [1, "ls"]},
        {"code": "remote", "type": "KeyboardInterrupt", "message": "x"},
        {"code": "remote", "type": "SystemExit", "message": "x", "builtin": "SystemExit"},
        {"code": "remote", "type": "x.Y", "message": "x", "builtin": "print"},
        # Raised out of a coroutine it would turn into RuntimeError("coroutine raised StopIteration").
        {"code": "remote", "type": "StopIteration", "message": "x"},
    ],
)
def test_a_name_from_the_peer_is_only_looked_up_never_imported_or_run(body: dict[str, object]) -> None:
    got = error_from_body(body, _registry())
    assert type(got) is errors.RemoteGrainError and got.type_name == body["type"]


def test_a_class_with_init_subclass_or_new_of_its_own_is_not_subclassed() -> None:
    class Hooked(Exception):
        def __init_subclass__(cls) -> None:
            raise AssertionError("must not run on a peer's say-so")

    registry = TypeRegistry()
    registry.register_error(Hooked)
    got = error_from_body({"code": "remote", "type": f"{__name__}.{Hooked.__qualname__}", "message": "m"}, registry)
    assert type(got) is errors.RemoteGrainError


def test_a_remote_error_passed_on_keeps_its_class() -> None:
    once = _across(ValueError("v"))
    twice = error_from_body(error_body(once))
    assert isinstance(twice, ValueError) and isinstance(twice, errors.RemoteGrainError)
    assert twice.args == ("v",) and twice.traceback_text == once.traceback_text


def test_long_attributes_stay_behind() -> None:
    import json

    with pytest.raises(json.JSONDecodeError) as info:
        json.loads("[" + "1, " * 10_000)
    body = error_body(info.value)
    assert "doc" not in body["fields"] and body["fields"]["pos"] == info.value.pos
