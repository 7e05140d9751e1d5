"""The papers' comparison at a CPU budget: every head, several seeds, rank against perplexity.

    python benchmarks/replication_study.py                # plan, then run what is not done yet
    python benchmarks/replication_study.py --plan         # only print the remaining work + ETA

Every number comes from highrank's own commands, run as subprocesses exactly as a user would
type them (each command line is printed and kept in the results' ``commands.txt``):

    highrank train configs/ptb/small-<head>.toml --run.out_dir=RUN --train.seed=S ...
    highrank eval RUN --split test
    highrank analyze rank RUN --split test --max-contexts C
    highrank analyze kl RUN --split test
    highrank compare <softmax runs> -- <head runs> --names softmax,<head> --out RESULTS/...
    highrank report <all runs> --out RESULTS/report.html

The budget (the same for every head; defaults, stated again in ``summary.md``):

* the small PTB recipes (``configs/ptb/small-<head>.toml``: AWD-LSTM, d_embed 200, 2 layers,
  batch 32, bptt 35), with ``model.d_hidden`` of each head chosen so that every model has the
  softmax model's parameter count within 2% (:func:`matched_hidden_sizes`);
* ``--epochs`` epochs (3) of PTB train (929,589 tokens each) under ONE switch policy for
  every head: ET-ASGD, averaging from the last epoch on (``train.switch_epoch = epochs - 1``);
  each head keeps its small recipe's learning rate (MoS 20, the others 30: see the TOMLs);
* ``--seeds`` seeds per head (3), plus ``--extra-seeds`` (2) for softmax and MoS;
* test perplexity of the best checkpoint; Press and effective ranks of the test log-prob
  matrix over the first ``--rank-contexts`` contexts (20,000 of 82,430, to bound the time);
  pairwise KL with the analysis's default protocol.

Rerunning continues where it stopped: a finished stage leaves its record (a ``.done`` marker
for training, the verb's own JSON record otherwise) and is never redone; an interrupted
training run resumes from its last checkpoint (or restarts when it had none). The run
directories live in ``benchmarks/results/replication/runs`` and are committed without their
checkpoints and log-prob matrices (.gitignore), so that a later fresh clone holds every
finished stage's records and continues with the rest.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEADS = ("softmax", "moc", "mos", "mixtape", "sigsoftmax", "gss", "plif")
PTB_VOCAB = 10_000
PARAMETER_TOLERANCE = 0.02
# Seconds per stage before anything was measured here (one PTB epoch of small-softmax took
# 147 s and small-mos 387 s alone on this machine: benchmarks/results/train-small-ptb.json);
# replaced by the medians of stages that finished as soon as there are some.
PRIOR_EPOCH_SECONDS = {"softmax": 150, "mos": 390}
PRIOR_EPOCH_DEFAULT = 300
PRIOR_STAGE_SECONDS = {"eval": 120, "rank": 240, "kl": 120}


@dataclass(frozen=True)
class Run:
    head: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.head}-seed{self.seed}"


@dataclass(frozen=True)
class Task:
    run: Run
    stage: str  # train | eval | rank | kl


def matched_hidden_sizes(heads=HEADS, tolerance=PARAMETER_TOLERANCE) -> dict[str, int]:
    """``model.d_hidden`` per head so that each small model has the softmax model's parameter
    count within ``tolerance`` (the closest width that does; an error if none does)."""
    from highrank.config import load_config
    from highrank.train import parameter_count

    def count(head: str, d_hidden: int) -> int:
        config = load_config(config_path(head), [f"model.d_hidden={d_hidden}"])
        return parameter_count(config, PTB_VOCAB)

    target = count("softmax", load_config(config_path("softmax")).model.d_hidden)
    sizes = {}
    for head in heads:
        low, high = 16, 4096  # count grows with d_hidden: bisect for the closest width
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if count(head, middle) <= target else (low, middle)
        best = min((low, high), key=lambda d: abs(count(head, d) - target))
        if abs(count(head, best) - target) > tolerance * target:
            raise SystemExit(f"{head}: no d_hidden gives {target:,} parameters within 2%")
        sizes[head] = best
    return sizes


def config_path(head: str) -> Path:
    return REPO / "configs" / "ptb" / f"small-{head}.toml"


def plan(args: argparse.Namespace) -> list[Run]:
    """Seed-major (every head's seed 1, then every head's seed 2, ...), so that a study cut
    short still holds a run of every head."""
    runs = []
    for head in args.heads:
        extra = args.extra_seeds if head in ("softmax", "mos") else 0
        runs += [Run(head, seed) for seed in range(1, args.seeds + extra + 1)]
    return sorted(runs, key=lambda run: (run.seed, args.heads.index(run.head)))


def run_dir(args: argparse.Namespace, run: Run) -> Path:
    return Path(args.runs) / run.name


def is_done(args: argparse.Namespace, task: Task) -> bool:
    directory = run_dir(args, task.run)
    if task.stage == "train":
        return (directory / "study-train.done").is_file()
    if task.stage == "eval":
        return (directory / "eval-test-best.json").is_file()
    tag = f"test-best-first{args.rank_contexts}" if task.stage == "rank" else "test-best"
    return (directory / "analysis" / f"{task.stage}-{tag}.json").is_file()


def remaining(args: argparse.Namespace, runs: list[Run]) -> list[Task]:
    stages = ("train", "eval", "rank", "kl")
    return [Task(r, s) for r in runs for s in stages if not is_done(args, Task(r, s))]


# ---- time estimates ---------------------------------------------------------------------


def timings_path(args: argparse.Namespace) -> Path:
    return Path(args.results) / "timings.json"


def load_timings(args: argparse.Namespace) -> dict[str, list[float]]:
    path = timings_path(args)
    return json.loads(path.read_text()) if path.is_file() else {}


def record_timing(args: argparse.Namespace, task: Task, seconds: float) -> None:
    timings = load_timings(args)
    timings.setdefault(timing_key(task), []).append(round(seconds, 1))
    _write_text(timings_path(args), json.dumps(timings, indent=1, sort_keys=True))


def timing_key(task: Task) -> str:
    return f"{task.stage}:{task.run.head}" if task.stage == "train" else task.stage


def estimate_seconds(args: argparse.Namespace, task: Task) -> float:
    measured = load_timings(args).get(timing_key(task))
    if measured:
        return statistics.median(measured)
    if task.stage == "train":
        per_epoch = PRIOR_EPOCH_SECONDS.get(task.run.head, PRIOR_EPOCH_DEFAULT)
        return per_epoch * args.epochs
    return PRIOR_STAGE_SECONDS[task.stage]


def print_plan(args: argparse.Namespace, tasks: list[Task]) -> None:
    total = sum(estimate_seconds(args, t) for t in tasks)
    print(f"remaining: {len(tasks)} stages, about {total / 3600:.1f} h on this machine")
    for stage in ("train", "eval", "rank", "kl"):
        names = [t.run.name for t in tasks if t.stage == stage]
        if names:
            print(f"  {stage:5s} {len(names):3d}: {', '.join(names)}")


# ---- running ---------------------------------------------------------------------------


def highrank(args: argparse.Namespace, *words: str) -> None:
    """Run one highrank command (printed and logged); stop the study if it fails."""
    command = [sys.executable, "-m", "highrank", *words]
    line = shlex.join(["highrank", *words])
    print(f"+ {line}", flush=True)
    with open(Path(args.results) / "commands.txt", "a", encoding="utf-8") as log:
        log.write(line + "\n")
    status = subprocess.run(command, cwd=REPO).returncode
    if status != 0:
        raise SystemExit(f"the study stopped: `{line}` exited with {status}; rerun to continue")


def train_words(args: argparse.Namespace, run: Run, d_hidden: int) -> list[str]:
    directory = run_dir(args, run)
    if (directory / "checkpoints" / "last.pt").is_file():
        return ["train", "--resume", str(directory), "--no-progress"]
    if directory.exists():  # interrupted before its first checkpoint: nothing to keep
        import shutil

        shutil.rmtree(directory)
    return [
        "train",
        str(config_path(run.head).relative_to(REPO)),
        f"--run.out_dir={directory}",
        f"--train.seed={run.seed}",
        f"--train.epochs={args.epochs}",
        "--train.optimizer=et-asgd",
        f"--train.switch_epoch={args.epochs - 1}",
        f"--model.d_hidden={d_hidden}",
        "--no-progress",
        *args.override,
    ]


def run_task(args: argparse.Namespace, task: Task, d_hidden: int) -> None:
    directory = str(run_dir(args, task.run))
    if task.stage == "train":
        highrank(args, *train_words(args, task.run, d_hidden))
        (run_dir(args, task.run) / "study-train.done").write_text("")
    elif task.stage == "eval":
        highrank(args, "eval", directory, "--split", "test", "--no-progress")
    elif task.stage == "rank":
        contexts = str(args.rank_contexts)
        highrank(args, "analyze", "rank", directory, "--split", "test", "--max-contexts", contexts)
    else:
        highrank(args, "analyze", "kl", directory, "--split", "test")


def summarize(args: argparse.Namespace, runs: list[Run]) -> None:
    """``highrank compare`` of every head against softmax, and the HTML report."""
    results = Path(args.results)
    softmax = [str(run_dir(args, r)) for r in runs if r.head == "softmax"]
    tag = f"test-best-first{args.rank_contexts}"
    for head in args.heads:
        if head == "softmax":
            continue
        group = [str(run_dir(args, r)) for r in runs if r.head == head]
        out = str(results / f"compare-{head}")
        highrank(args, "compare", *softmax, "--", *group, "--names", f"softmax,{head}",
                 "--rank-tag", tag, "--out", out)
    everything = [str(run_dir(args, r)) for r in runs]
    highrank(args, "report", *everything, "--out", str(results / "report.html"))
    table = summary_table(args, runs)
    _write_text(results / "summary.json", json.dumps(table, indent=1))
    _write_text(results / "summary.md", summary_markdown(args, table))
    print(summary_markdown(args, table))


def read_records(args: argparse.Namespace, run: Run) -> dict:
    """The figures of one run, read from the records its commands wrote."""
    directory = run_dir(args, run)
    tag = f"test-best-first{args.rank_contexts}"
    evaluation = json.loads((directory / "eval-test-best.json").read_text())
    rank = json.loads((directory / "analysis" / f"rank-{tag}.json").read_text())
    kl = json.loads((directory / "analysis" / "kl-test-best.json").read_text())
    return {
        "perplexity": evaluation["perplexity"],
        "press_rank": rank["press_rank"],
        "effective_rank": rank["effective_rank"],
        "kl": kl["mean"],
    }


def summary_table(args: argparse.Namespace, runs: list[Run]) -> dict:
    """Per head: the seeds' figures, mean and sd of perplexity, the t-test against softmax
    (from ``compare.json``), and Pearson's r of Press rank and perplexity over all runs."""
    from scipy import stats

    per_run = {r.name: {"head": r.head, "seed": r.seed, **read_records(args, r)} for r in runs}
    table = {"budget": budget(args), "runs": per_run, "heads": {}}
    for head in args.heads:
        rows = [v for v in per_run.values() if v["head"] == head]
        ppl = [row["perplexity"] for row in rows]
        compare = Path(args.results) / f"compare-{head}" / "compare.json"
        table["heads"][head] = {
            "seeds": [row["seed"] for row in rows],
            "ppl_mean": statistics.mean(ppl),
            "ppl_sd": statistics.stdev(ppl),
            "press_rank_mean": statistics.mean(row["press_rank"] for row in rows),
            "kl_mean": statistics.mean(row["kl"] for row in rows),
            "compare_vs_softmax": json.loads(compare.read_text()) if compare.is_file() else None,
        }
    ranks = [v["press_rank"] for v in per_run.values()]
    ppls = [v["perplexity"] for v in per_run.values()]
    pearson = stats.pearsonr(ranks, ppls)
    table["rank_vs_perplexity"] = {"pearson_r": pearson.statistic, "p_value": pearson.pvalue}
    return table


