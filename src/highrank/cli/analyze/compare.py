"""``highrank compare``: two groups of runs (seeds), t-test on perplexity, rank vs perplexity
(:mod:`highrank.analysis.significance`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from highrank.cli.choices import GROUP_SEPARATOR as SEPARATOR
from highrank.util.atomic import write_text_atomic
from highrank.util.paths import run_dir_problem

# The options are declared without the library (numpy, scipy), which the functions import.


def _add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--names", type=_two_names, default=("A", "B"), help="names of the groups (A,B)"
    )
    parser.add_argument("--split", choices=["valid", "test"], default="test", help="(test)")
    parser.add_argument(
        "--which",
        default="auto",
        help="checkpoint: best, last, finetuned or a .pt path; auto (default): each run's "
        "finetuned record when it has one, else best",
    )
    parser.add_argument("--welch", action="store_true", help="Welch's t-test (unequal variances)")
    parser.add_argument(
        "--paired",
        action="store_true",
        help="a paired t-test: each run of group A with the run in its place in group B (the "
        "same seed; retrofit outputs' seeds are checked)",
    )
    parser.add_argument(
        "--alpha", type=_probability, default=0.05, help="significance level (0.05)"
    )
    parser.add_argument(
        "--rank-tag",
        help="rank records to correlate with perplexity: RUN_DIR/analysis/rank-TAG.json "
        "(default SPLIT-WHICH, e.g. test-best; test-best-first33320 for --max-contexts 33320)",
    )
    parser.add_argument("--out", help="also write compare.json and compare.md here")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``highrank compare GROUP_A_RUN... -- GROUP_B_RUN... [options]``.

    argparse drops ``--`` from ordinary positionals, so the runs are one REMAINDER
    positional holding the separator; options written after the runs land in it too and are
    parsed again by :func:`split_groups`.
    """
    _add_options(parser)
    parser.add_argument(
        "runs",
        nargs=argparse.REMAINDER,
        metavar="GROUP_A_RUN... -- GROUP_B_RUN...",
        help="run directories of the two groups (each evaluated with `highrank eval`), or "
        "the --out folders of `highrank retrofit` (their results.json)",
    )
    parser.epilog = "Options may come before the runs or after the last run of group B."


def split_groups(
    tokens: Sequence[str], namespace: argparse.Namespace | None = None
) -> tuple[list[str], list[str]]:
    """The two groups of run directories around the one ``--`` of ``tokens``; options
    among them are parsed into ``namespace`` (argparse errors exit with status 2)."""
    tokens = list(tokens)
    if tokens.count(SEPARATOR) != 1:
        raise _compare_error(
            f"found {tokens.count(SEPARATOR)} '--' among the runs; expected two groups of run "
            "directories separated by one --: highrank compare RUN_A1 RUN_A2 ... -- RUN_B1 ..."
        )
    cut = tokens.index(SEPARATOR)
    parser = argparse.ArgumentParser(prog="highrank compare", add_help=False, allow_abbrev=False)
    _add_options(parser)
    groups = []
    for side in (tokens[:cut], tokens[cut + 1 :]):
        _, runs = parser.parse_known_args(side, namespace)
        stray = [token for token in runs if token.startswith("-")]
        if stray:
            parser.error(f"unrecognized arguments: {' '.join(stray)}")
        groups.append(runs)
    for name, runs in zip("AB", groups, strict=True):
        if len(runs) < 2:
            raise _compare_error(f"group {name} has {len(runs)} run(s); expected at least 2")
    return groups[0], groups[1]


def _compare_error(message: str) -> Exception:
    from highrank.analysis.significance import CompareError

    return CompareError(message)


def run(args: argparse.Namespace) -> int:
    """``highrank compare``: the t-test of the two groups' perplexities, printed and saved."""
    try:  # the options after the runs, and the runs, before the library is imported
        runs_a, runs_b = split_groups(args.runs, args)
        problem = next(filter(None, map(run_dir_problem, runs_a + runs_b)), None)
    except ValueError as error:  # CompareError
        problem = str(error)
    if problem:
        print(f"highrank compare: error: {problem}", file=sys.stderr)
        return 2
    from highrank.analysis.output import write_json
    from highrank.analysis.significance import CompareError, compare_runs

    try:
        name_a, name_b = args.names
        knobs = {
            "split": args.split,
            "which": args.which,
            "welch": args.welch,
            "paired": args.paired,
            "rank_tag": args.rank_tag,
        }
        record = compare_runs({name_a: runs_a, name_b: runs_b}, **knobs, alpha=args.alpha)
    except CompareError as error:
        print(f"highrank compare: error: {error}", file=sys.stderr)
        return 2
    print(report(record), end="")
    if args.out:
        out = Path(args.out)
        paths = [
            write_json(out / "compare.json", record),
            write_text_atomic(out / "compare.md", report(record, markdown=True)),
        ]
        print(f"wrote {paths[0]} and {paths[1]}")
    return 0


def report(record: dict[str, Any], *, markdown: bool = False) -> str:
    """The groups' table and one line each for the t-test and the rank correlation."""
    from highrank.analysis.output import text_table

    rows = [
        [name, record[f"n_{side}"], record[f"mean_{side}"], record[f"std_{side}"]]
        for name, side in zip(record["groups"], "ab", strict=True)
    ]
    headers = ["group", "runs", f"mean {record['split']} ppl", "std"]
    table = text_table(headers, rows, markdown=markdown)
    lines = [_test_line(record), _rank_line(record["rank_vs_perplexity"])]
    for name, group in record["groups"].items():
        for run, source in zip(group["runs"], group.get("sources", []), strict=False):
            lines.append(f"{name}: {run}: {source}")
    title = "# Comparison of two groups of runs\n\n" if markdown else ""
    return title + table + "\n" + "\n".join(lines) + "\n"


def _test_line(record: dict[str, Any]) -> str:
    verdict = "significant" if record["significant"] else "not significant"
    relation = "<" if record["significant"] else ">="
    return (
        f"{record['test']}, two-sided: t = {record['t']:.4g}, df = {record['df']:.4g}, "
        f"p = {record['p']:.4g} {relation} {record['alpha']:g}: {verdict}; "
        f"lower mean perplexity: {record['lower_perplexity']}"
    )


def _rank_line(correlation: dict[str, Any]) -> str:
    if "skipped" in correlation:
        return f"press rank vs perplexity: skipped: {correlation['skipped']}"
    return (
        f"press rank vs perplexity: Pearson r = {correlation['r']:.4g}, "
        f"p = {correlation['p']:.4g} over {correlation['n']} runs"
    )


def _two_names(text: str) -> tuple[str, str]:
    names = tuple(name.strip() for name in text.split(","))
    if len(names) != 2 or not all(names) or names[0] == names[1]:
        raise argparse.ArgumentTypeError(f"expected two different names like A,B; got {text!r}")
    return names


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1); got {text!r}") from None
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1); got {text!r}")
    return value
