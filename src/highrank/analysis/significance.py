"""Is one model better than another over random seeds, and does rank track perplexity?

The recipe of the softmax-bottleneck literature (e.g. Kanai et al. 2018, Sigsoftmax; Ganea
et al. 2019, "Breaking the Softmax Bottleneck via Learnable Monotonic Pointwise
Non-linearities"; the rank study, Parthiban, Mao & Inkpen 2021, "On the Softmax Bottleneck of
Recurrent Language Models"): train each model with several seeds (the rank study: 10), compare
their test perplexities with an unpaired two-sample t-test, two-sided, and call the difference
significant at p < 0.05; relate log-probability rank and perplexity by Pearson's correlation
across models.

:func:`compare_groups` is Student's t-test (pooled variance, df = n_a + n_b - 2) or, with
``welch=True``, Welch's (df by Welch-Satterthwaite), computed by SciPy's ``ttest_ind``;
:func:`pearson` is SciPy's ``pearsonr``. Several heads compared with one reference are several
tests: :func:`holm_adjusted` gives Holm's (1979) step-down adjusted p-values, so that "p < 0.05
after adjustment" holds for the family of comparisons (SciPy adjusts only for the false
discovery rate).

    highrank eval runs/softmax-s1 --split test    # ... for every run: eval-test-best.json
    highrank compare runs/softmax-s* -- runs/mos-s* --names softmax,mos --out results/

The outputs of ``highrank retrofit`` compare too (their ``results.json``: the trained model's
valid and test perplexity, :func:`read_retrofit`), all runs of both groups retrofits or none, and
all scored on the same data with the same base model (their base perplexities agree).
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

from highrank.analysis.output import read_json, record_tag, run_record_path
from highrank.runs.locks import LOCK_FILE
from highrank.util.paths import is_retrofit_output, run_dir_problem

SEPARATOR = "--"
MIN_CORRELATION_POINTS = 3  # Pearson of two points is always +-1


class CompareError(ValueError):
    """Input to a comparison that cannot be used: too few or non-finite values, missing files."""


@dataclass(frozen=True)
class GroupComparison:
    """A two-sample t-test of groups a and b, unpaired or paired (``std_*`` with ddof=1;
    ``p`` two-sided)."""

    mean_a: float
    mean_b: float
    std_a: float
    std_b: float
    n_a: int
    n_b: int
    t: float
    df: float
    p: float
    welch: bool
    paired: bool = False  # a paired test of a[i] against b[i] (df = n - 1)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Correlation:
    """Pearson's r of n points and its two-sided p-value (no correlation as the null)."""

    r: float
    p: float
    n: int


def _as_sample(values: Sequence[float], name: str, minimum: int = 2) -> np.ndarray:
    """``values`` as a float64 vector of at least ``minimum`` finite numbers."""
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1 or array.size < minimum:
        raise CompareError(
            f"{name} has {array.size} value(s); expected a list of at least {minimum}"
        )
    bad = [f"#{i}={v}" for i, v in enumerate(array.tolist()) if not math.isfinite(v)]
    if bad:
        raise CompareError(f"{name} holds non-finite values ({', '.join(bad)}); expected numbers")
    return array


def welch_df(var_a: float, n_a: int, var_b: float, n_b: int) -> float:
    """Welch-Satterthwaite degrees of freedom of two samples' variances (ddof=1)."""
    a, b = var_a / n_a, var_b / n_b
    return (a + b) ** 2 / (a**2 / (n_a - 1) + b**2 / (n_b - 1))


def compare_groups(
    a: Sequence[float], b: Sequence[float], *, welch: bool = False
) -> GroupComparison:
    """Two-sided unpaired t-test of the means of ``a`` and ``b`` (Student's with pooled
    variance, or Welch's); ``t`` is positive when ``a``'s mean is larger."""
    x, y = _as_sample(a, "group a"), _as_sample(b, "group b")
    var_x, var_y = float(x.var(ddof=1)), float(y.var(ddof=1))
    if var_x == 0.0 and var_y == 0.0:
        raise CompareError(
            "both groups have zero spread (every value equal within each group): the t "
            "statistic is undefined; were the runs trained with different seeds?"
        )
    result = stats.ttest_ind(x, y, equal_var=not welch)
    df = welch_df(var_x, x.size, var_y, y.size) if welch else float(x.size + y.size - 2)
    return GroupComparison(
        mean_a=float(x.mean()),
        mean_b=float(y.mean()),
        std_a=math.sqrt(var_x),
        std_b=math.sqrt(var_y),
        n_a=int(x.size),
        n_b=int(y.size),
        t=float(result.statistic),
        df=df,
        p=float(result.pvalue),
        welch=welch,
    )


