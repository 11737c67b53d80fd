"""The gateway tests use the model fixtures of tests/conftest.py (tests/model_fixtures.py)."""
