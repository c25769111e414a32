"""Package names that load on first use (PEP 562), so importing a package stays cheap.

``from silo import errors`` must not import the whole runtime, and the
dashboard's ``import grains.training.api.records`` must not import torch: those
packages name their public classes in a table and let this module's
``__getattr__`` import each one's module when it is first asked for.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports ``names[name]`` on first use."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    return __getattr__
