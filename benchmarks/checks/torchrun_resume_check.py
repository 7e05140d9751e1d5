"""The README's torchrun claim, end to end: a two-process run stopped and resumed logs the same
step losses as a straight two-process run.

    python -m benchmarks.checks.torchrun_resume_check [--config configs/ptb/small-softmax.toml]
        [--data ../shared/data/ptb] [--steps 40] [--every 1] [--nproc 2]
        [--runs runs/torchrun-check] [--out benchmarks/results/torchrun-resume]

Three commands, as a user types them (``torchrun --nproc-per-node N -m highrank train ...``,
gloo on CPU): a straight run of ``--steps`` steps; a run stopped at half of them
(``--max-steps``); its ``--resume`` to ``--steps``. The step losses are logged every
``--every`` steps (``train.log_every``); the check compares the two runs' logged losses
exactly (``==`` on the floats of metrics.jsonl) and writes ``<out>/check.json`` with both
lists, the commands, their exit statuses and the machine. Exit status 1 when they differ.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks._common import DATA, REPO, machine, write_json


def torchrun(nproc: int, *words: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "-m", "highrank", "train", *words,
    ]  # fmt: skip


def step_losses(run_dir: Path) -> dict[int, float]:
    """step -> logged training loss; a resumed run's repeated records keep the last."""
    losses = {}
    for line in (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if record.get("kind") == "step" and record.get("stage") == "train":
            losses[record["step"]] = record["train_loss"]
    return losses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--config", default="configs/ptb/small-softmax.toml")
    parser.add_argument("--data", default=str(DATA / "ptb"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=1, help="train.log_every (1)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--runs", default=str(REPO / "runs" / "torchrun-check"))
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "torchrun-resume"))
    args = parser.parse_args(argv)
    if not Path(args.data).is_dir():
        parser.error(f"--data {args.data}: no such corpus directory (Penn Treebank's folder)")
    if args.steps < 2 or args.every < 1:
        parser.error(f"--steps >= 2 and --every >= 1 (got {args.steps}, {args.every})")
    runs = Path(args.runs)
    shutil.rmtree(runs, ignore_errors=True)
    straight, stopped = runs / "straight", runs / "stopped"
    common = [f"--data.dir={args.data}", f"--train.log_every={args.every}", "--no-progress"]
    commands = [
        torchrun(args.nproc, args.config, f"--run.out_dir={straight}", "--max-steps",
                 str(args.steps), *common),
        torchrun(args.nproc, args.config, f"--run.out_dir={stopped}", "--max-steps",
                 str(args.steps // 2), *common),
        torchrun(args.nproc, "--resume", str(stopped), "--max-steps", str(args.steps),
                 "--no-progress"),
    ]  # fmt: skip
    statuses = []
    for command in commands:
        print("+", " ".join(command), flush=True)
        statuses.append(subprocess.run(command, cwd=REPO).returncode)
        if statuses[-1] != 0:
            break
    result = {"commands": [" ".join(c) for c in commands], "exit_statuses": statuses}
    if statuses == [0, 0, 0]:
        a, b = step_losses(straight), step_losses(stopped)
        result |= {
            "straight": a,
            "stopped_and_resumed": b,
            "identical": a == b and len(a) == args.steps // args.every,
        }
    # torchrun sets OMP_NUM_THREADS=1 in each process unless the environment sets it
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    result["machine"] = machine(threads) | {"processes": args.nproc}
    write_json(Path(args.out) / "check.json", result)
    print(json.dumps({k: result.get(k) for k in ("exit_statuses", "identical")}))
    return 0 if result.get("identical") else 1


if __name__ == "__main__":
    raise SystemExit(main())
