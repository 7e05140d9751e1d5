"""One training step at One-Billion-Word scale: softmax, MoS-7 and Mixtape at V = 100,000.

    python -m benchmarks.heads.billion_word_step [--heads softmax,softmax-unchunked,mos,mixtape]
        [--batch 16] [--bptt 20] [--rounds 3] [--threads 1]
        [--out benchmarks/results/billion-word-step]

The shape (issue 11): a 100,000-word vocabulary (the 1B-Word recipe's ``data.max_vocab``) and an
LSTM LM whose 1024-wide last layer feeds the output layer, projected by the head as the papers
do (MoS: K = 7 tanh projections of the 1024-wide state to 1024-wide contexts; Mixtape: its 4
gated contexts). Every model is the AWD-LSTM of ``configs/ptb/small-<head>.toml`` (its dropouts,
AR/TAR, clip, SGD) resized: d_embed 1024 (tied input and output embeddings), two layers of
1024, ``--batch`` x ``--bptt`` tokens per step, MoS with ``n_components = 7``. Random token ids,
no corpus is read. The sizes of the papers' own 1B-Word LSTMs are not restated here: this
measures what the output layer costs at that vocabulary and context width, on a CPU.

What is measured, per head:

* **time**: forward, backward, gradient clip and SGD update of one step; the models alternate
  step by step in one process (``--rounds`` rounds after one warm-up step each), so machine
  noise hits them alike; median seconds and the ratio to the softmax model's median;
* **memory**: peak-RSS growth of one step over the memory held before it (parameters, their
  gradients from a warm-up step, the batch), each model in a fresh process; and the model's
  whole peak RSS. ``softmax-unchunked`` is the softmax head with its loss on the whole
  N x V logit matrix (``chunk_size = None``), the layer as usually written.

Writes ``billion-word-step.json`` and ``.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import multiprocessing
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks._common import REPO, module_name, write_json, write_text
from highrank.bench.heads import proc_status_kib, reset_peak_rss
from highrank.config import load_config
from highrank.models import build_model, count_parameters
from highrank.util.machine import describe_machine

MODULE = module_name(__file__)  # benchmarks.heads.billion_word_step

VOCAB = 100_000
WIDTH = 1024
HEADS = {  # label -> (recipe, head knobs over the recipe's, chunk_size of the loss)
    "softmax": ("small-softmax", {}, "auto"),
    "softmax-unchunked": ("small-softmax", {}, None),
    "mos": ("small-mos", {"n_components": 7}, "auto"),
    "mixtape": ("small-mixtape", {}, "auto"),
}


@dataclass(frozen=True)
class Shape:
    batch: int = 16
    bptt: int = 20
    vocab: int = VOCAB
    width: int = WIDTH


def build(label: str, shape: Shape, seed: int = 0):
    """(model, optimizer, (tokens, target), chunk_size, clip) of one head at ``shape``."""
    batch, bptt, vocab, width = shape.batch, shape.bptt, shape.vocab, shape.width
    recipe, knobs, chunk_size = HEADS[label]
    config = load_config(REPO / "configs" / "ptb" / f"{recipe}.toml")
    config.model.d_embed = width
    config.model.d_hidden = width
    config.model.n_layers = 2
    config.head.knobs.update(knobs)
    torch.manual_seed(seed)
    model = build_model(config, vocab).train()
    optimizer = torch.optim.SGD(model.parameter_groups(config.train.lr), lr=config.train.lr)
    ids = torch.randint(0, vocab, (bptt + 1, batch), generator=torch.Generator().manual_seed(seed))
    return model, optimizer, (ids[:-1], ids[1:]), chunk_size, config.train.clip


def step(model, optimizer, batch, chunk_size, clip: float) -> None:
    tokens, target = batch
    optimizer.zero_grad(set_to_none=False)  # gradients stay allocated, as in a training loop
    loss, _, extras = model(tokens, target, chunk_size=chunk_size)
    (loss + model.backbone.regularization_loss(extras)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()


# ---- memory: one model per fresh process ----------------------------------------------------


def peak_memory(label: str, shape: Shape, threads: int) -> dict:
    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        return pool.apply(_peak_memory_here, (label, shape, threads))


def _peak_memory_here(label: str, shape: Shape, threads: int) -> dict:
    torch.set_num_threads(threads)
    model, optimizer, data, chunk_size, clip = build(label, shape)
    step(model, optimizer, data, chunk_size, clip)  # gradients and optimizer state exist now
    gc.collect()
    _return_freed_heap_to_the_system()
    before = proc_status_kib("VmRSS")
    reset_peak_rss()
    step(model, optimizer, data, chunk_size, clip)
    peak = proc_status_kib("VmHWM")
    return {"step_growth_mb": (peak - before) / 1024, "peak_rss_mb": peak / 1024}


def _return_freed_heap_to_the_system() -> None:
    """glibc's ``malloc_trim(0)``: memory the warm-up step freed but malloc kept would count as
    held before the step, and hide that much of its growth. No-op off glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# ---- the benchmark --------------------------------------------------------------------------


