"""One epoch of Penn Treebank with the small CPU recipes: training throughput and validation
perplexity, recorded for the README.

    python -m benchmarks.studies.train_small_ptb [--heads softmax,mos] [--data ../shared/data/ptb]
        [--out benchmarks/results/train-small-ptb.json]

Each recipe runs `highrank train configs/ptb/small-<head>.toml --train.epochs=1` in a fresh
process (run directories go to a temporary folder; only the summary is kept): tokens/s is the
epoch's training throughput from metrics.jsonl, and the validation perplexity is that of the
epoch's end (batch 10, hidden state carried). The machine and versions are recorded.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._common import DATA, REPO, write_json
from highrank.runs.run_dir import read_metrics
from highrank.util.machine import describe_machine


def run_recipe(head: str, data: Path, scratch: Path) -> dict:
    run_dir = scratch / f"small-{head}"
    command = [
        sys.executable,
        "-m",
        "highrank",
        "train",
        str(REPO / f"configs/ptb/small-{head}.toml"),
        "--train.epochs=1",
        f"--data.dir={data}",
        f"--run.out_dir={run_dir}",
        "--no-progress",
    ]
    start = time.perf_counter()
    subprocess.run(command, check=True, cwd=REPO)
    seconds = time.perf_counter() - start
    epoch = read_metrics(run_dir / "metrics.jsonl", kind="epoch")[-1]
    return {
        "head": head,
        "command": " ".join(["highrank", *command[3:]]),
        "train_tokens_per_s": epoch["tokens_per_s"],
        "val_ppl_after_1_epoch": epoch["val_ppl"],
        "train_loss": epoch["train_loss"],
        "wall_seconds": round(seconds, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", default="softmax,mos")
    parser.add_argument("--data", default=str(DATA / "ptb"))
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/train-small-ptb.json"))
    args = parser.parse_args()
    if not Path(args.data).is_dir():
        print(f"Penn Treebank not found at {args.data}; pass --data DIR", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as scratch:
        rows = [run_recipe(h, Path(args.data), Path(scratch)) for h in args.heads.split(",")]
    out = Path(args.out)
    # Rows of heads not run now are kept, so one recipe can be re-measured on its own.
    kept = json.loads(out.read_text(encoding="utf-8"))["rows"] if out.is_file() else []
    fresh = {row["head"] for row in rows}
    result = {
        "machine": describe_machine(),
        "rows": [row for row in kept if row["head"] not in fresh] + rows,
    }
    write_json(out, result)
    print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
