"""Mixtape's fused loss at several chunk sizes, interleaved with the softmax heads.

Why ``Mixtape.auto_chunk_tokens`` holds at least ``MIN_AUTO_CHUNK_TOKENS`` tokens
(``heads/kernels/mixtape_ce.py``): every chunk makes three passes over the V x d decoder, so
at large V small chunks are bound by that memory traffic. Times one forward + backward of 1400
tokens (the ``highrank bench heads`` shapes) per chunk size, each run interleaved with the
naive softmax baseline and also reporting the fused softmax head ("auto" chunks), all in one
process.

    PYTHONPATH=src OMP_NUM_THREADS=1 python -m benchmarks.heads.mixtape_chunk_sweep \\
        --vocab 100000 --chunks 20,40,80,128,256 --out benchmarks/results/heads-mixtape-fused

Writes chunk-sweep-V<vocab>.json and .md in ``--out``; a size already there is not redone.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from benchmarks._common import write_json, write_text
from highrank.bench.heads import BASELINE, CASES, build_step, time_interleaved
from highrank.util.machine import describe_machine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=100_000)
    parser.add_argument("--chunks", default="20,40,80,128,256")
    parser.add_argument("--tokens", type=int, default=1400)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    json_path = args.out / f"chunk-sweep-V{args.vocab}.json"
    if json_path.exists():
        print(f"{json_path} exists: nothing to do")
        return
    baseline = build_step(BASELINE, args.vocab, args.tokens, "cpu")
    cases = {"softmax (auto)": CASES["softmax"]}
    for size in (int(text) for text in args.chunks.split(",")):
        cases[f"mixtape ({size})"] = dataclasses.replace(CASES["mixtape"], chunk_size=size)
    rows = []
    for label, case in cases.items():
        step = build_step(case, args.vocab, args.tokens, "cpu")
        timing = time_interleaved(
            step, baseline, repeats=args.repeats, warmup=args.warmup, device="cpu"
        )
        rows.append({"case": label, "chunk_size": case.chunk_size, **timing})
        print(label, f"{timing['head_ms']:.0f} ms, {timing['time_ratio']:.2f} x naive softmax")
        del step
    result = {
        "machine": describe_machine(),
        "settings": {**vars(args), "out": str(args.out)},
        "rows": rows,
        "load_average": Path("/proc/loadavg").read_text().split()[:3],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    lines = [
        f"V = {args.vocab:,}, {args.tokens} tokens, torch threads {torch.get_num_threads()}, "
        f"median of {args.repeats} runs after {args.warmup} warm-up; each run interleaved with "
        "the naive softmax baseline.",
        "",
        "| case | head ms | naive softmax ms | time ratio |",
        "| --- | ---: | ---: | ---: |",
    ]
    for row in rows:
        lines.append(
            f"| {row['case']} | {row['head_ms']:.0f} | {row['baseline_ms']:.0f} | "
            f"{row['time_ratio']:.2f} |"
        )
    write_text(json_path.with_suffix(".md"), "\n".join(lines) + "\n")
    write_json(json_path, result)


if __name__ == "__main__":
    main()
