"""Host introspection (`/discovery`, `/health` device stats) and build info (`/version`)."""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import subprocess
from pathlib import Path

import pytest
import torch

import helexa
from helexa import version as ver
from helexa.node import discovery as disc
from helexa.node.discovery import (
    classify_nvidia_smi,
    cuda_unavailable_reason,
    device_stats,
    discovery,
)
from helexa.node.version import build_info

REPO_ROOT = Path(__file__).resolve().parents[2]

cpu_only_host = pytest.mark.skipif(
    torch.cuda.is_available() or disc.is_nvidia_host(), reason="needs a host without NVIDIA GPUs"
)

KERNEL_VERSION_TEXT = (
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.154.05  Thu Dec 28 15:37:48 UTC 2023\n"
    "GCC version:  gcc version 11.4.0 (Ubuntu 11.4.0-1ubuntu1~22.04)\n"
)
MISMATCH_OUTPUT = (
    "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 535.183\n"
)
HEALTHY_SMI_OUTPUT = (
    "| NVIDIA-SMI 535.154.05   Driver Version: 535.154.05   CUDA Version: 12.2 |\n"
    "|   0  NVIDIA L4   Off | 00000000:00:03.0 Off |   0 |\n"
)


@pytest.fixture
def fresh_caches():
    """Per-process caches cleared around a test that fakes what they remember."""
    cuda_unavailable_reason.cache_clear()
    ver.build_info.cache_clear()
    yield
    cuda_unavailable_reason.cache_clear()
    ver.build_info.cache_clear()


@cpu_only_host
def test_discovery_describes_this_cpu_host_with_no_devices_and_no_cuda_complaint():
    body = discovery(max_prompt_tokens=4096)

    assert set(body) == {
        "hostname",
        "os",
        "cpu",
        "ram_mb",
        "devices",
        "engines",
        "cuda_unavailable_reason",
        "max_prompt_tokens",
    }
    assert body["hostname"] == socket.gethostname()
    assert body["os"] == {
        "system": platform.system(),
        "release": platform.release(),
        "machine": platform.machine(),
    }
    assert body["cpu"]["logical_cores"] == os.cpu_count()
    assert body["cpu"]["model"] is None or body["cpu"]["model"].strip()
    assert 0 < body["ram_mb"]["available"] <= body["ram_mb"]["total"]
    assert body["devices"] == []
    assert body["cuda_unavailable_reason"] is None
    assert body["max_prompt_tokens"] == 4096
    assert body["engines"]["helexa"] == helexa.__version__
    assert body["engines"]["torch"] == str(torch.__version__)
    assert body["engines"]["cuda"] == torch.version.cuda
    assert json.loads(json.dumps(body)) == body


def test_discovery_echoes_an_unknown_max_prompt_tokens_as_null():
    assert discovery(max_prompt_tokens=None)["max_prompt_tokens"] is None


def test_version_mismatch_tells_the_operator_to_reboot_and_names_the_kernel_module_version():
    reason = classify_nvidia_smi(18, MISMATCH_OUTPUT, KERNEL_VERSION_TEXT, torch_cuda="12.4")

    assert reason is not None
    assert "reboot the host" in reason
    assert "535.154.05" in reason  # kernel module
    assert "535.183" in reason  # userspace library
    assert "\n" not in reason


def test_version_mismatch_still_says_reboot_when_the_kernel_version_is_unreadable():
    reason = classify_nvidia_smi(18, MISMATCH_OUTPUT, None, torch_cuda="12.4")

    assert reason is not None and "reboot the host" in reason


def test_open_kernel_module_version_text_is_parsed():
    text = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.54.14  Release Build\n"

    assert disc.parse_kernel_module_version(text) == "550.54.14"


def test_cpu_only_torch_on_a_gpu_host_says_to_install_cuda_torch():
    reason = classify_nvidia_smi(0, HEALTHY_SMI_OUTPUT, KERNEL_VERSION_TEXT, torch_cuda=None)

    assert reason is not None
    assert "no CUDA support" in reason
    assert "CUDA build of torch" in reason


def test_a_healthy_nvidia_smi_with_cuda_torch_is_not_a_problem():
    assert classify_nvidia_smi(0, HEALTHY_SMI_OUTPUT, KERNEL_VERSION_TEXT, "12.4") is None


def test_other_nvidia_smi_failures_quote_its_first_line():
    output = "\nNVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\nMore"

    reason = classify_nvidia_smi(9, output, None, torch_cuda="12.4")

    assert reason == (
        "nvidia-smi failed (exit status 9): NVIDIA-SMI has failed because it couldn't "
        "communicate with the NVIDIA driver."
    )


def test_a_broken_driver_host_reports_the_mismatch_in_discovery(
    monkeypatch, tmp_path, fresh_caches
):
    (tmp_path / "version").write_text(KERNEL_VERSION_TEXT)
    monkeypatch.setattr(disc, "NVIDIA_PROC_DIR", tmp_path)
    monkeypatch.setattr(disc, "_run_nvidia_smi", lambda: (18, MISMATCH_OUTPUT))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    reason = discovery(max_prompt_tokens=None)["cuda_unavailable_reason"]

    assert reason is not None and "reboot the host" in reason and "535.154.05" in reason


@cpu_only_host
def test_device_stats_on_a_cpu_host_is_one_cpu_entry_with_free_within_total():
    stats = device_stats()

    assert len(stats) == 1
    (cpu,) = stats
    assert cpu["kind"] == "cpu"
    assert 0 < cpu["memory_free_mb"] <= cpu["memory_total_mb"]
    assert 0 <= cpu["utilization_percent"] <= 100


def test_build_info_reports_the_package_and_runtime_versions(fresh_caches):
    info = build_info()

    assert info["version"] == helexa.__version__
    assert info["python"] == platform.python_version()
    assert info["torch"] == str(torch.__version__)
    assert info["cuda"] == torch.version.cuda
    assert json.loads(json.dumps(info)) == info


@pytest.mark.skipif(not (REPO_ROOT / ".git").exists(), reason="needs a git checkout")
def test_build_info_from_a_git_checkout_has_the_head_commit_and_a_dirty_flag(fresh_caches):
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()

    info = build_info()

    assert re.fullmatch(r"[0-9a-f]{40}", info["git_sha"])
    assert info["git_sha"] == head
    assert isinstance(info["git_dirty"], bool)
    assert info["build_time"] is None


def test_packaged_build_json_wins_over_git(monkeypatch, tmp_path, fresh_caches):
    build_json = tmp_path / "_build_info.json"
    build_json.write_text(
        json.dumps({"git_sha": "a" * 40, "git_dirty": False, "build_time": "2026-05-01T12:00:00Z"})
    )
    monkeypatch.setattr(ver, "BUILD_JSON", build_json)

    info = build_info()

    assert (info["git_sha"], info["git_dirty"], info["build_time"]) == (
        "a" * 40,
        False,
        "2026-05-01T12:00:00Z",
    )


def test_a_damaged_build_json_falls_back_to_git(monkeypatch, tmp_path, fresh_caches):
    build_json = tmp_path / "_build_info.json"
    build_json.write_text("{not json")
    monkeypatch.setattr(ver, "BUILD_JSON", build_json)

    assert build_info()["git_sha"] == ver._git_info(ver.PACKAGE_DIR.parent)["git_sha"]


def test_outside_a_git_checkout_git_fields_are_unknown(tmp_path):
    assert ver._git_info(tmp_path) == {"git_sha": None, "git_dirty": None, "build_time": None}
