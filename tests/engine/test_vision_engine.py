"""Images through the engine (issue 37): tiny random Qwen3.5 / Qwen3.5-MoE checkpoints in the
ConditionalGeneration layout, with a vision tower, against transformers in float32: the
tower's output spliced into the pad rows (chunks cutting through them), M-RoPE positions,
images batched with text, and the prefix cache keyed by the pixels."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from helexa.engine import LLM, SamplingParams
from helexa.engine.vision.inputs import ImageInput
from helexa.engine.vision.preprocess import patches, resize_image
from tests.engine.test_parity import (
    EXACT,
    LOGITS_ATOL,
    _hf_greedy,
    _record_logits,
    assert_same_greedy_run,
)
from tests.engine.tiny import VISION_TOKENS, make_tiny_vision_model
from tests.shared_fixtures import needs_shared

pytestmark = needs_shared

PAD = VISION_TOKENS["image_token_id"]
START, END = VISION_TOKENS["vision_start_token_id"], VISION_TOKENS["vision_end_token_id"]
IM_START, IM_END, NL = 151644, 151645, 198
NUM_TOKENS = 8


def _image(height: int, width: int, seed: int) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(height, width, 3, generator=g) * 255).byte().numpy())


def _prompt(images: list[ImageInput], llm: LLM, words: list[int]) -> list[int]:
    """A user turn with the images between words, then the assistant's turn opened (its
    `<|im_start|>` a special token after the images: where a hybrid model snapshots)."""
    profile = llm.engine.loaded.vision
    ids = [IM_START, 872, NL, words[0]]
    for i, image in enumerate(images):
        ids += [START, *[PAD] * image.num_tokens(profile), END, words[(i + 1) % len(words)]]
    return [*ids, IM_END, NL, IM_START, 77091, NL]


def _reference(hf, prompt: list[int], images: list[ImageInput], profile):
    """transformers' greedy tokens and logits for the prompt with its images."""
    ids = torch.tensor([prompt])
    extra = {}
    if images:
        extra = dict(
            pixel_values=torch.cat([patches(i, profile) for i in images]),
            image_grid_thw=torch.tensor([i.grid(profile) for i in images]),
            mm_token_type_ids=(ids == PAD).int(),
        )
    return _hf_greedy(hf, prompt, NUM_TOKENS, **extra)


def _assert_matches_transformers(llm, hf, cases, label: str, atol: float = LOGITS_ATOL):
    """`cases` ((prompt, images) each) batched through `llm`, against transformers: the
    same greedy tokens, logits within `atol` at every step. Returns the sequences."""
    profile = llm.engine.loaded.vision
    seen = _record_logits(llm)
    seqs = _run(llm, cases)
    for (prompt, images), seq in zip(cases, seqs, strict=True):
        ref_tokens, ref_logits = _reference(hf, prompt, images, profile)
        assert_same_greedy_run(
            seq.output_token_ids,
            torch.stack(seen[seq.request_id]),
            ref_tokens,
            ref_logits,
            f"{label} with {len(images)} images",
            atol=atol,
        )
    return seqs


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def vision_model(request, tmp_path_factory):
    model_dir, hf = make_tiny_vision_model(request.param, tmp_path_factory.mktemp("vision"))
    # chunks of 24 tokens: every image's pad run (72 and 60 tokens) is cut by several
    llm = LLM(str(model_dir), **EXACT)
    return request.param, llm, hf


def _run(llm: LLM, prompts: list[tuple[list[int], list[ImageInput]]]):
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    seqs = []
    for ids, images in prompts:
        seq = llm.engine.make_sequence(ids, params, images=images or None)
        seqs.append(llm.engine.add_request(seq))
    while not all(s.is_finished for s in seqs):
        llm.engine.step()
    return seqs


