"""``highrank bench heads``: the heads' time and peak memory against a naive softmax."""

from __future__ import annotations

import argparse
import sys

from highrank.cli.choices import BENCH_CASES, BENCH_DEFAULT_CASES
from highrank.cli.common import int_list, name_list, non_negative_int, positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options, from the torch-free copies of the cases (:mod:`highrank.cli.choices`)."""
    parser.add_argument("what", choices=["heads"], help="heads: output-layer time and memory")
    parser.add_argument(
        "--vocab",
        type=int_list,
        default=[10_000, 33_278, 100_000],
        help="comma-separated vocabulary sizes (default 10000,33278,100000)",
    )
    parser.add_argument(
        "--cases",
        type=lambda text: list(name_list(text, "bench case", BENCH_CASES)),
        default=list(BENCH_DEFAULT_CASES),
        help=f"comma-separated cases from: {', '.join(BENCH_CASES)} (default "
        f"{','.join(BENCH_DEFAULT_CASES)})",
    )
    parser.add_argument("--tokens", type=positive_int, default=1400, help="tokens per step")
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed runs (median)")
    parser.add_argument("--warmup", type=non_negative_int, default=2, help="untimed runs first")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    parser.add_argument(
        "--budget-mb",
        type=float,
        default=None,
        help="also time each head at the largest batch fitting this peak-memory growth (MiB)",
    )
    parser.add_argument("--out", default="bench-out", help="folder for heads.json and heads.md")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from highrank.bench.heads import markdown_table, run_benchmark, write_results

    if args.device.startswith("cuda") and not _cuda_available():
        args.parser.error(f"--device {args.device}: CUDA is not available on this machine")
    try:
        result = run_benchmark(
            vocab_sizes=args.vocab,
            labels=args.cases,
            tokens=args.tokens,
            repeats=args.repeats,
            warmup=args.warmup,
            device=args.device,
            budget_mb=args.budget_mb,
            progress=lambda message: print(message, file=sys.stderr),
        )
    except ValueError as error:
        args.parser.error(str(error))
    json_path, md_path = write_results(result, Path(args.out))
    print(markdown_table(result))
    print(f"wrote {json_path} and {md_path}")
    return 0


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
