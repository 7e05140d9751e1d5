"""The engines this project's CPU machines cannot run, checked on GPUs (issue 33): NCCL DDP and
FSDP2 of a highrank HF model, the Trainer with FSDP (accelerate) and with DeepSpeed ZeRO-3,
and ``highrank retrofit`` under torchrun on CUDA. Written beside the CPU tests; not yet run.

    python -m benchmarks.checks.engines_gpu_check [--nproc N] [--device cuda|cpu]
        [--cases ddp,fsdp2,trainer-fsdp,trainer-zero3,retrofit]
        [--out benchmarks/results/engines-gpu-check]

Each case runs as users run it, ``torchrun --standalone --nproc-per-node N -m
benchmarks.checks.engines_gpu_check --worker CASE`` (NCCL, process r on GPU ``LOCAL_RANK``), and
once with ``--nproc-per-node 1`` on the same global batch; the check compares the two runs' step
losses (relative 1e-4: GPU sums are not ordered) and, for the engines, that the one saved
folder reloads in this process with a tied head still tied. It writes ``<out>/check.json``
(every case's losses, commands, exit statuses and seconds, the machine) and exits 1 when a
case fails. ``trainer-fsdp`` also records accelerate's ``distributed_type`` (on the CPU it
falls back to DDP: MULTI_CPU), ``trainer-zero3`` is skipped without ``deepspeed``.
``--device cpu`` runs the same cases on gloo (a smoke test of this script; the CPU results
themselves are tests/integrations/test_hf_distributed.py and test_retrofit_distributed.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks._common import REPO, machine, module_name, write_json, write_text

MODULE = module_name(__file__)  # benchmarks.checks.engines_gpu_check

CASES = ("ddp", "fsdp2", "trainer-fsdp", "trainer-zero3", "retrofit")
MODELS = {"gpt2-mos": ("gpt2", "mos"), "llama-mixtape": ("llama", "mixtape"),
          "gpt2-softmax": ("gpt2", "softmax")}
KNOBS = {"mos": {"n_components": 2, "latent_dropout": 0.0},
         "mixtape": {"gate_dim": 4, "frequent_fraction": 0.3}, "softmax": {}}
VOCAB, HIDDEN, STEPS, LR, BATCH, LENGTH = 100, 32, 3, 0.1, 8, 16
ZERO3 = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto",
         "gradient_accumulation_steps": 1, "train_batch_size": "auto"}


# ---- inside each torchrun process -----------------------------------------------------------


def _model(arch: str, head: str):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from highrank.integrations.hf import attach_head

    torch.manual_seed(0)
    if arch == "gpt2":  # tied
        base = GPT2LMHeadModel(GPT2Config(
            n_embd=HIDDEN, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=64,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    else:  # untied
        base = LlamaForCausalLM(LlamaConfig(
            hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB))
    return attach_head(base, head, init="paper", **KNOBS[head]).train()


def _batch():
    import torch

    return torch.randint(0, VOCAB, (BATCH, LENGTH), generator=torch.Generator().manual_seed(1))


def _engine(case: str, arch: str, head: str, device, folder: Path) -> list[float]:
    """STEPS SGD steps through DDP or fully_shard_highrank on this process's share."""
    import torch
    import torch.distributed as dist

    from highrank.integrations.hf import fully_shard_highrank, save_pretrained_gathered

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model(arch, head).to(device)
    share = BATCH // world
    ids = _batch()[rank * share : (rank + 1) * share].to(device)
    if case == "ddp":
        gpu = [device.index] if device.type == "cuda" else None
        wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=gpu)
    else:
        wrapped = fully_shard_highrank(model)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        loss = wrapped(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    save_pretrained_gathered(wrapped, folder / "model")
    return losses


def _trainer(case: str, arch: str, head: str, device, folder: Path) -> tuple[list[float], str]:
    import torch.distributed as dist
    from transformers import Trainer, TrainingArguments

    world = dist.get_world_size()
    extra: dict = {"use_cpu": device.type == "cpu"}
    if case == "trainer-fsdp":
        block = "GPT2Block" if arch == "gpt2" else "LlamaDecoderLayer"
        extra.update(fsdp=True, fsdp_config={"version": 2, "reshard_after_forward": True,
                                             "transformer_layer_cls_to_wrap": [block]})
    else:
        extra["deepspeed"] = ZERO3
    args = TrainingArguments(
        str(folder), per_device_train_batch_size=BATCH // world, max_steps=STEPS,
        learning_rate=LR, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=0.0, logging_steps=1, save_strategy="no", report_to="none", seed=0,
        disable_tqdm=True, **extra)
    data = [{"input_ids": row, "labels": row} for row in _batch()]
    trainer = Trainer(_model(arch, head), args, train_dataset=data)
    trainer.train()
    trainer.save_model(str(folder / "model"))
    kind = str(trainer.accelerator.distributed_type)
    return [r["loss"] for r in trainer.state.log_history if "loss" in r], kind


def worker(case: str, out: Path, device_name: str) -> int:
    import torch
    import torch.distributed as dist

    from highrank.train.distributed import init_from_env

    init_from_env()
    if not dist.is_initialized():  # --nproc-per-node 1 still runs through torchrun
        dist.init_process_group("gloo" if device_name == "cpu" else "nccl")
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if device_name == "cuda" else torch.device("cpu")
    torch.use_deterministic_algorithms(True, warn_only=True)
    record: dict = {}
    for name, (arch, head) in MODELS.items():
        folder = out / name
        if case in ("ddp", "fsdp2"):
            record[name] = {"losses": _engine(case, arch, head, device, folder)}
        else:
            losses, kind = _trainer(case, arch, head, device, folder)
            record[name] = {"losses": losses, "distributed_type": kind}
    if dist.get_rank() == 0:
        write_json(out / "losses.json", record)
    dist.barrier()
    return 0


# ---- the driver ---------------------------------------------------------------------------------


def _torchrun(nproc: int, *words: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), *words]


