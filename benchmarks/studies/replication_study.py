"""The papers' comparison at a CPU budget: every head, several seeds, rank against perplexity.

    python -m benchmarks.studies.replication_study              # plan, then run what is not done
    python -m benchmarks.studies.replication_study --plan       # only print the work left + ETA
    python -m benchmarks.studies.replication_study --summarize  # results of the finished runs

Every number comes from highrank's own commands, run as subprocesses exactly as a user would
type them (each command line is printed and kept in the results' ``commands.txt``):

    highrank train configs/ptb/small-<head>.toml --run.out_dir=RUN --train.seed=S ...
    highrank eval RUN --split test
    highrank analyze rank RUN --split test --max-contexts C
    highrank analyze kl RUN --split test
    highrank eval RUN --split test --max-tokens T                  # the slice, statically
    highrank dynamic-eval RUN --split test --max-tokens T --max-stats-batches M --lr E --epsilon P
    highrank compare <softmax runs> -- <head runs> --names softmax,<head> --welch --out RESULTS/..
    highrank report <finished runs> --out RESULTS/report

The budget (the same for every head; defaults, stated again in ``summary.md``):

* the small PTB recipes (``configs/ptb/small-<head>.toml``: AWD-LSTM, d_embed 200, 2 layers,
  batch 32, bptt 35), with ``model.d_hidden`` of each head chosen so that every model has the
  softmax model's parameter count within 2% (:func:`matched_hidden_sizes`);
* ``--epochs`` epochs (3) of PTB train (929,589 tokens each) under ONE switch policy for
  every head: ET-ASGD, averaging from the last epoch on (``train.switch_epoch = epochs - 1``);
  each head keeps its small recipe's learning rate (MoS and Mixtape 20, the others 30: see
  the TOMLs);
* ``--seeds`` seeds per head (3), plus ``--extra-seeds`` (2) for softmax and MoS;
* test perplexity of the best checkpoint; Press and effective ranks of the test log-prob
  matrix over the first ``--rank-contexts`` contexts (20,000 of 82,430, to bound the time);
  pairwise KL with the analysis's default protocol;
* dynamic evaluation (Krause et al. 2017) on a stated slice, the first ``--dynamic-tokens``
  test tokens (1,000 of 82,430), scored statically too, so the two figures share their
  tokens; the gradient statistics come from the first ``--dynamic-stats-batches`` (10) of the
  N training segments of a full pass (N = 1,859 for PTB), and eta and epsilon are scaled by
  sqrt(10 / N) so that the step eta * grad / (MS + epsilon) is in expectation the full pass's
  (:func:`dynamic_knobs`). The whole stage took 65 s and 99 s for small-mos (two runs), 62 s
  for small-softmax and 102 s for small-MoC here, 2 threads, under the load of the running
  study; one statistics segment of small-mos takes about 2 s then, so a full pass would cost
  over an hour per run.

``--summarize`` builds the results from the runs finished so far (training and test
evaluation done) without running any stage: the table says which runs and stages are missing,
heads with one finished seed show a mean only. The results (``summary.md``/``.json``, the
figures ``learning-curves.png``, ``spectrum.png``, ``rank-vs-perplexity.png``, ``compare-<head>/``
and ``report/report.html``) are written to ``--results``; :func:`summarize` says what each holds.

Rerunning continues where it stopped: a finished stage leaves its record (a ``.done`` marker
for training, the verb's own JSON record otherwise) and is never redone; an interrupted
training run resumes from its last checkpoint (or restarts when it had none). The run
directories live in ``benchmarks/results/replication/runs`` and are committed without their
checkpoints and log-prob matrices (.gitignore), so that a later fresh clone holds every
finished stage's records and continues with the rest.

Several processes may share a study, each with its own ``--heads``; where their heads overlap,
each skips a stage another finished since its plan was made, and waits for one another is
running now (its lock held) before the stages that need it (:class:`benchmarks.study.Study`).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import _common
from benchmarks._common import REPO, append_line, write_json, write_text
from benchmarks.study import Stage, Study
from highrank.runs.locks import LOCK_FILE, LockedError, exclusive

HEADS = ("softmax", "moc", "mos", "mixtape", "sigsoftmax", "gss", "plif")
PTB_VOCAB = 10_000
PARAMETER_TOLERANCE = 0.02
# Seconds per stage before anything was measured here (one PTB epoch of small-softmax took
# 147 s and small-mos 387 s alone on this machine: benchmarks/results/train-small-ptb.json);
# replaced by the medians of stages that finished as soon as there are some.
PRIOR_EPOCH_SECONDS = {"softmax": 150, "mos": 390}
PRIOR_EPOCH_DEFAULT = 300
# dynamic: the stage at the default slice took 62 s (softmax) to 102 s (MoC) under the study's load
PRIOR_STAGE_SECONDS = {"eval": 120, "rank": 240, "kl": 120, "dynamic": 90}
STAGES = ("train", "eval", "rank", "kl", "dynamic")
# Every head's colour in every figure (matplotlib's default cycle, in HEADS order).
COLOURS = {head: f"C{i}" for i, head in enumerate(HEADS)}


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
    stage: str  # one of STAGES


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
    if task.stage == "dynamic":  # both records of the slice, the statistics as asked now
        static, dynamic = slice_records(args, task.run)
        if not (static.is_file() and dynamic.is_file()):
            return False
        return read_json(dynamic).get("max_stats_batches") == args.dynamic_stats_batches
    tag = rank_tag(args) if task.stage == "rank" else "test-best"
    return (directory / "analysis" / f"{task.stage}-{tag}.json").is_file()


def remaining(args: argparse.Namespace, runs: list[Run]) -> list[Task]:
    return [Task(r, s) for r in runs for s in STAGES if not is_done(args, Task(r, s))]


def rank_tag(args: argparse.Namespace) -> str:
    return f"test-best-first{args.rank_contexts}"


def slice_records(args: argparse.Namespace, run: Run) -> tuple[Path, Path]:
    """The records of ``highrank eval`` and ``dynamic-eval`` on the first ``--dynamic-tokens``
    test tokens (their names carry ``-first<T>``: never taken for the full split's figure)."""
    directory = run_dir(args, run)
    suffix = f"test-best-first{args.dynamic_tokens}.json"
    return directory / f"eval-{suffix}", directory / f"dynamic-eval-{suffix}"


# ---- time estimates ---------------------------------------------------------------------


def timings_path(args: argparse.Namespace) -> Path:
    return Path(args.results) / "timings.json"


def load_timings(args: argparse.Namespace) -> dict[str, list[float]]:
    path = timings_path(args)
    return json.loads(path.read_text()) if path.is_file() else {}


def record_timing(args: argparse.Namespace, task: Task, seconds: float) -> None:
    timings = load_timings(args)
    timings.setdefault(timing_key(task), []).append(round(seconds, 1))
    write_json(timings_path(args), timings, indent=1, sort_keys=True)


def timing_key(task: Task) -> str:
    per_head = task.stage in ("train", "dynamic")  # the heads' costs differ most there
    return f"{task.stage}:{task.run.head}" if per_head else task.stage


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
    for stage in STAGES:
        names = [t.run.name for t in tasks if t.stage == stage]
        if names:
            print(f"  {stage:7s} {len(names):3d}: {', '.join(names)}")


# ---- running ---------------------------------------------------------------------------


def highrank(args: argparse.Namespace, *words: str, check: bool = True) -> int:
    """Run one highrank command (printed and logged); stop the study if it fails, unless
    ``check`` is False (then the exit status is returned)."""
    command = [sys.executable, "-m", "highrank", *words]
    line = shlex.join(["highrank", *words])
    print(f"+ {line}", flush=True)
    append_line(Path(args.results) / "commands.txt", line)
    status = subprocess.run(command, cwd=REPO).returncode
    if status != 0 and check:
        raise SystemExit(f"the study stopped: `{line}` exited with {status}; rerun to continue")
    return status


def why_skip(args: argparse.Namespace, task: Task) -> str | None:
    """Why a planned stage is not run now, or None: another process sharing the study (with
    overlapping ``--heads``) finished it since the plan was made, is working on it, or has
    not finished the run's training."""
    if is_done(args, task):
        return "done by another process"
    if task.stage != "train" and not is_done(args, Task(task.run, "train")):
        return "its training is not done (another process has it); rerun to continue"
    return lock_holder(args, task)


def lock_holder(args: argparse.Namespace, task: Task) -> str | None:
    """Who holds the lock of ``task``'s highrank command now (the error's text), or None."""
    lock = stage_lock(args, task)
    if lock is None or not lock.is_file():
        return None
    try:
        with exclusive(lock, f"{task.run.name} ({task.stage})"):
            return None
    except LockedError as error:
        return str(error)


def stage_lock(args: argparse.Namespace, task: Task) -> Path | None:
    """The lock file a stage's highrank command takes (training: the run directory's; the
    rank: its record's), or None for the stages that take none."""
    directory = run_dir(args, task.run)
    if task.stage == "train":
        return directory / LOCK_FILE
    if task.stage == "rank":
        return directory / "analysis" / f"rank-{rank_tag(args)}.lock"
    return None


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
        write_text(run_dir(args, task.run) / "study-train.done", "")
    elif task.stage == "eval":
        highrank(args, "eval", directory, "--split", "test", "--no-progress")
    elif task.stage == "rank":
        contexts = str(args.rank_contexts)
        highrank(args, "analyze", "rank", directory, "--split", "test", "--max-contexts", contexts)
    elif task.stage == "kl":
        highrank(args, "analyze", "kl", directory, "--split", "test")
    else:
        tokens = ["--split", "test", "--max-tokens", str(args.dynamic_tokens), "--no-progress"]
        highrank(args, "eval", directory, *tokens)
        knobs = dynamic_knobs(run_dir(args, task.run), args.dynamic_stats_batches)
        highrank(args, "dynamic-eval", directory, *tokens, *knobs)


def dynamic_knobs(directory: Path, batches: int) -> list[str]:
    """``--max-stats-batches M --lr eta' --epsilon eps'`` for dynamic evaluation with gradient
    statistics from the first M of the N training segments of a full pass.

    Krause et al. (2017, Sec. 4) sum squared gradients over all N segments, MS = sqrt(sum_s
    g_s^2), and the run's eta and epsilon (its ``[dynamic_eval]``) assume that full sum. Over
    M segments MS is about sqrt(M / N) times as large, and the step eta * g / (MS + epsilon)
    would grow by sqrt(N / M); scaling eta and epsilon by r = sqrt(M / N) keeps it, and the
    decay rates MS / sum_q mean(MS_q) do not depend on the scale of MS."""
    from highrank.config import load_config
    from highrank.data.streaming import open_corpus

    config = load_config(directory / "config.toml")
    settings = config.dynamic_eval
    corpus = open_corpus(config.data, config.train.seed)
    rows = len(corpus.train) // settings.stats_batch_size  # batchify's (T, B) layout
    full = math.ceil((rows - 1) / settings.bptt)  # segments of a full pass
    scale = math.sqrt(min(batches, full) / full)
    return [
        "--max-stats-batches",
        str(batches),
        "--lr",
        repr(settings.lr * scale),
        "--epsilon",
        repr(settings.epsilon * scale),
    ]


# ---- results: the table of the finished runs ----------------------------------------------


def finished_runs(args: argparse.Namespace, runs: list[Run]) -> list[Run]:
    """The runs whose training and full test evaluation are done: the rows of the table."""
    return [r for r in runs if is_done(args, Task(r, "train")) and is_done(args, Task(r, "eval"))]


def summarize(args: argparse.Namespace, runs: list[Run]) -> dict | None:
    """The results of the finished runs (all planned runs once the study is complete), in
    ``--results``:

    * ``compare-<head>/``: ``highrank compare --welch`` of each head against softmax, for the
      heads with at least 2 finished seeds when softmax has 2 too;
    * ``report/report.html``: ``highrank report`` of the finished runs;
    * ``summary.json`` and ``summary.md``: the table (:func:`summary_table`), which names the
      runs and stages still missing;
    * ``learning-curves.png``, ``spectrum.png``, ``rank-vs-perplexity.png``
      (:func:`draw_figures`).

    Runs no stage: a partial table can be published while the study goes on."""
    results = Path(args.results)
    finished = finished_runs(args, runs)
    if not finished:
        print("summary: no run has finished training and test evaluation yet; nothing to show")
        return None
    run_compares(args, finished)
    directories = [str(run_dir(args, r)) for r in finished]
    if highrank(args, "report", *directories, "--out", str(results / "report"), check=False):
        print("summary: `highrank report` failed (above); the table and figures are still written")
    table = summary_table(args, runs, finished)
    table["figures"] = draw_figures(args, table, finished)
    write_json(results / "summary.json", table, indent=1)
    markdown = summary_markdown(args, table)
    write_text(results / "summary.md", markdown + "\n")
    print(markdown)
    return table


def run_compares(args: argparse.Namespace, finished: list[Run]) -> None:
    """``highrank compare`` (Welch's t-test) of every head with 2 finished seeds against
    softmax's finished seeds; a failure is reported and leaves the t-test to the table."""
    softmax = [str(run_dir(args, r)) for r in finished if r.head == "softmax"]
    for head in args.heads:
        group = [str(run_dir(args, r)) for r in finished if r.head == head]
        if head == "softmax" or len(softmax) < 2 or len(group) < 2:
            continue
        out = str(Path(args.results) / f"compare-{head}")
        words = ["compare", *softmax, "--", *group, "--names", f"softmax,{head}", "--welch"]
        status = highrank(args, *words, "--rank-tag", rank_tag(args), "--out", out, check=False)
        if status != 0:
            print(f"summary: compare of {head} exited with {status}; the table computes the test")


def read_json(path: Path) -> dict:
    """A JSON record; a broken one is one error line naming the file."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:
        raise SystemExit(f"{path}: not valid JSON ({error}); delete it, rerun its stage") from None
    if not isinstance(record, dict):
        raise SystemExit(f"{path}: holds a {type(record).__name__}; expected a JSON object")
    return record


def record_field(path: Path, key: str):
    """``key`` of the record at ``path``, or None when there is no such record."""
    if not path.is_file():
        return None
    record = read_json(path)
    if key not in record:
        raise SystemExit(f"{path}: no key {key!r}; expected the record of its highrank command")
    return record[key]


def read_records(args: argparse.Namespace, run: Run) -> dict:
    """The figures of one finished run, read from the records its commands wrote (None for a
    stage not done yet)."""
    directory = run_dir(args, run)
    rank = directory / "analysis" / f"rank-{rank_tag(args)}.json"
    static, dynamic = slice_records(args, run)
    sliced = is_done(args, Task(run, "dynamic"))
    return {
        "head": run.head,
        "seed": run.seed,
        "perplexity": record_field(directory / "eval-test-best.json", "perplexity"),
        "press_rank": record_field(rank, "press_rank"),
        "effective_rank": record_field(rank, "effective_rank"),  # {epsilon: rank}
        "kl": record_field(directory / "analysis" / "kl-test-best.json", "mean"),
        "slice_static_ppl": record_field(static, "perplexity") if sliced else None,
        "slice_dynamic_ppl": record_field(dynamic, "perplexity") if sliced else None,
    }


def spread(values: list[float]) -> dict:
    """Mean, sample sd (ddof 1) and count of ``values``: sd None below 2 values, mean None
    for none."""
    n = len(values)
    return {
        "n": n,
        "mean": statistics.fmean(values) if n else None,
        "sd": statistics.stdev(values) if n >= 2 else None,
    }


def summary_table(args: argparse.Namespace, runs: list[Run], finished: list[Run]) -> dict:
    """The finished runs' figures, per head their mean +- sd, the t-test against softmax and
    Pearson's r of Press rank and perplexity over all finished runs, with what is missing."""
    per_run = {r.name: read_records(args, r) for r in finished}
    missing_stages = {
        stage: [r.name for r in finished if not is_done(args, Task(r, stage))]
        for stage in ("rank", "kl", "dynamic")
    }
    missing_stages = {stage: names for stage, names in missing_stages.items() if names}
    missing_runs = [r.name for r in runs if r.name not in per_run]
    heads = [head for head in args.heads if any(v["head"] == head for v in per_run.values())]
    return {
        "budget": budget(args),
        "complete": not missing_runs and not missing_stages,
        "planned_runs": [r.name for r in runs],
        "missing_runs": missing_runs,
        "missing_stages": missing_stages,
        "runs": per_run,
        "heads": with_holm({head: head_row(args, head, per_run) for head in heads}),
        "rank_vs_perplexity": rank_correlation(per_run),
    }


def with_holm(heads: dict) -> dict:
    """Each head's t-test against softmax gains ``p_holm``, its p-value adjusted by Holm's
    method over all the heads tested (``holm_tests`` of them): one study, several tests."""
    from highrank.analysis.significance import holm_adjusted

    tests = [row["t_test_vs_softmax"] for row in heads.values()]
    tests = [test for test in tests if "p" in test]
    for test, adjusted in zip(tests, holm_adjusted([t["p"] for t in tests]), strict=True):
        test.update(p_holm=adjusted, holm_tests=len(tests))
    return heads


def head_row(args: argparse.Namespace, head: str, per_run: dict) -> dict:
    """One head's seeds and the spread of each figure over them (each over the runs that
    have it: ``n`` says how many)."""
    rows = [v for v in per_run.values() if v["head"] == head]

    def present(key: str) -> list:
        return [row[key] for row in rows if row[key] is not None]

    ranks = present("effective_rank")
    epsilons = list(ranks[0]) if ranks else []
    return {
        "seeds": [row["seed"] for row in rows],
        "perplexity": spread(present("perplexity")),
        "t_test_vs_softmax": t_test(args, head, per_run),
        "press_rank": spread(present("press_rank")),
        "effective_rank": {eps: spread([r[eps] for r in ranks if eps in r]) for eps in epsilons},
        "kl": spread(present("kl")),
        "slice_static_ppl": spread(present("slice_static_ppl")),
        "slice_dynamic_ppl": spread(present("slice_dynamic_ppl")),
    }


def t_test(args: argparse.Namespace, head: str, per_run: dict) -> dict:
    """Two-sided t-test of softmax's and ``head``'s test perplexities: from the record of
    ``highrank compare`` when it covers exactly these runs, else Welch's t-test computed here
    (SciPy's ``ttest_ind(equal_var=False)`` via :func:`compare_groups`); ``"skipped"`` with
    the reason when a group has fewer than 2 finished seeds."""
    from highrank.analysis.significance import CompareError, compare_groups

    if head == "softmax":
        return {"skipped": "the reference"}
    groups = {
        name: {k: v["perplexity"] for k, v in per_run.items() if v["head"] == name}
        for name in ("softmax", head)
    }
    sizes = {name: len(group) for name, group in groups.items()}
    if min(sizes.values()) < 2:
        return {"skipped": f"needs 2 finished seeds in each group; has {sizes}"}
    path = Path(args.results) / f"compare-{head}" / "compare.json"
    record = read_json(path) if path.is_file() else None
    if record is not None and compare_covers(record, groups):
        found = {key: record[key] for key in ("test", "t", "df", "p")}
        return {**found, "source": f"highrank compare: compare-{head}/compare.json"}
    try:
        result = compare_groups(
            list(groups["softmax"].values()), list(groups[head].values()), welch=True
        )
    except CompareError as error:
        return {"skipped": str(error)}
    return {
        "test": "Welch's t-test",
        "t": result.t,
        "df": result.df,
        "p": result.p,
        "source": "computed by the study (scipy.stats.ttest_ind, equal_var=False): no compare "
        "record of these runs",
    }


def compare_covers(record: dict, groups: dict[str, dict[str, float]]) -> bool:
    """Whether a ``compare.json`` compares exactly these runs (by run name: the folder may
    have moved since)."""
    recorded = record.get("groups", {})
    return all(
        sorted(Path(r).name for r in recorded.get(name, {}).get("runs", [])) == sorted(runs)
        for name, runs in groups.items()
    )


def rank_correlation(per_run: dict) -> dict:
    """Pearson's r of Press rank and test perplexity over every finished run with a rank
    record (each run one point), or ``{"skipped": why}`` below 3 runs."""
    from highrank.analysis.significance import MIN_CORRELATION_POINTS, CompareError, pearson

    points = {k: v for k, v in per_run.items() if v["press_rank"] is not None}
    if len(points) < MIN_CORRELATION_POINTS:
        return {"skipped": f"{len(points)} run(s) with a rank record; needs 3"}
    ranks = [v["press_rank"] for v in points.values()]
    try:
        result = pearson(ranks, [v["perplexity"] for v in points.values()])
    except CompareError as error:
        return {"skipped": str(error)}
    return {"r": result.r, "p": result.p, "n": result.n, "runs": list(points)}


def budget(args: argparse.Namespace) -> str:
    return (
        f"PTB, small AWD-LSTM recipes at equal parameter count (within 2%), {args.epochs} "
        f"epochs, ET-ASGD from epoch {args.epochs}, test ranks over the first "
        f"{args.rank_contexts:,} contexts; dynamic evaluation on the first "
        f"{args.dynamic_tokens:,} test tokens with gradient statistics from "
        f"{args.dynamic_stats_batches} training segments (eta and epsilon scaled to match a "
        "full pass)"
    )


# ---- results: the markdown table ------------------------------------------------------------


def summary_markdown(args: argparse.Namespace, table: dict) -> str:
    planned, missing = len(table["planned_runs"]), table["missing_runs"]
    state = "complete" if table["complete"] else "PARTIAL"
    lines = [
        f"# Replication study: {state}, {planned - len(missing)} of {planned} planned runs",
        "",
        f"Budget: {table['budget']}.",
        "",
    ]
    if missing:
        lines.append(f"Not finished yet, left out of the table: {', '.join(missing)}.")
    for stage, names in table["missing_stages"].items():
        lines.append(
            f"Stage {stage} not done yet for: {', '.join(names)} (its columns count "
            "the runs that have it: `n=`)."
        )
    heads = table["heads"]
    epsilons = next((list(r["effective_rank"]) for r in heads.values() if r["effective_rank"]), [])
    lines += ["", *markdown_rows(args, heads, epsilons), "", *markdown_notes(args, table)]
    return "\n".join(lines)


def markdown_rows(args: argparse.Namespace, heads: dict, epsilons: list[str]) -> list[str]:
    effective = " / ".join(epsilons) or "-"
    lines = [
        f"| head | seeds | test ppl (mean +- sd) | p vs softmax (Holm) | Press rank | eff. rank "
        f"({effective}) | KL | first {args.dynamic_tokens:,} test tokens: ppl static -> dynamic |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for head, row in heads.items():
        runs = len(row["seeds"])
        ppl = cell(row["perplexity"], ".2f", runs)
        if runs < 2:
            ppl += " (1 seed: mean only)"
        test = row["t_test_vs_softmax"]
        p_value = f"{test['p']:.3g} ({test['p_holm']:.3g})" if "p" in test else "-"
        no_record = {"n": 0, "mean": None, "sd": None}  # this head's runs have no rank yet
        ranks = " / ".join(
            cell(row["effective_rank"].get(e, no_record), ".0f", runs) for e in epsilons
        )
        sliced = (
            f"{cell(row['slice_static_ppl'], '.1f', runs)} -> "
            f"{cell(row['slice_dynamic_ppl'], '.1f', runs)}"
        )
        lines.append(
            f"| {head} | {runs} ({', '.join(map(str, row['seeds']))}) | {ppl} | {p_value} "
            f"| {cell(row['press_rank'], '.0f', runs)} | {ranks or '-'} "
            f"| {cell(row['kl'], '.3f', runs)} | {sliced} |"
        )
    return lines


def cell(figure: dict, fmt: str, runs: int) -> str:
    """``mean +- sd`` (``mean`` below 2 values, ``-`` for none), ``n=k`` when only k of the
    head's runs have the figure."""
    if figure["n"] == 0:
        return "-"
    text = format(figure["mean"], fmt)
    if figure["sd"] is not None:
        text += f" +- {format(figure['sd'], fmt)}"
    return text if figure["n"] == runs else f"{text} (n={figure['n']})"


def markdown_notes(args: argparse.Namespace, table: dict) -> list[str]:
    lines = ["t-tests of the seeds' test perplexities against softmax (two-sided):"]
    for head, row in table["heads"].items():
        test = row["t_test_vs_softmax"]
        if "p" in test:
            lines.append(
                f"- {head}: {test['test']}, t = {test['t']:.3g}, df = {test['df']:.3g}, "
                f"p = {test['p']:.3g}, Holm-adjusted over the {test['holm_tests']} tests "
                f"{test['p_holm']:.3g} ({test['source']})"
            )
        elif head != "softmax":
            lines.append(f"- {head}: none: {test['skipped']}")
    pearson = table["rank_vs_perplexity"]
    if "r" in pearson:
        lines.append(
            f"\nPearson r (Press rank, test ppl) over {pearson['n']} runs: "
            f"{pearson['r']:.3f} (p = {pearson['p']:.3g})."
        )
    else:
        lines.append(f"\nPearson r (Press rank, test ppl): not computed: {pearson['skipped']}.")
    lines.append(
        "Effective rank: the smallest k whose leading singular values hold a "
        "(1 - epsilon) share of the squared Frobenius norm, for each epsilon."
    )
    figures = table.get("figures", {})
    lines += ["", "Figures: " + "; ".join(f"{name}: {what}" for name, what in figures.items())]
    return lines


# ---- results: figures ---------------------------------------------------------------------


def draw_figures(args: argparse.Namespace, table: dict, finished: list[Run]) -> dict[str, str]:
    """Learning curves of every run, the spectrum of one run per head, rank against
    perplexity; each value is the PNG's name beside summary.md, or why it was not drawn."""
    import matplotlib

    matplotlib.use("Agg")
    results = Path(args.results)
    return {
        "learning curves": learning_curves(args, finished, results / "learning-curves.png"),
        "spectrum": spectrum_figure(args, finished, results / "spectrum.png"),
        "rank vs perplexity": rank_scatter(args, table, results / "rank-vs-perplexity.png"),
    }


def training_metrics(path: Path) -> tuple[list[dict], list[dict]]:
    """The step and epoch records of the training stage of a ``metrics.jsonl``; a step or
    epoch logged twice (a resumed run) counts once, its last record."""
    from highrank.runs.run_dir import read_metrics

    kept: dict[tuple, dict] = {}
    for record in read_metrics(path):
        if record.get("stage") == "train" and record.get("kind") in ("step", "epoch"):
            position = record["step"] if record["kind"] == "step" else record["epoch"]
            kept[record["kind"], position] = record
    steps = sorted((r for (kind, _), r in kept.items() if kind == "step"), key=lambda r: r["step"])
    epochs = sorted(
        (r for (kind, _), r in kept.items() if kind == "epoch"), key=lambda r: r["epoch"]
    )
    return steps, epochs


def learning_curves(args: argparse.Namespace, finished: list[Run], path: Path) -> str:
    """Training loss per logged update and validation perplexity per epoch, every run, one
    colour per head (its seeds share it)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120)
    labelled = set()
    for run in finished:
        metrics = run_dir(args, run) / "metrics.jsonl"
        if not metrics.is_file():
            continue
        steps, epochs = training_metrics(metrics)
        label = None if run.head in labelled else run.head
        labelled.add(run.head)
        style = {"color": COLOURS[run.head], "lw": 1, "alpha": 0.85, "label": label}
        left.plot([r["step"] for r in steps], [r["train_loss"] for r in steps], **style)
        validated = [r for r in epochs if r.get("val_ppl") is not None]
        right.plot(
            [r["epoch"] for r in validated], [r["val_ppl"] for r in validated], marker="o", **style
        )
    if not labelled:
        plt.close(figure)
        return "not drawn: no finished run has a metrics.jsonl"
    left.set(xlabel="update", ylabel="training loss (logged mean)", title="training loss")
    right.set(
        xlabel="epoch", ylabel="validation perplexity", title="validation perplexity (end of epoch)"
    )
    right.xaxis.set_major_locator(MaxNLocator(integer=True))
    for axes in (left, right):
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=8)
    return save_figure(figure, path)


def spectrum_figure(args: argparse.Namespace, finished: list[Run], path: Path) -> str:
    """The singular-value spectrum (:func:`highrank.analysis.rank.write_spectrum`) of
    each head's finished run of lowest seed that has its rank record and singular values."""
    from highrank.analysis.rank import write_spectrum

    records = []
    for head in args.heads:
        for run in sorted((r for r in finished if r.head == head), key=lambda r: r.seed):
            folder = run_dir(args, run) / "analysis"
            record_path = folder / f"rank-{rank_tag(args)}.json"
            if not record_path.is_file():
                continue
            record = read_json(record_path)
            if (folder / str(record.get("singular_values_file"))).is_file():
                # where the reader found it: the record's run_dir may have moved
                found = {"run_dir": str(run_dir(args, run)), "out_dir": str(folder)}
                records.append({**record, **found})
                break
    if not records:
        return "not drawn: no finished run has a rank record with its singular values"
    write_spectrum(records, path)
    return f"{path.name} ({', '.join(Path(r['run_dir']).name for r in records)})"


def rank_scatter(args: argparse.Namespace, table: dict, path: Path) -> str:
    """Press rank against test perplexity, one point per finished run with a rank record."""
    import matplotlib.pyplot as plt

    points = [v for v in table["runs"].values() if v["press_rank"] is not None]
    if not points:
        return "not drawn: no finished run has a rank record"
    figure, axes = plt.subplots(figsize=(6.4, 4.4), dpi=120)
    for head in HEADS:
        mine = [v for v in points if v["head"] == head]
        if mine:
            axes.scatter(
                [v["press_rank"] for v in mine],
                [v["perplexity"] for v in mine],
                color=COLOURS[head],
                label=head,
            )
    correlation = table["rank_vs_perplexity"]
    title = (
        f"Pearson r = {correlation['r']:.2f} (p = {correlation['p']:.2g}, {correlation['n']} runs)"
        if "r" in correlation
        else f"Pearson r not computed: {correlation['skipped']}"
    )
    axes.set(
        xlabel=f"Press rank (test, first {args.rank_contexts:,} contexts)", ylabel="test perplexity"
    )
    axes.set_title(title, fontsize=10)
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8)
    return save_figure(figure, path)


def save_figure(figure, path: Path) -> str:
    import matplotlib.pyplot as plt

    figure.tight_layout()
    _common.save_figure(figure, path)
    plt.close(figure)
    return path.name


def record_hidden_sizes(path: Path, sizes: dict[str, int]) -> None:
    """Add ``sizes`` to the record: studies of some heads each (``--heads``, e.g. two processes
    side by side) keep every head's width in one file."""
    known = json.loads(path.read_text()) if path.is_file() else {}
    ordered = {head: {**known, **sizes}[head] for head in HEADS if head in {**known, **sizes}}
    write_json(path, ordered, indent=1)


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--heads", type=lambda s: tuple(s.split(",")), default=HEADS)
    parser.add_argument("--seeds", type=int, default=3, help="seeds per head (3)")
    parser.add_argument("--extra-seeds", type=int, default=2, help="more for softmax, MoS (2)")
    parser.add_argument("--epochs", type=int, default=3, help="PTB epochs per run (3)")
    parser.add_argument("--rank-contexts", type=int, default=20_000, help="(20000)")
    parser.add_argument("--runs", default=str(REPO / "benchmarks/results/replication/runs"))
    parser.add_argument("--results", default=str(REPO / "benchmarks/results/replication"))
    parser.add_argument(
        "--dynamic-tokens",
        type=int,
        default=1000,
        help="dynamic evaluation on the first N test tokens (1000)",
    )
    parser.add_argument(
        "--dynamic-stats-batches",
        type=int,
        default=10,
        help="its gradient statistics from this many training segments (10)",
    )
    parser.add_argument("--plan", action="store_true", help="print the remaining work only")
    parser.add_argument(
        "--summarize",
        action="store_true",
        help="write the results of the finished runs only (a partial table while the study "
        "runs), running no stage",
    )
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
    if args.dynamic_tokens < 2 or args.dynamic_stats_batches < 1:
        parser.error(
            f"--dynamic-tokens >= 2 (got {args.dynamic_tokens}); --dynamic-stats-batches >= 1 "
            f"(got {args.dynamic_stats_batches})"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    Path(args.results).mkdir(parents=True, exist_ok=True)
    runs = plan(args)
    tasks = remaining(args, runs)
    print_plan(args, tasks)
    if args.plan:
        return 0
    if args.summarize:
        summarize(args, runs)
        return 0
    sizes = matched_hidden_sizes(args.heads)
    record_hidden_sizes(Path(args.results) / "hidden-sizes.json", sizes)
    status = study(args, runs, sizes).run()
    summarize(args, runs)
    return status


def study(args: argparse.Namespace, runs: list[Run], sizes: dict[str, int]) -> Study:
    """The study as a :class:`benchmarks.study.Study`: a stage ``<run>-<stage>`` per task, done
    when its highrank records are there (:func:`is_done`); a stage other than training needs its
    run's training. The runner's locks live in ``RESULTS/.locks``; a stage whose highrank lock
    another process holds (a run directory's, a rank record's) counts as being made elsewhere,
    so a study waits for what a study beside it is running instead of stopping on its lock."""
    tasks = {f"{run.name}-{stage}": Task(run, stage) for run in runs for stage in STAGES}

    def needs(task: Task) -> tuple[str, ...]:
        return () if task.stage == "train" else (f"{task.run.name}-train",)

    def work(name: str) -> dict:
        task, started = tasks[name], time.perf_counter()
        run_task(args, task, sizes[task.run.head])
        record_timing(args, task, time.perf_counter() - started)
        return {}

    def held_by_highrank(name: str) -> bool:
        holder = lock_holder(args, tasks[name])
        if holder:
            print(f"waiting for {name}: {holder}", flush=True)
        return holder is not None

    return Study(
        [Stage(name, needs(task)) for name, task in tasks.items()],
        work,
        records=None,
        locks=Path(args.results) / ".locks",
        done=lambda name: is_done(args, tasks[name]),
        busy=held_by_highrank,
        after=lambda name: print_plan(args, remaining(args, runs)),
    )

if __name__ == "__main__":
    raise SystemExit(main())
