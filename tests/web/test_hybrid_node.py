"""A hybrid Qwen3.5 model (Gated DeltaNet + gated attention) served by a real node process.

A recurrent state cannot be rewound, so the engine resumes a hybrid model's prompt only from
a snapshot taken right after the last special token of an earlier prompt (the `<|im_start|>`
opening the assistant turn). A multi-turn chat must therefore hit the cache from its second
turn on, report it in `usage.prompt_tokens_details.cached_tokens`, and answer exactly what a
node without the prefix cache answers."""

from __future__ import annotations

import json
import signal

import httpx
import pytest

from tests.engine.tiny import make_tiny_new_family
from tests.shared_fixtures import needs_shared
from tests.web.node_proc import NodeProcess, start_node

pytestmark = needs_shared

TOKENIZER = "Qwen3-0.6B"
# The tokenizer's whole vocabulary (added tokens included: <|im_start|> is 151644), as the
# real Qwen3 models size their embeddings.
VOCAB = 151936
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory) -> dict[str, str]:
    """The conditional-generation layout (text_config + vision tower) and the text-only one."""
    root = tmp_path_factory.mktemp("hybrid")
    dirs = {}
    for kind in ("qwen3_5", "qwen3_5_text"):
        model_dir, _ = make_tiny_new_family(kind, root, vocab_size=VOCAB, tokenizer=TOKENIZER)
        dirs[kind] = str(model_dir)
    return dirs


@pytest.fixture(scope="module")
def model_id(hybrid_dirs) -> str:
    return hybrid_dirs["qwen3_5"]


@pytest.fixture(scope="module")
def cached_node(tmp_path_factory, hybrid_dirs):
    proc = start_node(tmp_path_factory.mktemp("cached"), list(hybrid_dirs.values()))
    yield proc
    proc.stop(signal.SIGTERM)


@pytest.fixture(scope="module")
def uncached_node(tmp_path_factory, model_id):
    proc = start_node(
        tmp_path_factory.mktemp("uncached"),
        [model_id],
        engine={"enable_prefix_caching": False},
    )
    yield proc
    proc.stop(signal.SIGTERM)


@pytest.fixture(scope="module")
def tokenizer(model_id):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_id)


# -- helpers ------------------------------------------------------------------------------