def compare_paired(a: Sequence[float], b: Sequence[float]) -> GroupComparison:
    """Two-sided paired t-test of ``a[i] - b[i]`` (SciPy's ``ttest_rel``; df = n - 1): runs
    that share a seed share their batch order and random factors, whose effect the pairing
    removes; ``t`` is positive when ``a``'s mean is larger."""
    x, y = _as_sample(a, "group a"), _as_sample(b, "group b")
    if x.size != y.size:
        raise CompareError(f"a paired test needs groups of one size; got {x.size} and {y.size}")
    differences = x - y
    if float(differences.var(ddof=1)) == 0.0:
        raise CompareError("every pair differs by the same amount: the paired t statistic is "
                           "undefined; compare unpaired (without --paired)")
    result = stats.ttest_rel(x, y)
    return GroupComparison(
        mean_a=float(x.mean()),
        mean_b=float(y.mean()),
        std_a=float(x.std(ddof=1)),
        std_b=float(y.std(ddof=1)),
        n_a=int(x.size),
        n_b=int(y.size),
        t=float(result.statistic),
        df=float(x.size - 1),
        p=float(result.pvalue),
        welch=False,
        paired=True,
    )


def pearson(x: Sequence[float], y: Sequence[float]) -> Correlation:
    """Pearson's correlation of ``x`` and ``y`` with its two-sided p-value (SciPy)."""
    u = _as_sample(x, "x", MIN_CORRELATION_POINTS)
    v = _as_sample(y, "y", MIN_CORRELATION_POINTS)
    if u.size != v.size:
        raise CompareError(f"x has {u.size} values but y has {v.size}; expected equal lengths")
    for name, values in (("x", u), ("y", v)):
        if np.ptp(values) == 0:
            raise CompareError(
                f"{name} is constant ({values[0]:g} every time): the correlation is undefined"
            )
    result = stats.pearsonr(u, v)
    return Correlation(r=float(result.statistic), p=float(result.pvalue), n=int(u.size))


