"""How each mode runs a job (Lightning's Strategy): one subpackage per mode, each a driver (what
the coordinator runs), the mode's grains and their cores.

- :mod:`~grains.training.strategies.ps`: a parameter server (modes ``sync``, ``async``, ``ssp``);
- :mod:`~grains.training.strategies.allreduce`: a torch.distributed group (mode ``allreduce``);
- :mod:`~grains.training.strategies.pipeline`: stages on silos (mode ``pipeline``, and hybrid).

Drivers see the coordinator only through :class:`~grains.training.strategies.driver.JobContext`;
the modes never import each other (both checked by ``.importlinter``)."""
