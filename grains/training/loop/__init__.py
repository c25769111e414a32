"""The one training loop of every mode: the user's program, the step runner (autocast,
accumulation, the non-finite rule, loss scaling, clipping), the optimizer and schedule, and
gradient compression."""