def holm_adjusted(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given (Holm 1979, "A simple sequentially
    rejective multiple test procedure"): with the m p-values sorted, p_(1) <= ... <= p_(m),
    the i-th becomes max over j <= i of min(1, (m - j + 1) p_(j)). Rejecting where the adjusted
    value is below alpha controls the family-wise error rate at alpha."""
    values = np.asarray(p_values, dtype=np.float64)
    if values.ndim != 1 or np.any(~np.isfinite(values)) or np.any((values < 0) | (values > 1)):
        raise CompareError(f"p-values must be a list of numbers in [0, 1]; got {list(p_values)}")
    m = values.size
    order = np.argsort(values, kind="stable")
    scaled = np.minimum(1.0, (m - np.arange(m)) * values[order])  # (m - j + 1) p_(j), j from 1
    adjusted = np.empty(m)
    adjusted[order] = np.maximum.accumulate(scaled)
    return adjusted.tolist()


# ---- reading run directories ---------------------------------------------------------------


def eval_path(run_dir: str | Path, split: str, which: str) -> Path:
    """``RUN_DIR/eval-<split>-<which>.json``, as ``highrank eval`` writes it."""
    return Path(run_dir) / f"eval-{split}-{Path(which).stem}.json"


def rank_path(run_dir: str | Path, tag: str) -> Path:
    """``RUN_DIR/analysis/rank-<tag>.json``, the record of ``highrank analyze rank`` (tag:
    :func:`highrank.analysis.output.record_tag`, e.g. ``test-best`` or
    ``test-best-first33320``)."""
    return run_record_path(run_dir, "rank", tag)


def resolve_which(run_dir: str | Path, split: str, which: str) -> str:
    """``which``, or for ``"auto"`` the finetuned checkpoint when the run has its eval record,
    else ``best`` (the order ``highrank report`` prefers too)."""
    if which != "auto":
        return which
    return "finetuned" if eval_path(run_dir, split, "finetuned").is_file() else "best"


def read_perplexity(run_dir: str | Path, split: str, which: str) -> float:
    """The ``"perplexity"`` of a run's eval record; a missing record names the command that
    writes it."""
    return read_eval(run_dir, split, which)["perplexity"]


def read_eval(run_dir: str | Path, split: str, which: str) -> dict[str, Any]:
    """A run's eval record (full split of its own corpus) with its perplexity checked and
    ``"source"`` saying which checkpoint and data it came from."""
    # torch: `compare` of records needs none
    from highrank.evaluate.records import describe, stale_checkpoint

    if is_retrofit_output(run_dir):
        return read_retrofit(run_dir, split)
    problem = not_a_run(run_dir)
    if problem:
        raise CompareError(problem)
    which = resolve_which(run_dir, split, which)
    path = eval_path(run_dir, split, which)
    if not path.is_file():
        raise CompareError(
            f"run {run_dir} has no {path.name}: evaluate it first with "
            f"`highrank eval {run_dir} --split {split} --which {which}`"
        )
    record = _read_record(path)
    if record.get("default_data") is False:
        raise CompareError(f"{path} is not of the full split of the run's corpus; re-evaluate")
    record["perplexity"] = _number(record, "perplexity", path, float)
    # a checkpoint rewritten since (a resumed training): the record describes another model
    current = stale_checkpoint(run_dir, {"checkpoint": which, **record})
    if current is not None:
        raise CompareError(
            f"{path} scored an earlier {current.name} (the checkpoint has changed since: "
            f"sha256 {record['checkpoint_sha256'][:12]}... then); re-evaluate with `highrank "
            f"eval {run_dir} --split {split} --which {which}`"
        )
    return {**record, "which": which, "source": describe({**record, "split": split}),
            "seed": train_seed(run_dir)}


def not_a_run(run_dir: str | Path) -> str | None:
    """Why ``run_dir`` is neither a run of ``highrank train`` nor a retrofit's output, or None."""
    run_dir = Path(run_dir)
    problem = run_dir_problem(run_dir)
    if problem or (run_dir / "config.toml").is_file() or is_retrofit_output(run_dir):
        return problem
    if (run_dir / LOCK_FILE).is_file():  # both commands take the lock before writing either
        return (f"{run_dir} holds a lock but no config.toml or plan.json yet: a `highrank "
                "train` or `highrank retrofit` starting there (or stopped before it wrote "
                "either); compare it once it has finished")
    return (f"{run_dir} is neither a run of `highrank train` (no config.toml) nor the output "
            "of `highrank retrofit` (no plan.json)")


def train_seed(run_dir: str | Path) -> int | None:
    """The ``train.seed`` in a run's ``config.toml``, None when it cannot be read there."""
    try:
        config = tomllib.loads((Path(run_dir) / "config.toml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None
    seed = config.get("train", {}).get("seed") if isinstance(config.get("train"), dict) else None
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else None


def read_retrofit(out: str | Path, split: str) -> dict[str, Any]:
    """The record :func:`read_eval` gives for a ``highrank retrofit`` output: its trained
    model's ``split`` perplexity from ``results.json``, with the base model's beside it (two
    retrofits of one model on one text share it) and ``"source"``."""
    path = Path(out) / "results.json"
    if not path.is_file():
        raise CompareError(f"retrofit {out} has not finished (no {path.name}): run its command "
                           "again to complete it")
    record = _read_record(path)
    trained, base = record.get("trained"), record.get("base")
    if not (isinstance(trained, dict) and isinstance(base, dict) and split in trained
            and split in base):
        raise CompareError(f"{path} holds no {split} score of the trained and the base model "
                           f"(retrofit with --{split} FILE)")
    plan = record.get("plan") if isinstance(record.get("plan"), dict) else {}
    perplexity = _number(trained[split], "perplexity", path, float)
    tokens = trained[split].get("tokens")
    source = (f"retrofit {plan.get('head', '?')} ({plan.get('mode', '?')}, seed "
              f"{plan.get('seed', '?')}) on --{split} {plan.get(split, '?')} ({tokens} tokens)")
    return {"perplexity": perplexity, "which": "retrofit", "source": source, "retrofit": True,
            "base_perplexity": _number(base[split], "perplexity", path, float),
            "seed": plan.get("seed")}


# Two retrofits of one model on one text score its base model alike, to the rounding of their
# bfloat16 caches and devices (the study's records: 1.2e-5 to 1.7e-5 apart, CPU, H100, LoRA);
# another model or text moves it by percents.
BASE_TOLERANCE = 1e-3


def _refuse_mixed(groups: dict[str, Sequence[str]], evals: dict[str, list[dict]]) -> None:
    """Both groups' runs distinct, and every run scored on the same split file (its sha256,
    where the record has one): perplexities of other test data cannot be compared."""
    runs = [Path(r).resolve() for name in groups for r in groups[name]]
    twice = sorted({str(r) for r in runs if runs.count(r) > 1})
    if twice:
        raise CompareError(f"a run stands twice in the groups: {', '.join(twice)}")
    data: dict[str, list[str]] = {}
    for name in groups:
        for run, record in zip(groups[name], evals[name], strict=True):
            if record.get("data_sha256"):
                data.setdefault(record["data_sha256"], []).append(str(run))
    if len(data) > 1:
        shown = "; ".join(f"{', '.join(r)} (split sha256 {sha[:12]}...)" for sha, r in data.items())
        raise CompareError(
            f"the runs were scored on different data, whose perplexities do not compare: {shown}"
        )
    records = [(run, record) for name in groups
               for run, record in zip(groups[name], evals[name], strict=True)]
    retrofits = [(run, r["base_perplexity"]) for run, r in records if r.get("retrofit")]
    if retrofits and len(retrofits) != len(records):
        raise CompareError("the groups mix `highrank retrofit` outputs and `highrank train` "
                           "runs; compare retrofits with retrofits")
    if retrofits:
        first, reference = retrofits[0]
        for run, base in retrofits[1:]:
            if abs(base - reference) > BASE_TOLERANCE * reference:
                raise CompareError(
                    f"{run} and {first} score their base model differently ({base:.6g} against "
                    f"{reference:.6g}, more than a device or cache dtype moves it): another "
                    "model or other data, whose perplexities do not compare"
                )


def read_press_rank(run_dir: str | Path, tag: str) -> int | None:
    """The ``"press_rank"`` of a run's rank record ``tag``, None when the run has none."""
    path = rank_path(run_dir, tag)
    return _number(_read_record(path), "press_rank", path, int) if path.is_file() else None


def _read_record(path: Path) -> dict[str, Any]:
    try:
        record = read_json(path)
    except ValueError as error:
        raise CompareError(str(error)) from None
    if not isinstance(record, dict):
        raise CompareError(f"{path} holds a {type(record).__name__}; expected a JSON object")
    return record


def _number(record: dict[str, Any], key: str, path: Path, kind: type) -> Any:
    value = record.get(key)
    wanted = "an integer" if kind is int else "a finite number"
    ok = isinstance(value, int) if kind is int else isinstance(value, int | float)
    if not ok or isinstance(value, bool) or not math.isfinite(value):
        raise CompareError(f"{path}: key {key!r} is {value!r}; expected {wanted}")
    return kind(value)


# ---- the comparison of two groups of runs ----------------------------------------------------


def compare_runs(
    groups: dict[str, Sequence[str]],
    *,
    split: str = "test",
    which: str = "best",
    welch: bool = False,
    paired: bool = False,
    alpha: float = 0.05,
    rank_tag: str | None = None,
) -> dict[str, Any]:
    """The record of ``highrank compare``: each group's perplexities, the t-test (unpaired,
    or ``paired``: the i-th run of a with the i-th of b) and, when every run has a rank record
    (``rank-<rank_tag>.json``, default ``<split>-<which>``), the Pearson correlation of Press
    rank and perplexity over all runs of both groups."""
    (name_a, runs_a), (name_b, runs_b) = groups.items()
    if paired and welch:
        raise CompareError("--paired and --welch are two different tests; choose one")
    evals = {name: [read_eval(r, split, which) for r in runs] for name, runs in groups.items()}
    _refuse_mixed(groups, evals)
    ppl = {name: [e["perplexity"] for e in records] for name, records in evals.items()}
    tags = [record_tag(split, e["which"]) for name in groups for e in evals[name]]
    if paired:
        if len(runs_a) != len(runs_b):
            raise CompareError(f"--paired pairs each run with the one in its place: the groups "
                               f"have {len(runs_a)} and {len(runs_b)} runs")
        _refuse_other_seeds(groups, evals)
        test = compare_paired(ppl[name_a], ppl[name_b])
    else:
        test = compare_groups(ppl[name_a], ppl[name_b], welch=welch)
    better = name_a if test.mean_a < test.mean_b else name_b
    kind = ("paired t-test (each run of one group with the run in its place in the other)"
            if paired else "Welch's t-test" if welch else "Student's t-test (pooled variance)")
    retrofits = all(e.get("retrofit") for name in groups for e in evals[name])
    return {
        "split": split,
        "checkpoint": "retrofit results.json" if retrofits else which,
        "test": kind,
        "alpha": alpha,
        "groups": {
            name: {
                "runs": [str(r) for r in runs],
                "perplexities": ppl[name],
                "sources": [e["source"] for e in evals[name]],
            }
            for name, runs in groups.items()
        },
        **test.as_dict(),
        "significant": test.p < alpha,
        "lower_perplexity": better,
        "rank_vs_perplexity": rank_correlation(
            [*runs_a, *runs_b], [*ppl[name_a], *ppl[name_b]], rank_tag or tags
        ),
    }


def _refuse_other_seeds(groups: dict[str, Sequence[str]], evals: dict[str, list[dict]]) -> None:
    """Paired runs share their seed where their records say it (a training run's config.toml,
    a retrofit's plan)."""
    (name_a, runs_a), (name_b, runs_b) = groups.items()
    seeds = {name: [e.get("seed") for e in evals[name]] for name in groups}
    if all(seed is not None for name in groups for seed in seeds[name]) and (
            sorted(seeds[name_a]) != sorted(seeds[name_b])):
        raise CompareError(
            f"--paired pairs runs of one seed, but the groups' seeds differ ({name_a}: "
            f"{', '.join(map(str, seeds[name_a]))}; {name_b}: "
            f"{', '.join(map(str, seeds[name_b]))}): compare them unpaired (without --paired)"
        )
    for run_a, run_b, a, b in zip(runs_a, runs_b, evals[name_a], evals[name_b], strict=True):
        if a.get("seed") is not None and b.get("seed") is not None and a["seed"] != b["seed"]:
            raise CompareError(
                f"--paired pairs {run_a} (seed {a['seed']}) with {run_b} (seed {b['seed']}): "
                "give the runs of both groups in the order of their seeds"
            )


def rank_correlation(
    runs: Sequence[str], perplexities: Sequence[float], tag: str | Sequence[str]
) -> dict[str, Any]:
    """Pearson of press_rank (records ``rank-<tag>.json``; one tag, or one per run) vs
    perplexity over ``runs``, pooled over both groups (each run is one point), or
    ``{"skipped": why}``."""
    if any(is_retrofit_output(run) for run in runs):
        return {"skipped": "retrofit outputs keep no rank records: `highrank analyze rank --hf "
                           "OUT/model --text FILE --out DIR` measures each model's"}
    tags = [tag] * len(runs) if isinstance(tag, str) else list(tag)
    ranks = [read_press_rank(run, t) for run, t in zip(runs, tags, strict=True)]
    tag = tags[0] if len(set(tags)) == 1 else "TAG"
    missing = [str(run) for run, rank in zip(runs, ranks, strict=True) if rank is None]
    if missing:
        return {
            "skipped": f"{len(missing)} of {len(runs)} runs have no "
            f"{rank_path('RUN_DIR', tag)} (`highrank analyze rank`, or pass --rank-tag): "
            + ", ".join(missing)
        }
    try:
        correlation = pearson(ranks, perplexities)
    except CompareError as error:
        return {"skipped": f"press_rank vs perplexity: {error}"}
    return {**asdict(correlation), "press_ranks": ranks}
