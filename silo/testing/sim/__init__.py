"""Deterministic simulation: a whole cluster in one process, on virtual time, under one seed.

``python -m silo.testing.sim run --seeds 1-200`` runs one simulated cluster per
seed (:mod:`silo.testing.sim.world`): real silo components over the Redis
twins and the in-memory network, on an event loop whose time is virtual and
whose task order is drawn from the seed (:mod:`silo.testing.sim.loop`), with
faults drawn from the seed (Redis failovers: :mod:`silo.testing.sim.replication`), and checks the recorded history against the
promises of docs/concepts.md and docs/reliability.md
(:mod:`silo.testing.sim.checks`). The same seed replays the same run, event
for event; ``scale`` runs a large cluster's membership on virtual time
(:mod:`silo.testing.sim.scale`). The ``services`` scenario
(:mod:`silo.testing.sim.services`) also runs each silo's reminders and stream
delivery on one command-level Redis twin (:mod:`silo.testing.sim.redis_twin`,
fakeredis). docs/reliability.md ("Simulation") says
what is modelled and what is left to the real-process tests.
"""
