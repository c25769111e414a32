"""A module no silo in the tests is started with: importing it leaves a mark.

If a silo ever imported a grain module on demand because a frame named it,
the file named by ``$REDGRAIN_TEST_IMPORT_MARK`` would appear.
"""

from __future__ import annotations

import os
from pathlib import Path

from grains import Grain

_mark = os.environ.get("REDGRAIN_TEST_IMPORT_MARK")
if _mark:
    Path(_mark).write_text(f"imported by pid {os.getpid()}\n")


class Sentinel(Grain):
    async def touch(self) -> str:
        return "imported"
