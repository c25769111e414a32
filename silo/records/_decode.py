"""What the readers share: a Redis reply field as text, whatever the client's decoding."""

from __future__ import annotations

from typing import Any


def text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)
