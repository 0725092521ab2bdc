"""The test kit: one helper per need, shared by unit and integration tests.

Import helpers as ``from tests.kit.<module> import ...``; fixtures reach every test through
``tests/conftest.py``. See ``tests/README.md`` for what each module offers.
"""
