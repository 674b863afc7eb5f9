"""What a node has: CPUs, memory, GPUs (via NVML), features. Overridable from configuration.

GPUs are read through a thin NVML adapter; no library or no driver means zero GPUs, not a
crash. Tests that need GPUs pass them explicitly (`--gpus h100:8`) or inject a fake adapter.
"""

from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import dataclass, field
from typing import Protocol

import psutil

log = logging.getLogger(__name__)

_KNOWN = (
    "gh200",
    "h200",
    "h100",
    "h800",
    "b200",
    "b100",
    "a100",
    "a800",
    "a40",
    "a30",
    "a10",
    "l40s",
    "l40",
    "l4",
    "v100",
    "t4",
    "rtx",
)


class GpuAdapter(Protocol):
    def devices(self) -> list[tuple[int, str]]:
        """(index, model name as reported by the driver)."""


class NvmlAdapter:
    """The production adapter (nvidia-ml-py)."""

    def devices(self) -> list[tuple[int, str]]:
        try:
            import pynvml
        except ImportError:
            return []
        try:
            pynvml.nvmlInit()
        except Exception as e:  # no driver / no GPU: a node without GPUs
            log.debug("NVML unavailable: %s", e)
            return []
        try:
            out = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
                out.append((i, name.decode() if isinstance(name, bytes) else str(name)))
            return out
        finally:
            with contextlib.suppress(Exception):
                pynvml.nvmlShutdown()


def gpu_type_of(model: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100'; unknown models keep a slug of their name."""
    low = model.lower().replace("nvidia", "").strip()
    for known in _KNOWN:
        if re.search(rf"\b{known}\b", low):
            return known
    return re.sub(r"[^a-z0-9]+", "-", low).strip("-") or "gpu"


def parse_gpu_override(text: str) -> list[tuple[int, str]]:
    """'h100:8' or 'a40:2,l4:1' -> [(0,'h100'),...]; '0' or '' -> no GPUs.

    Devices are numbered 0..n-1 across the node, as CUDA numbers them: the index is what a
    job gets in CUDA_VISIBLE_DEVICES."""
    out: list[tuple[int, str]] = []
    text = text.strip()
    if text in ("", "0", "none"):
        return out
    for part in text.split(","):
        kind, _, count = part.strip().rpartition(":")
        if not kind or not count.isdigit() or not re.fullmatch(r"[a-z0-9_.-]+", kind.lower()):
            raise ValueError(f"invalid GPU list '{text}': use TYPE:COUNT[,TYPE:COUNT], e.g. h100:8")
        first = len(out)  # not len(out) inside the generator: it grows while extending
        out.extend((first + i, kind.lower()) for i in range(int(count)))
    return out


@dataclass
class NodeResources:
    cpus: int
    mem_mb: int
    gpus: list[tuple[int, str]] = field(default_factory=list)
    features: list[str] = field(default_factory=list)
    # place in the topology tree, {level: domain} (--topology switch=s1,rack=r1)
    topology: dict[str, str] = field(default_factory=dict)


def detect(gpu_adapter: GpuAdapter | None = None) -> NodeResources:
    cpus = psutil.cpu_count(logical=True) or 1
    mem_mb = int(psutil.virtual_memory().total // (1024 * 1024))
    adapter = gpu_adapter or NvmlAdapter()
    gpus = [(i, gpu_type_of(m)) for i, m in adapter.devices()]
    return NodeResources(cpus=cpus, mem_mb=mem_mb, gpus=gpus)
