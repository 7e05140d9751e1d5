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

torch and numpy are imported when the description is made, not with this module.
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


__all__ = ["cpu_model", "describe_machine", "machine_line"]