def measure(labels: list[str], shape: Shape, rounds: int, threads: int) -> list[dict]:
    models = {label: build(label, shape) for label in labels}
    for model, optimizer, data, chunk_size, clip in models.values():
        step(model, optimizer, data, chunk_size, clip)  # warm-up
    times: dict[str, list[float]] = {label: [] for label in labels}
    for round_index in range(rounds):
        for label, (model, optimizer, data, chunk_size, clip) in models.items():
            start = time.perf_counter()
            step(model, optimizer, data, chunk_size, clip)
            times[label].append(time.perf_counter() - start)
        print(
            f"round {round_index + 1}/{rounds}: "
            + ", ".join(f"{k} {v[-1]:.1f} s" for k, v in times.items()),
            flush=True,
        )
    parameters = {label: count_parameters(models[label][0]) for label in labels}
    del models
    gc.collect()
    rows = []
    for label in labels:
        memory = peak_memory(label, shape, threads)
        rows.append(
            {
                "head": label,
                "parameters": parameters[label],
                "median_s_per_step": statistics.median(times[label]),
                "step_times_s": times[label],
                **memory,
            }
        )
    base = next((row for row in rows if row["head"] == "softmax"), rows[0])
    for row in rows:
        row["time_vs_softmax"] = row["median_s_per_step"] / base["median_s_per_step"]
        # Tiny shapes can grow RSS by less than a page: no ratio rather than a division by 0.
        growth = base["step_growth_mb"]
        row["step_memory_vs_softmax"] = row["step_growth_mb"] / growth if growth > 0 else None
    return rows


def markdown(record: dict) -> str:
    m = record["machine"]
    lines = [
        f"{m['cpu']} ({m['cpu_count']} CPUs), torch {m['torch']}, {record['threads']} "
        f"thread(s); load average before {record['load_average_before']}. V = "
        f"{record['vocab']:,}, d_embed = hidden = {record['width']}, 2 LSTM layers, "
        f"{record['tokens_per_step']:,} tokens per step ({record['batch']} x {record['bptt']}); "
        f"time: medians of {record['rounds']} steps, models alternating in one process; "
        "memory: one step in a fresh process.",
        "",
        "| head | parameters | s/step | x softmax time | step memory growth (MiB) "
        "| x softmax memory | peak RSS (MiB) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in record["rows"]:
        lines.append(
            f"| {row['head']} | {row['parameters']:,} | {row['median_s_per_step']:.2f} "
            f"| {row['time_vs_softmax']:.2f} | {row['step_growth_mb']:.0f} "
            f"| {_ratio(row['step_memory_vs_softmax'])} | {row['peak_rss_mb']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument(
        "--heads",
        type=lambda s: s.split(","),
        default=["softmax", "softmax-unchunked", "mos", "mixtape"],
    )
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--bptt", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=VOCAB, help="(100000)")
    parser.add_argument("--width", type=int, default=WIDTH, help="(1024)")
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/billion-word-step"))
    args = parser.parse_args(argv)
    unknown = sorted(set(args.heads) - set(HEADS))
    if unknown:
        parser.error(f"unknown heads {unknown}; choose from {', '.join(HEADS)}")
    torch.set_num_threads(args.threads)
    load_before = list(os.getloadavg())
    shape = Shape(args.batch, args.bptt, args.vocab, args.width)
    rows = measure(args.heads, shape, args.rounds, args.threads)
    record = {
        "command": f"python -m {MODULE} --heads "
        + ",".join(args.heads)
        + f" --batch {args.batch} --bptt {args.bptt} --rounds {args.rounds} "
        f"--threads {args.threads} --vocab {args.vocab} --width {args.width}",
        "vocab": args.vocab,
        "width": args.width,
        "machine": describe_machine(),
        "threads": args.threads,
        "batch": args.batch,
        "bptt": args.bptt,
        "rounds": args.rounds,
        "tokens_per_step": args.batch * args.bptt,
        "load_average_before": load_before,
        "load_average_after": list(os.getloadavg()),
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "billion-word-step.json", record, indent=1)
    write_text(out / "billion-word-step.md", markdown(record))
    print(markdown(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
