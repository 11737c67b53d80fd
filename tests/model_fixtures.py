"""The models the server tests share (a scripted model, tiny random llama/qwen3 models, and
scripted answers spoken through the real Qwen3 vocabulary) and the node serving the
latter. Registered once, in tests/conftest.py, so node and gateway tests share one of each."""

from __future__ import annotations

import json
import signal

import pytest

from tests.shared_fixtures import need_shared
from tests.web.node_proc import scripted_model, start_node, tiny_model

SCRIPT = "Hello world. The answer is 42, and that is final."


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    need_shared()
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
def scripted_id(model_dirs) -> str:
    return str(model_dirs["scripted"])


@pytest.fixture(scope="session")
def tiny_id(model_dirs) -> str:
    return str(model_dirs["tiny"])


@pytest.fixture(scope="session")
def long_id(model_dirs) -> str:
    return str(model_dirs["long"])


# -- agents' protocols: scripted answers through the real Qwen3 tokenizer and templates ----

QWEN3 = "Qwen3-0.6B"
QWEN35_TEMPLATE = "Qwen3.5-4B/Qwen3.5-4B.jinja"  # opens <think> in the generation prompt
QWEN3_CODER_TEMPLATE = "Qwen3-Coder-30B-A3B-Instruct/Qwen3-Coder.jinja"

REASONING = "Two and two. Let me count: one, two, three, four. So it is four, surely."
AGENT_SCRIPTS = {
    "think": f"<think>\n{REASONING}\n</think>\n\nThe answer is 4.",
    # the template opens <think> itself: the model's first words are reasoning
    "opens": f"{REASONING}\n</think>\n\nThe answer is 4.",
    "calls": (
        "I will look both up.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Zürich 🇨🇭", "days": 3}}\n'
        "</tool_call>\n<tool_call>\n<function=search>\n<parameter=query>\nbest café ☕\n"
        "</parameter>\n<parameter=limit>\n5\n</parameter>\n<parameter=exact>\ntrue\n"
        '</parameter>\n<parameter=filters>\n{"open": true}\n</parameter>\n'
        "<parameter=score>\nvery high\n</parameter>\n</function>\n</tool_call>"
    ),
    "slip": '<tool_call>\n{"arguments": {"name": "get_weather", "city": "Oslo"}}}}\n</tool_call>',
    "garbage": "<tool_call>\nget_weather(city=Oslo)\n</tool_call>",
    "plain": "I would rather not call a tool.",
    # whole calls in each format, as a model writes them when tool_choice demands one: the
    # grammar that constrains a demanded call must let each through unchanged
    "forced_json": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    "forced_xml": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
        "</function>\n</tool_call>"
    ),
    "think_call": (
        f"<think>\n{REASONING}\n</think>\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    ),
}


@pytest.fixture(scope="session")
def agent_models(tmp_path_factory) -> dict[str, str]:
    need_shared()
    root = tmp_path_factory.mktemp("agent-models")
    dirs = {
        name: scripted_model(
            root,
            script,
            name,
            tokenizer_from=QWEN3,
            chat_template={"opens": QWEN35_TEMPLATE, "forced_xml": QWEN3_CODER_TEMPLATE}.get(name),
        )
        for name, script in AGENT_SCRIPTS.items()
    }
    dirs["coder"] = scripted_model(
        root, "ok", "coder", tokenizer_from=QWEN3, chat_template=QWEN3_CODER_TEMPLATE
    )
    # no tool-call markers in its vocabulary: a demanded call cannot be constrained
    dirs["plain_smol"] = scripted_model(root, AGENT_SCRIPTS["plain"], "plain_smol")
    # markers that are *special* tokens (as [THINK] is in Mistral vocabularies)
    dirs["special"] = scripted_model(root, AGENT_SCRIPTS["think"], "special", tokenizer_from=QWEN3)
    tokenizer = json.loads((dirs["special"] / "tokenizer.json").read_text())
    for token in tokenizer["added_tokens"]:
        if token["content"] in ("<think>", "</think>"):
            token["special"] = True
    (dirs["special"] / "tokenizer.json").write_text(json.dumps(tokenizer))
    return {name: str(d) for name, d in dirs.items()}


@pytest.fixture(scope="module")
def agent_node(tmp_path_factory, agent_models):
    """A node serving scripted answers spoken through the Qwen3 vocabulary. A module's: its
    fifteen model workers hold ~6.5 GB, which a session's fixture kept on every xdist worker
    that ever ran one of its five modules until the run ended (three of them OOM-killed CI
    on 24 GiB)."""
    proc = start_node(tmp_path_factory.mktemp("agent-node"), list(agent_models.values()))
    yield proc
    proc.stop(signal.SIGTERM)
