"""Host introspection for the node's `/discovery` and `/health` routes (no HTTP here)."""

from __future__ import annotations

import functools
import os
import platform
import re
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

import torch

from helexa.node.version import engine_versions

MIB = 1024 * 1024
MEMINFO = Path("/proc/meminfo")
CPUINFO = Path("/proc/cpuinfo")
# Present whenever the NVIDIA kernel module is loaded, even if userspace is broken.
NVIDIA_PROC_DIR = Path("/proc/driver/nvidia")
NVIDIA_SMI_TIMEOUT_S = 5

CUDA_TORCH_HINT = (
    "install a CUDA build of torch, e.g. "
    "`pip install torch --index-url https://download.pytorch.org/whl/cu124`"
)


def discovery(max_prompt_tokens: int | None) -> dict[str, Any]:
    """The `/discovery` body: what this host is and what it can run."""
    return {
        "hostname": socket.gethostname(),
        "os": {
            "system": platform.system(),
            "release": platform.release(),
            "machine": platform.machine(),
        },
        "cpu": {"model": cpu_model(), "logical_cores": os.cpu_count()},
        "ram_mb": _ram_mb(),
        "devices": [dict(d) for d in _cuda_devices()],
        "engines": engine_versions(),
        "cuda_unavailable_reason": cuda_unavailable_reason(),
        "max_prompt_tokens": max_prompt_tokens,
    }


def device_stats() -> list[dict[str, Any]]:
    """Live per-device stats for `/health`; cheap enough to call every few seconds.

    CUDA entries: {kind="cuda", index, name, memory_free_mb, memory_total_mb,
    utilization_percent}; a CPU-only host gets one {kind="cpu", name, …} entry instead.
    """
    devices = _cuda_devices()
    if not devices:
        ram = _ram_mb()
        return [
            {
                "kind": "cpu",
                "name": cpu_model(),
                "memory_free_mb": ram["available"],
                "memory_total_mb": ram["total"],
                "utilization_percent": _cpu_utilization_percent(),
            }
        ]
    stats = []
    for device in devices:
        index = device["index"]
        try:
            free, total = torch.cuda.mem_get_info(index)
            free_mb, total_mb = free // MIB, total // MIB
        except RuntimeError:
            # A faulted device must not take /health down with it.
            free_mb, total_mb = None, device["total_mb"]
        stats.append(
            {
                "kind": "cuda",
                "index": index,
                "name": device["name"],
                "memory_free_mb": free_mb,
                "memory_total_mb": total_mb,
                "utilization_percent": _cuda_utilization_percent(index),
            }
        )
    return stats


@functools.cache
def cuda_unavailable_reason() -> str | None:
    """Why CUDA cannot be used on an NVIDIA host, in one line; None if it works or no GPU.

    Cached: the usual causes (driver/library mismatch, CPU-only torch) last until a reboot
    or reinstall, and torch itself caches its CUDA probe per process.
    """
    if torch.cuda.is_available() or not is_nvidia_host():
        return None
    returncode, output = _run_nvidia_smi()
    reason = classify_nvidia_smi(
        returncode, output, _read_text(NVIDIA_PROC_DIR / "version"), torch.version.cuda
    )
    if reason is None:
        # The driver answers, yet torch still sees no device.
        reason = (
            f"nvidia-smi reports a working driver but torch (CUDA {torch.version.cuda}) "
            "sees no usable device; check CUDA_VISIBLE_DEVICES and that the driver "
            f"supports CUDA {torch.version.cuda}"
        )
    return reason


