"""Qwen3.5 / Qwen3.5-MoE GGUF files (llama.cpp `qwen35`, `qwen35moe`), written by llama.cpp's
own converter from tiny HF checkpoints, run like the checkpoints they came from.

The converter comes from the llama-cpp-python sdist that scripts/setup-env unpacks into the
venv (`share/llama.cpp-convert`), or from `$HELEXA_LLAMA_CPP` (a llama.cpp checkout); without
either these tests skip, and under CI fail, as the shared fixtures do.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tokenizers
import torch
from safetensors.torch import load_file, save_file

from helexa.engine import LLM, SamplingParams
from helexa.engine.layers.linear import Linear
from helexa.engine.loader.gguf import PRE_TOKENIZERS, load_gguf
from tests.engine.test_gguf_moe import _round_trip, _teacher_forced_logits
from tests.engine.test_parity import EXACT, _hf_greedy, _record_logits, assert_same_greedy_run
from tests.engine.tiny import HYBRID_TEXT, MOE
from tests.shared_fixtures import FIXTURE_MODELS, needs_shared

pytestmark = needs_shared

TOKENIZER = "SmolLM2-135M-Instruct"  # its byte-level BPE is one the converter recognises
VOCAB = 49152  # that tokenizer's: the converter wants every token id below vocab_size
PROMPTS = ([5, 17, 300, 42, 7, 99, 23], [1000, *range(30, 60)])
NUM_TOKENS = 16


def _converter() -> Path:
    """llama.cpp's source dir holding convert_hf_to_gguf.py and gguf-py/."""
    where = os.environ.get("HELEXA_LLAMA_CPP") or Path(sys.prefix) / "share" / "llama.cpp-convert"
    path = Path(where)
    if (path / "convert_hf_to_gguf.py").is_file() and (path / "gguf-py").is_dir():
        return path
    why = f"llama.cpp's convert_hf_to_gguf.py not at {path} (scripts/setup-env, $HELEXA_LLAMA_CPP)"
    if os.environ.get("CI"):
        pytest.fail(f"CI must run every test: {why}", pytrace=False)
    pytest.skip(why)


