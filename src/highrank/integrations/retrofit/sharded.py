"""A retrofit's training state when FSDP2 shards the model (``--mode full --fsdp``).

Each process holds a shard of every parameter and of its Adam moments; ``state.pt`` holds them
whole, in the very format a one-process or DDP run writes (``trainable``: the parameters by
name; ``optimizer``: ``torch.optim.Optimizer.state_dict()``'s, parameters numbered in the
order of ``named_parameters``), so one reader checks every state file. Saving gathers the
shards to process 0's CPU (every process takes part; :mod:`torch.distributed.checkpoint`'s
``full_state_dict``); loading gives every process the whole state, which it shards again.
Adam is elementwise, so a run resumed from a gathered state continues bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn


def _options(**extra):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **extra)


def trainable_names(module: nn.Module) -> list[str]:
    """The names of the parameters that train, in the order the optimizer numbers them."""
    return [name for name, param in module.named_parameters() if param.requires_grad]


def full_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters, whole, on process 0's CPU (an empty dict elsewhere); every
    process calls it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(module, options=_options(cpu_offload=True))
    names = set(trainable_names(module))
    return {name: value for name, value in state.items() if name in names}


def full_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state, whole, numbered as ``optimizer.state_dict()`` numbers it, on
    process 0 (an empty dict elsewhere); every process calls it."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(module, optimizer, options=_options(cpu_offload=True))
    if not state:
        return {}
    number = {name: i for i, name in enumerate(trainable_names(module))}
    return {
        "state": {number[name]: value for name, value in state["state"].items()},
        "param_groups": [{**group, "params": [number[name] for name in group["params"]]}
                         for group in state["param_groups"]],
    }


def load_full_weights(module: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Every process loads the whole ``weights`` (by name) into its shards."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(module, weights, options=_options(strict=False))


def load_full_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer,
                              saved: dict) -> None:
    """Every process loads the whole ``saved`` optimizer state (numbered) into its shards."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    names = trainable_names(module)
    by_name = {
        "state": {names[i]: value for i, value in saved["state"].items()},
        "param_groups": [{**group, "params": [names[i] for i in group["params"]]}
                         for group in saved["param_groups"]],
    }
    set_optimizer_state_dict(module, optimizer, by_name, options=_options())


__all__ = [
    "full_optimizer_state",
    "full_weights",
    "load_full_optimizer_state",
    "load_full_weights",
    "trainable_names",
]
