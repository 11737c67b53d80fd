"""A CPU model's packed weights in one huge-page arena (layers/hugepages.py): where they lie,
that the kernel may back them with huge pages, and that nothing they compute changes."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from helexa.engine import LLM, SamplingParams
from helexa.engine.layers import hugepages
from tests.shared_fixtures import need_shared

THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_mode() -> str | None:
    try:
        text = Path(THP).read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")]


def _mapping_of(address: int) -> dict[str, str]:
    """/proc/self/smaps' fields of the mapping that holds `address`."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="no transparent huge pages")
def test_the_arena_starts_on_a_huge_page_and_may_be_backed_by_them():
    block = hugepages.arena(5 << 20)
    assert block is not None and block.dtype == torch.uint8 and block.numel() == 5 << 20
    assert block.data_ptr() % hugepages.HUGE_PAGE == 0
    block.fill_(7)  # writable, every page touched
    assert int(block.sum()) == 7 * (5 << 20)
    assert _mapping_of(block.data_ptr()).get("THPeligible") == "1"


def test_a_loaded_models_packed_weights_move_into_one_arena_and_compute_the_same(
    tmp_path, monkeypatch
):
    from tests.engine.test_gguf_parity import write_gguf_from_hf
    from tests.engine.test_parity import _record_logits
    from tests.engine.tiny import make_tiny_model

    need_shared()
    _, hf = make_tiny_model("smollm2", tmp_path, head_dim=16)
    add = gguf.GGUFWriter.add_tensor

    def quantized(self, name, tensor, raw_shape=None, raw_dtype=None):  # Q8_0 blocks
        if tensor.ndim == 2 and tensor.shape[1] % 32 == 0:
            return add(self, name, gguf.quants.quantize(tensor, QT.Q8_0), raw_dtype=QT.Q8_0)
        return add(self, name, tensor, raw_shape, raw_dtype)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", quantized)
    (tmp_path / "gguf").mkdir()
    path = write_gguf_from_hf(hf, "llama", tmp_path / "gguf" / "smollm2.gguf")
    prompts = [[5, 17, 300, 42, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = []
    for held in (True, False):
        if not held:
            monkeypatch.setattr(hugepages, "arena", lambda nbytes: None)
        llm = LLM(str(path), device="cpu", kv_cache_memory_mb=8, autotune=False)  # a CPU arena
        linears = hugepages.packed_linears(llm.engine.runner.model)
        # the qkv / gate-up fusions, o, down and the tied table, of both layers
        assert len(linears) == 2 * 4 + 1
        starts = sorted(lin.weight.data_ptr() for lin in linears)
        storages = {lin.weight.untyped_storage().data_ptr() for lin in linears}
        if held:
            assert len(storages) == 1 and starts[0] % hugepages.HUGE_PAGE == 0
            assert all(p % hugepages.ALIGN == 0 for p in starts)
        else:
            assert len(storages) == len(linears)
        seen = _record_logits(llm)
        outs = llm.generate(prompts, params)
        runs.append([(o.token_ids, torch.stack(seen[o.request_id])) for o in outs])
    for (tokens_a, logits_a), (tokens_b, logits_b) in zip(*runs, strict=True):
        assert tokens_a == tokens_b
        assert torch.equal(logits_a, logits_b)
