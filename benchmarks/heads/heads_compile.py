"""Compiled vs eager speed of every head: ``torch.compile(fullgraph=True)`` (Inductor) against
the same head run eagerly, interleaved run by run in one process.

    python -m benchmarks.heads.heads_compile [--vocab 10000] [--tokens 700] [--repeats 5]
        [--warmup 2] [--threads 1] [--heads softmax,mos,...]
        [--out benchmarks/results/heads-compile]

Per head, at the papers' PTB shapes (``highrank.bench.heads.HEAD_SHAPES``: hidden 400 for the
softmax family; hidden 620, embeddings 280 and 15 components for the mixtures) and hidden
states laid out (70, tokens / 70, d) as AWD-LSTM's time-major batches:

* **train**: ``head.loss(hidden, target)`` compiled, then ``backward()`` (AOTAutograd compiles
  the backward graph too), in training mode, default
  ``chunk_size="auto"`` (the fused closed-form chunks for softmax, MoC and MoS; chunked
  activation checkpointing for the others when compiled, gradients in forward when eager);
* **log_prob**: ``head.log_prob(hidden)`` in eval mode without gradients.

Each is timed as the median of ``repeats`` runs after ``warmup`` runs, the compiled and the
eager function alternated run by run (``highrank.bench.heads.time_interleaved``), and
reported as the ratio compiled / eager (below 1: compiling pays) together with the first
call's compile time. Results are written after every head to ``heads-compile.json`` and
``heads-compile.md`` in ``--out``; a rerun with the same settings skips the heads already
measured (delete the JSON to start over).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks._common import REPO, write_json, write_text
from highrank.bench.heads import BPTT, HEAD_SHAPES, time_interleaved
from highrank.heads import build_head
from highrank.util.machine import describe_machine

DEFAULT_OUT = REPO / "benchmarks" / "results" / "heads-compile"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=10_000, help="V (%(default)s)")
    parser.add_argument("--tokens", type=int, default=700, help="tokens per step, a multiple of 70")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs after compiling")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (%(default)s)")
    parser.add_argument("--heads", default=",".join(HEAD_SHAPES), help="comma-separated heads")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="results folder (%(default)s)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.heads.split(",")) - set(HEAD_SHAPES))
    if unknown:
        parser.error(f"unknown head(s) {', '.join(unknown)}; choose from {', '.join(HEAD_SHAPES)}")
    if args.tokens <= 0 or args.tokens % BPTT:
        parser.error(f"--tokens must be a positive multiple of {BPTT}; got {args.tokens}")
    return args


def build(name: str, vocab_size: int, tokens: int):
    """The head and its inputs: tanh hidden states (70, tokens / 70, d_in), random targets."""
    d_in, knobs = HEAD_SHAPES[name]
    generator = torch.Generator().manual_seed(0)
    shape = (BPTT, tokens // BPTT)
    hidden = torch.tanh(torch.randn(*shape, d_in, generator=generator)).requires_grad_(True)
    target = torch.randint(0, vocab_size, shape, generator=generator)
    torch.manual_seed(0)
    return build_head(name, d_in=d_in, vocab_size=vocab_size, **knobs), hidden, target


def loss_of(head, hidden, target) -> torch.Tensor:
    return head.loss(hidden, target)


@torch.no_grad()
def log_prob_of(head, hidden) -> torch.Tensor:
    return head.log_prob(hidden)


def eager_and_compiled(mode: str, head, hidden, target):
    """The step of ``mode`` as two argument-free callables: "train" runs the loss (compiled
    with its backward graph) and calls backward; "log_prob" runs log_prob without gradients."""
    head.train(mode == "train")
    if mode == "log_prob":
        compiled = torch.compile(log_prob_of, fullgraph=True)
        return (lambda: log_prob_of(head, hidden.detach())), (
            lambda: compiled(head, hidden.detach())
        )
    compiled = torch.compile(loss_of, fullgraph=True)
    return (lambda: loss_of(head, hidden, target).backward()), (
        lambda: compiled(head, hidden, target).backward()
    )


def measure_head(name: str, args: argparse.Namespace) -> dict:
    """Compile time and interleaved compiled/eager medians for one head."""
    torch._dynamo.reset()
    head, hidden, target = build(name, args.vocab, args.tokens)
    record = {}
    for mode in ("train", "log_prob"):
        eager, compiled = eager_and_compiled(mode, head, hidden, target)
        start = time.perf_counter()
        compiled()  # compiles
        compile_s = time.perf_counter() - start
        timing = time_interleaved(
            compiled, eager, repeats=args.repeats, warmup=args.warmup, device="cpu"
        )
        record[mode] = {
            "compile_s": compile_s,
            "compiled_ms": timing["head_ms"],
            "eager_ms": timing["baseline_ms"],
            "ratio": timing["time_ratio"],
            "median_of_run_ratios": timing["median_of_run_ratios"],
        }
        print(
            f"{name:>10} {mode:>8}: compiled {timing['head_ms']:8.1f} ms, eager "
            f"{timing['baseline_ms']:8.1f} ms, ratio {timing['time_ratio']:.2f} "
            f"(compile {compile_s:.0f} s)",
            flush=True,
        )
    return record


def markdown(results: dict) -> str:
    machine, settings = results["machine"], results["settings"]
    lines = [
        f"Machine: {machine['cpu']}, {machine['cpu_count']} cores, torch {machine['torch']} "
        f"({settings['threads']} thread(s)), device cpu. V = {settings['vocab']:,}, "
        f"{settings['tokens']} tokens per step; median of {settings['repeats']} runs after "
        f"{settings['warmup']} warm-up runs, compiled and eager alternated in one process.",
        "",
        "| head | train: compiled ms | eager ms | ratio | compile s "
        "| log_prob: compiled ms | eager ms | ratio | compile s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, record in results["heads"].items():
        cells = []
        for mode in ("train", "log_prob"):
            r = record[mode]
            cells += [
                f"{r['compiled_ms']:.1f}",
                f"{r['eager_ms']:.1f}",
                f"{r['ratio']:.2f}",
                f"{r['compile_s']:.0f}",
            ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record_path = out / "heads-compile.json"
    settings = {
        "vocab": args.vocab,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "threads": args.threads,
        "backend": "inductor",
        "fullgraph": True,
    }
    results = {"machine": describe_machine(), "settings": settings, "heads": {}}
    if record_path.exists():
        previous = json.loads(record_path.read_text())
        if previous.get("settings") == settings:
            results["heads"] = previous["heads"]  # resume: keep what was measured
    for name in args.heads.split(","):
        if name in results["heads"]:
            print(f"{name:>10}: already measured, skipped", flush=True)
            continue
        results["heads"][name] = measure_head(name, args)
        write_json(record_path, results)
        write_text(out / "heads-compile.md", markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
