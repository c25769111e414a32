"""The job's loggers: its history, learning rate and checkpoint events in TensorBoard and MLflow.

``loggers = ["tensorboard", "mlflow"]`` in the job spec. They run where the
coordinator runs, fed from the job's history as points are recorded
(:mod:`grains.training.history`: one training point per step done, one
evaluation point per evaluated checkpoint), so they hold what ``history()``
and the dashboard's curves hold:

- ``train/loss``, ``train/<metric>``, ``train/lr`` (the rate that step ran at,
  from the job's own schedule: :func:`grains.training.loop.optim.build_schedule`)
  and ``train/samples_per_s`` at each step done; ``eval/<metric>`` at each
  evaluated step; ``checkpoint`` (value: the step) at each committed checkpoint;
- TensorBoard: event files in ``<log_dir>/<job>/run-<run>`` (torch's
  ``SummaryWriter``), the job's end as a text event;
- MLflow: one MLflow run per run of the job, in the experiment named after the
  job, in ``mlflow_tracking_uri`` (default: a file store in ``<log_dir>/mlruns``),
  with the spec's fields as parameters and the job's end as the run's status.

A relative ``log_dir`` is resolved against the working directory of the
coordinator's silo process. Writes run off the event loop, one at a time, in
order. A logger that fails (disk full, a bad URI, a server down) is dropped
for the rest of the activation and reported (:attr:`JobLoggers.failures`):
the job goes on.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import warnings
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from grains.training.api.job import TrainingJob
from grains.training.api.messages import HistoryPoint
from grains.training.loop.optim import advance, build_schedule
from silo.errors import ConfigError

log = logging.getLogger("redgrain.training.loggers")

R = TypeVar("R")
_END_STATUS = {"completed": "FINISHED", "failed": "FAILED", "cancelled": "KILLED"}


class _Sink(Protocol):
    def points(self, points: list[tuple[HistoryPoint, float | None]]) -> None: ...
    def checkpoint(self, step: int) -> None: ...
    def end(self, status: str, step: int) -> None: ...
    def close(self) -> None: ...


_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "mlflow": ("mlflow.tracking", "mlflow-skinny")}


def check_loggers(spec: TrainingJob) -> None:
    """ConfigError when a logger's library is not installed here (on the coordinator's silo)."""
    import importlib

    for name in spec.loggers:
        module, package = _PACKAGES[name]
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(
                f"logger {name!r} needs {package} on the coordinator's silo (pip install 'redgrain[loggers]'): {exc}"
            ) from None


def log_root(spec: TrainingJob) -> Path:
    """``log_dir``, resolved (a relative one against this process's working directory)."""
    return Path(spec.log_dir).expanduser().resolve()


def mlflow_uri(spec: TrainingJob) -> str:
    """The tracking URI the job's MLflow logger writes to."""
    return spec.mlflow_tracking_uri or (log_root(spec) / "mlruns").as_uri()


def _scalars(point: HistoryPoint, lr: float | None) -> dict[str, float]:
    if point.eval_metrics is not None:
        return {f"eval/{k}": v for k, v in point.eval_metrics.items()}
    out = {f"train/{k}": v for k, v in point.metrics.items()}
    if point.loss is not None:
        out["train/loss"] = point.loss
    if lr is not None:
        out["train/lr"] = lr
    out["train/samples_per_s"] = point.samples_per_s
    return out


class TensorBoardSink:
    """Event files of one run of the job (torch's SummaryWriter)."""

    def __init__(self, directory: Path, after: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.directory = directory
        # purge_step: TensorBoard hides what earlier writers logged from this step on.
        self._writer = SummaryWriter(log_dir=str(directory), purge_step=after + 1 if after else None)

    def points(self, points: list[tuple[HistoryPoint, float | None]]) -> None:
        for point, lr in points:
            for tag, value in _scalars(point, lr).items():
                self._writer.add_scalar(tag, value, point.step, walltime=point.at or None)
        self._writer.flush()

    def checkpoint(self, step: int) -> None:
        self._writer.add_scalar("checkpoint", step, step)
        self._writer.flush()

    def end(self, status: str, step: int) -> None:
        self._writer.add_text("job", f"{status} at step {step}", step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class MlflowSink:
    """One MLflow run of the job's run (resumed by id when the coordinator moves)."""

    def __init__(self, uri: str, job: str, run: int, spec: TrainingJob, run_id: str | None) -> None:
        if uri.startswith("file:"):
            # MLflow 3 refuses its file store unless asked: it is what a job logs to without a server.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=uri)
        self.run_id = ""
        if run_id:
            try:
                self.run_id = self._client.get_run(run_id).info.run_id
            except Exception:  # noqa: BLE001 - another silo's file store, or deleted: a new run
                self.run_id = ""
        if not self.run_id:
            experiment = self._client.get_experiment_by_name(job)
            experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(job)
            made = self._client.create_run(experiment_id, run_name=f"run-{run}", tags={"redgrain.job": job, "redgrain.run": str(run)})
            self.run_id = made.info.run_id
            fields = spec.model_dump(mode="json", exclude={"loggers", "log_dir", "mlflow_tracking_uri"})
            params = [Param(k, str(v)[:6000]) for k, v in sorted(fields.items())]
            for i in range(0, len(params), 100):  # MLflow's batch limit
                self._client.log_batch(self.run_id, params=params[i : i + 100])

    def points(self, points: list[tuple[HistoryPoint, float | None]]) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(tag, value, int(1000 * (point.at or time.time())), point.step)
                   for point, lr in points for tag, value in _scalars(point, lr).items()]  # fmt: skip
        for i in range(0, len(metrics), 1000):  # MLflow's batch limit
            self._client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def checkpoint(self, step: int) -> None:
        self._client.log_metric(self.run_id, "checkpoint", step, step=step)

    def end(self, status: str, step: int) -> None:
        self._client.set_tag(self.run_id, "redgrain.end", f"{status} at step {step}")
        self._client.set_terminated(self.run_id, _END_STATUS.get(status, "FINISHED"))

    def close(self) -> None:
        pass


class LearningRate:
    """The rate each step runs at, from the job's optimizer settings and schedule (the default
    parameter group's), stepped forward as steps come (rebuilt when the job goes back)."""

    def __init__(self, spec: TrainingJob, total_steps: int) -> None:
        self._spec, self._total = spec, total_steps
        self._opt: torch.optim.Optimizer | None = None
        self._schedule: Any = None
        self._at = 0

    def _build(self) -> None:
        lr = float(self._spec.optimizer_args.get("lr", self._spec.lr))
        self._opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr, momentum=0.9)
        self._schedule = build_schedule(self._opt, self._spec, self._total)
        self._at = 0

    def at(self, step: int) -> float:
        """The rate step ``step`` (counted from 1) ran at."""
        if self._opt is None or step - 1 < self._at:
            self._build()
        advance(self._schedule, step - 1 - self._at)
        self._at = step - 1
        assert self._opt is not None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return float(self._opt.param_groups[0]["lr"])


class JobLoggers:
    """A run's loggers as the coordinator uses them: ``run`` is the grain's ``run_in_thread``."""

    def __init__(self, spec: TrainingJob, job: str, run: int, mlflow_run_id: str | None,
                 run_in_thread: Callable[..., Awaitable[Any]], after: int = 0) -> None:  # fmt: skip
        """``after``: the step this run's logging goes on from (0: a new run); what was logged
        past it is superseded (a resume from an older checkpoint, a coordinator that moved)."""
        self._spec, self._job, self._run, self._after = spec, job, run, after
        self._mlflow_run_id = mlflow_run_id
        self._in_thread = run_in_thread
        self._sinks: dict[str, _Sink] = {}
        self._started = False
        self._lock = asyncio.Lock()
        self._rate: LearningRate | None = None
        self.failures: list[str] = []
        """What went wrong, one line per logger dropped (new ones: :meth:`take_failures`)."""
        self._reported = 0

    @property
    def mlflow_run_id(self) -> str | None:
        sink = self._sinks.get("mlflow")
        return sink.run_id if isinstance(sink, MlflowSink) else self._mlflow_run_id

    def take_failures(self) -> list[str]:
        """Failures not taken before."""
        new = self.failures[self._reported :]
        self._reported = len(self.failures)
        return new

    def _start(self) -> None:
        for name in self._spec.loggers:
            try:
                if name == "tensorboard":
                    self._sinks[name] = TensorBoardSink(log_root(self._spec) / self._job / f"run-{self._run}", self._after)
                elif name == "mlflow":
                    self._sinks[name] = MlflowSink(mlflow_uri(self._spec), self._job, self._run, self._spec, self._mlflow_run_id)
            except Exception as exc:  # noqa: BLE001 - any failure of a logger is the logger's, not the job's
                self._fail(name, exc)

    def _fail(self, name: str, exc: BaseException) -> None:
        self._sinks.pop(name, None)
        why = f"logger {name} failed and is off for this run: {type(exc).__name__}: {exc}"[:500]
        log.warning("%s: %s", self._job, why)
        self.failures.append(why)

    def _each(self, call: Callable[[_Sink], None]) -> None:
        if not self._started:
            self._started = True
            self._start()
        for name, sink in list(self._sinks.items()):
            try:
                call(sink)
            except Exception as exc:  # noqa: BLE001 - as above
                self._fail(name, exc)

    async def _write(self, call: Callable[[_Sink], None], prepare: Callable[[], Any] | None = None) -> None:
        def write() -> None:
            if prepare is not None:
                prepare()
            self._each(call)

        async with self._lock:  # one write at a time, in the order the job made them
            await self._in_thread(write)

    async def points(self, points: list[HistoryPoint], total_steps: int) -> None:
        """Newly recorded history points (training points get the step's learning rate)."""
        if not points:
            return
        if self._rate is None:
            self._rate = LearningRate(self._spec, max(total_steps, 1))
        rate = self._rate

        def lr(point: HistoryPoint) -> float | None:
            if point.eval_metrics is not None:
                return None
            try:
                return rate.at(point.step)
            except Exception:  # noqa: BLE001 - a schedule that cannot be rebuilt here: no rate, not a failure
                return None

        pairs: list[tuple[HistoryPoint, float | None]] = []
        await self._write(lambda sink: sink.points(pairs), lambda: pairs.extend((p, lr(p)) for p in points))

    async def checkpoint(self, step: int) -> None:
        await self._write(lambda sink: sink.checkpoint(step))

    async def end(self, status: str, step: int) -> None:
        """The job ended: its end into each logger, then they close."""
        await self._write(lambda sink: sink.end(status, step))
        await self.close()

    async def close(self) -> None:
        if self._started:
            await self._write(lambda sink: sink.close())
        self._sinks.clear()
