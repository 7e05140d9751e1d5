"""Training-step time of the Transformer LM recipes against the small AWD-LSTM recipe, side by side.

    python -m benchmarks.heads.transformer_lm_step --heads softmax,mos,mixtape --rounds 5 \
        --threads 2

Builds each model from its config (configs/ptb/small-softmax.toml and
configs/ptb/transformer-<head>.toml) for V = 10,000 (PTB) on random token ids (no corpus is
read), and times one training step of each: forward, backward, gradient clip and optimizer
update (SGD for the AWD-LSTM with its variable-BPTT mean length bptt = 35, AdamW for the
Transformer with its window of 70), in interleaved rounds, so that a busy machine slows every
model alike. Reports the median seconds per step and per 1,000 target tokens, the ratio of
per-token time to the AWD-LSTM's, and the epoch time implied by the per-token median
(929,589 PTB training tokens). Writes benchmarks/results/transformer-lm-step/<machine>.json.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

from benchmarks._common import REPO, module_name, write_json
from highrank.config import load_config
from highrank.models import build_model, count_parameters
from highrank.train.transformer import ADAM_BETA1, ADAM_EPSILON, adamw_groups
from highrank.util.machine import describe_machine

MODULE = module_name(__file__)  # benchmarks.heads.transformer_lm_step

PTB_VOCAB, PTB_TRAIN_TOKENS = 10_000, 929_589


def build(name: str):
    """(model, optimizer, (tokens, target)) for configs/ptb/<name>.toml on random ids."""
    config = load_config(REPO / "configs" / "ptb" / f"{name}.toml")
    torch.manual_seed(0)
    model = build_model(config, PTB_VOCAB).train()
    t = config.train
    if config.model.backbone == "transformer":
        groups = adamw_groups(model, t.lr, t.weight_decay)
        optimizer = torch.optim.AdamW(groups, betas=(ADAM_BETA1, t.adam_beta2), eps=ADAM_EPSILON)
    else:
        optimizer = torch.optim.SGD(model.parameter_groups(t.lr), lr=t.lr)
    ids = torch.randint(0, PTB_VOCAB, (t.bptt + 1, t.batch_size))
    return config, model, optimizer, (ids[:-1], ids[1:])


def step(model, optimizer, batch, clip: float) -> None:
    tokens, target = batch
    optimizer.zero_grad(set_to_none=True)
    loss, _, extras = model(tokens, target)
    (loss + model.backbone.regularization_loss(extras)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", default="softmax,mos,mixtape")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    names = ["small-softmax", *(f"transformer-{h}" for h in args.heads.split(","))]
    models = {name: build(name) for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    for config, model, optimizer, batch in models.values():  # warm-up
        step(model, optimizer, batch, config.train.clip)
    for _ in range(args.rounds):
        for name, (config, model, optimizer, batch) in models.items():
            start = time.perf_counter()
            step(model, optimizer, batch, config.train.clip)
            times[name].append(time.perf_counter() - start)
    rows = []
    for name, (_, model, _, batch) in models.items():
        seconds = statistics.median(times[name])
        per_k = 1000 * seconds / batch[1].numel()
        rows.append(
            {
                "config": f"configs/ptb/{name}.toml",
                "parameters": count_parameters(model),
                "tokens_per_step": batch[1].numel(),
                "median_s_per_step": round(seconds, 4),
                "median_s_per_1k_tokens": round(per_k, 4),
                "epoch_minutes_at_this_rate": round(per_k * PTB_TRAIN_TOKENS / 1000 / 60, 1),
                "step_times_s": [round(s, 4) for s in times[name]],
            }
        )
    base = rows[0]["median_s_per_1k_tokens"]
    for row in rows:
        row["per_token_time_vs_small_awd_lstm"] = round(row["median_s_per_1k_tokens"] / base, 2)
        print(
            f"{row['config']:<42} {row['parameters']:>10,} params  "
            f"{row['median_s_per_step']:>8.3f} s/step  "
            f"{row['median_s_per_1k_tokens']:>7.3f} s/1k tokens  "
            f"x{row['per_token_time_vs_small_awd_lstm']:<5} "
            f"{row['epoch_minutes_at_this_rate']} min/epoch"
        )
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
    record = {
        "command": f"python -m {MODULE} "
        f"--heads {args.heads} --rounds {args.rounds} --threads {args.threads}",
        "machine": describe_machine(threads=args.threads),
        "load_average_after": load,
        "rows": rows,
    }
    out = REPO / "benchmarks" / "results" / "transformer-lm-step"
    write_json(out / f"{platform.node() or 'machine'}.json", record)


if __name__ == "__main__":
    main()
