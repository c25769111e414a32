"""Where a job is in its data (counted in samples) and the batches each trainer takes there.

The built-in datasets are :mod:`grains.training.datasets` (job specs name that path)."""
