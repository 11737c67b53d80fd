"""One shared node process serving a scripted model and a tiny random llama."""

from __future__ import annotations

import signal

import pytest

from tests.engine.tiny import FIXTURE_MODELS
from tests.web.node_proc import scripted_model, start_node, tiny_model

SCRIPT = "Hello world. The answer is 42, and that is final."


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    if not FIXTURE_MODELS.is_dir():
        pytest.skip("shared fixtures absent")
    root = tmp_path_factory.mktemp("models")
    return {
        "scripted": scripted_model(root, SCRIPT),
        # 256 positions: context limits are reachable in a test
        # the tokenizer's whole vocabulary: chat templates use ids far above 512
        "tiny": tiny_model(root, "smollm2", max_position_embeddings=256, vocab_size=49152),
        # long enough to still be generating when a test looks
        "long": tiny_model(root / "c", "smollm2", max_position_embeddings=8192, vocab_size=49152),
        "tiny2": tiny_model(root / "b", "qwen3", max_position_embeddings=256, vocab_size=49152),
    }


@pytest.fixture(scope="session")
def node(tmp_path_factory, model_dirs):
    """The node most tests share: scripted + tiny llama, roomy admission."""
    proc = start_node(
        tmp_path_factory.mktemp("node"),
        [model_dirs["scripted"], model_dirs["tiny"], model_dirs["long"]],
    )
    yield proc
    proc.stop(signal.SIGTERM)


@pytest.fixture(scope="session")
def scripted_id(model_dirs) -> str:
    return str(model_dirs["scripted"])


@pytest.fixture(scope="session")
def tiny_id(model_dirs) -> str:
    return str(model_dirs["tiny"])


@pytest.fixture(scope="session")
def long_id(model_dirs) -> str:
    return str(model_dirs["long"])
