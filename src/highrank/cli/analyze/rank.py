"""``highrank analyze rank``: each run's (or --hf model's) log-probability matrix, its Press
rank, epsilon-effective ranks, singular values and spectrum plot
(:func:`highrank.analysis.rank.analyze_rank` of each :class:`~highrank.analysis.rows.RowSource`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from highrank.cli.analyze.common import add_run_arguments, row_sources
from highrank.cli.choices import GRAM_BACKENDS, MATRIX_KINDS
from highrank.util.argtypes import positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser, hf=True)
    parser.add_argument(
        "--kind",
        choices=MATRIX_KINDS,
        default="log_prob",
        help="log_prob, or the transformed logits of the softmax family (log_prob)",
    )
    parser.add_argument(
        "--max-contexts",
        type=positive_int,
        help="only the first N contexts (default: the whole split or text)",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=1,
        help="columns the split is read in (1: stream order, as the papers)",
    )
    parser.add_argument(
        "--bptt",
        type=positive_int,
        help="segment length (default: a Transformer run's train.bptt, its training window; "
        "70 for AWD-LSTM runs)",
    )
    parser.add_argument(
        "--keep-matrix",
        action="store_true",
        help="keep the matrix .npy in RUN_DIR/analysis or --out (default: delete it)",
    )
    parser.add_argument("--backend", choices=GRAM_BACKENDS, default="auto", help="(auto)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cpu)")
    parser.add_argument(
        "--block-rows",
        type=positive_int,
        default=2048,
        help="rows read at a time, and the panel of A A^T when contexts < words (2048)",
    )
    parser.add_argument(
        "--checkpoint-minutes",
        type=float,
        default=10.0,
        help="minutes between Gram-matrix checkpoints (10)",
    )
    parser.add_argument(
        "--out",
        help="also write rank.json, rank.md and spectrum.png here (with --hf: every record)",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def run(args: argparse.Namespace) -> int:
    from highrank.analysis.logprob_matrix import DiskSpaceError, MatrixKindError
    from highrank.analysis.output import write_json
    from highrank.analysis.rank import GramMemoryError, analyze_rank, summary_table, write_spectrum
    from highrank.causal_lm import HFInputError
    from highrank.runs.locks import LockedError

    try:
        sources = row_sources(args)
        if args.kind != "log_prob" and args.hf:
            raise HFInputError("--kind logits needs a highrank head; --hf models give log_prob")
        records, written = [], []
        for source in sources:
            record = analyze_rank(
                source,
                max_contexts=args.max_contexts,
                out=args.out,
                kind=args.kind,
                batch_size=args.batch_size,
                bptt=args.bptt,
                keep_matrix=args.keep_matrix,
                backend=args.backend,
                device=args.device,
                block_rows=args.block_rows,
                checkpoint_seconds=args.checkpoint_minutes * 60,
                progress=not args.no_progress,
            )
            tag = source.tag(kind=args.kind, max_contexts=args.max_contexts,
                             batch_size=args.batch_size, bptt=args.bptt)
            records.append(record)
            written.append(source.folder(args.out) / f"rank-{tag}.json")
            source.release()  # one model in memory at a time
    except (HFInputError, GramMemoryError, DiskSpaceError, LockedError, MatrixKindError) as error:
        print(f"highrank analyze rank: error: {error}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    print(summary_table(records), end="")
    if args.out:
        out = Path(args.out)
        write_json(out / "rank.json", {"runs": records})
        (out / "rank.md").write_text(summary_table(records, markdown=True), encoding="utf-8")
        plot = write_spectrum(records, out / "spectrum.png")
        print(f"wrote {out / 'rank.json'}, {out / 'rank.md'}, {plot}")
    return 0