def _run(command: list[str], env: dict) -> dict:
    began = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    return {"command": " ".join(command), "status": done.returncode,
            "seconds": round(time.perf_counter() - began, 1), "stderr_tail": done.stderr[-2000:]}


def _close(a: list, b: list, rel: float = 1e-4) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rel * max(abs(x), abs(y), 1e-12)
                                    for x, y in zip(a, b, strict=True))


def _reloads(folder: Path, arch: str) -> bool:
    from transformers import AutoModelForCausalLM

    import highrank.integrations.hf  # noqa: F401  (registers the model type)

    model = AutoModelForCausalLM.from_pretrained(folder)
    return (model.head.weight is model.get_input_embeddings().weight) == (arch == "gpt2")


def check_engine(case: str, nproc: int, device: str, out: Path, env: dict) -> dict:
    if case == "trainer-zero3":
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            return {"skipped": "deepspeed is not installed (pip install deepspeed)"}
    runs, losses = {}, {}
    for n in (nproc, 1):
        folder = out / case / f"nproc{n}"
        runs[n] = _run(_torchrun(n, "-m", MODULE, "--worker", case,
                                 "--device", device, "--out", str(folder)), env)
        if runs[n]["status"] == 0:
            losses[n] = json.loads((folder / "losses.json").read_text())
    record = {"runs": runs, "losses": losses}
    if len(losses) < 2:
        return {**record, "passed": False}
    record["same_losses"] = {m: _close(losses[nproc][m]["losses"], losses[1][m]["losses"])
                             for m in MODELS}
    record["reloads"] = {m: _reloads(out / case / f"nproc{nproc}" / m / "model", MODELS[m][0])
                         for m in MODELS}
    record["passed"] = all(record["same_losses"].values()) and all(record["reloads"].values())
    return record


def check_retrofit(nproc: int, device: str, out: Path, env: dict) -> dict:
    """``highrank retrofit`` in every mode on a tiny Llama with a word-level tokenizer, N
    processes against one: the step losses (history.json) within 1e-4."""
    root = out / "retrofit"
    model, texts = retrofit_inputs(root)
    record: dict = {}
    for mode in ("frozen", "lora", "full"):
        histories, runs = {}, {}
        for n in (nproc, 1):
            folder = root / f"{mode}-nproc{n}"
            words = ["-m", "highrank", "retrofit", "--hf", str(model), "--head", "mos",
                     "--knob", "n_components=2", "--knob", "latent_dropout=0", "--mode", mode,
                     "--train", str(texts["train"]), "--valid", str(texts["valid"]), "--out",
                     str(folder), "--window", "16", "--batch-tokens", str(64 * nproc),
                     "--steps", "12", "--lr", "1e-3", "--device", device]
            runs[n] = _run(_torchrun(n, *words), env)
            if runs[n]["status"] == 0:
                history = json.loads((folder / "history.json").read_text())["history"]
                histories[n] = [step["loss"] for step in history]
        passed = len(histories) == 2 and _close(histories[nproc], histories[1])
        record[mode] = {"runs": runs, "losses": histories, "passed": passed}
    return {**record, "passed": all(r["passed"] for r in record.values())}


def retrofit_inputs(root: Path) -> tuple[Path, dict]:
    import random

    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(3, VOCAB)]
    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2, **{w: i for i, w in enumerate(words, 3)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>",
                                   unk_token="<unk>", eos_token="<eos>")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=64))
    model.save_pretrained(root / "model")
    fast.save_pretrained(root / "model")
    rng, texts = random.Random(0), {}
    for split, n in (("train", 4000), ("valid", 400)):
        texts[split] = root / f"{split}.txt"
        write_text(texts[split], " ".join(rng.choice(words) for _ in range(n)) + "\n")
    return root / "model", texts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--nproc", type=int, default=None, help="default: the GPUs (at least 2)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/engines-gpu-check"))
    parser.add_argument("--worker", choices=CASES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.worker:
        return worker(args.worker, out, args.device)
    import torch

    gpus = torch.cuda.device_count()
    if args.device == "cuda" and gpus < 1:
        parser.error("no GPU here: this check is for GPU machines (--device cpu smoke-tests it)")
    nproc = args.nproc or max(2, gpus)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    record = {"machine": machine(), "nproc": nproc, "device": args.device, "cases": {}}
    for case in cases:
        print(f"{case} ...", flush=True)
        result = (check_retrofit(nproc, args.device, out, env) if case == "retrofit"
                  else check_engine(case, nproc, args.device, out, env))
        record["cases"][case] = result
        print(f"{case}: {'skipped' if 'skipped' in result else result['passed']}", flush=True)
        write_json(out / "check.json", record)
    failed = [c for c, r in record["cases"].items() if "skipped" not in r and not r["passed"]]
    print(f"wrote {out / 'check.json'}; failed: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
