"""Serving trained models: batched, replicated inference grains behind the Open Inference Protocol.

Silos host ``--grains grains.serving`` (and ``grains.training`` where the
jobs run); ``redgrain serve --job JOB --name NAME`` deploys the job's model
and answers KServe V2 REST requests; from Python::

    await deploy(client, "digits", ServeSpec(job="digits"))
    y = await client.get_grain(ModelGrain, "digits").predict(x)

Names load on first use: the dashboard imports the torch-free
``grains.serving.records`` without importing torch (docs/serving.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from silo.lazy import lazy_exports

if TYPE_CHECKING:
    from grains.serving.client import Predictor, deploy
    from grains.serving.model import Deployment, DeploymentGrain, GpuModelGrain, ModelGrain
    from grains.serving.spec import ModelInfo, ServeSpec, TensorSpec
    from grains.serving.tensors import Inference

_LAZY = {
    "Deployment": "grains.serving.model",
    "DeploymentGrain": "grains.serving.model",
    "GpuModelGrain": "grains.serving.model",
    "Inference": "grains.serving.tensors",
    "ModelGrain": "grains.serving.model",
    "ModelInfo": "grains.serving.spec",
    "Predictor": "grains.serving.client",
    "ServeSpec": "grains.serving.spec",
    "TensorSpec": "grains.serving.spec",
    "deploy": "grains.serving.client",
}

__all__ = [
    "Deployment",
    "DeploymentGrain",
    "GpuModelGrain",
    "Inference",
    "ModelGrain",
    "ModelInfo",
    "Predictor",
    "ServeSpec",
    "TensorSpec",
    "deploy",
]

__getattr__ = lazy_exports(__name__, _LAZY)
