"""Pipeline training (mode ``pipeline``, hybrid with several replicas): the model cut into stage
grains on different silos, each running its schedule's action list (GPipe or 1F1B)."""
