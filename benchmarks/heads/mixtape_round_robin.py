"""The fused Mixtape loss against the softmax heads, every case in turn in one process.

``highrank bench heads`` interleaves each head with the naive softmax only; here the naive
softmax, the fused softmax head, Mixtape on its fused loss and Mixtape on the generic chunked
path run round-robin (one step each per round), so that Mixtape can be quoted directly as a
multiple of either softmax, with the machine's load hitting all four alike. Same shapes as
``highrank bench heads`` (1400 tokens; d = 400 for the softmaxes, 620 -> 280 for Mixtape).

    PYTHONPATH=src OMP_NUM_THREADS=1 python -m benchmarks.heads.mixtape_round_robin \\
        --vocab 10000,33278,100000 --out benchmarks/results/heads-mixtape-fused

Writes round-robin.json and .md in ``--out``; a vocabulary already there is not redone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks._common import write_json, write_text
from highrank.bench.heads import BASELINE, CASES, build_step
from highrank.util.machine import describe_machine

LABELS = {
    "naive softmax": BASELINE,
    "softmax (fused)": CASES["softmax"],
    "mixtape (fused)": CASES["mixtape"],
    "mixtape (generic)": CASES["mixtape-generic"],
}


def time_round_robin(vocab: int, tokens: int, rounds: int, warmup: int) -> dict:
    steps = {label: build_step(case, vocab, tokens, "cpu") for label, case in LABELS.items()}
    times: dict[str, list[float]] = {label: [] for label in steps}
    for round_index in range(warmup + rounds):
        for label, step in steps.items():
            start = time.perf_counter()
            step()
            if round_index >= warmup:
                times[label].append(time.perf_counter() - start)
    medians = {label: statistics.median(values) for label, values in times.items()}
    return {
        "vocab_size": vocab,
        "ms": {label: 1e3 * value for label, value in medians.items()},
        "runs_ms": {label: [1e3 * v for v in values] for label, values in times.items()},
        "mixtape_over_softmax": medians["mixtape (fused)"] / medians["softmax (fused)"],
        "mixtape_over_naive": medians["mixtape (fused)"] / medians["naive softmax"],
        "generic_over_naive": medians["mixtape (generic)"] / medians["naive softmax"],
        "fused_speedup": medians["mixtape (generic)"] / medians["mixtape (fused)"],
        "load_average": Path("/proc/loadavg").read_text().split()[:3],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", default="10000,33278,100000")
    parser.add_argument("--tokens", type=int, default=1400)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    json_path = args.out / "round-robin.json"
    result = json.loads(json_path.read_text()) if json_path.exists() else {"rows": []}
    result["machine"] = describe_machine()
    result["settings"] = {**vars(args), "out": str(args.out)}
    done = {row["vocab_size"] for row in result["rows"]}
    for vocab in (int(text) for text in args.vocab.split(",")):
        if vocab in done:
            continue
        row = time_round_robin(vocab, args.tokens, args.rounds, args.warmup)
        result["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "runs_ms"}))
        args.out.mkdir(parents=True, exist_ok=True)
        write_json(json_path, result)
        write_text(json_path.with_suffix(".md"), _markdown(result))


def _markdown(result: dict) -> str:
    settings = result["settings"]
    lines = [
        f"{settings['tokens']} tokens per step, torch threads {torch.get_num_threads()}, "
        f"median of {settings['rounds']} rounds after {settings['warmup']} warm-up round(s); "
        "each round runs the four cases in turn in one process.",
        "",
        "| V | naive softmax ms | softmax (fused) ms | Mixtape fused ms | Mixtape generic ms "
        "| fused Mixtape / fused softmax | fused Mixtape / naive softmax "
        "| generic Mixtape / naive softmax | load average |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in result["rows"]:
        ms = row["ms"]
        lines.append(
            f"| {row['vocab_size']:,} | {ms['naive softmax']:.0f} | {ms['softmax (fused)']:.0f} "
            f"| {ms['mixtape (fused)']:.0f} | {ms['mixtape (generic)']:.0f} "
            f"| {row['mixtape_over_softmax']:.2f} | {row['mixtape_over_naive']:.2f} "
            f"| {row['generic_over_naive']:.2f} | {' '.join(row['load_average'])} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