def test_images_batched_with_text_match_transformers(vision_model):
    kind, llm, hf = vision_model
    profile = llm.engine.loaded.vision
    wide = resize_image(_image(100, 200, 0), profile)  # 192x384: 6x12 tokens
    tall = resize_image(_image(300, 120, 1), profile)  # taller than wide
    assert (wide.height < wide.width) and (tall.height > tall.width)
    cases = [
        (_prompt([wide], llm, [3838, 374]), [wide]),
        (_prompt([tall, wide], llm, [3838, 374, 279]), [tall, wide]),
        ([IM_START, 872, NL, *range(1000, 1040), IM_END, NL, IM_START, 77091, NL], []),
    ]
    seqs = _assert_matches_transformers(llm, hf, cases, kind)
    # M-RoPE moved the text after the images: an image takes max(rows, cols) positions
    assert seqs[0].position_offset == 12 - 72 and seqs[2].position_offset == 0


def test_a_repeated_image_hits_the_prefix_cache_and_a_different_one_never_does(vision_model):
    _, llm, hf = vision_model
    profile = llm.engine.loaded.vision
    first = resize_image(_image(100, 200, 7), profile)
    other = resize_image(_image(100, 200, 8), profile)  # the same size: the same token ids
    prompt = _prompt([first], llm, [3838, 374])
    assert _prompt([other], llm, [3838, 374]) == prompt
    (a,) = _run(llm, [(prompt, [first])])
    (b,) = _run(llm, [(prompt, [first])])
    (c,) = _run(llm, [(prompt, [other])])
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens == len(prompt) - 2  # resumed after the last special token
    assert b.output_token_ids == a.output_token_ids
    assert c.num_cached_tokens == 0  # the pixels differ: no block and no snapshot matches
    ref_tokens, _ = _reference(hf, prompt, [other], profile)
    assert c.output_token_ids == ref_tokens


def test_each_image_is_encoded_once_within_the_step_budget(vision_model, monkeypatch):
    _, llm, _ = vision_model
    profile = llm.engine.loaded.vision
    images = [resize_image(_image(100, 200, s), profile) for s in (11, 12)]
    tower = llm.engine.runner.model.visual
    calls: list[int] = []
    real = tower.encode
    monkeypatch.setattr(
        tower, "encode", lambda imgs, prof: calls.append(len(imgs)) or real(imgs, prof)
    )
    (seq,) = _run(llm, [(_prompt(images, llm, [3838, 374, 279]), images)])
    # 24-token chunks: the first image in the first step, the second when a chunk reaches it;
    # each run's output dropped once its KV is computed
    assert calls == [1, 1]
    assert all(p.embeds is None for p in seq.mm.images)


def test_images_that_do_not_match_their_placeholders_are_refused(vision_model):
    _, llm, _ = vision_model
    profile = llm.engine.loaded.vision
    image = resize_image(_image(100, 200, 3), profile)
    params = SamplingParams(max_tokens=1)
    prompt = _prompt([image], llm, [3838, 374])
    with pytest.raises(ValueError, match="placeholder runs for 2 images"):
        llm.engine.make_sequence(prompt, params, images=[image, image])
    with pytest.raises(ValueError, match="takes 72 tokens but its placeholder run has 71"):
        llm.engine.make_sequence(
            [t for i, t in enumerate(prompt) if i != 5], params, images=[image]
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_images_on_cuda_match_transformers(kind, tmp_path):
    """The same parity on a GPU: the tower, the splice and M-RoPE through the Triton path
    (float32, CUDA graphs on for the decode steps)."""
    model_dir, hf = make_tiny_vision_model(kind, tmp_path)
    llm = LLM(str(model_dir), device="cuda", **EXACT)
    profile = llm.engine.loaded.vision
    images = [
        resize_image(_image(100, 200, 0), profile),
        resize_image(_image(300, 120, 1), profile),
    ]
    prompt = _prompt(images, llm, [3838, 374, 279])
    _assert_matches_transformers(llm, hf, [(prompt, images)], f"{kind} on CUDA", atol=1e-3)