def _hf_model(kind: str):
    """A tiny random Qwen3.5 (`dense`) or Qwen3.5-MoE (`moe`) CausalLM, float32, eval mode.

    dense: three 32-wide value heads (whole Q8_0 blocks) per key head and an untied lm_head;
    moe: two 24-wide ones (a Q8_0 block spans two heads) and tied embeddings. The converter
    reorders the value heads of both (three per key head: its order is not its own inverse)."""
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(0)
    if kind == "dense":
        text = dict(
            HYBRID_TEXT, linear_key_head_dim=32, linear_value_head_dim=32, linear_num_value_heads=6
        )
        config = Qwen3_5TextConfig(
            **text, vocab_size=VOCAB, intermediate_size=96, tie_word_embeddings=False
        )
        model = Qwen3_5ForCausalLM(config)
    else:
        config = Qwen3_5MoeTextConfig(
            **HYBRID_TEXT, **MOE, vocab_size=VOCAB, shared_expert_intermediate_size=48,
            tie_word_embeddings=True,
        )  # fmt: skip
        model = Qwen3_5MoeForCausalLM(config)
    model = model.float().eval()
    with torch.no_grad():  # random norms and gating parameters, so a misplaced one shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("A_log", "dt_bias")):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _write_checkpoint(hf, out: Path) -> Path:
    """`hf` as save_pretrained writes it, plus an MTP head (a copy of the full-attention
    layer 1 and its projections, as the released checkpoints carry one), and a tokenizer."""
    hf.save_pretrained(out)
    weights = load_file(out / "model.safetensors")
    for name, w in list(weights.items()):
        if name.startswith("model.layers.1."):
            weights[name.replace("model.layers.1.", "mtp.layers.0.")] = w.clone()
    hidden = hf.config.hidden_size
    weights["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        weights[f"mtp.{norm}.weight"] = torch.randn(hidden) * 0.1
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    # transformers' AutoTokenizer swaps in its Qwen3.5 tokenizer class (Qwen3.5's split regex)
    # for a qwen3_5_moe_text dir, but not for qwen3_5_text: with SmolLM2's vocab that regex
    # hashes to a pre-tokenizer the converter does not know. The converter itself goes by
    # `architectures`, so the MoE dir is labelled qwen3_5_text for the tokenizer's sake.
    config["model_type"] = "qwen3_5_text"
    (out / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(FIXTURE_MODELS / TOKENIZER / f, out / f)
    return out


def convert(model_dir: Path, outtype: str, *flags: str) -> Path:
    """llama.cpp's convert_hf_to_gguf.py on `model_dir`, as a user runs it; once per
    `outtype` and `flags`, the file kept beside the checkpoint."""
    out = model_dir.parent / f"{outtype}{''.join(flags)}.gguf"
    if out.exists():
        return out
    llama_cpp = _converter()
    done = subprocess.run(
        [sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(model_dir),
         "--outtype", outtype, "--outfile", str(out), *flags],
        env={**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py"), "HF_HUB_OFFLINE": "1"},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture(scope="module", params=["dense", "moe"])
def tiny(request, tmp_path_factory):
    """(kind, HF model, its checkpoint dir)."""
    _converter()  # skip before building anything
    hf = _hf_model(request.param)
    root = tmp_path_factory.mktemp(request.param)
    return request.param, hf, _write_checkpoint(hf, root / "hf")


def tiled_value_heads(weights: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """HF `weights` with the linear-attention value heads reordered as llama.cpp's converter
    writes them: grouped by key head, [Hk, r], to tiled, [r, Hk] (r value heads per key
    head)."""
    return {name: _move_value_heads(name, w, cfg, tile=True) for name, w in weights.items()}


def grouped_value_heads(weights: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """`tiled_value_heads` undone: a GGUF's value heads back in HF's order."""
    return {name: _move_value_heads(name, w, cfg, tile=False) for name, w in weights.items()}


def _move_value_heads(name: str, w: torch.Tensor, cfg: dict, *, tile: bool) -> torch.Tensor:
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]

    def reorder(x: torch.Tensor, size: int, dim: int = 0) -> torch.Tensor:
        heads = torch.arange(hv * size).reshape(hk, hv // hk, size)
        tiled = heads.transpose(0, 1).reshape(-1)  # the grouped element at each tiled place
        return x.index_select(dim, tiled if tile else tiled.argsort())

    if ".linear_attn." not in name:
        return w
    qk = 2 * hk * dk  # in_proj_qkv's rows and conv1d's channels: q, k, then the value heads
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        return torch.cat([w[:qk], reorder(w[qk:], dv)])
    if name.endswith("in_proj_z.weight"):
        return reorder(w, dv)
    if name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
        return reorder(w, 1)
    if name.endswith("out_proj.weight"):
        return reorder(w, dv, dim=1)
    return w


def _held(hf, outtype: str):
    """`hf` with the weights a converted file holds: F16 or Q8_0 (F16 where a row does not
    split into 32s) for what the converter stores so; F32 for norms, conv1d, A_log, dt_bias
    and the routers, which it always keeps. out_proj's Q8_0 blocks run along its columns in
    the file's tiled order, where a block may span two value heads (24 wide)."""
    held = copy.deepcopy(hf)
    kept = ("conv1d.weight", "mlp.gate.weight", "shared_expert_gate.weight")
    with torch.no_grad():
        for name, p in held.named_parameters():
            if p.ndim < 2 or name.endswith(kept) or outtype == "f32":
                continue
            if outtype == "f16" or p.shape[-1] % 32:
                p.copy_(p.half().float())
            elif name.endswith("out_proj.weight"):
                cfg = hf.config.to_dict()
                tiled = _move_value_heads(name, p, cfg, tile=True)
                stored = torch.from_numpy(_round_trip(tiled.numpy(), "Q8_0"))
                p.copy_(_move_value_heads(name, stored, cfg, tile=False))
            else:
                p.copy_(torch.from_numpy(_round_trip(p.numpy(), "Q8_0")))
    return held


def _generate(path: Path) -> tuple[LLM, list[tuple[list[int], torch.Tensor]]]:
    """Greedy tokens and per-step logits of each prompt, batched, prefilled in small chunks."""
    llm = LLM(str(path), **EXACT, autotune=False)  # kernel plans: beside the point here
    seen = _record_logits(llm)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate(list(PROMPTS), params)
    return llm, [(o.token_ids, torch.stack(seen[o.request_id])) for o in outputs]


def test_a_converted_file_maps_to_the_hf_config_without_its_mtp_head(tiny):
    kind, hf, model_dir = tiny
    model = load_gguf(convert(model_dir, "f32"))
    cfg, ref = model.config, hf.config
    expected = {
        "model_type": "qwen3_5_text" if kind == "dense" else "qwen3_5_moe_text",
        "num_hidden_layers": 4,  # the file's fifth block is the MTP head
        "layer_types": ref.layer_types,
        "partial_rotary_factor": 0.25,
        "tie_word_embeddings": ref.tie_word_embeddings,
        **{
            k: getattr(ref, k)
            for k in (
                "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                "linear_value_head_dim", "linear_conv_kernel_dim", "rms_norm_eps", "vocab_size",
            )
        },
    }  # fmt: skip
    if kind == "moe":
        expected.update(
            num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
        )  # fmt: skip
    assert {k: cfg[k] for k in expected} == expected
    assert not any(name.startswith("model.layers.4.") for name in model.tensors)
    assert not any(name.startswith("blk.") for name in model.tensors), "an unmapped tensor"
    # the undone rewrites: norms back to offsets from one, A_log from -exp(A_log), conv1d back
    # to [C, 1, K]; the value heads stay in the file's tiled order, which the config says
    assert cfg["linear_value_head_order"] == "tiled"
    ours, theirs = model.tensors, tiled_value_heads(hf.state_dict(), ref.to_dict())
    for name in (
        "model.norm.weight",
        "model.layers.1.self_attn.q_norm.weight",
        "model.layers.0.linear_attn.A_log",
        "model.layers.0.linear_attn.dt_bias",
        "model.layers.0.linear_attn.conv1d.weight",
        "model.layers.0.linear_attn.in_proj_qkv.weight",
        "model.layers.0.linear_attn.in_proj_z.weight",
        "model.layers.0.linear_attn.in_proj_b.weight",
        "model.layers.0.linear_attn.out_proj.weight",
        "model.layers.0.linear_attn.norm.weight",
    ):
        torch.testing.assert_close(ours[name].dequantize(), theirs[name], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("outtype", ["f32", "f16"])
def test_a_float_file_generates_what_transformers_does(tiny, outtype):
    kind, hf, model_dir = tiny
    # the MoE file with the converter's fusing options: q/k/v and the experts' gate/up as one
    flags = ("--fuse-qkv", "--fuse-gate-up-exps") if kind == "moe" and outtype == "f16" else ()
    llm, ours = _generate(convert(model_dir, outtype, *flags))
    assert llm.engine.loaded.source_format == "gguf"
    held = _held(hf, outtype)
    for prompt, (tokens, logits) in zip(PROMPTS, ours, strict=True):
        ref_tokens, ref_logits = _hf_greedy(held, prompt, NUM_TOKENS)
        assert_same_greedy_run(tokens, logits, ref_tokens, ref_logits, f"{kind} {outtype}")


def test_a_q8_0_file_stays_quantized_and_matches_transformers_on_its_weights(tiny):
    kind, hf, model_dir = tiny
    llm, ours = _generate(convert(model_dir, "q8_0"))
    layer = llm.engine.runner.model.layers[0].linear_attn
    formats = [m.format for m in layer.modules() if isinstance(m, Linear)]
    assert formats and "float" not in formats, formats
    held, agree = _held(hf, "q8_0"), 0
    for prompt, (tokens, logits) in zip(PROMPTS, ours, strict=True):
        # a prompt step runs in float32 on the weights the file holds: transformers' logits
        # on those weights, to float rounding. (Decode steps take int8 or bf16 activations,
        # which a random hybrid model amplifies to ~0.1 in its logits.)
        ref = _teacher_forced_logits(held, prompt, tokens)
        diff = (logits[0] - ref[0]).abs().max().item()
        assert diff <= 1e-3, f"{kind} Q8_0 prompt step: max |Δlogits| {diff:.2e}"
        float_logits = _teacher_forced_logits(hf, prompt, tokens)
        agree += (float_logits.argmax(-1) == torch.tensor(tokens)).sum().item()
    # and decoding stays with the float model's picks, but for near ties
    share = agree / (NUM_TOKENS * len(PROMPTS))
    assert share >= 0.6, f"{kind} Q8_0: {share:.0%} of steps pick the float token"


def test_the_qwen35_pre_tokenizer_keeps_combining_marks_inside_words():
    def split(pre: str, text: str) -> list[str]:
        backend = tokenizers.Tokenizer(tokenizers.models.BPE())
        PRE_TOKENIZERS[pre].apply(backend)
        return [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(text)]

    word = "हिन्दी"  # Devanagari: its vowel signs and virama are marks (\p{M}), not letters
    assert len(split("qwen35", f"a {word}!")) == 3
    assert len(split("qwen2", f"a {word}!")) > 3  # Qwen2's \p{L}+ splits at each mark
    assert split("qwen35", "I'm 123") == split("qwen2", "I'm 123")
