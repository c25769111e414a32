"""Calling a served model from Python: deploy it, then predict with failover.

::

    await deploy(client, "digits", ServeSpec(job="digits"))
    y = await client.get_grain(ModelGrain, "digits").predict(x)     # a plain grain call
    y = await Predictor(client, "digits").predict(x)                # the same, retried on another replica

A plain call to a replica whose silo dies mid-call fails with
``SiloUnavailableError`` (it may have run: the runtime retries only calls it
knows were not delivered). ``predict`` has no side effects, so
:class:`Predictor` sends it again, to whichever replica the cluster picks,
until the request's deadline; serving errors come back as their own classes
(:mod:`grains.serving.errors`). The HTTP front calls through one.
"""

from __future__ import annotations

import asyncio
from typing import Any

from grains.serving.errors import from_remote
from grains.serving.model import Deployment, DeploymentGrain, GpuModelGrain, ModelGrain
from grains.serving.spec import ModelInfo, ServeSpec
from silo import errors

RETRYABLE = (errors.SiloUnavailableError, errors.GrainDeactivatedError, errors.OverloadedError)
"""Errors after which an idempotent predict is sent again (the replica or its silo went away)."""
_BACKOFF_S = (0.005, 0.02, 0.05, 0.1, 0.2)


async def deploy(client: Any, name: str, spec: ServeSpec | dict[str, Any]) -> Deployment:
    """Serve ``spec`` as model ``name``; returns the deployment (its revision)."""
    return await client.get_grain(DeploymentGrain, name).deploy(spec)  # type: ignore[no-any-return]


def grain_for(role: str | None) -> type[ModelGrain]:
    """The replica grain type for a placement role (None: any silo hosting the serving grains)."""
    if role is None:
        return ModelGrain
    if role == "gpu":
        return GpuModelGrain
    raise errors.ConfigError(f"no model grain for role {role!r}: subclass ModelGrain with @silo_role({role!r})"
                             " (docs/serving.md) and name it with --grain")  # fmt: skip


class Predictor:
    """``predict`` on model ``name``, retried on another replica until ``timeout_s``."""

    def __init__(self, client: Any, name: str, *, grain: type[ModelGrain] = ModelGrain, timeout_s: float = 10.0) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self._client = client
        self._grain = grain
        self._ref: Any = client.get_grain(grain, name)
        self.retries = 0

    async def predict(self, inputs: Any, timeout_s: float | None = None) -> Any:
        return await self._call("predict", inputs, timeout_s=timeout_s)

    async def metadata(self, timeout_s: float | None = None) -> ModelInfo:
        return await self._call("metadata", timeout_s=timeout_s)  # type: ignore[no-any-return]

    async def ready(self, timeout_s: float | None = None) -> bool:
        return bool(await self._call("ready", timeout_s=timeout_s))

    async def _call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (timeout_s or self.timeout_s)
        attempt = 0
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise errors.GrainTimeoutError(f"{self._grain.__name__}/{self.name}", method, timeout_s or self.timeout_s)
            try:
                return await getattr(self._ref.with_timeout(remaining), method)(*args)
            except RETRYABLE:
                if deadline - loop.time() <= 0:
                    raise
                self.retries += 1
                await asyncio.sleep(min(_BACKOFF_S[min(attempt, len(_BACKOFF_S) - 1)], max(0.0, deadline - loop.time())))
                attempt += 1
            except errors.RemoteGrainError as exc:
                raise from_remote(exc) from None
