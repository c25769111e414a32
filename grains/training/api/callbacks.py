"""The job's callbacks: user objects named by import path, told of evaluations, checkpoints and the end.

``callbacks = ["pkg.module:EarlyStopping"]`` names classes (made once per
job, with no arguments, on the coordinator's silo) or objects. Each may have
any of these methods; the ones it lacks are not called:

- ``on_eval(step, metrics) -> bool | None``: an evaluation of committed step
  ``step`` finished with ``metrics``; returning True stops the job there
  (early stopping): it completes *as of that step*, later checkpoints are
  dropped, and its weights are that checkpoint's;
- ``on_checkpoint(step)``: checkpoint ``step`` was committed;
- ``on_end(status, step)``: the job ended (completed, failed, cancelled).

They run off the event loop, one at a time. A callback that raises fails
the job with the reason (it would raise again on a retry).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from silo.errors import ConfigError

log = logging.getLogger("redgrain.training.callbacks")


def resolve_callback(path: str) -> Any:
    """The callback object named by ``pkg.module:name`` (a class is instantiated with no arguments)."""
    mod_name, _, attr = path.partition(":")
    try:
        obj: Any = importlib.import_module(mod_name)
    except ImportError as exc:
        raise ConfigError(f"callback {path!r}: cannot import module {mod_name!r}: {exc}") from None
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ConfigError(f"callback {path!r}: module {mod_name!r} has no attribute {attr!r}")
    if isinstance(obj, type):
        try:
            obj = obj()
        except Exception as exc:  # noqa: BLE001 - the user's constructor: any failure is a bad spec
            raise ConfigError(f"callback {path!r}: {obj.__name__}() raised {type(exc).__name__}: {exc}") from None
    if not any(callable(getattr(obj, hook, None)) for hook in ("on_eval", "on_checkpoint", "on_end")):
        raise ConfigError(f"callback {path!r} has none of on_eval, on_checkpoint, on_end")
    return obj


class CallbackError(RuntimeError):
    """A callback raised (the job fails with this)."""


class Callbacks:
    """A job's callback objects, in the order the spec names them (used off the loop)."""

    def __init__(self, paths: list[str]) -> None:
        self._objects = [(p, resolve_callback(p)) for p in paths]

    def __bool__(self) -> bool:
        return bool(self._objects)

    def on_eval(self, step: int, metrics: dict[str, float]) -> str | None:
        """Every callback's ``on_eval``; the path of the first that asked to stop (None: none did)."""
        stop = None
        for path, _ in self._objects:
            if self._call(path, "on_eval", step, dict(metrics)) is True and stop is None:
                stop = path
        return stop

    def on_checkpoint(self, step: int) -> None:
        for path, _ in self._objects:
            self._call(path, "on_checkpoint", step)

    def on_end(self, status: str, step: int) -> None:
        for path, _ in self._objects:
            self._call(path, "on_end", status, step)

    def _call(self, path: str, hook: str, *args: Any) -> Any:
        fn = getattr(dict(self._objects)[path], hook, None)
        if not callable(fn):
            return None
        try:
            return fn(*args)
        except Exception as exc:
            raise CallbackError(f"callback {path}.{hook} raised {type(exc).__name__}: {exc}") from exc
