"""Chaos tests (issue 9)."""
