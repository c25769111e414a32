"""The serving grains: a model's deployment (one per name) and its replicas (stateless workers).

:class:`DeploymentGrain` (key = the model's name) holds the :class:`ServeSpec`
and a revision counter in its persisted state: ``deploy`` and ``reload``
bump it. :class:`ModelGrain` (same key) is a ``@stateless_worker``: each silo
that hosts it runs one replica, activated by the first request routed there
(callers pick a silo hosting the type at random, so load spreads over them).
A replica loads the weights in ``on_activate`` (calls wait for it), then once
every ``reload_poll_s`` asks the deployment for its revision and the job for
its newest committed weights (or stats the weights file); when they changed
it builds a new :class:`~grains.serving.loader.LoadedModel` off the loop and
swaps the reference. Batches already running finish on the old one, and no
request is refused while the new one loads. The same tick publishes the
replica's record (:mod:`grains.serving.records`).

The class is ``@reentrant``: ``infer`` (and ``predict``, its outputs alone)
calls must reach the batcher together to be merged, so they may not wait for
each other's turns. A request is pinned to the ``LoadedModel`` it was checked
against: every pass of it runs there, and its answer names that model's
version and step. A redeploy applies its batching settings and poll period
in place (docs/serving.md, "Dynamic batching"). The
forward pass runs on the silo's executor (``run_in_thread``), never on the
loop. :class:`GpuModelGrain` is the same grain placed only on silos with the
``gpu`` role; any other role is a two-line subclass (see docs/serving.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import BaseModel

from grains.base import DeactivationReason, Grain
from grains.context import TimerHandle
from grains.placement import hash_placement, reentrant, silo_role, stateless_worker
from grains.serving import loader
from grains.serving.batcher import DynamicBatcher
from grains.serving.errors import (
    ModelNotFoundError,
    ModelNotReadyError,
    ModelUnservableError,
    ServingError,
)
from grains.serving.loader import LoadedModel
from grains.serving.records import RECORD_TTL_S, WORKLOAD, batch_bucket, models_key, replicas_key
from grains.serving.spec import ModelInfo, ServeSpec, parse_spec
from grains.serving.stats import ReplicaStats
from grains.serving.tensors import Inference, Inputs, chunks, merge, signature
from grains.training.api.messages import TrainingStatus
from grains.training.coordinator import CoordinatorGrain
from grains.workload import workload
from silo import errors

log = logging.getLogger("redgrain.serving")

_ACTIVATION_WAIT_S = 10.0


class Deployment(BaseModel):
    name: str
    revision: int = 0
    spec: ServeSpec | None = None


@hash_placement
class DeploymentGrain(Grain):
    """Key: the model's name. The one place a model's spec lives."""

    class State(BaseModel):
        revision: int = 0
        spec: ServeSpec | None = None

    async def deploy(self, spec: ServeSpec | dict[str, Any]) -> Deployment:
        """Serve ``spec`` under this name (replicas load it within ``reload_poll_s``)."""
        s = parse_spec(spec)
        if s != self.state.spec:
            self.state.spec = s
            self.state.revision += 1
            await self.write_state()
        return await self.current()

    async def reload(self) -> Deployment:
        """Make every replica load its weights again (a new file at the same path, say)."""
        self.state.revision += 1
        await self.write_state()
        return await self.current()

    async def undeploy(self) -> None:
        """Stop serving: replicas answer ModelNotFoundError and go away."""
        self.state.spec = None
        self.state.revision += 1
        await self.write_state()

    async def current(self) -> Deployment:
        return Deployment(name=self.key, revision=self.state.revision, spec=self.state.spec)


@dataclass(frozen=True, slots=True)
class _Item:
    """One request in the replica's batcher, pinned to the weights it was checked against."""

    model: LoadedModel
    inputs: Inputs
    rows: int


