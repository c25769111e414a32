"""What silos publish to Redis for everyone else to read: one module per record, no torch.

The dashboard, the ``redgrain`` command and other silos read the cluster only
through these records (and the keys they live under, ``silo/keys.py``):

* :mod:`~silo.records.membership`: membership rows (``keys.members``):
  address, generation, status, roles, load; written by the membership
  table's Lua scripts;
* :mod:`~silo.records.stats`: silo stats (``keys.silo_stats``), one JSON
  record per silo per second, with every component's ``statistics()`` and
  per-method counters whose latency histograms share fixed buckets, so
  readers can add them up across silos;
* :mod:`~silo.records.events`: cluster events (``keys.events``): joins,
  deaths, drains, rebalances; the writer every silo and the dashboard use,
  and its reader;
* :mod:`~silo.records.progress`: job progress, published by workloads through
  the public grain API (``Grain.publish_progress``); their schemas live with
  the workload (``grains/training/api/records.py``);
* :mod:`~silo.records.control`: control requests (``keys.control``,
  ``keys.job_cancel``): drain a silo, cancel a job; the only writers, shared
  by the CLI and the dashboard;
* :mod:`~silo.records.reminders`, :mod:`~silo.records.streams`,
  :mod:`~silo.records.logs`: readers of what other parts of the runtime
  write (reminder rows, streams and their dead letters, the log stream), for
  the dashboard's pages.

Each name has one home, imported from there: this package re-exports nothing,
so importing one record loads no other (and never the runtime).
"""