def _body(model: str, messages: list[dict], **kw) -> dict:
    return {"model": model, "messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS, **kw}


def chat(node: NodeProcess, model: str, messages: list[dict]) -> tuple[str, dict]:
    r = node.post("/v1/chat/completions", _body(model, messages))
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"]


def chat_streamed(node: NodeProcess, model: str, messages: list[dict]) -> tuple[str, dict]:
    body = _body(model, messages, stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", node.v1 + "/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"], "include_usage: a trailing usage chunk"
    return text, last["usage"]


def cached(usage: dict) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def converse(node: NodeProcess, model: str, system: str, users: list[str]):
    """Run a chat turn by turn, echoing each reply back: [(messages, content, usage)]."""
    turns = []
    messages = [{"role": "system", "content": system}]
    for text in users:
        messages = [*messages, {"role": "user", "content": text}]
        content, usage = chat(node, model, messages)
        turns.append((messages, content, usage))
        messages = [*messages, {"role": "assistant", "content": content}]
    return turns


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The prompt as HF renders it (the node defaults `enable_thinking` to off)."""
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


def after_last_special(tokenizer, ids: list[int]) -> int:
    """Where the engine snapshots a hybrid prompt: right after its last special token."""
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return max(i for i, t in enumerate(ids) if t in special) + 1


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# -- the prefix cache over a conversation -------------------------------------------------

USERS = ["Name three rivers.", "Which is the longest?", "And the shortest?"]


@pytest.fixture(scope="module")
def conversation(cached_node, model_id):
    return converse(cached_node, model_id, "You are a terse geographer.", USERS)


def test_later_turns_resume_from_the_snapshot_after_the_previous_prompt(conversation, tokenizer):
    prompts = [prompt_ids(tokenizer, messages) for messages, _, _ in conversation]
    for ids, (_, content, usage) in zip(prompts, conversation, strict=True):
        assert usage["prompt_tokens"] == len(ids)  # the node renders as HF does
        assert usage["completion_tokens"] == MAX_TOKENS and content
    assert cached(conversation[0][2]) == 0  # nothing to resume the first turn from
    for turn in (1, 2):
        hit = cached(conversation[turn][2])
        previous, now = prompts[turn - 1], prompts[turn]
        assert 0 < hit <= shared_prefix(previous, now) < len(now)
        # exactly where the previous turn's prompt was snapshotted: after its <|im_start|>
        assert hit == after_last_special(tokenizer, previous)
        assert previous[hit - 1] == tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_the_cached_answers_equal_a_node_without_the_prefix_cache(
    conversation, uncached_node, model_id
):
    for messages, content, usage in conversation:
        plain_content, plain_usage = chat(uncached_node, model_id, messages)
        assert plain_content == content
        assert plain_usage["completion_tokens"] == usage["completion_tokens"]
        assert plain_usage["prompt_tokens"] == usage["prompt_tokens"]
        assert cached(plain_usage) == 0


def test_a_streamed_turn_reports_the_same_hit_and_text(
    cached_node, uncached_node, model_id, tokenizer
):
    ((messages, first, _),) = converse(cached_node, model_id, "You are a terse chemist.", USERS[:1])
    messages = [*messages, {"role": "assistant", "content": first}]
    messages.append({"role": "user", "content": USERS[1]})
    expected = after_last_special(tokenizer, prompt_ids(tokenizer, messages[:2]))

    text, usage = chat_streamed(cached_node, model_id, messages)
    assert cached(usage) == expected > 0
    assert usage["completion_tokens"] == MAX_TOKENS
    plain_text, plain_usage = chat(uncached_node, model_id, messages)
    assert text == plain_text and cached(plain_usage) == 0

    # the streamed turn was snapshotted too: the same prompt again resumes from that one
    again, again_usage = chat(cached_node, model_id, messages)
    assert again == text
    assert cached(again_usage) == after_last_special(tokenizer, prompt_ids(tokenizer, messages))
    assert cached(again_usage) > cached(usage)


def test_the_text_only_layout_serves_and_hits_the_cache_too(cached_node, hybrid_dirs, tokenizer):
    text_id = hybrid_dirs["qwen3_5_text"]
    turns = converse(cached_node, text_id, "You are a terse baker.", USERS[:2])
    assert cached(turns[0][2]) == 0
    first_prompt = prompt_ids(tokenizer, turns[0][0])
    assert cached(turns[1][2]) == after_last_special(tokenizer, first_prompt) > 0


# -- what the model accepts ---------------------------------------------------------------


def test_the_vision_layout_takes_images_and_the_text_layout_does_not(cached_node, hybrid_dirs):
    cards = {m["id"]: m for m in cached_node.get("/v1/models").json()["data"]}
    models = {m["id"]: m for m in cached_node.get("/models").json()}
    for kind, caps in (("qwen3_5", ["text", "image"]), ("qwen3_5_text", ["text"])):
        model = hybrid_dirs[kind]
        assert cards[model]["capabilities"] == caps
        assert models[model]["status"] == "loaded"
        assert models[model]["capabilities"] == caps


@pytest.mark.parametrize("stream", [False, True])
def test_an_image_part_is_refused_by_the_text_only_layout(cached_node, hybrid_dirs, stream):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    content = [{"type": "text", "text": "What is this?"}, image]
    body = _body(hybrid_dirs["qwen3_5_text"], [{"role": "user", "content": content}], stream=stream)
    r = cached_node.post("/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "vision_unsupported"
    # the vision layout reads the image: this one is a PNG signature and nothing more
    body["model"] = hybrid_dirs["qwen3_5"]
    r = cached_node.post("/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_image", r.text
    assert err["type"] == "invalid_request_error" and err["message"]