def budget(args: argparse.Namespace) -> str:
    return (
        f"PTB, small AWD-LSTM recipes at equal parameter count (within 2%), {args.epochs} "
        f"epochs, ET-ASGD from epoch {args.epochs}, test ranks over the first "
        f"{args.rank_contexts:,} contexts"
    )


def summary_markdown(args: argparse.Namespace, table: dict) -> str:
    lines = [
        f"Budget: {table['budget']}.",
        "",
        "| head | seeds | test ppl (mean +- sd) | Press rank | KL |",
        "| --- | --- | --- | ---: | ---: |",
    ]
    for head, row in table["heads"].items():
        lines.append(
            f"| {head} | {len(row['seeds'])} | {row['ppl_mean']:.2f} +- {row['ppl_sd']:.2f} "
            f"| {row['press_rank_mean']:.0f} | {row['kl_mean']:.3f} |"
        )
    pearson = table["rank_vs_perplexity"]
    lines += ["", f"Pearson r (Press rank, test ppl) over all runs: {pearson['pearson_r']:.3f} "
              f"(p = {pearson['p_value']:.3g}); t-tests against softmax: compare-<head>/."]
    return "\n".join(lines)


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text + "\n", encoding="utf-8")
    partial.replace(path)


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--heads", type=lambda s: tuple(s.split(",")), default=HEADS)
    parser.add_argument("--seeds", type=int, default=3, help="seeds per head (3)")
    parser.add_argument("--extra-seeds", type=int, default=2, help="more for softmax, MoS (2)")
    parser.add_argument("--epochs", type=int, default=3, help="PTB epochs per run (3)")
    parser.add_argument("--rank-contexts", type=int, default=20_000, help="(20000)")
    parser.add_argument("--runs", default=str(REPO / "benchmarks/results/replication/runs"))
    parser.add_argument("--results", default=str(REPO / "benchmarks/results/replication"))
    parser.add_argument("--plan", action="store_true", help="print the remaining work only")
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="--SECTION.KEY=VALUE",
        help="one more config override for every training run (repeatable; e.g. for a smoke "
        "test on a tiny corpus); a study with overrides is not the study this file describes",
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.heads) - set(HEADS))
    if unknown or args.epochs < 2 or args.seeds < 2:
        parser.error(f"heads from {', '.join(HEADS)}; --epochs >= 2; --seeds >= 2 ({unknown})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    Path(args.results).mkdir(parents=True, exist_ok=True)
    runs = plan(args)
    tasks = remaining(args, runs)
    print_plan(args, tasks)
    if args.plan:
        return 0
    sizes = matched_hidden_sizes(args.heads)
    _write_text(Path(args.results) / "hidden-sizes.json", json.dumps(sizes, indent=1))
    for done, task in enumerate(tasks):
        started = time.perf_counter()
        run_task(args, task, sizes[task.run.head])
        record_timing(args, task, time.perf_counter() - started)
        print_plan(args, tasks[done + 1 :])
    summarize(args, runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
