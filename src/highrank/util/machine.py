"""The machine a result was measured on: one description, one set of keys, for every record.

A run directory's ``environment.json``, the demo's ``results.json``, ``highrank bench heads``
and every script under ``benchmarks/`` state their machine with :func:`describe_machine`, so a
number can always be traced to the hardware and the versions that produced it::

    platform         platform.platform() (OS, kernel, architecture)
    python, torch, numpy   versions
    cpu              the CPU's model name (/proc/cpuinfo; platform.processor() elsewhere)
    cpu_count        os.cpu_count()
    torch_threads    the threads the measurement used (torch's current count unless given)
    omp_wait_policy  OMP_WAIT_POLICY as this process saw it (None: unset; see highrank.cli)
    cuda             torch's CUDA version when a GPU is usable, else None
    gpus             the names of the visible CUDA devices ([] without)
    note             what the numbers should be read with, e.g. "shared with other jobs"

:func:`available_memory` is the one memory probe: what training, the rank instruments and a
retrofit check their plans against before any long work.

torch and numpy are imported when they are needed, not with this module.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from typing import Any


def describe_machine(*, threads: int | None = None, note: str | None = None) -> dict[str, Any]:
    """The keys of the module docstring, for this process on this machine."""
    import numpy as np
    import torch

    gpu = torch.cuda.is_available()
    return {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "numpy": np.__version__,
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads() if threads is None else threads,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "cuda": torch.version.cuda if gpu else None,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if gpu
        else [],
        "note": note,
    }


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else ``platform.processor()``, else
    ``"unknown"``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def available_memory(device: Any = "cpu") -> int | None:
    """Bytes free on ``device`` (a ``torch.device`` or its name): free GPU memory for CUDA,
    ``MemAvailable`` of ``/proc/meminfo`` for the CPU (the free physical pages where that file
    is missing); ``None`` where it cannot be known (another device, an unreadable probe)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file counts kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def machine_line(machine: dict[str, Any]) -> str:
    """One line for a table's caption: ``<cpu>, <n> CPUs, torch <version> (<t> threads)``,
    the GPUs and the note when there are any."""
    line = (
        f"{machine['cpu']}, {machine['cpu_count']} CPUs, torch {machine['torch']} "
        f"({machine['torch_threads']} threads)"
    )
    if machine.get("gpus"):
        line += f", GPU {', '.join(machine['gpus'])}"
    return line + (f"; {machine['note']}" if machine.get("note") else "")


__all__ = ["available_memory", "cpu_model", "describe_machine", "machine_line"]
