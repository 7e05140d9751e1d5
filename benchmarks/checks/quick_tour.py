"""The README's quick tour, timed: every verb on two small PTB runs, in minutes, not hours.

    python -m benchmarks.checks.quick_tour [--data ../shared/data] [--steps 300]
        [--runs runs/tour] [--out benchmarks/results/quick-tour]

Runs each command of the tour below in turn (a subprocess, as a user would type it, with the
threads torch picks), times it, and writes ``<out>/times.json`` and ``<out>/times.md``: the
command, its wall time and the machine's load average before it, so that the README's
"how long" column comes from a rerunnable command. Existing tour runs are removed first.

The tour (``--which last``: a run stopped by ``--max-steps`` has no ``best.pt``):

    highrank train configs/ptb/small-softmax.toml --max-steps 300 --run.out_dir=runs/tour/softmax
    highrank train configs/ptb/small-mos.toml --max-steps 300 --run.out_dir=runs/tour/mos
    highrank eval runs/tour/softmax --which last --split test            # the whole test split
    highrank eval runs/tour/mos --which last --split test --max-tokens 20000
    highrank dynamic-eval runs/tour/softmax --which last --max-tokens 2000 --max-stats-batches 100
    highrank analyze rank runs/tour/softmax runs/tour/mos --which last --max-contexts 5000 \
        --out reports/tour
    highrank analyze kl runs/tour/softmax runs/tour/mos --which last --max-contexts 5000
    highrank analyze topk runs/tour/softmax runs/tour/mos --which last --random 3
    highrank report runs/tour/softmax runs/tour/mos --out reports/tour
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks._common import REPO, machine, write_json, write_text


def tour(steps: int, runs: str, data: str, reports: str) -> list[list[str]]:
    softmax, mos = f"{runs}/softmax", f"{runs}/mos"
    ptb = f"--data.dir={data}/ptb"
    last = ["--which", "last"]
    return [
        ["train", "configs/ptb/small-softmax.toml", "--max-steps", str(steps),
         f"--run.out_dir={softmax}", ptb],
        ["train", "configs/ptb/small-mos.toml", "--max-steps", str(steps),
         f"--run.out_dir={mos}", ptb],
        ["eval", softmax, *last, "--split", "test"],
        ["eval", mos, *last, "--split", "test", "--max-tokens", "20000"],
        ["dynamic-eval", softmax, *last, "--max-tokens", "2000", "--max-stats-batches", "100"],
        ["analyze", "rank", softmax, mos, *last, "--max-contexts", "5000", "--out", reports],
        ["analyze", "kl", softmax, mos, *last, "--max-contexts", "5000"],
        ["analyze", "topk", softmax, mos, *last, "--random", "3"],
        ["report", softmax, mos, "--out", reports],
    ]  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--data", default="../shared/data", help="data root (relative to the repo)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--runs", default="runs/tour")
    p.add_argument("--reports", default="reports/tour")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "quick-tour"))
    args = p.parse_args(argv)
    if not (REPO / args.data / "ptb").is_dir() and not Path(args.data, "ptb").is_dir():
        raise SystemExit(f"no Penn Treebank under {args.data}/ptb; name the data root with --data")
    shutil.rmtree(REPO / args.runs, ignore_errors=True)
    rows = []
    for words in tour(args.steps, args.runs, args.data, args.reports):
        words = [*words, "--no-progress"] if words[0] != "report" else words
        line = shlex.join(["highrank", *words])
        load = os.getloadavg()[0]
        print(f"+ {line}", flush=True)
        began = time.perf_counter()
        subprocess.run([sys.executable, "-m", "highrank", *words], check=True, cwd=REPO)
        seconds = time.perf_counter() - began
        rows.append({"command": line, "seconds": round(seconds, 1), "load_before": load})
        print(f"  {seconds:.1f} s", flush=True)
    write_json(Path(args.out) / "times.json", {"machine": machine(None), "rows": rows})
    table = ["| command | seconds | load average before |", "| --- | ---: | ---: |"]
    table += [f"| `{r['command']}` | {r['seconds']:.0f} | {r['load_before']:.1f} |" for r in rows]
    write_text(Path(args.out) / "times.md", "\n".join(table) + "\n")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
