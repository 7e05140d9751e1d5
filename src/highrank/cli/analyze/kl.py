"""``highrank analyze kl``: expected pairwise KL divergence of runs or --hf models
(:mod:`highrank.analysis.kl`): one record per run, a table, a summary with ``--out``."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from highrank.cli.analyze.common import add_run_arguments, row_sources
from highrank.cli.choices import KL_PAIRS
from highrank.util.argtypes import positive_int
from highrank.util.atomic import write_text_atomic


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``highrank analyze kl``."""
    add_run_arguments(parser, hf=True)
    parser.add_argument(
        "--pairs", type=positive_int, default=KL_PAIRS, help=f"context pairs ({KL_PAIRS})"
    )
    parser.add_argument(
        "--max-contexts", type=positive_int, help="pair among the first N contexts only"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the pair sampler (0)")
    parser.add_argument(
        "--matrix",
        action="append",
        metavar="PATH",
        help="read rows from this log-prob .npy (written with batch_size 1) instead of running "
        "the model; give one per RUN_DIR, in the same order",
    )
    parser.add_argument("--device", default="cpu", help="where the model runs (cpu)")
    parser.add_argument("--out", help="also write kl.json and kl.md here (with --hf: every record)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


HEADERS = ["head", "run", "pairs", "mean KL", "std", "s.e."]


def _sampling(args: argparse.Namespace) -> str:
    """The record name's part for a pair sample other than the default (``-pairs100-seed3``),
    so that a quick probe never replaces the default record that ``report`` shows."""
    if args.pairs == KL_PAIRS and args.seed == 0:
        return ""
    return f"-pairs{args.pairs}-seed{args.seed}"


def table_rows(records: Sequence[dict[str, Any]]) -> list[list[Any]]:
    """One row per run, in :data:`HEADERS` order (non-finite numbers as ``-``)."""
    numbers = ("mean", "std", "stderr")
    return [
        [r["head"], r.get("run_dir") or r["model"], r["pairs"], *(_finite(r[k]) for k in numbers)]
        for r in records
    ]


def run(args: argparse.Namespace) -> int:
    """``highrank analyze kl``: one record per run, a table, and a summary with ``--out``."""
    from highrank.analysis.kl import KLError
    from highrank.analysis.output import record_tag, run_record_path, text_table, write_json
    from highrank.causal_lm import HFInputError

    try:
        records = _records(args)
    except (KLError, HFInputError) as error:
        print(f"highrank analyze kl: error: {error}", file=sys.stderr)
        return 2
    if args.hf:
        written = [write_json(_hf_path(args, r["tag"]), r) for r in records]
    else:
        tag = record_tag(args.split, args.which, max_contexts=args.max_contexts) + _sampling(args)
        written = [write_json(run_record_path(r["run_dir"], "kl", tag), r) for r in records]
    print(text_table(HEADERS, table_rows(records)), end="")
    infinite = [r.get("run_dir") or r["model"] for r in records if r["infinite_pairs"]]
    if infinite:
        print(f"infinite divergences (a zero probability): {', '.join(infinite)}")
    if args.out:
        written += _write_summary(Path(args.out), records)
    print("wrote " + ", ".join(map(str, written)))
    return 0


def _records(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One record per RUN_DIR (its model run, or the ``--matrix`` given for it) or per
    ``--hf`` model on ``--text``, each model loaded in turn."""
    from highrank.analysis.kl import KLError, analyze_kl, analyze_kl_matrix

    sources = row_sources(args)
    matrices = args.matrix or []
    if matrices and args.hf:
        raise KLError("--matrix reads rows of runs; with --hf the model itself is run")
    if matrices and len(matrices) != len(args.run_dirs):
        raise KLError(
            f"--matrix was given {len(matrices)} time(s) for {len(args.run_dirs)} RUN_DIR(s); "
            "expected one matrix per run directory, in the same order"
        )
    options = {"n_pairs": args.pairs, "seed": args.seed, "max_contexts": args.max_contexts}
    for source in sources if args.hf else ():  # another model's record: refused before the work
        source.check_record(_hf_path(args, source.tag(max_contexts=args.max_contexts)))
    records = []
    for index, source in enumerate(sources):
        if matrices:
            record = analyze_kl_matrix(
                args.run_dirs[index], matrices[index], split=args.split, which=args.which, **options
            )
        else:
            record = analyze_kl(source, progress=not args.no_progress, **options)
            source.release()  # one model in memory at a time
        records.append(record if args.hf else {**record, "checkpoint": args.which})
    return records


def _hf_path(args: argparse.Namespace, tag: str) -> Path:
    """``--out/kl-<tag>[-pairs...]``: the record of one ``--hf`` model."""
    return Path(args.out) / f"kl-{tag}{_sampling(args)}.json"


def _write_summary(out: Path, records: list[dict[str, Any]]) -> list[Path]:
    from highrank.analysis.output import text_table, write_json

    title = "# Expected pairwise KL divergence E[KL(P(.|c) || P(.|c'))]\n\n"
    first = records[0]
    note = (
        f"\n{first['pairs']:,} ordered pairs of distinct contexts, uniform with replacement, "
        f"seed {first['seed']}, split {first['split']}; KL in nats, float64.\n"
    )
    table = text_table(HEADERS, table_rows(records), markdown=True)
    return [
        write_json(out / "kl.json", {"protocol": first["protocol"], "runs": records}),
        write_text_atomic(out / "kl.md", title + table + note),
    ]


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
