"""Ray Serve's side of bench_serving, run in its own process: prints one JSON line last.

The same models and weights as redgrain's run, one replica, ``@serve.batch``
with the same largest batch and no batching delay, called through a
``DeploymentHandle`` by 1, 8 and 64 concurrent async callers with single-row
requests (the Python API on both sides; no HTTP).

With ``--http PORT`` it serves the digits model behind Ray Serve's HTTP
proxy instead, answering V2 infer requests (JSON or Triton binary, through
redgrain's own codec, so both sides parse the same way), prints ``ready``
and serves until its stdin closes; bench_serving's wire clients measure it
(benchmarks/serving_wire.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from typing import Any

from benchmarks import common
from benchmarks.serving_common import CONCURRENCY, MAX_BATCH, MODELS, drive, requests_for


async def measure(weights: dict[str, str], quick: bool) -> dict[str, Any]:
    import ray
    import torch
    from ray import serve

    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    serve.start(proxy_location="Disabled", logging_config={"log_level": "ERROR"})

    @serve.deployment(max_ongoing_requests=1024, ray_actor_options={"num_cpus": 1})
    class Model:
        def __init__(self, factory: str, path: str) -> None:
            self.model = _load(factory, path)

        @serve.batch(max_batch_size=MAX_BATCH, batch_wait_timeout_s=0.0)
        async def __call__(self, rows: list[torch.Tensor]) -> list[torch.Tensor]:
            with torch.inference_mode():
                out = self.model(torch.cat(rows))
            return list(out.split(1))

    out: dict[str, Any] = {}
    for name, (factory, features) in MODELS.items():
        handle = serve.run(Model.bind(factory, weights[name]), name=name, route_prefix=None)  # type: ignore[attr-defined]
        rows = [torch.randn(1, features) for _ in range(64)]

        async def call(row: Any, handle: Any = handle) -> Any:
            return await handle.remote(row)

        await drive(call, rows, 8, 200)  # warm-up
        out[name] = {str(c): await drive(call, rows, c, requests_for(c, quick)) for c in CONCURRENCY}
        serve.delete(name)
    serve.shutdown()
    ray.shutdown()
    return out



def _load(factory: str, path: str) -> Any:
    """The benchmark's model with the saved weights, in eval mode (inside a Ray replica)."""
    import torch

    from benchmarks.common import fix_torch_threads
    from grains.training.api.job import resolve_path

    fix_torch_threads()
    model = resolve_path(factory, "model")()
    model.load_state_dict(torch.load(path, weights_only=True))
    return model.eval()

def serve_http(weights: dict[str, str], port: int) -> None:
    import ray
    import torch
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import Response

    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config={"log_level": "ERROR"})

    @serve.deployment(max_ongoing_requests=1024, ray_actor_options={"num_cpus": 1})
    class V2:
        def __init__(self, factory: str, path: str) -> None:
            self.model = _load(factory, path)

        @serve.batch(max_batch_size=MAX_BATCH, batch_wait_timeout_s=0.0)
        async def forward(self, rows: list[torch.Tensor]) -> list[torch.Tensor]:
            with torch.inference_mode():
                out = self.model(torch.cat(rows))
            return list(out.split(1))

        async def __call__(self, request: Request) -> Response:
            from grains.serving import oip

            header = request.headers.get(oip.HEADER)
            req, tensors = oip.decode_request(await request.body(), int(header) if header else None)
            out = await self.forward(tensors["input"])
            payload, json_length = oip.encode_response(req, "digits", "1", {"output": out})
            if json_length is None:
                return Response(payload, media_type=oip.JSON_TYPE)
            return Response(payload, media_type=oip.BINARY_TYPE, headers={oip.HEADER: str(json_length)})

    factory, _ = MODELS["digits"]
    serve.run(V2.bind(factory, weights["digits"]), name="digits", route_prefix="/v2/models/digits")  # type: ignore[attr-defined]
    print("ready", flush=True)
    sys.stdin.read()  # until bench_serving closes it
    serve.shutdown()
    ray.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--weights", required=True, help="JSON {model name: state_dict path}")
    parser.add_argument("--http", type=int, default=None, metavar="PORT", help="serve digits over V2 HTTP on PORT")
    args = parser.parse_args()
    common.fix_torch_threads()
    if args.http is not None:
        serve_http(json.loads(args.weights), args.http)
        return 0
    result = asyncio.run(measure(json.loads(args.weights), args.quick))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
