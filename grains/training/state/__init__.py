"""A job's state at a step: the one snapshot format of every mode, which steps are checkpoints,
their store, what a model holds by kind, and saved ``state_dict`` files read without unpickling."""
