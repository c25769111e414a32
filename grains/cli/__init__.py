"""The faces: the ``redgrain`` command and the demo. They may use every layer below them."""
