"""A grain that logs, for the Logs page tests (silos load it with ``grains=``)."""

from __future__ import annotations

import logging

from grains import Grain

log = logging.getLogger("tests.grumbler")


class Grumbler(Grain):
    async def grumble(self, text: str, level: str = "WARNING") -> str:
        """Logs ``text`` at ``level`` on the silo it runs on; returns that silo's address."""
        log.log(logging.getLevelName(level), "grumble: %s", text)
        return str(self.silo)
