"""Files mypy checks in tests/grains/test_typed_refs.py; none of them is a test module."""
