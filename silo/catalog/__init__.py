"""Activations on one silo: the catalog, turns and mailboxes, timers, state handles, the grain context."""
