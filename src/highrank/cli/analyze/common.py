"""Options the analysis verbs share: run directories (``RUN_DIR... --which --split
--data-dir``) and Hugging Face causal LMs on a text (``--hf MODEL --text FILE --window
--bos --batch-windows``), and which of the two the arguments ask for."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from highrank.cli.choices import BATCH_ELEMENTS
from highrank.util.argtypes import positive_int
from highrank.util.paths import (
    file_problem,
    made_out_folder_problem,
    out_folder_problem,
    run_dir_problem,
)

if TYPE_CHECKING:
    from highrank.analysis.rows import RowSource

# The options are declared from torch-free constants (highrank.cli.choices) and the library is
# imported inside the functions that use it: `highrank analyze KIND --help` and argparse's
# errors import no torch, numpy or scipy (tests/test_layering.py).


def add_run_arguments(
    parser: argparse.ArgumentParser, *, corpus: bool = True, hf: bool = False
) -> None:
    """The options every analysis of trained runs shares: ``RUN_DIR...`` and ``--which``;
    with ``corpus`` also ``--split`` and ``--data-dir`` (the corpus the contexts come from);
    with ``hf`` RUN_DIRs become optional and ``--hf MODEL --text FILE`` (Hugging Face causal
    LMs, :mod:`highrank.analysis.hf_contexts`) can replace them."""
    parser.add_argument(
        "run_dirs",
        nargs="*" if hf else "+",
        metavar="RUN_DIR",
        help="runs of `highrank train`" + (" (or --hf MODEL --text FILE)" if hf else ""),
    )
    parser.add_argument(
        "--which", default="best", help="checkpoint: best, last, finetuned or a .pt path (best)"
    )
    if corpus:
        parser.add_argument(
            "--split", choices=("train", "valid", "test"), default="test", help="(test)"
        )
        parser.add_argument("--data-dir", help="corpus folder (default: each run's data.dir)")
    if hf:
        add_hf_arguments(parser)


def add_hf_arguments(parser: argparse.ArgumentParser) -> None:
    """``--hf MODEL --text FILE`` (instead of RUN_DIRs) and the window options."""
    group = parser.add_argument_group(
        "Hugging Face causal LMs (instead of RUN_DIRs; records go to --out)",
        "Contexts: the text's tokens (no special tokens added) in non-overlapping windows of "
        "--window tokens, each run as its own sequence; row i is the model's distribution "
        "after token i given the tokens of its window up to i (1 .. W tokens), target token "
        "i + 1.",
    )
    group.add_argument(
        "--hf",
        action="append",
        metavar="MODEL",
        help="a local model folder (save_pretrained output) or a .gguf file; repeat to "
        "compare models (needs the hf extra)",
    )
    group.add_argument("--text", metavar="FILE", help="UTF-8 text file the contexts come from")
    group.add_argument(
        "--window",
        type=positive_int,
        help="tokens per window (default: min(the model's maximum positions, 1024))",
    )
    group.add_argument(
        "--bos",
        action="store_true",
        help="put the tokenizer's BOS token before every window (default: none added)",
    )
    group.add_argument(
        "--batch-windows",
        type=positive_int,
        help=f"windows per forward pass (default: logits under {BATCH_ELEMENTS:,} entries)",
    )


def hf_mode(args: argparse.Namespace) -> bool:
    """Whether ``args`` ask for Hugging Face models (``--hf``) or runs; refuses a mixture
    or a missing ``--text`` / ``--out`` in one line."""
    from highrank.causal_lm import HFInputError

    models, runs = getattr(args, "hf", None), getattr(args, "run_dirs", [])
    if models and runs:
        raise HFInputError("give RUN_DIRs or --hf MODEL, not both")
    if not models:
        if getattr(args, "text", None):
            raise HFInputError("--text goes with --hf MODEL")
        if not runs:
            raise HFInputError("expected RUN_DIR... or --hf MODEL --text FILE --out DIR")
        return False
    if not args.text:
        raise HFInputError("--hf needs --text FILE: the text the contexts come from")
    if not getattr(args, "out", None):
        raise HFInputError("--hf needs --out DIR: the records are written there")
    given = [f"--{name} {getattr(args, name)}" for name, default in RUN_ONLY.items()
             if getattr(args, name, default) != default]
    if given:
        raise HFInputError(f"{', '.join(given)} chooses what a run directory is read at; --hf "
                           "reads the model as saved, on --text")
    check_out_folder(args.out, HFInputError)
    return True


# Options that choose what of a run directory an analysis reads, with their defaults: given
# with --hf, they would be ignored.
RUN_ONLY = {"which": "best", "split": "test"}


def check_runs_or_hf(args: argparse.Namespace, error: type[Exception]) -> None:
    """RUN_DIR... or ``--hf MODEL --text FILE --out DIR``, not both; ``--out`` a folder."""
    if bool(args.hf) == bool(args.run_dirs):
        raise error("give RUN_DIR... or --hf MODEL --text FILE --out DIR, not both")
    if args.hf and not (args.text and args.out):
        raise error("--hf needs --text FILE (the contexts) and --out DIR (the records)")
    if args.text and not args.hf:
        raise error("--text goes with --hf MODEL")
    if args.out:
        check_out_folder(args.out, error)


def record_each(args: argparse.Namespace, analyse_run, analyse_hf) -> list[dict]:
    """Each RUN_DIR's (or ``--hf`` model's) record, written where ``analyse_*(source, args)
    -> (record, path)`` says, the path printed."""
    from highrank.analysis.output import write_json

    records = []
    for source in args.hf or args.run_dirs:
        record, path = (analyse_hf if args.hf else analyse_run)(source, args)
        if args.hf:
            check_hf_record(path, record)
        write_json(path, record)
        print(f"wrote {path}")
        records.append(record)
    return records


def hf_record_path(args: argparse.Namespace, stem: str, model: str,
                   max_contexts: int | None) -> Path:
    """``--out/<stem>-<tag>.json``, the record of ``--hf`` model ``model`` on ``--text`` (its
    tag as the analysis writes it), refused before the work when another model of the same
    name wrote it."""
    from highrank.analysis.hf_contexts import check_record_owner, hf_tag

    tag = hf_tag(model, args.text, window=args.window, bos=args.bos, max_contexts=max_contexts)
    path = Path(args.out) / f"{stem}-{tag}.json"
    check_record_owner(path, model)
    return path


def check_hf_record(path: Path, record: dict) -> None:
    """A ``--hf`` record is not written over another model's record of the same name."""
    from highrank.analysis.hf_contexts import check_record_owner

    check_record_owner(path, record.get("model"))


