"""Images through a real node and a real gateway (issue 37): a tiny random Qwen3.5 in the
ConditionalGeneration layout with a vision tower, the real Qwen3.5 template and the Qwen3
tokenizer. Its answers over the OpenAI chat, Responses and (through the gateway) Anthropic
routes are transformers' greedy answer for the same prompt and pixels; the prompt's image
tokens count in `prompt_tokens`; Claude Code's image blocks (a pasted screenshot, and an
image a tool returned) pass the gateway."""

from __future__ import annotations

import base64
import io
import json
import signal
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import torch
from PIL import Image

from helexa.engine.vision.inputs import VisionProfile
from helexa.engine.vision.preprocess import patches, resize_image
from tests.engine.tiny import VISION_TOKENS, make_tiny_new_family, make_tiny_vision_model
from tests.gateway.gateway_proc import start_gateway
from tests.shared_fixtures import FIXTURE_MODELS, needs_shared
from tests.web.node_proc import start_node

pytestmark = needs_shared

MAX_TOKENS = 6
PAD = VISION_TOKENS["image_token_id"]
QUESTION = "What is in this picture?"
NO_THINKING = {"enable_thinking": False}


def _png(height: int, width: int, seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    pixels = (torch.rand(height, width, 3, generator=g) * 255).byte().numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


IMAGE = _png(100, 200, 0)
DATA_URL = "data:image/png;base64," + base64.b64encode(IMAGE).decode()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision")
    vision_dir, hf = make_tiny_vision_model("qwen3_5", root)
    text_dir, _ = make_tiny_new_family("qwen3_5_text", root, vocab_size=151936)
    node = start_node(root / "node", [vision_dir, text_dir])
    gw = start_gateway(root / "gw", {"n": node})
    yield {"vision": str(vision_dir), "text": str(text_dir), "hf": hf, "node": node, "gw": gw}
    gw.stop(signal.SIGTERM)
    node.stop(signal.SIGTERM)


def _reference(served) -> tuple[str, int]:
    """transformers' greedy answer (text) and prompt length for QUESTION about IMAGE, with
    the template rendered by transformers' tokenizer and the pad run widened as its
    processor does."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(served["vision"])
    template = (FIXTURE_MODELS / "Qwen3.5-4B" / "Qwen3.5-4B.jinja").read_text()
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}
    ]
    text = tok.apply_chat_template(
        messages, chat_template=template, add_generation_prompt=True, tokenize=False, **NO_THINKING
    )
    profile = VisionProfile.from_configs(
        json.loads(Path(served["vision"], "config.json").read_text()), None
    )
    image = resize_image(Image.open(io.BytesIO(IMAGE)), profile)
    ids = []
    for t in tok.encode(text, add_special_tokens=False):
        ids += [PAD] * image.num_tokens(profile) if t == PAD else [t]
    input_ids = torch.tensor([ids])
    out = served["hf"].generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        pixel_values=patches(image, profile),
        image_grid_thw=torch.tensor([image.grid(profile)]),
        mm_token_type_ids=(input_ids == PAD).int(),
        max_new_tokens=MAX_TOKENS,
        min_new_tokens=MAX_TOKENS,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    answer = tok.decode(out[0, len(ids) :], skip_special_tokens=True)
    return answer, len(ids)


@pytest.fixture(scope="module")
def reference(served) -> tuple[str, int]:
    return _reference(served)


def _openai_parts() -> list[dict]:
    return [
        {"type": "image_url", "image_url": {"url": DATA_URL}},
        {"type": "text", "text": QUESTION},
    ]


def test_the_openai_sdk_gets_transformers_answer_and_image_tokens_count(served, reference):
    client = openai.OpenAI(base_url=served["node"].v1, api_key="unused", max_retries=0)
    r = client.chat.completions.create(
        model=served["vision"],
        messages=[{"role": "user", "content": _openai_parts()}],
        temperature=0,
        max_tokens=MAX_TOKENS,
        extra_body={"chat_template_kwargs": NO_THINKING, "ignore_eos": True},
    )
    answer, prompt_len = reference
    assert r.choices[0].message.content == answer
    assert r.usage.prompt_tokens == prompt_len > 72  # the image's 72 pad tokens counted


def test_the_responses_route_takes_input_image(served, reference):
    client = openai.OpenAI(base_url=served["node"].v1, api_key="unused", max_retries=0)
    r = client.responses.create(
        model=served["vision"],
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": DATA_URL},
                    {"type": "input_text", "text": QUESTION},
                ],
            }
        ],
        temperature=0,
        max_output_tokens=MAX_TOKENS,
        extra_body={"chat_template_kwargs": NO_THINKING, "ignore_eos": True},
    )
    assert r.usage.input_tokens == reference[1]


def test_the_anthropic_sdk_through_the_gateway_gets_the_same_answer(served, reference):
    claude = anthropic.Anthropic(base_url=served["gw"].base_url, api_key="unused", max_retries=0)
    block = {"type": "base64", "media_type": "image/png", "data": DATA_URL.split(",", 1)[1]}
    r = claude.messages.create(
        model=served["vision"],
        max_tokens=MAX_TOKENS,
        messages=[
            {
                "role": "user",
                "content": [{"type": "image", "source": block}, {"type": "text", "text": QUESTION}],
            }
        ],
        extra_body={"ignore_eos": True, "temperature": 0},
    )
    answer, prompt_len = reference
    assert "".join(b.text for b in r.content if b.type == "text") == answer
    # the same image and text as the OpenAI request before: the node's prefix cache resumed
    # it past the image (a snapshot after the last special token), and Anthropic's usage
    # splits the prompt into what was read from the cache and the rest
    usage = r.usage
    assert usage.cache_read_input_tokens > 72
    assert usage.input_tokens + usage.cache_read_input_tokens == prompt_len


def test_claude_codes_image_blocks_pass_the_gateway(served):
    """A captured Claude Code request (its system prompt, metadata, thinking, output_config,
    context_management and headers), with a pasted screenshot in the user's turn and an
    image a tool returned (its Read tool on a .png) inside a tool_result."""
    capture = json.loads(
        (
            FIXTURE_MODELS.parent / "traffic" / "claude-code" / "004-tool-post-v1-messages.json"
        ).read_text()
    )
    body = capture["body"]
    source = {"type": "base64", "media_type": "image/png", "data": DATA_URL.split(",", 1)[1]}
    body["messages"] = [
        {
            "role": "user",
            "content": [
                {"type": "image", "source": source},
                {
                    "type": "text",
                    "text": "Read shot.png too",
                    "cache_control": {"type": "ephemeral"},
                },
            ],
        },
        {
            "role": "assistant",
            "content": [
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "Read",
                    "input": {"file_path": "/tmp/shot.png"},
                }
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "image", "source": source}],
                }
            ],
        },
    ]
    # its Read tool alone (the other 23 tools' schemas would not fit the tiny model's context)
    body["tools"] = [t for t in body["tools"] if t["name"] == "Read"]
    body.update(model=served["vision"], max_tokens=MAX_TOKENS, stream=False)
    headers = {
        k: v
        for k, v in capture["headers"].items()
        if k.lower().startswith(("anthropic-", "user-agent", "x-app"))
    }
    r = httpx.post(f"{served['gw'].base_url}/v1/messages", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    prompt = sum(
        usage[k] for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    )
    assert prompt > 2 * 72  # both images' tokens


def test_models_advertise_images_for_the_vision_checkpoint_only(served):
    for path in ("/v1/models", "/models"):
        listed = served["node"].get(path).json()
        entries = {m["id"]: m for m in (listed["data"] if path == "/v1/models" else listed)}
        assert entries[served["vision"]]["capabilities"] == ["text", "image"], path
        assert entries[served["text"]]["capabilities"] == ["text"], path


def test_a_text_only_model_and_a_remote_url_are_refused_with_400(served):
    node = served["node"]
    r = node.post(
        "/v1/chat/completions",
        {"model": served["text"], "messages": [{"role": "user", "content": _openai_parts()}]},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "vision_unsupported"
    remote = [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]
    r = node.post(
        "/v1/chat/completions",
        {"model": served["vision"], "messages": [{"role": "user", "content": remote}]},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "image_url_not_allowed", r.text