def _timed(fn: Any, *args: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


@stateless_worker(max_local=1)
@reentrant
class ModelGrain(Grain):
    """Key: the model's name. A replica on each silo that hosts it."""

    def __init__(self) -> None:
        self._loaded: LoadedModel | None = None
        self._deployment = Deployment(name="")
        self._weights: tuple[Any, ...] | None = None
        self._error = ""
        self._unservable = False
        """The last load failed with a ConfigError: the deployment must change, waiting will not help."""
        self._reloads = 0
        self._loaded_at = 0.0
        self._batcher: DynamicBatcher[_Item, Inputs] | None = None
        self._stats = ReplicaStats()
        self._refreshing: asyncio.Lock | None = None
        self._poll: TimerHandle | None = None
        self._poll_s = 0.0
        self._polls = 0
        """Polls begun (numbered from 1)."""
        self._polled = 0
        """Number of the last poll that finished without raising."""
        self._activated = asyncio.Event()  # binds no loop until awaited
        """Set once on_activate's first load ended: calls that start before (reentrant) wait for it."""
        self._cost_s: dict[int, float] = {}
        """Forward time by batch-size bucket (moving average): short passes run on the loop."""
        self._weights_exist = False
        """The last look found weights to load (a failure to load them is then worth retrying)."""

    async def on_activate(self) -> None:
        self._refreshing = asyncio.Lock()
        try:
            await self._first_load()
        finally:
            self._activated.set()
        self._schedule(self._deployment.spec.reload_poll_s if self._deployment.spec else 1.0)

    def _schedule(self, poll_s: float) -> None:
        if self._poll is not None:
            self._poll.cancel()
        self._poll_s = poll_s
        self._poll = self.register_timer(self._tick, due_s=poll_s, period_s=poll_s, interleave=True)

    async def _first_load(self) -> None:
        # Calls wait while a replica activates: when weights exist but cannot be read yet (a
        # job restarting gathers its tensors from grains still being placed; a silo going
        # away mid-read) keep trying for a while rather than answer "not ready" at once.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _ACTIVATION_WAIT_S
        while True:
            try:
                await self._refresh()
            except errors.RedgrainError as exc:
                self._error = str(exc)
                self._weights_exist = True
            if self._loaded is not None or not self._weights_exist or loop.time() > deadline:
                break
            await asyncio.sleep(0.2)

    async def on_deactivate(self, reason: DeactivationReason) -> None:
        redis = workload(self).redis_client()
        if redis is not None:
            try:
                await redis.hdel(replicas_key(self._prefix(), self.key), self.activation_id)
            except Exception as exc:  # noqa: BLE001 - best effort: readers drop stale records anyway
                log.debug("%s: removing the replica record failed: %s", self.key, exc)

    # --- the API -------------------------------------------------------------------
    async def infer(
        self, inputs: torch.Tensor | dict[str, torch.Tensor], requests: int = 1
    ) -> Inference:
        """The model's output for ``inputs`` (a batch: rows first), merged with concurrent
        requests, with the version and step of the weights that computed it.

        ``requests``: how many callers' requests ``inputs`` holds (a :class:`Predictor` merged
        them), so the replica's statistics count requests, not calls. A request of more rows
        than ``max_batch_size`` runs as several batches of at most that many, all on the
        weights it was checked against (a swap meanwhile does not mix versions in one answer)."""
        start = time.perf_counter()
        failed = True
        try:
            loaded, batcher = await self._when_ready()
            rows = loaded.check(inputs)
            # One batch: one set of weights and one signature (torch.cat along the rows fits).
            sig = signature(inputs)
            key = (loaded, sig and sig[1])
            parts = chunks(inputs, rows, batcher.max_rows)
            if len(parts) == 1:
                out = await batcher.submit(_Item(loaded, inputs, rows), rows, key)
            else:
                outs = await asyncio.gather(*(batcher.submit(_Item(loaded, p, n), n, key) for p, n in parts))
                out = merge(outs)
            failed = False
            return Inference(out, loaded.info.version, loaded.info.step)
        finally:
            self._stats.on_request(time.perf_counter() - start, failed=failed, requests=max(1, int(requests)))

    async def predict(
        self, inputs: torch.Tensor | dict[str, torch.Tensor], requests: int = 1
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """``infer``'s outputs alone."""
        return (await self.infer(inputs, requests)).outputs

    async def metadata(self) -> ModelInfo:
        """Inputs, outputs and weights version (ModelNotReadyError before weights are loaded)."""
        return (await self._when_ready())[0].info

    async def ready(self) -> bool:
        """Whether weights are loaded (ModelNotFoundError: nothing is deployed under this name)."""
        await self._activated.wait()
        if self._deployment.spec is None:
            raise ModelNotFoundError(self.key)
        return self._loaded is not None

    async def refresh(self) -> ModelInfo:
        """Look for newer weights now (instead of at the next tick) on this replica.

        The answer describes weights at least as new as the deployment and the job's were when
        the call arrived: a poll already in flight may have read them before, so it is waited
        for, and unless a poll begun since has finished, this one looks again."""
        await self._refresh(wait=True)
        return await self.metadata()

    # --- loading ---------------------------------------------------------------------
    async def _when_ready(self) -> tuple[LoadedModel, DynamicBatcher[_Item, Inputs]]:
        if not self._activated.is_set():
            await self._activated.wait()
        return self._ready()

    def _ready(self) -> tuple[LoadedModel, DynamicBatcher[_Item, Inputs]]:
        if self._deployment.spec is None:
            raise ModelNotFoundError(self.key)
        if self._loaded is None and self._unservable:
            raise ModelUnservableError(f"model {self.key} cannot be served as deployed: {self._error}")
        if self._loaded is None or self._batcher is None:
            raise ModelNotReadyError(f"model {self.key} has no weights loaded yet" + (f": {self._error}" if self._error else ""))
        return self._loaded, self._batcher

    def _prefix(self) -> str:
        return workload(self).rendezvous_prefix(WORKLOAD, 0)

    async def _tick(self) -> None:
        try:
            await self._refresh()
        except errors.RedgrainError as exc:  # a silo going away mid-call: try again next tick
            log.debug("%s: refresh failed: %s", self.key, exc)
        await self._publish()
        if self._deployment.spec is None and self._loaded is None:
            self.deactivate_on_idle()

    async def _refresh(self, *, wait: bool = False) -> None:
        """Poll the deployment and the weights; ``wait``: also when a poll is in flight (else skip)."""
        assert self._refreshing is not None
        if self._refreshing.locked() and not wait:
            return  # a tick during a poll: that poll is as good
        begun = self._polls
        async with self._refreshing:
            if self._polled > begun:
                return  # a poll that began after the call has finished
            self._polls += 1
            await self._poll_once()
            self._polled = self._polls

    async def _poll_once(self) -> None:
        dep: Deployment = await self.get_grain(DeploymentGrain, self.key).current()
        spec = dep.spec
        if spec is None:
            self._deployment, self._loaded, self._batcher = dep, None, None
            return
        if dep.revision != self._deployment.revision:
            self._weights = None  # a new spec or an explicit reload: load again
            self._configure(spec)
        self._deployment = dep
        try:
            await self._load_newer(spec)
        except errors.GrainCallError:
            raise
        except Exception as exc:  # noqa: BLE001 - a bad file or factory is the deployment's fault
            error = f"{type(exc).__name__}: {exc}"[:500]
            if error != self._error:  # once, not at every poll: the next deploy or weights may fix it
                log.warning("%s: loading weights failed: %s", self.key, error)
            self._error, self._unservable = error, isinstance(exc, errors.ConfigError)

    async def _load_newer(self, spec: ServeSpec) -> None:
        self._weights_exist = False
        if spec.job is not None:
            coord = self.get_grain(CoordinatorGrain, spec.job)
            st: TrainingStatus = await coord.status()
            if st.status == "completed":
                key: tuple[Any, ...] = ("job", spec.job, st.run, "final", st.step)
            elif st.checkpoints:
                key = ("job", spec.job, st.run, "checkpoint", st.checkpoints[-1])
            else:
                if self._loaded is None:
                    self._error = f"job {spec.job} is {st.status} and has no committed weights yet"
                return  # nothing newer: keep serving what is loaded
            if key == self._weights:
                return
            self._weights_exist = True
            job = await coord.job_spec()
            step = int(key[-1])
            # A running job's live weights are past its newest checkpoint: read that checkpoint,
            # so the version served is the step it names (and every replica serves the same).
            state = await coord.with_timeout(120.0).state_dict(None if key[3] == "final" else step)
            if job is None or not state:
                self._error = f"job {spec.job} has no weights yet"
                return
            new = await self.run_in_thread(loader.from_job, job, state, spec, self.key, step, self.device)
        else:
            assert spec.weights is not None
            stamp = await self.run_in_thread(loader.weights_stamp, spec.weights)
            key = ("file", spec.weights, stamp)
            if key == self._weights:
                return
            self._weights_exist = True
            new = await self.run_in_thread(loader.from_file, spec, self.key, self.device)
        self._swap(new, spec, key)

    def _configure(self, spec: ServeSpec) -> None:
        """A deployment's batching settings and poll period, from the next batch and tick on."""
        if self._batcher is not None:
            self._batcher.configure(max_rows=spec.max_batch_size, max_delay_s=spec.max_delay_ms / 1000,
                                    slots=spec.max_concurrent_batches)  # fmt: skip
        if self._poll is not None and spec.reload_poll_s != self._poll_s:
            self._schedule(spec.reload_poll_s)

    def _swap(self, new: LoadedModel, spec: ServeSpec, key: tuple[Any, ...]) -> None:
        """The new weights take every batch from now on; running ones finish on the old."""
        if self._loaded is not None:
            self._reloads += 1
        self._loaded, self._weights, self._error, self._loaded_at = new, key, "", time.time()
        self._unservable = False
        self._cost_s = {}
        if self._batcher is None:  # else _configure applied this spec's settings in place
            self._batcher = DynamicBatcher(self._run_batch, max_rows=spec.max_batch_size,
                                           max_delay_s=spec.max_delay_ms / 1000,
                                           slots=spec.max_concurrent_batches, on_batch=self._stats.on_batch)  # fmt: skip
        log.info("%s: serving %s", self.key, new.info.version)

    async def _run_batch(self, items: Sequence[_Item]) -> list[Inputs]:
        if self._loaded is None:
            raise ModelNotReadyError(f"model {self.key} was undeployed")
        model = items[0].model  # the batcher's key: every item's
        inputs, rows = [it.inputs for it in items], [it.rows for it in items]
        bucket = batch_bucket(sum(rows))
        spec = self._deployment.spec
        limit_s = (spec.inline_below_ms if spec is not None else 0.0) / 1000
        known = self._cost_s.get(bucket)
        if known is not None and known < limit_s:
            # Shorter than a hop to the executor and back (and the GIL hand-offs it causes).
            t0 = time.perf_counter()
            out = model.forward(inputs, rows)
            took = time.perf_counter() - t0
        else:
            out, took = await self.run_in_thread(_timed, model.forward, inputs, rows)
        self._cost_s[bucket] = took if known is None else 0.8 * known + 0.2 * took
        return out

    # --- the published record ----------------------------------------------------------
    async def _publish(self) -> None:
        redis = workload(self).redis_client()
        if redis is None:
            return
        info = self._loaded.info if self._loaded is not None else None
        rec = self._stats.record(
            model=self.key, replica=self.activation_id, silo=str(self.silo), grain_type=type(self).__name__,
            ready=info is not None, version=info.version if info else "", step=info.step if info else 0,
            error=self._error, loaded_at=self._loaded_at, reloads=self._reloads,
        )  # fmt: skip
        prefix = self._prefix()
        try:
            async with redis.pipeline(transaction=False) as pipe:
                pipe.hset(replicas_key(prefix, self.key), self.activation_id, rec.model_dump_json())
                pipe.expire(replicas_key(prefix, self.key), RECORD_TTL_S)
                pipe.sadd(models_key(prefix), self.key)
                await pipe.execute()
        except Exception as exc:  # noqa: BLE001 - the dashboard misses a second, serving goes on
            log.debug("%s: publishing the replica record failed: %s", self.key, exc)


@silo_role("gpu")
@stateless_worker(max_local=1)
@reentrant
class GpuModelGrain(ModelGrain):
    """A :class:`ModelGrain` whose replicas run only on silos started with ``--roles gpu``."""


__all__ = ["Deployment", "DeploymentGrain", "GpuModelGrain", "Inference", "ModelGrain", "ServingError"]
