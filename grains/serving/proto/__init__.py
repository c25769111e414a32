"""The Open Inference Protocol's gRPC definition and the Python modules ``make proto`` generates from it.

The ``_pb2`` modules are committed so that an install needs no protoc; their
messages live in a descriptor pool of their own, not protobuf's default one,
so they import beside tritonclient's copy of the same ``inference.*`` names
(docs/decisions.md).
"""
