"""Pipeline training (mode ``pipeline``; hybrid: several trainers, each a copy of the pipeline): the
model cut into stage grains on different silos, each running its schedule's action list (GPipe or 1F1B)."""
