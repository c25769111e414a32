"""The web dashboard (FastAPI); reads only what silos publish to Redis."""
