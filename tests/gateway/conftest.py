"""The model fixtures the node tests use serve the gateway tests too."""

from tests.web.conftest import (  # noqa: F401
    agent_models,
    agent_node,
    long_id,
    model_dirs,
    scripted_id,
    tiny_id,
)
