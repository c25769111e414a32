"""Fuzz tests (issue 9)."""
