"""The default test suite and ``highrank --help`` at two commits, side by side (issue 20: the
layout redesign should make the suite faster, not slower).

    python -m benchmarks.checks.suite_timing BEFORE AFTER              # e.g. 2e5098b 7b6f67e
    python -m benchmarks.checks.suite_timing BEFORE AFTER --summarize  # the tables, from records

Each commit is checked out in its own worktree (``--work``/wt-COMMIT) and both suites run at
the same time, one process of one thread each (``OMP_NUM_THREADS=1``), so that both see the
same machine: the comparison is their ratio, not either time. Each writes a JUnit XML report;
the tests both commits hold (matched by test module and name: the redesign moved test files)
are summed per commit. Then ``python -m highrank --help`` runs ``--repeats`` times per commit,
alternating, and the medians are compared. Both use this repository's virtual environment with
``PYTHONPATH`` pointing at the worktree's ``src``.

Records go to ``--out`` (benchmarks/results/suite-timing): ``{before,after}.xml`` and
``.log`` and ``summary.json``.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from benchmarks._common import REPO, RESULTS, machine, module_name, run_env, write_json

MODULE = module_name(__file__)  # benchmarks.checks.suite_timing

SIDES = ("before", "after")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", help="the commit before the change")
    parser.add_argument("after", help="the commit after it")
    parser.add_argument("--work", type=Path, default=REPO.parent, help="where the worktrees go")
    parser.add_argument("--out", type=Path, default=RESULTS / "suite-timing")
    parser.add_argument("--repeats", type=int, default=7, help="--help runs per commit")
    parser.add_argument("--summarize", action="store_true", help="only read the records")
    return parser.parse_args(argv)


def worktree(args: argparse.Namespace, commit: str) -> Path:
    path = args.work / f"wt-{commit}"
    if not path.is_dir():
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), commit], check=True
        )
    return path


def side_env(tree: Path) -> dict[str, str]:
    return {**run_env(threads=1), "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(tree / "src")}


def run_suites(args: argparse.Namespace, trees: dict[str, Path]) -> dict[str, int]:
    """Both suites at once; their exit codes (a failing test still times the suite)."""
    args.out.mkdir(parents=True, exist_ok=True)
    processes = {}
    for side, tree in trees.items():
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                   f"--junitxml={(args.out / f'{side}.xml').resolve()}"]
        with open(args.out / f"{side}.log", "w", encoding="utf-8") as log:  # the child keeps it
            processes[side] = subprocess.Popen(
                command, cwd=tree, env=side_env(tree), stdout=log, stderr=subprocess.STDOUT
            )
    return {side: process.wait() for side, process in processes.items()}


def help_seconds(args: argparse.Namespace, trees: dict[str, Path]) -> dict[str, list[float]]:
    seconds: dict[str, list[float]] = {side: [] for side in trees}
    for _ in range(args.repeats):
        for side, tree in trees.items():  # alternating, so both meet the same load
            began = time.perf_counter()
            subprocess.run([sys.executable, "-m", "highrank", "--help"], cwd=tree,
                           env=side_env(tree), stdout=subprocess.DEVNULL, check=True)
            seconds[side].append(round(time.perf_counter() - began, 3))
    return seconds


def test_times(path: Path) -> dict[tuple[str, str], float]:
    """(test module or class, test name) -> seconds, from a JUnit XML report (the last part
    of its classname: the module for plain tests, the class for methods); a pair that occurs
    twice is left out of the comparison."""
    times: dict[tuple[str, str], float] = {}
    seen: collections.Counter = collections.Counter()
    for case in ET.parse(path).iter("testcase"):
        key = (case.get("classname", "").split(".")[-1], case.get("name", ""))
        seen[key] += 1
        times[key] = float(case.get("time", 0.0))
    return {key: value for key, value in times.items() if seen[key] == 1}


def suite_seconds(path: Path) -> float:
    """Every test's time, duplicates included (collection time is not in it)."""
    return sum(float(case.get("time", 0.0)) for case in ET.parse(path).iter("testcase"))


def outcome_counts(path: Path) -> dict[str, int]:
    counts: collections.Counter = collections.Counter()
    for case in ET.parse(path).iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        counts[kinds[0] if kinds else "passed"] += 1
    return dict(counts)


def summarize(args: argparse.Namespace, help_runs: dict | None) -> dict:
    times = {side: test_times(args.out / f"{side}.xml") for side in SIDES}
    common = sorted(set(times["before"]) & set(times["after"]))
    sums = {side: round(suite_seconds(args.out / f"{side}.xml"), 1) for side in SIDES}
    common_sums = {side: round(sum(times[side][k] for k in common), 1) for side in SIDES}
    summary = {
        "commits": {"before": args.before, "after": args.after},
        "tests": {side: outcome_counts(args.out / f"{side}.xml") for side in SIDES},
        "suite_seconds": sums,
        "common_tests": len(common),
        "common_tests_seconds": common_sums,
        "common_ratio_after_over_before": round(common_sums["after"] / common_sums["before"], 3),
    }
    previous = args.out / "summary.json"
    if help_runs is None and previous.is_file():
        import json

        help_runs = json.loads(previous.read_text()).get("help_seconds")
    if help_runs:
        summary["help_seconds"] = help_runs
        medians = {side: statistics.median(help_runs[side]) for side in SIDES}
        summary["help_median_seconds"] = medians
        summary["help_ratio_after_over_before"] = round(medians["after"] / medians["before"], 3)
    return summary


def main(argv=None) -> None:
    args = parse_args(argv)
    help_runs = None
    if not args.summarize:
        trees = {"before": worktree(args, args.before), "after": worktree(args, args.after)}
        codes = run_suites(args, trees)
        print(f"suites finished, exit codes {codes}")
        help_runs = help_seconds(args, trees)
    summary = summarize(args, help_runs)
    summary["command"] = f"python -m {MODULE} " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    summary["machine"] = machine(threads=1, note=os.environ.get("SUITE_TIMING_NOTE"))
    write_json(args.out / "summary.json", summary)
    for key in ("tests", "suite_seconds", "common_tests", "common_tests_seconds",
                "common_ratio_after_over_before", "help_median_seconds",
                "help_ratio_after_over_before"):
        print(f"{key}: {summary.get(key)}")


if __name__ == "__main__":
    main()
