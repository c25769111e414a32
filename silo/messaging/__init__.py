"""Calls between processes: framing and transport, the router (calls out) and the dispatcher (calls in)."""
