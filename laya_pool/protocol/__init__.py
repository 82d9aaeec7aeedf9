"""The contract every room shares: the wire format (`protocol.wire`) and the facts around it (`protocol.contract`).

This package imports nothing else of ours, so the client, the worker and the broker can all depend on it
without depending on each other (the one-way import rule is checked by tests/test_imports.py).
"""
