"""Test doubles and local clusters, public like ``trio.testing``.

In-memory twins of every seam (directory, membership table, state store,
transport), a fake clock, the embedded Redis helper and ``LocalCluster``
(a private Redis plus silo subprocesses). Unit tests use the twins; cluster
tests start real processes.
"""
