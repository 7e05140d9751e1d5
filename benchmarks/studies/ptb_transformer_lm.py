"""Transformer LMs on Penn Treebank: words (softmax, MoS, Mixtape) and characters (softmax, MoS).

    python -m benchmarks.studies.ptb_transformer_lm [--experiments word,char] [--threads 1]
        [--data ../shared/data] [--runs runs/ptb-transformer-lm]
        [--out benchmarks/results/ptb-transformer-lm]

Two tables of the Transformer issue, made with highrank's own commands (each printed and kept
in ``<out>/commands.txt``; the evaluations' records are computed in this process by
``highrank.evaluate.evaluate_run``, the call behind ``highrank eval``, and logged as that
command):

* **word**: ``configs/ptb/transformer-<head>.toml`` for softmax, MoS (K = 5) and Mixtape, at
  one budget: ``--train.epochs=2 --train.warmup_steps=100`` (830 updates of 32 windows x 70
  tokens, 1.86M tokens seen; the configs' own 20 epochs do not fit a CPU session). Valid and
  test perplexity of the best checkpoint (windows of 70, each scored independently), and the
  Press / effective ranks of the test log-prob matrix over its first ``--rank-contexts``
  contexts.
* **char**: ``configs/ptb-char/transformer-<head>.toml`` (softmax and MoS at equal parameter
  counts, 1 epoch of PTB characters): valid and test bits per character, and the rank of the
  (V = 50) test log-prob matrix — the MoS paper's inverse experiment.

Every run is trained in a subprocess with ``OMP_NUM_THREADS=--threads``. Rerunning continues:
an interrupted training run resumes from its last checkpoint (exactly), a finished stage (its
record exists) is skipped (the stages run on :class:`benchmarks.study.Study`).
``<out>/<experiment>.json`` and ``.md`` gather the records with the machine, the budget and
the training time of each run (from its ``metrics.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
from pathlib import Path

from benchmarks import _common
from benchmarks._common import DATA, REPO, append_line, machine, write_json, write_text
from benchmarks.studies.multi30k_table import train_seconds
from benchmarks.study import Stage, Study

EXPERIMENTS = {
    "word": {
        "heads": ("softmax", "mos", "mixtape"),
        "configs": "configs/ptb",
        "overrides": ["--train.epochs=2", "--train.warmup_steps=100"],
    },
    "char": {"heads": ("softmax", "mos"), "configs": "configs/ptb-char", "overrides": []},
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--experiments", default="word,char")
    p.add_argument("--heads", help="only these heads (default: each experiment's)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rank-contexts", type=int, default=8192)
    p.add_argument("--data", default=str(DATA), help="data root")
    p.add_argument("--runs", default=str(REPO / "runs" / "ptb-transformer-lm"))
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "ptb-transformer-lm"))
    args = p.parse_args(argv)
    args.experiments = args.experiments.split(",")
    unknown = sorted(set(args.experiments) - set(EXPERIMENTS))
    if unknown:
        p.error(f"unknown experiment(s) {unknown}; expected some of {sorted(EXPERIMENTS)}")
    return args


def highrank(args, *words: str) -> None:
    _common.highrank(*words, threads=args.threads, log=Path(args.out) / "commands.txt")


def train(args, experiment: str, head: str, run: Path) -> None:
    done = run / "benchmark-train.done"
    if done.is_file():
        return
    spec = EXPERIMENTS[experiment]
    if (run / "checkpoints" / "last.pt").is_file():
        highrank(args, "train", "--resume", str(run), "--no-progress")
    else:
        config = f"{spec['configs']}/transformer-{head}.toml"
        data = Path(args.data) / "ptb"
        highrank(
            args,
            "train",
            config,
            f"--run.out_dir={run}",
            f"--data.dir={data}",
            *spec["overrides"],
            "--no-progress",
        )
    write_text(done, "")


def record(path: Path) -> dict:
    return json.loads(path.read_text())


def evaluate(args, run: Path) -> dict:
    """The valid and test records of ``highrank eval RUN --split SPLIT``: the same record,
    computed in this process (:func:`highrank.evaluate.evaluate_run` on ``--threads`` threads)
    and written where the command keeps it; the command is logged as if it had run."""
    import torch

    from highrank.evaluate.run import evaluate_run, record_file
    from highrank.util.atomic import write_json as write_record

    out = {}
    for split in ("valid", "test"):
        path = run / f"eval-{split}-best.json"
        if not path.is_file():
            line = shlex.join(["highrank", "eval", str(run), "--split", split, "--no-progress"])
            print(f"+ {line}", flush=True)
            append_line(Path(args.out) / "commands.txt",
                        f"{line}  # in process: highrank.evaluate.evaluate_run")
            threads = torch.get_num_threads()
            torch.set_num_threads(args.threads)
            try:
                result = evaluate_run(run, split)
            finally:
                torch.set_num_threads(threads)
            path = write_record(record_file(run, result), result)
        out[split] = record(path)
    return out


def rank(args, run: Path) -> dict:
    path = run / "analysis" / f"rank-test-best-first{args.rank_contexts}.json"
    if not path.is_file():
        highrank(
            args,
            "analyze",
            "rank",
            str(run),
            "--split",
            "test",
            "--max-contexts",
            str(args.rank_contexts),
            "--no-progress",
        )
    return record(path)


def row(experiment: str, head: str, run: Path, evals: dict, ranks: dict) -> dict:
    from highrank.runs.run_dir import read_metrics

    records = read_metrics(run / "metrics.jsonl")
    validations = [r for r in records if r["kind"] in ("epoch", "eval")]
    figures = {
        "head": head,
        "run": str(run.relative_to(REPO)) if run.is_relative_to(REPO) else str(run),
        "updates": max(r["step"] for r in records),
        "train_seconds": round(train_seconds(validations), 1),
        "press_rank": ranks["press_rank"],
        "effective_rank": ranks["effective_rank"],
        "logprob_matrix_shape": ranks["shape"],
    }
    for split, result in evals.items():
        figures[f"{split}_loss"] = result["loss"]
        figures[f"{split}_ppl"] = result["perplexity"]
        if experiment == "char":
            figures[f"{split}_bpc"] = result["bits_per_char"]
    return figures


def table_markdown(experiment: str, rows: list[dict]) -> str:
    unit = "bpc" if experiment == "char" else "ppl"
    lines = [
        f"| head | valid {unit} | test {unit} | Press rank | updates | training min |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['head']} | {r[f'valid_{unit}']:.3f} | {r[f'test_{unit}']:.3f} | "
            f"{r['press_rank']} | {r['updates']} | {r['train_seconds'] / 60:.1f} |"
        )
    return "\n".join(lines) + "\n"


def heads_of(args, experiment: str) -> list[str]:
    return args.heads.split(",") if args.heads else EXPERIMENTS[experiment]["heads"]


def study(args) -> Study:
    """Per experiment and head, the stages ``<experiment>-<head>-{train,eval,rank}`` on
    :class:`benchmarks.study.Study`, each done when its highrank records exist (training: its
    ``benchmark-train.done``), eval and rank after the training; lock files in ``--runs``."""
    runs = {}
    for experiment in args.experiments:
        for head in heads_of(args, experiment):
            runs[f"{experiment}-{head}"] = (experiment, head, Path(args.runs) / experiment / head)
    stages = []
    for name in runs:
        stages += [Stage(f"{name}-train"), Stage(f"{name}-eval", (f"{name}-train",)),
                   Stage(f"{name}-rank", (f"{name}-train",))]

    def split(stage: str) -> tuple[str, str, Path, str]:
        name, _, kind = stage.rpartition("-")
        return (*runs[name], kind)

    def done(stage: str) -> bool:
        _, _, run, kind = split(stage)
        if kind == "train":
            return (run / "benchmark-train.done").is_file()
        if kind == "eval":
            return all((run / f"eval-{s}-best.json").is_file() for s in ("valid", "test"))
        return (run / "analysis" / f"rank-test-best-first{args.rank_contexts}.json").is_file()

    def work(stage: str) -> dict:
        experiment, head, run, kind = split(stage)
        if kind == "train":
            train(args, experiment, head, run)
        else:
            (evaluate if kind == "eval" else rank)(args, run)
        return {}

    return Study(stages, work, records=None, locks=Path(args.runs), done=done)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    status = study(args).run()
    if status:
        return status
    for experiment in args.experiments:
        spec = EXPERIMENTS[experiment]
        heads = heads_of(args, experiment)
        rows = []
        for head in heads:
            run = Path(args.runs) / experiment / head
            rows.append(row(experiment, head, run, evaluate(args, run), rank(args, run)))
        summary = {
            "experiment": experiment,
            "budget": spec["overrides"] or "the configs' own (1 epoch)",
            "rank_contexts": args.rank_contexts,
            "machine": machine(args.threads),
            "rows": rows,
        }
        name = experiment if not args.heads else f"{experiment}-{'-'.join(heads)}"
        write_json(Path(args.out) / f"{name}.json", summary)
        write_text(Path(args.out) / f"{name}.md", table_markdown(experiment, rows))
        print(table_markdown(experiment, rows))
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
