"""Grain state (fenced, etagged, chunked for big tensors) and group checkpoints in Redis."""
