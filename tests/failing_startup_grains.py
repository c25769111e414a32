"""A grain module whose ``@on_silo_start`` task fails (``RG_TEST_STARTUP=raise``) or hangs
(``hang``): a silo that loads it must not start."""

from __future__ import annotations

import asyncio
import os

from grains import Grain, on_silo_start


class Bystander(Grain):
    async def ping(self) -> str:
        return "pong"


@on_silo_start
async def check_config() -> None:
    mode = os.environ.get("RG_TEST_STARTUP", "raise")
    if mode == "raise":
        raise RuntimeError("the catalogue database is unreachable")
    if mode == "hang":
        await asyncio.Event().wait()
