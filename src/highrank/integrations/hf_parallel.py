"""A ``HighrankForCausalLM`` in several processes: FSDP2 sharding and one saved folder.

DistributedDataParallel needs nothing of highrank: wrap the model as any other (the heads'
chunked losses hand the gradients they compute in the forward pass to autograd in backward,
so DDP's hooks see them). FSDP2 (``torch.distributed.fsdp.fully_shard``) needs two things a
plain "shard every block, then the root" recipe gets wrong for a highrank model, and
:func:`fully_shard_highrank` does both:

* a **tied head** shares its decoder matrix E with the input embedding. FSDP2 manages each
  parameter in one group only, and torch >= 2.13 refuses a head sharded on its own ("Parameter
  'head.weight' is shared with a parameter already managed by another FSDP group"): the head
  and the input embedding are sharded as one group (``fully_shard([embedding, head])``). An
  untied head is a group of its own, the embedding stays with the root;
* the model calls its head through ``head.loss`` and ``head.log_prob`` (and a pointwise
  softmax's ``transformed_logits`` during ``generate``), not ``head(...)``, so FSDP2's
  forward hooks, which gather a group's shards, are registered on those methods
  (``register_fsdp_forward_method``).

The body's blocks (the classes its ``_no_split_modules`` names: ``LlamaDecoderLayer``,
``GPT2Block``, ...) are one group each, the rest (final norm, positions; the embedding when
untied) the root group. A frozen body beside a trainable head needs nothing more: FSDP2 keeps
each parameter's ``requires_grad`` (FSDP1's ``use_orig_params`` question does not arise).

:func:`save_pretrained_gathered` writes one ``save_pretrained`` folder from any of them (a
plain model, DDP, FSDP2): every process calls it; the full weights are gathered to process 0's
CPU and only process 0 writes. The folder reloads in one process with ``from_pretrained``
like any other (tied weights stored once, ``config.architectures`` ``HighrankForCausalLM``).

Not covered: TRL's ``fused_lm_head=True`` path reads the head's rows directly and is not
registered here; DeepSpeed ZeRO-3 and NCCL have not run on this project's machines
(``docs/distributed-training.md``, ``benchmarks/checks/engines_gpu_check.py``).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

# The head's methods HighrankForCausalLM calls instead of forward: FSDP2 gathers the head's
# shards around each call.
HEAD_METHODS = ("loss", "log_prob", "transformed_logits")


def body_blocks(model: nn.Module) -> list[nn.Module]:
    """The body's repeated blocks: its modules whose class the model's ``_no_split_modules``
    names (gathered by transformers from the body: ``LlamaDecoderLayer``, ``GPT2Block``),
    the head's own class left out."""
    head_class = type(model.head).__name__
    names = set(getattr(model, "_no_split_modules", None) or ()) - {head_class}
    return [module for module in model.model.modules() if type(module).__name__ in names]


def fully_shard_highrank(model: nn.Module, **fsdp_kwargs) -> nn.Module:
    """Shard ``model`` (a :class:`~highrank.integrations.hf.HighrankForCausalLM`) with FSDP2
    in place and return it: each body block one group, the head with the input embedding
    when tied (else alone), the rest the root; the head's methods registered (see the module
    docstring). ``fsdp_kwargs`` go to every ``fully_shard`` call (``mesh``,
    ``reshard_after_forward``, ``mp_policy``, ``offload_policy``, ...). Needs an initialised
    process group (``torchrun``: ``torch.distributed.init_process_group()``); the model is on
    its device (CPU with gloo, this process's GPU with NCCL) and alike in every process."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    if not (hasattr(model, "head") and hasattr(model, "model")):
        raise TypeError(
            f"fully_shard_highrank takes a HighrankForCausalLM (attach_head's model); got "
            f"{type(model).__name__}"
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "fully_shard_highrank needs a process group: start the processes with torchrun "
            "and call torch.distributed.init_process_group() first"
        )
    for block in body_blocks(model):
        fully_shard(block, **fsdp_kwargs)
    embedding, head = model.get_input_embeddings(), model.head
    if embedding is not None and head.weight is embedding.weight:
        fully_shard([embedding, head], **fsdp_kwargs)  # one group: the shared E
    else:
        fully_shard(head, **fsdp_kwargs)
    for name in HEAD_METHODS:
        if callable(getattr(head, name, None)):
            register_fsdp_forward_method(head, name)
    return fully_shard(model, **fsdp_kwargs)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights as CPU tensors under the plain model's names, on process 0
    (an empty dict on the others); every process must call it (FSDP2 gathers the shards)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model = _unwrapped(model)
    if not is_sharded(model):
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        return state if _rank() == 0 else {}
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def save_pretrained_gathered(model: nn.Module, folder: str | Path, **kwargs) -> None:
    """``save_pretrained(folder, **kwargs)`` of a model trained in several processes (plain,
    in DDP, or sharded by :func:`fully_shard_highrank`): every process calls it, process 0
    writes the whole model, the others wait for it."""
    plain = _unwrapped(model)
    state = full_state_dict(plain)
    if _rank() == 0:
        plain.save_pretrained(folder, state_dict=state, is_main_process=True, **kwargs)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _unwrapped(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (FSDP2 shards the model in place: nothing to unwrap)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def is_sharded(model: nn.Module) -> bool:
    """Has FSDP2 sharded ``model`` (or a part of it)?"""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(module, FSDPModule) for module in model.modules())


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


__all__ = [
    "HEAD_METHODS",
    "body_blocks",
    "full_state_dict",
    "fully_shard_highrank",
    "is_sharded",
    "save_pretrained_gathered",
]
