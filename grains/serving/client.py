"""Calling a served model from Python: deploy it, then predict with failover.

::

    await deploy(client, "digits", ServeSpec(job="digits"))
    y = await client.get_grain(ModelGrain, "digits").predict(x)     # a plain grain call
    y = await Predictor(client, "digits").predict(x)                # the same, retried on another replica
    a = await Predictor(client, "digits").infer(x)                  # a.outputs, a.version, a.step

A plain call to a replica whose silo dies mid-call fails with
``SiloUnavailableError`` (it may have run: the runtime retries only calls it
knows were not delivered). ``predict`` has no side effects, so
:class:`Predictor` sends it again, to whichever replica the cluster picks,
until the request's deadline; serving errors come back as their own classes
(:mod:`grains.serving.errors`). The HTTP front calls through one.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from grains.serving.coalescer import Coalescer, signature
from grains.serving.errors import from_remote
from grains.serving.model import Deployment, DeploymentGrain, GpuModelGrain, ModelGrain
from grains.serving.spec import ModelInfo, ServeSpec
from grains.serving.tensors import Inference
from silo import errors

log = logging.getLogger(__name__)

RETRYABLE = (errors.SiloUnavailableError, errors.GrainDeactivatedError, errors.OverloadedError)
"""Errors after which an idempotent predict is sent again (the replica or its silo went away)."""
_BACKOFF_S = (0.005, 0.02, 0.05, 0.1, 0.2)
LIMIT_TTL_S = 30.0
"""How long a Predictor trusts the model's max_batch_size it read (merged calls stay under it)."""


async def deploy(client: Any, name: str, spec: ServeSpec | dict[str, Any]) -> Deployment:
    """Serve ``spec`` as model ``name``; returns the deployment (its revision)."""
    return await client.get_grain(DeploymentGrain, name).deploy(spec)


def grain_for(role: str | None) -> type[ModelGrain]:
    """The replica grain type for a placement role (None: any silo hosting the serving grains)."""
    if role is None:
        return ModelGrain
    if role == "gpu":
        return GpuModelGrain
    raise errors.ConfigError(f"no model grain for role {role!r}: subclass ModelGrain with @silo_role({role!r})"
                             " (docs/serving.md) and name it with --grain")  # fmt: skip


class Predictor:
    """``infer`` (or ``predict``: its outputs alone) on model ``name``, retried on another
    replica until ``timeout_s``.

    :param coalesce: merge concurrent predicts from this process into one grain call
        (:mod:`grains.serving.coalescer`); off, every predict is a call of its own.
    :param in_flight: merged calls out at once (the requests arriving meanwhile are the next).
    """

    def __init__(
        self, client: Any, name: str, *, grain: type[ModelGrain] = ModelGrain, timeout_s: float = 10.0,
        coalesce: bool = True, in_flight: int = 2,
    ) -> None:  # fmt: skip
        self.name = name
        self.timeout_s = timeout_s
        self._client = client
        self._grain = grain
        self._ref: Any = client.get_grain(grain, name)
        self.retries = 0
        self._coalescer = Coalescer(self._send, max_rows=1, in_flight=in_flight, split=Inference.split) if coalesce else None
        self._limit: asyncio.Future[int | None] | None = None
        """The model's max_batch_size, as last read (None: not known, predicts go alone)."""
        self._limit_until = 0.0

    @property
    def in_flight(self) -> int | None:
        """Merged calls out at once (None without coalescing); settable, from the next call on."""
        return self._coalescer.in_flight if self._coalescer is not None else None

    @in_flight.setter
    def in_flight(self, value: int) -> None:
        if self._coalescer is not None:
            self._coalescer.in_flight = value

    @property
    def calls(self) -> int | None:
        """Grain calls the coalescer sent (None without coalescing)."""
        return self._coalescer.calls if self._coalescer is not None else None

    async def infer(self, inputs: Any, timeout_s: float | None = None) -> Inference:
        """The outputs for ``inputs`` with the version and step of the weights that computed them
        (merged with concurrent requests from this process, each answer true to its own call)."""
        timeout = timeout_s or self.timeout_s
        sig = signature(inputs) if self._coalescer is not None else None
        if sig is None or self._coalescer is None:
            return await self._call("infer", inputs, timeout_s=timeout)  # type: ignore[no-any-return]
        rows, key = sig
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            async with asyncio.timeout(timeout):  # no task per request, unlike wait_for
                limit = await self._max_rows()
                if limit is not None and rows < limit:
                    return await self._coalescer.submit(inputs, rows, key, deadline)  # type: ignore[no-any-return]
        except TimeoutError:
            raise errors.GrainTimeoutError(f"{self._grain.__name__}/{self.name}", "infer", timeout) from None
        # The limit is not known (the model is not loaded yet) or the request fills a batch alone.
        return await self._call("infer", inputs, timeout_s=max(deadline - loop.time(), 1e-3))  # type: ignore[no-any-return]

    async def predict(self, inputs: Any, timeout_s: float | None = None) -> Any:
        """``infer``'s outputs alone."""
        return (await self.infer(inputs, timeout_s)).outputs

    async def metadata(self, timeout_s: float | None = None) -> ModelInfo:
        return await self._call("metadata", timeout_s=timeout_s)  # type: ignore[no-any-return]

    async def ready(self, timeout_s: float | None = None) -> bool:
        return bool(await self._call("ready", timeout_s=timeout_s))

    async def _max_rows(self) -> int | None:
        lim = self._limit
        loop = asyncio.get_running_loop()
        if lim is not None and (not lim.done() or loop.time() < self._limit_until):
            return lim.result() if lim.done() else await asyncio.shield(lim)
        # One metadata read for all callers, again every LIMIT_TTL_S (a redeploy may change it);
        # while it fails (the model not loaded yet) predicts go alone and get the replica's own
        # answer, and the read is tried again a second later.
        lim = self._limit = loop.create_future()
        limit: int | None = None
        try:
            info = await self._call("metadata", timeout_s=self.timeout_s)
            limit = info.max_batch_size
        except Exception as exc:  # noqa: BLE001 - the predict itself will say what is wrong
            log.debug("%s: reading the model's batch limit failed: %s", self.name, exc)
        finally:  # also when this caller is cancelled: the others waiting on it go on
            if limit is not None and self._coalescer is not None:
                self._coalescer.max_rows = limit
            self._limit_until = loop.time() + (LIMIT_TTL_S if limit is not None else 1.0)
            lim.set_result(limit)
        return limit

    async def _send(self, inputs: Any, requests: int, deadline: float) -> Any:
        remaining = deadline - asyncio.get_running_loop().time()
        if requests == 1:
            return await self._call("infer", inputs, timeout_s=max(remaining, 1e-3))
        return await self._call("infer", inputs, timeout_s=max(remaining, 1e-3), requests=requests)

    async def _call(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (timeout_s or self.timeout_s)
        attempt = 0
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise errors.GrainTimeoutError(f"{self._grain.__name__}/{self.name}", method, timeout_s or self.timeout_s)
            try:
                return await getattr(self._ref.with_timeout(remaining), method)(*args, **kwargs)
            except RETRYABLE:
                if deadline - loop.time() <= 0:
                    raise
                self.retries += 1
                await asyncio.sleep(min(_BACKOFF_S[min(attempt, len(_BACKOFF_S) - 1)], max(0.0, deadline - loop.time())))
                attempt += 1
            except errors.RemoteGrainError as exc:
                raise from_remote(exc) from None
