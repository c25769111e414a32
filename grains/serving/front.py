"""What every inference front does, whatever its wire: the one implementation HTTP and gRPC share.

A front (:mod:`grains.serving.http`, :mod:`grains.serving.grpc_front`) only
parses its protocol's messages into tensors and writes answers back; the rest
is here, once, so the two cannot drift apart:

- one :class:`~grains.serving.client.Predictor` per model (retries over a
  replica lost mid-call, client-side coalescing);
- each answer's weights version, the one that computed it (``Predictor.infer``);
- which failure is which status (:func:`failure`): the HTTP status, from which
  the gRPC front derives its code (:data:`GRPC_CODES`);
- server, model and readiness metadata as the Open Inference Protocol words it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from importlib import metadata as _metadata
from typing import Any

import torch

from grains.serving.client import Predictor
from grains.serving.errors import ModelNotReadyError, ServingError
from grains.serving.model import ModelGrain
from grains.serving.spec import ModelInfo
from silo import errors

SERVER_NAME = "redgrain"
EXTENSIONS = ["binary_tensor_data"]
INFO_TTL_S = 1.0

GRPC_CODES = {400: "INVALID_ARGUMENT", 404: "NOT_FOUND", 413: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}
"""The gRPC status code (``grpc.StatusCode`` member name) of each HTTP status a front answers."""


@dataclass(frozen=True, slots=True)
class Failure:
    """A request's failure as a front answers it: an HTTP status and a message."""

    status: int
    message: str

    @property
    def grpc_code(self) -> str:
        return GRPC_CODES.get(self.status, "INTERNAL")


def failure(exc: BaseException) -> Failure | None:
    """The answer to ``exc``, or None when it is not a request's failure (a bug: let it raise)."""
    if isinstance(exc, ServingError):
        return Failure(exc.status, str(exc))
    if isinstance(exc, errors.GrainTimeoutError):
        return Failure(504, str(exc))
    if isinstance(exc, errors.SiloError | errors.StorageError | errors.GrainCallError):
        return Failure(503, f"the cluster could not answer: {exc}")
    return None


def server_version() -> str:
    try:
        return _metadata.version("redgrain")
    except _metadata.PackageNotFoundError:
        return "0"


@dataclass(frozen=True, slots=True)
class Answer:
    """An inference's outputs by name and the weights version that computed them."""

    outputs: dict[str, torch.Tensor]
    version: str


class Front:
    """The models a front serves, through ``client`` (set it before the first request).

    ``in_flight``: each model's merged grain calls out at once (the ``Predictor``'s); the
    requests that arrive meanwhile wait and leave together as the next call. None (the
    default): one per silo that hosts the replica type, as the cluster view says, read again
    every second. A second call to one replica only queues behind the first there, yet costs a
    frame each way and a turn on both sides; fewer, fuller calls cost less a request
    (docs/serving.md, "Where the gRPC time goes").
    """

    def __init__(
        self, client: Any = None, *, grain: type[ModelGrain] = ModelGrain, timeout_s: float = 10.0,
        in_flight: int | None = None,
    ) -> None:  # fmt: skip
        if in_flight is not None and in_flight < 1:
            raise ValueError(f"in_flight is {in_flight}; a front needs at least one call in flight")
        self.client = client
        self.grain = grain
        self.timeout_s = timeout_s
        self.in_flight = in_flight
        self._fitted_until = 0.0
        self._predictors: dict[str, Predictor] = {}
        self._infos: dict[str, tuple[float, ModelInfo]] = {}

    def predictor(self, name: str) -> Predictor:
        p = self._predictors.get(name)
        if p is None:
            p = self._predictors[name] = Predictor(self.client, name, grain=self.grain, timeout_s=self.timeout_s,
                                                   in_flight=self.in_flight or self._replicas())  # fmt: skip
        elif self.in_flight is None and time.monotonic() >= self._fitted_until:
            p.in_flight = self._replicas()
        return p

    def _replicas(self) -> int:
        """Silos that can run a replica now (at least 1), remembered for a second."""
        self._fitted_until = time.monotonic() + INFO_TTL_S
        return max(1, len(self.client.view.hosting(self.grain.__name__)))

    def serving(self) -> bool:
        """Server readiness: some silo hosts the replica grain type."""
        return bool(self.client.view.hosting(self.grain.__name__))

    async def model_info(self, name: str) -> ModelInfo:
        """The model's metadata, read now (and remembered for the answers' version)."""
        info = await self.predictor(name).metadata()
        self._infos[name] = (time.monotonic(), info)
        return info

    async def _recent_info(self, name: str) -> ModelInfo:
        # Output names only change with a redeploy: a second-old copy serves.
        cached = self._infos.get(name)
        if cached is not None and time.monotonic() - cached[0] < INFO_TTL_S:
            return cached[1]
        return await self.model_info(name)

    async def ready(self, name: str) -> bool:
        return await self.predictor(name).ready()

    async def infer(self, name: str, inputs: dict[str, torch.Tensor], timeout_s: float | None = None) -> Answer:
        """Model ``name``'s outputs for ``inputs`` (by input name), with the version that answered.

        ``timeout_s``: the request's own deadline where its wire carries one (gRPC's), at most the
        front's ``timeout_s``."""
        limit = self.timeout_s if timeout_s is None else max(1e-3, min(timeout_s, self.timeout_s))
        got = await self.predictor(name).infer(inputs, timeout_s=limit)
        # The version is the answer's own (the weights that computed it, across a hot reload);
        # the metadata is read only to name a lone output.
        if isinstance(got.outputs, dict):
            return Answer(got.outputs, got.version)
        info = await self._recent_info(name)
        if not info.outputs:
            raise ModelNotReadyError(f"model {name} describes no output")
        return Answer({info.outputs[0].name: got.outputs}, got.version)
