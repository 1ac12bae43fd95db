"""Helpers shared by the HTTP suite (tests/conftest.py) and the Python API tests
(tests/python/conftest.py). Standard library and pytest only."""
