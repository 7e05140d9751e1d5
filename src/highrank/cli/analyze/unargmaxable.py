"""``highrank analyze unargmaxable``: tokens no hidden state can make the argmax of a run's
(or --hf model's) output layer (:mod:`highrank.analysis.unargmaxable`)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from highrank.analysis.output import text_table, write_json
from highrank.analysis.unargmaxable import (
    DEFAULT_PATIENCE,
    DEFAULT_RADIUS,
    UnargmaxableError,
    find_unargmaxable,
    head_layer,
    report_record,
)
from highrank.util.atomic import write_text_atomic


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_dirs", nargs="*", metavar="RUN_DIR", help="runs of `highrank train` (or --hf)"
    )
    parser.add_argument("--which", default="best", help="checkpoint of the runs (best)")
    parser.add_argument(
        "--hf",
        action="append",
        metavar="MODEL",
        help="a Hugging Face model folder or .gguf file: its lm_head weight and bias "
        "(needs the hf extra; records go to --out)",
    )
    domain = parser.add_mutually_exclusive_group()
    domain.add_argument(
        "--radius",
        type=float,
        default=DEFAULT_RADIUS,
        help=f"hidden states in the box |h_k| <= R ({DEFAULT_RADIUS:g}, Grivas et al.)",
    )
    domain.add_argument(
        "--unbounded", action="store_true", help="any hidden state in R^d instead of a box"
    )
    parser.add_argument(
        "--patience",
        type=int,
        default=DEFAULT_PATIENCE,
        help=f"braid reflections per token before its LP ({DEFAULT_PATIENCE})",
    )
    parser.add_argument("--out", help="also write unargmaxable.json and unargmaxable.md here")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def run(args: argparse.Namespace) -> int:
    try:
        if bool(args.hf) == bool(args.run_dirs):
            raise UnargmaxableError("give RUN_DIR... or --hf MODEL (with --out DIR), not both")
        if args.hf and not args.out:
            raise UnargmaxableError("--hf needs --out DIR: the records are written there")
        radius = None if args.unbounded else args.radius
        records = []
        for source in args.hf or args.run_dirs:
            record, path = (_hf_record if args.hf else _run_record)(source, radius, args)
            write_json(path, record)
            print(f"wrote {path}")
            records.append(record)
    except ValueError as error:  # UnargmaxableError, HFInputError (a missing hf extra too)
        print(f"highrank analyze unargmaxable: error: {error}", file=sys.stderr)
        return 2
    print(summary_table(records), end="")
    if args.out:
        out = Path(args.out)
        write_json(out / "unargmaxable.json", {"inputs": records})
        write_text_atomic(out / "unargmaxable.md", summary_table(records, markdown=True))
        print(f"wrote {out / 'unargmaxable.json'}, {out / 'unargmaxable.md'}")
    return 0


def _analyse(weight, bias, radius, args, *, domain="as asked", names=None) -> dict[str, Any]:
    if domain == "box 1":
        radius = 1.0
    elif domain == "unbounded":
        radius = None
    report = find_unargmaxable(
        weight, bias, radius=radius, patience=args.patience, progress=not args.no_progress
    )
    return report_record(report, names=names)


def _run_record(run_dir: str, radius: float | None, args) -> tuple[dict[str, Any], Path]:
    from highrank.analysis.output import run_record_path
    from highrank.model import load_run

    model, config, vocab = load_run(run_dir, args.which)
    weight, bias, domain, meaning = head_layer(model.head, config.head.name)
    record = _analyse(
        weight, bias, radius, args, domain=domain, names=lambda ids: [vocab.words[i] for i in ids]
    )
    record = {"run_dir": str(run_dir), "head": config.head.name, "analysed": meaning, **record}
    tag = f"{Path(args.which).stem}-{_radius_tag(record['radius'])}"
    return record, run_record_path(run_dir, "unargmaxable", tag)


def _hf_record(model_path: str, radius: float | None, args) -> tuple[dict[str, Any], Path]:
    from highrank.analysis.hf_contexts import load_causal_lm, model_name

    began = time.perf_counter()
    model, tokenizer = load_causal_lm(model_path, progress=not args.no_progress)
    load_seconds = time.perf_counter() - began
    head = getattr(model, "head", None)
    if head is not None and hasattr(head, "log_prob"):  # a highrank head attached to the model
        name = model.config.head_name
        weight, bias, domain, meaning = head_layer(head, name)
    else:
        linear = model.get_output_embeddings()
        if linear is None or not hasattr(linear, "weight"):
            raise UnargmaxableError(f"{model_path}: the model has no output embedding (lm_head)")
        weight, bias, domain, meaning = (
            linear.weight.detach(),
            linear.bias,
            "as asked",
            ("exact: the lm_head softmax's argmax set"),
        )
        name = "lm_head"
    record = _analyse(
        weight,
        None if bias is None else bias.detach(),
        radius,
        args,
        domain=domain,
        names=lambda ids: [tokenizer.decode([int(i)]) for i in ids],
    )
    record = {
        "model": str(model_path),
        "head": name,
        "hidden_size": int(weight.shape[1]),
        "bias": bias is not None,
        "analysed": meaning,
        **record,
        "load_seconds": round(load_seconds, 2),
    }
    path = (
        Path(args.out)
        / f"unargmaxable-{model_name(model_path)}-{_radius_tag(record['radius'])}.json"
    )
    return record, path


def _radius_tag(radius: float | None) -> str:
    return "unbounded" if radius is None else f"box{radius:g}"


def summary_table(records: list[dict[str, Any]], *, markdown: bool = False) -> str:
    headers = ["input", "head", "V", "domain", "unargmaxable", "undecided", "LP tokens", "seconds"]
    rows = [
        [
            r.get("run_dir") or r.get("model"),
            r["head"],
            r["vocab_size"],
            r["domain"],
            r["unargmaxable"],
            r["undecided"],
            r["lp_tokens"],
            round(sum(r["seconds"].values()), 1),
        ]
        for r in records
    ]
    return text_table(headers, rows, markdown=markdown)
