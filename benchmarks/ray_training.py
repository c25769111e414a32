"""Ray's parameter-server pattern on bench_training's models and data, in its own process.

The synchronous parameter server of Ray's own example (docs.ray.io, Ray Core
examples, "Parameter Server"): one ``ParameterServer`` actor holds the model
and torch's optimizer; N ``DataWorker`` actors each compute gradients from the
weights' ObjectRef; the server applies the average and returns the new
weights, whose ObjectRef feeds the next step::

    weights = ps.get_weights.remote()
    for t in range(steps):
        grads = [w.compute_gradients.remote(weights, t) for w in workers]
        weights = ps.apply_gradients.remote(*grads)

Same model, data, batch schedule (worker j takes rank j's batch of global step
t, as a redgrain trainer does), optimizer and thread count (one torch thread
per process) as the redgrain rows. Weights and gradients travel as numpy
arrays, Ray's zero-copy path. Prints one JSON line last:
``{"config": {"workers": {"samples_per_s", "step_ms", "accuracy"}}}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any

from benchmarks import common


def measure(runs: list[dict[str, Any]]) -> dict[str, Any]:
    import numpy as np
    import ray
    import torch

    from grains.training.api.job import TrainingJob
    from grains.training.data.batches import Batches
    from grains.training.datasets import load_dataset
    from grains.training.models import build_model
    from grains.training.strategies.ps.shard import make_optimizer

    ray.init(num_cpus=4, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)

    def weights_of(model: torch.nn.Module) -> list[np.ndarray]:
        return [p.detach().numpy().copy() for p in model.parameters()]

    def load(model: torch.nn.Module, weights: list[np.ndarray]) -> None:
        import warnings

        # Arrays from Ray's object store are read-only; they are only read here.
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            for p, w in zip(model.parameters(), weights, strict=True):
                p.copy_(torch.from_numpy(w))

    # Actors are started once and set up again for each run (a Ray worker process costs
    # seconds to start here, and the measured steps start after they are up anyway).
    @ray.remote
    class ParameterServer:
        def __init__(self) -> None:
            common.fix_torch_threads()

        def setup(self, spec: dict[str, Any]) -> None:
            self.spec = TrainingJob(**spec)
            self.model = build_model(self.spec)
            self.opt = make_optimizer(list(self.model.parameters()), self.spec)

        def get_weights(self) -> list[np.ndarray]:
            return weights_of(self.model)

        def apply_gradients(self, *grads: list[np.ndarray]) -> list[np.ndarray]:
            for p, parts in zip(self.model.parameters(), zip(*grads, strict=True), strict=True):
                g = torch.from_numpy(np.add.reduce(parts) if len(parts) > 1 else parts[0].copy())
                p.grad = g.mul_(1.0 / len(parts))
            self.opt.step()
            return weights_of(self.model)

    @ray.remote
    class DataWorker:
        def __init__(self) -> None:
            common.fix_torch_threads()

        def setup(self, spec: dict[str, Any], rank: int) -> None:
            self.spec = TrainingJob(**spec)
            self.rank = rank
            self.model = build_model(self.spec)
            self.data = Batches(load_dataset(self.spec, "train"))

        def compute_gradients(self, weights: list[np.ndarray], step: int) -> list[np.ndarray]:
            import torch.nn.functional as F

            load(self.model, weights)
            s = self.spec
            x, y = self.data.batch(s.batch_size, int(s.trainers), self.rank, step, s.seed)
            self.model.zero_grad(set_to_none=True)
            F.cross_entropy(self.model(x), y).backward()
            return [p.grad.numpy() for p in self.model.parameters()]  # type: ignore[union-attr]

    out: dict[str, Any] = {}
    ps = ParameterServer.remote()  # type: ignore[attr-defined]
    pool = [DataWorker.remote() for _ in range(max(int(r["spec"]["trainers"]) for r in runs))]  # type: ignore[attr-defined]
    for run in runs:
        spec = run["spec"]
        n, steps = int(spec["trainers"]), int(spec["steps"])
        workers = pool[:n]
        ray.get([ps.setup.remote(spec), *(w.setup.remote(spec, j) for j, w in enumerate(workers))])
        weights = ps.get_weights.remote()
        ray.get([w.compute_gradients.remote(weights, 0) for w in workers])  # warm: no update
        warm = max(1, steps // 5)
        start = 0.0
        for t in range(steps):
            if t == warm:
                ray.get(weights)
                start = time.perf_counter()
            weights = ps.apply_gradients.remote(*(w.compute_gradients.remote(weights, t) for w in workers))
        final = ray.get(weights)
        elapsed = time.perf_counter() - start
        job = TrainingJob(**spec)
        model = build_model(job)
        load(model, final)
        tx, ty = Batches(load_dataset(job, "test")).all()
        with torch.no_grad():
            acc = float((model(tx).argmax(1) == ty).float().mean())
        out.setdefault(run["config"], {})[str(n)] = {
            "samples_per_s": (steps - warm) * job.batch_size * n / elapsed,
            "step_ms": 1000 * elapsed / (steps - warm),
            "accuracy": acc,
        }
    ray.shutdown()
    return out


def ray_parameter_server(runs: list[dict[str, Any]]) -> dict[str, Any] | str:
    """Ray's numbers for ``runs`` (``{"config": name, "spec": TrainingJob fields}``) from a
    subprocess, or a sentence saying why there are none."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return "ray is not installed (pip install '.[bench]'): Ray parameter-server rows skipped"
    proc = common.start_subprocess(["-m", "benchmarks.ray_training"])
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps(runs))
    proc.stdin.close()
    text = proc.stdout.read()
    rc = proc.wait(900)
    last = text.strip().splitlines()[-1] if text.strip() else ""
    if rc != 0 or not last.startswith("{"):
        return f"ray parameter-server measurement failed (exit {rc}): {text[-500:]}"
    return json.loads(last)  # type: ignore[no-any-return]


def main() -> int:
    argparse.ArgumentParser(description="reads the runs as JSON on stdin").parse_args()
    common.fix_torch_threads()
    result = measure(json.loads(sys.stdin.read()))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
