"""Where an activation is in its life: the one thing every part of the catalog compares against.

A leaf, so the modules an activation is made of (its state handles, its
timers) and those that watch it (the catalog, the dispatcher, the migrator)
read its state without importing the activation, and it can import them.
"""

from __future__ import annotations

import enum


class ActivationState(enum.StrEnum):
    """Where an activation is in its life; it only ever moves down this list."""

    ACTIVATING = "activating"
    """Created and registered; state loading and ``on_activate`` run. Calls queue, none runs."""
    ACTIVE = "active"
    """Serving turns."""
    DEACTIVATING = "deactivating"
    """Taking no new calls; the running turns finish, queued calls go back for re-routing."""
    INACTIVE = "inactive"
    """Gone: unregistered, or never started (activation failed, silo declared dead)."""
