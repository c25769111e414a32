"""Parameter-server training (modes ``sync``, ``async``, ``ssp``): parameter shards, trainers that
pull and push, and the driver that places and re-forms them."""