def classify_nvidia_smi(
    returncode: int, output: str, kernel_version_text: str | None, torch_cuda: str | None
) -> str | None:
    """One-line reason from nvidia-smi's exit status and output, /proc/driver/nvidia/version
    text and `torch.version.cuda`; None when nothing is wrong on that evidence."""
    if "driver/library version mismatch" in output.lower():
        kernel = parse_kernel_module_version(kernel_version_text)
        library = re.search(r"NVML library version:\s*(\S+)", output)
        versions = ", ".join(
            part
            for part in (
                f"library {library.group(1)}" if library else None,
                f"kernel module {kernel}" if kernel else None,
            )
            if part
        )
        return (
            "NVIDIA driver/library version mismatch: the userspace library and the loaded "
            f"kernel module versions differ{f' ({versions})' if versions else ''}, "
            "usually after a driver upgrade; reboot the host to reload the kernel module"
        )
    if torch_cuda is None:
        return f"the installed torch has no CUDA support (CPU-only build); {CUDA_TORCH_HINT}"
    if returncode == 0:
        return None
    first = next((line.strip() for line in output.splitlines() if line.strip()), "")
    return f"nvidia-smi failed (exit status {returncode}): {first or 'no output'}"


def parse_kernel_module_version(text: str | None) -> str | None:
    """The driver version in /proc/driver/nvidia/version text ("… Kernel Module  535.154.05 …")."""
    if not text:
        return None
    # Also matches the open module's "Open Kernel Module for x86_64  550.54.14".
    match = re.search(r"Kernel Module.*?(\d+\.\d+(?:\.\d+)*)", text)
    return match.group(1) if match else None


def is_nvidia_host() -> bool:
    """True when an NVIDIA driver is installed (nvidia-smi on PATH or the kernel module loaded)."""
    return shutil.which("nvidia-smi") is not None or NVIDIA_PROC_DIR.exists()


@functools.cache
def cpu_model() -> str | None:
    """The CPU's marketing name, e.g. "AMD EPYC 7763 64-Core Processor"."""
    for line in (_read_text(CPUINFO) or "").splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            return value.strip()
    # Not Linux, or an ARM kernel that omits "model name".
    return platform.processor() or None


@functools.cache
def _cuda_devices() -> tuple[dict[str, Any], ...]:
    """Static facts per visible CUDA device; () where CUDA is unavailable."""
    if not torch.cuda.is_available():
        return ()
    devices = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        devices.append(
            {
                "index": index,
                "name": props.name,
                "total_mb": props.total_memory // MIB,
                "compute_capability": f"{props.major}.{props.minor}",
            }
        )
    return tuple(devices)


def _ram_mb() -> dict[str, int | None]:
    """{total, available} system memory in MiB."""
    fields: dict[str, int] = {}
    for line in (_read_text(MEMINFO) or "").splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if key in ("MemTotal", "MemAvailable") and parts and parts[0].isdigit():
            fields[key] = int(parts[0]) // 1024  # meminfo counts KiB
    if "MemTotal" in fields and "MemAvailable" in fields:
        return {"total": fields["MemTotal"], "available": fields["MemAvailable"]}
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * page // MIB
    except (ValueError, OSError, AttributeError):
        return {"total": None, "available": None}
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * page // MIB
    except (ValueError, OSError):
        available = None  # macOS has no SC_AVPHYS_PAGES
    return {"total": total, "available": available}


def _cpu_utilization_percent() -> int | None:
    """1-minute load average as a share of logical cores, 0–100."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return None
    return min(100, round(load / (os.cpu_count() or 1) * 100))


def _cuda_utilization_percent(index: int) -> int | None:
    """GPU utilisation via NVML, or None where pynvml is missing or NVML refuses."""
    try:
        return int(torch.cuda.utilization(index))
    except Exception:  # optional metric: any NVML failure just means "unknown"
        return None


def _run_nvidia_smi() -> tuple[int, str]:
    """(exit status, stdout+stderr) of a bare `nvidia-smi`; failures to run become text."""
    path = shutil.which("nvidia-smi")
    if path is None:
        return 127, "nvidia-smi not found on PATH"
    try:
        done = subprocess.run(
            [path],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return 124, f"nvidia-smi did not answer within {NVIDIA_SMI_TIMEOUT_S} s"
    except Exception as exc:  # never let a probe turn into a stack trace
        return 126, f"nvidia-smi could not run: {exc}"
    return done.returncode, f"{done.stdout}\n{done.stderr}"


def _read_text(path: Path) -> str | None:
    """The file's text, or None where it is absent or unreadable."""
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
