"""What a training process sets up before its first step: the seeds and the device.

Apart from :mod:`highrank.train.steps` because :mod:`highrank.train.distributed` reseeds the
processes of a torchrun with it, while the steps ask distributed whether a loss is finite on
every process: one module each way, no cycle.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from highrank.config import ConfigError


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def resolve_device(name: str, option: str = "run.device") -> torch.device:
    """``run.device`` (or the command-line ``option`` that gave ``name``): ``"auto"`` is CUDA
    when available, else the CPU; a device this torch cannot use is a ConfigError naming it."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fix = f"use {'--run.device=' if option == 'run.device' else option + ' '}cpu or auto"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(
            f"{option} = {name!r} is not a device: expected cpu, cuda, cuda:N, mps or auto"
        ) from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count or (device.index or 0) >= count:
            build = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only"
            raise ConfigError(
                f"{option} = {name!r}, but this torch {torch.__version__} ({build}) sees "
                f"{count} CUDA device(s); {fix}"
            )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"{option} = {name!r}, but MPS is not available here; {fix}")
    return device


__all__ = ["resolve_device", "seed_everything"]