def write_summary(out: str, stem: str, payload: dict, markdown: str) -> None:
    """The verb's summary of every input in ``--out``: ``<stem>.json`` (``payload``) and
    ``<stem>.md`` (``markdown``), each written atomically, both paths printed."""
    from highrank.analysis.output import write_json
    from highrank.util.atomic import write_text_atomic

    folder = Path(out)
    write_json(folder / f"{stem}.json", payload)
    write_text_atomic(folder / f"{stem}.md", markdown)
    print(f"wrote {folder / f'{stem}.json'}, {folder / f'{stem}.md'}")


def check_out_folder(out: str, error: type[Exception]) -> None:
    """``--out`` must be (or be makeable as) a folder: ``error`` names the file in the way."""
    problem = out_folder_problem(out)
    if problem:
        raise error(f"--out {out}: {problem}")


def check_paths(args: argparse.Namespace, out_purpose: str = "the records") -> str | None:
    """The first problem, in one line, of the paths ``args`` name (RUN_DIRs, other inputs,
    ``--text``, ``--out``), or None; torch-free, so a typo is answered
    before the library is imported (a ``--hf`` model is checked by its loader, after what
    the analysis asks of the other options)."""
    for run_dir in getattr(args, "run_dirs", None) or ():
        problem = run_dir_problem(run_dir)
        if problem:
            return problem
    for path in getattr(args, "inputs", None) or ():  # hidden-size: runs, matrices, records
        if not Path(path).exists():
            return (
                f"{path} does not exist; expected a run directory, a .npy log-prob matrix or "
                "a rank record .json"
            )
    text = getattr(args, "text", None)
    problem = text and file_problem(text, "--text")
    if problem:
        return problem
    out = getattr(args, "out", None)
    problem = out and made_out_folder_problem(out, out_purpose)
    return f"--out {out}: {problem}" if problem else None


def row_sources(args: argparse.Namespace) -> list[RowSource]:
    """The row sources ``args`` name: one per RUN_DIR (``--split --which --data-dir``) or one
    per ``--hf MODEL`` on ``--text`` (``--window --bos --batch-windows``); nothing is loaded
    yet. Refuses a mixture, or ``--hf`` without ``--text`` / ``--out``, in one line."""
    from highrank.analysis.rows import RowSource

    device = getattr(args, "device", "cpu")
    if hf_mode(args):
        return [
            RowSource.from_causal_lm(
                model,
                args.text,
                window=args.window,
                bos=args.bos,
                device=device,
                batch_windows=getattr(args, "batch_windows", None),
            )
            for model in args.hf
        ]
    return [
        RowSource.from_run(
            run_dir, args.split, which=args.which, data_dir=args.data_dir, device=device
        )
        for run_dir in args.run_dirs
    ]
