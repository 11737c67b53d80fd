"""HF-layout model directories: config.json + safetensors (single or sharded)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


def read_json(path: Path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint files: the sharded index's shards, or every *.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(read_json(index)["weight_map"].values()))
        missing = [s for s in shards if not (model_dir / s).exists()]
        if missing:
            raise FileNotFoundError(
                f"{model_dir}: shards listed in the index are missing: {missing}"
            )
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights found")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Name and tensor of every weight; tensors are memory-mapped views until used."""
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, f.get_tensor(name)
