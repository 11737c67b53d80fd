"""The model fixtures the node tests use serve the gateway tests too."""

from tests.web.conftest import long_id, model_dirs, scripted_id, tiny_id  # noqa: F401
