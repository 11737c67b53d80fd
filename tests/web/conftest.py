"""One shared node process serving a scripted model and a tiny random llama; the model
fixtures themselves live in tests/model_fixtures.py (shared with the gateway tests)."""

from __future__ import annotations

import signal

import pytest

from tests.model_fixtures import REASONING, SCRIPT  # noqa: F401  (tests import them from here)
from tests.web.node_proc import start_node


@pytest.fixture(scope="session")
def node(tmp_path_factory, model_dirs):
    """The node most tests share: scripted + tiny llama, roomy admission."""
    proc = start_node(
        tmp_path_factory.mktemp("node"),
        [model_dirs["scripted"], model_dirs["tiny"], model_dirs["long"]],
    )
    yield proc
    proc.stop(signal.SIGTERM)
