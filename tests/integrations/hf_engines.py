"""Jobs of tests/integrations/test_hf_distributed.py: a highrank HF model trained a few steps
in one process (the reference) or in two (DDP, FSDP2, the transformers Trainer).

Every case trains the same model (seed 0) on the same global batch of 4 sequences of 9 tokens
(seed 1) for ``STEPS`` steps of plain SGD (lr ``LR``, no clipping, no weight decay), so the
only difference between one process and two is where the sums are taken. Dropout is off
(the bases' and MoS's latent dropout), or the processes' masks would differ.

``python -m torch.distributed.run --nproc-per-node 2 -m tests.integrations.hf_engines OUT
CASE...`` runs the Trainer cases (``base:head``) under torchrun and writes ``OUT/CASE/``:
``losses.json`` (the logged step losses) and ``model/`` (``Trainer.save_model``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from tests.integrations.conftest import HIDDEN, VOCAB

STEPS = 3
LR = 0.1
BATCH, LENGTH = 4, 9
KNOBS = {
    "softmax": {},
    "mos": {"n_components": 2, "latent_dropout": 0.0},
    "mixtape": {"gate_dim": 4, "frequent_fraction": 0.3},
}
# tied: GPT-2 (lm_head is the input embedding); untied: Llama.
BASES = {"tied": "gpt2", "untied": "llama"}


def base_model(kind: str):
    """A tiny dropout-free GPT-2 (tied) or Llama (untied), seeded."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "gpt2":
        config = GPT2Config(
            n_embd=HIDDEN, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=64,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            bos_token_id=None, eos_token_id=None,
        )  # fmt: skip
        return GPT2LMHeadModel(config)
    config = LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=64,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def highrank_model(base: str, head: str):
    """The case's model: ``head`` attached to the tiny ``base`` (paper init: every parameter
    of the head live), in training mode, the same in every process."""
    from highrank.integrations.hf import attach_head

    model = attach_head(base_model(base), head, init="paper", **KNOBS[head])
    return model.train()


def global_batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, LENGTH), generator=torch.Generator().manual_seed(1))


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def train(engine: str, base: str, head: str, folder: str | None = None) -> dict:
    """``STEPS`` SGD steps of the case through ``engine`` ("one": one process on the whole
    batch; "ddp"; "fsdp2": ``fully_shard_highrank``), each process on its share of the
    global batch. Returns the step losses (averaged over the processes), the final weights
    (whole, on process 0) and, with ``folder``, saves the model there
    (``save_pretrained_gathered``)."""
    import torch.distributed as dist

    from highrank.integrations.hf import fully_shard_highrank, save_pretrained_gathered
    from highrank.integrations.hf_parallel import full_state_dict

    model = highrank_model(base, head)
    rank, world = _rank_world()
    share = BATCH // world
    ids = global_batch()[rank * share : (rank + 1) * share]
    if engine == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    elif engine == "fsdp2":
        wrapped = fully_shard_highrank(model)
    else:
        wrapped = model
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        loss = wrapped(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean)
        losses.append(float(mean) / world)
    weights = full_state_dict(wrapped)
    if folder is not None:
        save_pretrained_gathered(wrapped, folder)
    return {"losses": losses, "weights": weights}


def train_cases(out: str, cases: list[tuple[str, str, str]]) -> list[dict]:
    """:func:`train` of each ``(engine, base, head)``, saved to ``out/<engine>-<base>-<head>``."""
    return [train(*case, folder=f"{out}/{'-'.join(case)}") for case in cases]


# ---- the transformers Trainer ------------------------------------------------------------------


def trainer_case(base: str, head: str, out: Path) -> list[float]:
    """The case through ``transformers.Trainer`` (DDP under torchrun: accelerate splits the
    global batch of ``BATCH`` sequences, ``BATCH / world`` per process): its logged losses;
    the model saved to ``out/model``."""
    from transformers import Trainer, TrainingArguments

    _, world = _rank_world()
    model = highrank_model(base, head)
    data = [{"input_ids": row, "labels": row} for row in global_batch()]
    args = TrainingArguments(
        str(out), per_device_train_batch_size=BATCH // world, max_steps=STEPS, learning_rate=LR,
        optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0,
        dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    trainer = Trainer(model, args, train_dataset=data)
    trainer.train()
    trainer.save_model(str(out / "model"))
    return [record["loss"] for record in trainer.state.log_history if "loss" in record]


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    out, cases = Path(argv[0]), argv[1:]
    for case in cases:
        base, head = case.split(":")
        folder = out / f"{base}-{head}"
        losses = trainer_case(base, head, folder)
        if int(os.environ.get("RANK", "0")) == 0:
            (folder / "losses.json").write_text(json.dumps(losses))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
