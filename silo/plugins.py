"""Objects named by import path (``package.module:name``) in settings or on the command line.

Storage-provider factories and call filters are configured this way, so a
deployment adds its own without code that builds the silo. Each silo (and
client) imports what its own settings name when it starts; nothing is
registered process-wide, so silos with different settings share a process.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

from silo import errors


def import_object(path: str, what: str) -> Any:
    """The object ``path`` names; ConfigError saying ``what`` it was for when it cannot be had."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise errors.ConfigError(f"{what} {path!r} is not an import path of the form package.module:name")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise errors.ConfigError(f"{what} {path!r}: cannot import {module_name!r}: {exc}") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise errors.ConfigError(f"{what} {path!r}: {module_name!r} has no {attr!r}") from None
    return obj


def load_filters(paths: Iterable[str], what: str) -> list[Any]:
    """Call filters by import path: a function is used as it is, a class is instantiated with no arguments."""
    out = []
    for path in paths:
        obj = import_object(path, what)
        if isinstance(obj, type):
            try:
                obj = obj()
            except Exception as exc:
                raise errors.ConfigError(f"{what} {path!r}: {obj.__qualname__}() failed: {exc}") from exc
        if not callable(obj):
            raise errors.ConfigError(f"{what} {path!r} is a {type(obj).__name__}, not a filter (f(ctx, call_next))")
        out.append(obj)
    return out
