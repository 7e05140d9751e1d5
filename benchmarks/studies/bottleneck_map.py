"""Where the softmax bottleneck binds on real text: Penn Treebank over the output width d.

    python -m benchmarks.studies.bottleneck_map               # run what is not done yet, in order
    python -m benchmarks.studies.bottleneck_map --first long  # the 15-epoch runs before the map
    python -m benchmarks.studies.bottleneck_map --plan        # the stages left, at measured rates
    python -m benchmarks.studies.bottleneck_map --summarize   # summary.json / .md / figures
    python -m benchmarks.studies.bottleneck_map --device cuda --widths 32 --data-dir DIR
                                                              # one width's cells on a GPU

Every number comes from highrank's own commands, run as subprocesses as a user would type them
(each line kept in ``commands.txt``), one thread per process (``OMP_NUM_THREADS=1``):

    highrank train configs/ptb/small-<head>.toml --run.out_dir=RUN <BODY> --model.d_project=D
        --train.lr=LR --train.seed=S <STOP> [head knobs]
    highrank eval RUN --split valid --which last          # a pilot's score
    highrank eval RUN --split test --batch-size 10        # the whole test split
    highrank analyze rank RUN --split test --max-contexts 2000 --batch-size 10
    highrank analyze gradient-bottleneck RUN --split test --max-contexts 2000
    highrank analyze saturation RUN --which best --split test --max-contexts 2000

**The body** (every cell; :data:`BODY`): the small PTB recipe's AWD-LSTM cut to one LSTM layer of
400 units over a 200-wide input embedding, its output projected linearly to width d
(``model.d_project``, after the body's output dropout), the head untied from the input
embedding. A cell differs from another by its output layer alone: the projection to d and the
head, with no dropout inside either (the first d = 8 cells, with the dropout on the projected
coordinates and MoS's latent dropout, all ended at unigram perplexity: ``superseded/``).

**The arms** at every d: ``softmax``; ``mos`` (K = 4, no latent dropout);
``mixtape`` (K = 4, its small recipe's gate); ``sigsoftmax``; and two controls, both at least the
MoS model's parameter count: ``mlp_softmax`` (a softmax over a residual MLP, rank-bounded: its
width the smallest that reaches MoS's count) and ``wide_softmax`` (a softmax whose output width
d' is the smallest that reaches it). :func:`cell` gives each arm's command.

**Fair training** (:data:`STOP`): SGD then averaged SGD (NT-ASGD, n = 3, after epoch 12 at the
latest: ``train.latest_switch_epoch``) from the recipe, each
(arm, d) at its own learning rate, chosen by a pilot (:func:`choose_lr`): :data:`PILOT_STEPS`
steps at each of :data:`PILOT_LRS`, scored on the whole validation split; when the best is at an
end of the grid the grid is extended by a factor of 2 that way (at most :data:`MAX_EXTENSIONS`
times). A run stops at one rule: ``train.patience = 3`` epoch-end validations without an
improvement of more than ``patience_min_delta = 0.002`` nats (0.2% perplexity), or 20 epochs
(the budget's cap, see the page). Seeds 1 and 2 for every cell; a third where a gap is within
two spreads (:func:`third_seed_arms`).

**The 15-epoch runs** (``long-<head>-seed<S>``): the replication study's small recipes of softmax
and MoS (``configs/ptb/small-<head>.toml``, d_hidden matched to the softmax model's parameter
count, :func:`benchmarks.studies.replication_study.matched_hidden_sizes`) for 15 epochs with
validation every epoch, 2 seeds each.

Resumable: a stage's record in ``records/`` marks it done (a training's, while its run's
``best.pt`` is there or its test is recorded: records brought from a GPU machine without their
checkpoints train the runs again whose tests are missing); a killed training run resumes from
its last checkpoint (``highrank train --resume``). Run directories are kept under ``runs/`` without
their checkpoints (.gitignore). Several processes may share the study (each takes a stage's lock
before running it): ``--first long`` and ``--first map`` give two processes different starts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from benchmarks._common import (
    DATA,
    REPO,
    RESULTS,
    highrank,
    machine,
    module_name,
    save_figure,
    write_json,
    write_text,
)
from benchmarks.study import Stage, Study, search_lr

MODULE = module_name(__file__)  # benchmarks.studies.bottleneck_map

OUT = RESULTS / "bottleneck-map"
PTB_VOCAB = 10_000
# In the order they run: the range first, every factor of 4 (the budget may end the map there),
# then the widths between.
D_VALUES = (8, 32, 128, 16, 64, 256)
HEADS = ("softmax", "mos", "mixtape", "sigsoftmax")
# The widths the CPU takes (the budget, about 40 process-hours for the whole map: d = 8
# and 16 cost about 37 of them on this CPU; d = 64 would add about 20, d = 256 about 40): the
# others wait for a GPU, about 12 minutes of device time a width (the page's *The budget*).
CPU_WIDTHS = (8, 16)
BUDGET_DEVICE = "a GPU"  # where the widths beyond CPU_WIDTHS are left
CONTROLS = ("mlp_softmax", "wide_softmax")
ARMS = HEADS + CONTROLS
SEEDS = (1, 2)
THIRD_SEED = 3  # where a gap is within two spreads (:func:`third_seed_arms`)
LONG_HEADS = ("softmax", "mos")
LONG_EPOCHS = 15
PILOT_LRS = (5.0, 10.0, 20.0, 40.0)
PILOT_STEPS = 300
MAX_EXTENSIONS = 2
RANK_CONTEXTS = 2000
THREADS = 1
# Where the cells run and read Penn Treebank (``--device``, ``--data-dir``; a child stage gets
# them from its parent): the CPU and ../shared/data unless a process says otherwise.
DEVICE = "cpu"
DATA_DIR = DATA

# The one body of every cell (on top of the small recipe's dropouts, AR/TAR and batching).
BODY = (
    "model.d_embed=200",
    "model.n_layers=1",
    "model.d_last=400",
    "model.tie_weights=false",
    "model.weight_drop=0.3",
    "model.dropout_input=0.3",
    "model.dropout_output=0.3",
    "train.test_batch_size=10",
    "run.device=cpu",
)
EPOCH_CAP = 20  # the budget's cap on a map run (the page's *The budget*)
# Learning-rate checks, (arm, d, lr, seed): a cell trained again at another lr than its pilot
# chose, where the choice looks like the pilot's short horizon (0.36 epoch) speaking. The
# rank-bounded control at d = 16 chose its grid's low end, 1.25 (validation perplexity 719 after
# the pilot, 738 at 5), and ended 49% above the softmax and behind its own d = 8 runs at lr 5.
# The cell's lowest checked seed decides: a check of it whose run ends at a lower best
# validation perplexity than that seed's pilot-lr run replaces the pilot's choice
# (:func:`adopted_check`): validation decides, as in the pilots. A seed with a check of its own
# trains at both lrs side by side (on a GPU, where a width's runs all train at once, no run
# waits for another) and is represented by its run at the cell's lr (:func:`standing_check`);
# the other seeds wait for the decision. d = 32's control chose its grid's low end too (1.25:
# 723, 2.5: 743, 5: 786 after the pilot): both its seeds are checked at 5 (it trains on a GPU).
LR_CHECKS = (("mlp_softmax", 16, 5.0, 1), ("mlp_softmax", 32, 5.0, 1),
             ("mlp_softmax", 32, 5.0, 2))


def _valid_lr_checks(checks: tuple[tuple[str, int, float, int], ...]) -> None:
    """Refuse :data:`LR_CHECKS` the stages could not honour: a checked seed outside
    :data:`SEEDS` (seeds 1 and 2 would wait for a third seed that waits for them), or checked
    seeds of one cell at different lrs (a seed without a check at the adopted lr would keep
    its pilot-lr run beside the others' adopted one)."""
    for arm, d, lr, seed in checks:
        if seed not in SEEDS:
            raise ValueError(f"LR_CHECKS: ({arm!r}, {d}, {lr:g}, {seed}): a check's seed must "
                             f"be one of SEEDS {SEEDS}")
    cells: dict[tuple[str, int], dict[int, set[float]]] = {}
    for arm, d, lr, seed in checks:
        cells.setdefault((arm, d), {}).setdefault(seed, set()).add(lr)
    for (arm, d), lrs in cells.items():
        if len({frozenset(v) for v in lrs.values()}) > 1:
            raise ValueError(f"LR_CHECKS: the seeds of ({arm!r}, d = {d}) are checked at "
                             f"different lrs {lrs}: every checked seed needs the same lrs")


_valid_lr_checks(LR_CHECKS)

STOP = (
    "train.optimizer=nt-asgd",
    "train.nonmono=3",
    # averaged SGD by epoch 12 at the latest, so that every run averages for 8 epochs of its 20
    # (the first d = 8 cell, without it, switched in its 20th and last: superseded/round3/)
    "train.latest_switch_epoch=12",
    "train.patience=3",
    "train.patience_min_delta=0.002",
    f"train.epochs={EPOCH_CAP}",
)
# arm -> (the small recipe it starts from, its head overrides). No arm has dropout inside its
# output layer (MoS's recipe drops 0.29 of its latents, which are d wide: at d = 8 that alone
# would handicap it); the body's dropout, before the projection to d, is every cell's.
RECIPE = {
    "softmax": ("softmax", ()),
    "mos": ("mos", ("head.n_components=4", "head.latent_dropout=0")),
    "mixtape": ("mixtape", ()),
    "sigsoftmax": ("sigsoftmax", ()),
    "mlp_softmax": ("softmax", ("head.name=mlp_softmax",)),
    "wide_softmax": ("softmax", ()),
}


# ---- the cells --------------------------------------------------------------------------------


def config_path(recipe: str) -> Path:
    return REPO / "configs" / "ptb" / f"small-{recipe}.toml"


def parameter_count(recipe: str, overrides: tuple[str, ...]) -> int:
    from highrank.config import load_config
    from highrank.train import parameter_count as count

    config = load_config(config_path(recipe), [f"data.dir={DATA_DIR / 'ptb'}", *overrides])
    return count(config, PTB_VOCAB)


def arm_overrides(arm: str, d: int) -> tuple[str, ...]:
    """The overrides that make ``arm`` at output width ``d`` (its body, projection and head):
    the controls sized to at least the MoS model's parameter count."""
    recipe, head = RECIPE[arm]
    base = (*BODY, *head)
    if arm not in CONTROLS:
        return (*base, f"model.d_project={d}")
    target = parameter_count("mos", arm_overrides("mos", d))
    if arm == "wide_softmax":
        width = _smallest(lambda w: parameter_count(recipe, (*base, f"model.d_project={w}")),
                          target, start=d)
        return (*base, f"model.d_project={width}")
    projected = (*base, f"model.d_project={d}")
    width = _smallest(lambda w: parameter_count(recipe, (*projected, f"head.mlp_width={w}")),
                      target, start=1)
    return (*projected, f"head.mlp_width={width}")


def _smallest(count, target: int, start: int) -> int:
    """The smallest integer w >= start with count(w) >= target (count increasing in w)."""
    high = max(start, 1)
    while count(high) < target:
        high *= 2
    low = start
    while low < high:
        middle = (low + high) // 2
        if count(middle) >= target:
            high = middle
        else:
            low = middle + 1
    return low


def train_words(arm: str, d: int, lr: float, seed: int, directory: Path,
                extra: tuple[str, ...] = STOP) -> list[str]:
    """``highrank train`` for one cell (``--resume`` when it has a checkpoint)."""
    if (directory / "checkpoints" / "last.pt").is_file():
        return ["train", "--resume", str(directory), "--no-progress"]
    if directory.exists():  # stopped before its first checkpoint: nothing to keep
        shutil.rmtree(directory)
    recipe, _ = RECIPE[arm]
    overrides = (*arm_overrides(arm, d), *extra, f"train.lr={lr:g}", f"train.seed={seed}")
    return ["train", str(config_path(recipe).relative_to(REPO)), f"--run.out_dir={directory}",
            f"--data.dir={DATA_DIR / 'ptb'}", *(f"--{o}" for o in on_device(overrides)),
            "--no-progress"]


def run(*words: str) -> None:
    highrank(*words, threads=THREADS, log=OUT / "commands.txt")


def on_device(overrides: tuple[str, ...]) -> tuple[str, ...]:
    """``overrides`` with the body's ``run.device=cpu`` set to :data:`DEVICE`."""
    return tuple(f"run.device={DEVICE}" if o == "run.device=cpu" else o for o in overrides)


def device_words() -> tuple[str, ...]:
    """``--device D`` for ``analyze`` off the CPU (its commands on it as before); ``highrank
    eval`` has no such option: it scores on the CPU wherever the run trained."""
    return () if DEVICE == "cpu" else ("--device", DEVICE)


# ---- pilots: each (arm, d)'s learning rate -----------------------------------------------------


def pilot(arm: str, d: int, lr: float) -> dict:
    """``PILOT_STEPS`` steps at ``lr``, then the whole validation split on the last weights;
    its record is kept in ``pilots/`` (a rerun reads it)."""
    record_path = OUT / "pilots" / f"{arm}-d{d}-lr{lr:g}.json"
    if record_path.is_file():
        return json.loads(record_path.read_text())
    directory = OUT / "pilot-runs" / f"{arm}-d{d}-lr{lr:g}"
    shutil.rmtree(directory, ignore_errors=True)
    began = time.perf_counter()
    words = train_words(arm, d, lr, 1, directory, extra=())
    run(*words, "--max-steps", str(PILOT_STEPS))
    run("eval", str(directory), "--split", "valid", "--which", "last", "--batch-size", "10",
        "--no-progress")
    score = json.loads((directory / "eval-valid-last.json").read_text())
    steps = [r for r in _metrics(directory) if r.get("kind") == "step"]
    record = {"arm": arm, "d": d, "lr": lr, "steps": PILOT_STEPS,
              "valid_loss": score["loss"], "valid_ppl": score["perplexity"],
              "train_loss_last": steps[-1]["train_loss"] if steps else None,
              "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps) if steps
              else None, "seconds": time.perf_counter() - began, "load_average": os.getloadavg(),
              "device": DEVICE}
    write_json(record_path, record)
    shutil.rmtree(directory, ignore_errors=True)  # its checkpoints are large; the record stays
    return record


def choose_lr(arm: str, d: int) -> dict:
    """Pilots over :data:`PILOT_LRS`, extended by x2 past an end that wins (at most
    :data:`MAX_EXTENSIONS` times); the lr of the lowest validation loss (a non-finite one
    loses)."""
    best, lrs, records = search_lr(lambda lr: pilot(arm, d, lr), PILOT_LRS, factor=2,
                                   max_extensions=MAX_EXTENSIONS)
    return {"arm": arm, "d": d, "lr": best, "grid": lrs,
            "valid_ppl": {f"{lr:g}": records[lr]["valid_ppl"] for lr in lrs},
            "tokens_per_s": {f"{lr:g}": records[lr]["tokens_per_s"] for lr in lrs},
            "at_an_end": best in (lrs[0], lrs[-1])}


# ---- stages ---------------------------------------------------------------------------------


def cell_dir(arm: str, d: int, seed: int) -> Path:
    return OUT / "runs" / f"{arm}-d{d}-seed{seed}"


def long_dir(head: str, seed: int) -> Path:
    return OUT / "runs" / f"long-{head}-seed{seed}"


def map_stages(widths: tuple[int, ...] = D_VALUES) -> list[Stage]:
    """Per d: the pilots, seeds 1 and 2 of every arm, each training followed by its test, the
    width's learning-rate checks (:data:`LR_CHECKS`) after seed 1, then the third seed of the
    arms :func:`third_seed_arms` names (read from the records: the list grows as they come). A
    test comes right after its training (half a minute) because it reads the run's ``best.pt``,
    which is not committed: a run trained in one session and tested in the next would have to
    train again on a new machine."""
    stages = []
    for d in widths:
        stages += [Stage(f"lr-{arm}-d{d}") for arm in ARMS]
        for seed in SEEDS:
            for arm in ARMS:
                stages += _trained_and_tested(arm, d, seed)
            if seed == SEEDS[0]:
                stages += lr_check_stages(d)
        for arm in third_seed_arms(d):
            stages += _trained_and_tested(arm, d, THIRD_SEED)
    return stages


def _trained_and_tested(arm: str, d: int, seed: int) -> list[Stage]:
    """A cell's training (after its pilots; a seed without a learning-rate check of its own
    also after the cell's deciding check and the run it is compared with, which may change
    its lr: :func:`seed_lr`) and its test."""
    cell = f"{arm}-d{d}-seed{seed}"
    checks = _cell_checks(arm, d)
    decision: tuple[str, ...] = ()
    if checks and seed not in {s for _, s in checks}:
        deciding = _deciding_seed(checks)
        decision = (*(check_name(arm, d, lr, s) for lr, s in checks if s == deciding),
                    f"train-{arm}-d{d}-seed{deciding}")
    return [Stage(f"train-{cell}", needs=(f"lr-{arm}-d{d}", *decision)),
            Stage(f"test-{cell}", needs=(f"train-{cell}",))]


def lr_check_stages(d: int) -> list[Stage]:
    """Width ``d``'s :data:`LR_CHECKS`, each one stage (trained and tested: its ``best.pt``
    stays on this machine) that needs only the pilots: it trains beside the run it checks."""
    return [Stage(check_name(arm, d, lr, seed), needs=(f"lr-{arm}-d{d}",))
            for arm, dd, lr, seed in LR_CHECKS if dd == d]


def _cell_checks(arm: str, d: int) -> list[tuple[float, int]]:
    """(lr, seed) of each of (arm, d)'s :data:`LR_CHECKS`."""
    return [(lr, seed) for a, dd, lr, seed in LR_CHECKS if (a, dd) == (arm, d)]


def _deciding_seed(checks: list[tuple[float, int]]) -> int:
    return min(seed for _, seed in checks)


def check_name(arm: str, d: int, lr: float, seed: int) -> str:
    return f"check-{arm}-d{d}-lr{lr:g}-seed{seed}"


def check_dir(rest: str) -> Path:
    """``checks/<arm>-d<d>-lr<lr>-seed<s>``: beside ``runs/``, whose cells the tables read."""
    return OUT / "checks" / rest


def adopted_check(arm: str, d: int) -> dict | None:
    """The finished learning-rate check of (arm, d) that replaces its pilot's choice, if any:
    of the checks of the cell's deciding (lowest checked) seed, the one whose run's best
    validation perplexity is lowest and below that of the pilot's run of the same seed (the
    test split is not looked at). Its lr is then the cell's, its run that seed's."""
    records = OUT / "records"
    checks = _cell_checks(arm, d)
    if not checks:
        return None
    seed = _deciding_seed(checks)
    cell = records / f"train-{arm}-d{d}-seed{seed}.json"
    if not cell.is_file():
        return None
    best = json.loads(cell.read_text())["best_valid_ppl"]
    adopted = None
    for lr, check_seed in checks:
        check = records / f"{check_name(arm, d, lr, check_seed)}.json"
        if check_seed == seed and check.is_file():
            record = json.loads(check.read_text())
            if record["best_valid_ppl"] < best:
                best, adopted = record["best_valid_ppl"], {**record, "stage": check.stem}
    return adopted


def standing_check(arm: str, d: int, seed: int) -> dict | None:
    """The check run that stands for (arm, d, seed) in place of its pilot-lr run: the
    adopted check's own seed's, or another seed's check at the adopted lr."""
    adopted = adopted_check(arm, d)
    if adopted is None or adopted["seed"] == seed:
        return adopted
    path = OUT / "records" / f"{check_name(arm, d, adopted['lr'], seed)}.json"
    return {**json.loads(path.read_text()), "stage": path.stem} if path.is_file() else None


def standing_known(arm: str, d: int, seed: int) -> bool:
    """Is it known which run stands for (arm, d, seed)? Always in a cell without checks; in a
    checked cell once the deciding seed's pilot-lr training and checks and this seed's own
    checks are recorded."""
    checks = _cell_checks(arm, d)
    if not checks:
        return True
    records = OUT / "records"
    deciding = _deciding_seed(checks)
    needed = [records / f"train-{arm}-d{d}-seed{deciding}.json"]
    needed += [records / f"{check_name(arm, d, lr, s)}.json" for lr, s in checks
               if s in (seed, deciding)]
    return all(path.is_file() for path in needed)


def standing_test_ppl(arm: str, d: int, seed: int) -> float | None:
    """The test perplexity of the run standing for (arm, d, seed); None until that run is
    known (:func:`standing_known`) and tested."""
    if not standing_known(arm, d, seed):
        return None
    check = standing_check(arm, d, seed)
    if check is not None:
        return check["test_ppl"]
    test = OUT / "records" / f"test-{arm}-d{d}-seed{seed}.json"
    return json.loads(test.read_text())["test_ppl"] if test.is_file() else None


def pilot_lr(arm: str, d: int) -> float:
    """The lr the pilots of (arm, d) chose (``records/lr-<arm>-d<d>.json``)."""
    return json.loads((OUT / "records" / f"lr-{arm}-d{d}.json").read_text())["lr"]


def cell_lr(arm: str, d: int) -> float:
    """The lr of (arm, d): its pilot's choice, or an adopted check's."""
    check = adopted_check(arm, d)
    return check["lr"] if check is not None else pilot_lr(arm, d)


def seed_lr(arm: str, d: int, seed: int) -> float:
    """The lr a cell's training of ``seed`` takes: the pilot's where the seed has a check of
    its own (which trains the other lr), else the cell's (:func:`cell_lr`)."""
    if seed in {s for _, s in _cell_checks(arm, d)}:
        return pilot_lr(arm, d)
    return cell_lr(arm, d)


def _check(rest: str) -> tuple[str, int, float, int]:
    arm_d_lr, seed = rest.rsplit("-seed", 1)
    arm_d, lr = arm_d_lr.rsplit("-lr", 1)
    arm, d = arm_d.rsplit("-d", 1)
    return arm, int(d), float(lr), int(seed)


def third_seed_arms(d: int) -> list[str]:
    """The arms of width ``d`` that get a third seed, once every arm's seeds 1 and 2 are
    tested: both arms of every pair (a high-rank head against the softmax or a control) whose
    gap is within two spreads, i.e. whose mean test log-perplexities differ by at most twice
    the larger of the two arms' standard deviations over the seeds. A seed's score is that of
    the run standing for it: an adopted learning-rate check's, not the pilot's run it replaced."""
    scores: dict[str, list[float]] = {}
    for arm in ARMS:
        for seed in SEEDS:
            test_ppl = standing_test_ppl(arm, d, seed)
            if test_ppl is None:
                return []
            scores.setdefault(arm, []).append(math.log(test_ppl))
    chosen: set[str] = set()
    for head in HEADS[1:]:
        for other in ("softmax", *CONTROLS):
            if not beyond_two_spreads(scores[head], scores[other]):
                chosen |= {head, other}
    return [arm for arm in ARMS if arm in chosen]


def beyond_two_spreads(first: list[float], second: list[float]) -> bool:
    """Do two arms' test log-perplexities over their seeds differ in mean by more than twice
    the larger of their standard deviations? (At least 2 seeds each.)"""
    gap = abs(statistics.fmean(first) - statistics.fmean(second))
    return gap > 2 * max(statistics.stdev(first), statistics.stdev(second))


def long_stages() -> list[Stage]:
    """Each 15-epoch run, then its test (half a minute: its figures come at once)."""
    stages = []
    for seed in SEEDS:
        for head in LONG_HEADS:
            run = f"long-{head}-seed{seed}"
            stages += [Stage(run), Stage(f"test-{run}", needs=(run,))]
    return stages


def stages(first: str, widths: tuple[int, ...] = D_VALUES, long: bool = True) -> list[Stage]:
    """The map's cells of ``widths`` (all by default) and the 15-epoch runs (unless ``long`` is
    False: a GPU machine given one width, say), the long runs first or last."""
    cells, runs = map_stages(widths), long_stages() if long else []
    return runs + cells if first == "long" else cells + runs


def stage_done(name: str) -> bool:
    """A stage's record, and for a training the run's ``best.pt`` too unless its test is
    recorded: the test reads the checkpoint, which stays on the machine that trained (records
    brought from a GPU machine without it train the run again)."""
    records = OUT / "records"
    if not (records / f"{name}.json").is_file():
        return False
    kind, rest = name.split("-", 1)
    if kind in ("train", "long"):
        directory = long_dir(*_long(name)) if kind == "long" else cell_dir(*_cell(rest))
        test = f"test-{name}" if kind == "long" else f"test-{rest}"
        return ((directory / "checkpoints" / "best.pt").is_file()
                or (records / f"{test}.json").is_file())
    return True


def work(name: str) -> dict:
    kind, rest = name.split("-", 1)
    if kind in ("train", "long"):
        # a training made again (its best.pt stayed on another machine) drops its old record
        # first: that record and the new run's first best.pt would read as done (stage_done),
        # and another process would test a run still training
        (OUT / "records" / f"{name}.json").unlink(missing_ok=True)
    if kind == "lr":
        arm, d = rest.rsplit("-d", 1)
        return choose_lr(arm, int(d))
    if kind == "train":
        arm, d, seed = _cell(rest)
        lr = seed_lr(arm, d, seed)
        directory = cell_dir(arm, d, seed)
        run(*train_words(arm, d, lr, seed, directory))
        return training_record(directory, {"arm": arm, "d": d, "seed": seed, "lr": lr})
    if kind == "long":
        head, seed = rest.rsplit("-seed", 1)
        directory = long_dir(head, int(seed))
        run(*long_words(head, int(seed), directory))
        return training_record(directory, {"arm": f"long-{head}", "seed": int(seed)})
    if kind == "test":
        directory = (long_dir(*_long(rest)) if rest.startswith("long-")
                     else cell_dir(*_cell(rest)))
        return test_record(directory)
    if kind == "check":
        arm, d, lr, seed = _check(rest)
        directory = check_dir(rest)
        run(*train_words(arm, d, lr, seed, directory))
        facts = {"arm": arm, "d": d, "seed": seed, "lr": lr, "pilot_lr": pilot_lr(arm, d)}
        return {**training_record(directory, facts), **test_record(directory)}
    raise ValueError(f"unknown stage {name!r}")


def _cell(rest: str) -> tuple[str, int, int]:
    arm_d, seed = rest.rsplit("-seed", 1)
    arm, d = arm_d.rsplit("-d", 1)
    return arm, int(d), int(seed)


def _long(rest: str) -> tuple[str, int]:
    head, seed = rest.removeprefix("long-").rsplit("-seed", 1)
    return head, int(seed)


def long_words(head: str, seed: int, directory: Path) -> list[str]:
    if (directory / "checkpoints" / "last.pt").is_file():
        return ["train", "--resume", str(directory), "--no-progress"]
    if directory.exists():
        shutil.rmtree(directory)
    from benchmarks.studies.replication_study import matched_hidden_sizes

    d_hidden = matched_hidden_sizes((head,))[head]
    return ["train", str(config_path(head).relative_to(REPO)), f"--run.out_dir={directory}",
            f"--data.dir={DATA_DIR / 'ptb'}", f"--train.seed={seed}",
            f"--train.epochs={LONG_EPOCHS}", f"--model.d_hidden={d_hidden}",
            "--train.test_batch_size=10", f"--run.device={DEVICE}", "--no-progress"]


def _metrics(directory: Path) -> list[dict]:
    """A run's metrics.jsonl; a torn last line (a run writing it now, or one killed while it
    did) is skipped."""
    from highrank.runs.run_dir import read_metrics

    path = directory / "metrics.jsonl"
    if not path.is_file():
        return []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the torn line's warning: expected of a live run
        return read_metrics(path)


def training_record(directory: Path, facts: dict) -> dict:
    """The run's learning curve (epoch-end validations), its stop and its rate."""
    from highrank.config import load_config
    from highrank.train import parameter_count as count

    rows = _metrics(directory)
    epochs = [r for r in rows if r.get("kind") == "epoch"]
    steps = [r for r in rows if r.get("kind") == "step" and r.get("tokens_per_s")]
    config = load_config(directory / "config.toml")
    model = config.model
    width = model.d_project or model.d_last or model.d_embed  # what the head reads
    return {**facts, "device": config.run.device, "params": count(config, PTB_VOCAB),
            "output_width": width,
            "curve": [{"epoch": r["epoch"], "train_loss": r.get("train_loss"),
                       "valid_loss": r.get("val_loss"), "phase": r.get("phase")}
                      for r in epochs],
            "epochs": len(epochs),
            "best_valid_ppl": math.exp(min(r["val_loss"] for r in epochs)) if epochs else None,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps) if steps
            else None}


def test_record(directory: Path) -> dict:
    """Test perplexity (whole split) and the Press rank of the test log-prob matrix."""
    on = device_words()
    run("eval", str(directory), "--split", "test", "--batch-size", "10", "--no-progress")
    score = json.loads((directory / "eval-test-best.json").read_text())
    run("analyze", "rank", str(directory), "--split", "test", "--max-contexts",
        str(RANK_CONTEXTS), "--batch-size", "10", *on, "--no-progress")
    rank = _rank_record(directory)
    run("analyze", "gradient-bottleneck", str(directory), "--split", "test", "--max-contexts",
        str(RANK_CONTEXTS), *on, "--no-progress")
    gradient = _analysis(directory, "gradient-bottleneck-test-best*.json")
    run("analyze", "saturation", str(directory), "--which", "best", "--split", "test",
        "--max-contexts", str(RANK_CONTEXTS), *on, "--no-progress")
    saturation = _saturation_point(directory)
    return {"test_ppl": score["perplexity"], "test_loss": score["loss"],
            "press_rank": rank.get("press_rank"), "effective_rank": rank.get("effective_rank"),
            "rank_contexts": RANK_CONTEXTS,
            "gradient_share": gradient.get("share", {}).get("mean"),
            "decoder_top10_energy": saturation.get("top_mass", {}).get("10"),
            "decoder_entropy_rank": saturation.get("entropy_effective_rank"),
            "anisotropy": saturation.get("anisotropy", {}).get("mean_cosine"),
            "tanh_saturated": _tanh_share(saturation)}


def _tanh_share(saturation_point: dict) -> float | None:
    """The share of the head's context-forming tanh units with |tanh| > 0.95 (None for heads
    without them, and for records written before the instrument had it)."""
    return (saturation_point.get("tanh_contexts") or {}).get("share_saturated")


def _saturation_point(directory: Path) -> dict:
    return _analysis(directory, "saturation-test*.json").get("checkpoints", [{}])[0]


def _rank_record(directory: Path) -> dict:
    return _analysis(directory, "rank-test-best*.json")


def _analysis(directory: Path, pattern: str) -> dict:
    found = sorted((directory / "analysis").glob(pattern))
    return json.loads(found[-1].read_text()) if found else {}


# ---- summary ----------------------------------------------------------------------------------


def summary_rows() -> list[dict]:
    """summary.json: one object per finished run (map cells and 15-epoch runs). A map cell's
    seed is represented by the run that stands for it (:func:`standing_check`: an adopted
    learning-rate check's where there is one) and left out while that is not yet known
    (:func:`standing_known`); ``record`` names the record each row is read from."""
    records = OUT / "records"
    cells = {path.stem.removeprefix("train-") for path in records.glob("train-*.json")}
    for path in records.glob("check-*.json"):  # it stands while its seed's run trains again
        arm, d, _, seed = _check(path.stem.removeprefix("check-"))
        cells.add(f"{arm}-d{d}-seed{seed}")
    rows = []
    for cell in sorted(cells):
        arm, d, seed = _cell(cell)
        if not standing_known(arm, d, seed):
            continue
        check = standing_check(arm, d, seed)
        if check is not None:
            rows.append(_summary_row(records / f"{check['stage']}.json", check, check,
                                     check_dir(check["stage"].removeprefix("check-"))))
        elif (records / f"train-{cell}.json").is_file():
            rows.append(_summary_row(records / f"train-{cell}.json", None,
                                     records / f"test-{cell}.json", cell_dir(arm, d, seed)))
    for path in sorted(records.glob("long-*.json")):
        rows.append(_summary_row(path, None, records / f"test-{path.stem}.json",
                                 OUT / "runs" / path.stem))
    return rows


def _summary_row(path: Path, train: dict | None, test: dict | Path, run_dir: Path) -> dict:
    """One summary.json object from a run's training record (read from ``path`` when None),
    its test record (a path that may not exist yet: not tested) and its folder (for a
    saturation figure recorded there)."""
    train = json.loads(path.read_text()) if train is None else train
    if isinstance(test, Path):
        test = json.loads(test.read_text()) if test.is_file() else {}
    arm = train["arm"]
    curve = [c["valid_loss"] for c in train["curve"] if c["valid_loss"] is not None]
    return {
        "head": "softmax" if arm == "wide_softmax" else arm.removeprefix("long-"),
        "arm": arm,
        # the cell's output width d (a wide softmax's own width is output_width)
        "d": train.get("d", train["output_width"]),
        "output_width": train["output_width"],
        "seed": train["seed"], "lr": train.get("lr"), "params": train["params"],
        "epochs": train["epochs"],
        "valid_ppl": math.exp(min(curve)) if curve else None,
        "test_ppl": test.get("test_ppl"), "press_rank": test.get("press_rank"),
        "gradient_share": test.get("gradient_share"),
        "decoder_top10_energy": test.get("decoder_top10_energy"),
        "anisotropy": test.get("anisotropy"),
        # read from the run's record: test stages recorded before the instrument had it
        "tanh_saturated": test.get("tanh_saturated", _tanh_share(_saturation_point(
            run_dir))) if test else None,
        "control": arm if arm in CONTROLS else None,
        "device": train.get("device", "cpu"),  # records before the field: the CPU's
        "record": path.name,
    }


def summarize() -> None:
    """summary.json, summary.md (per-cell means and spreads, gains with paired t-tests) and the
    figures, from the runs finished so far."""
    rows = summary_rows()
    write_json(OUT / "summary.json", rows)
    cells = cell_table(rows)
    gains = gain_table(rows)
    beats = beats_both_controls(gains)
    long = long_table(rows)
    write_json(OUT / "cells.json", {"cells": cells, "gains": gains, "beats_both_controls": beats,
                                    "long_runs": long})
    write_text(OUT / "summary.md", summary_markdown(cells, gains, beats, long, check_rows()))
    figures(rows, cells, gains)
    print(f"{len(rows)} finished run(s): {OUT / 'summary.json'}, {OUT / 'summary.md'}")


def _tested(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["test_ppl"] is not None and not r["arm"].startswith("long-")]


def cell_table(rows: list[dict]) -> list[dict]:
    """Per (arm, d): test perplexity's mean and sample standard deviation over the seeds."""
    groups: dict[tuple, list[dict]] = {}
    for row in _tested(rows):
        groups.setdefault((row["arm"], row["d"]), []).append(row)
    table = []
    for (arm, d), group in sorted(groups.items(), key=lambda item: (item[0][1],
                                                                      ARMS.index(item[0][0]))):
        ppl = [r["test_ppl"] for r in group]
        table.append({"arm": arm, "d": d, "seeds": sorted(r["seed"] for r in group),
                      "test_ppl_mean": statistics.fmean(ppl),
                      "test_ppl_sd": statistics.stdev(ppl) if len(ppl) > 1 else None,
                      "press_rank_mean": _mean(group, "press_rank"),
                      "gradient_share_mean": _mean(group, "gradient_share"),
                      "decoder_top10_energy_mean": _mean(group, "decoder_top10_energy"),
                      "anisotropy_mean": _mean(group, "anisotropy"),
                      "tanh_saturated_mean": _mean(group, "tanh_saturated"),
                      "params": group[0]["params"], "lr": group[0]["lr"],
                      "epochs": [r["epochs"] for r in group]})
    return table


def long_table(rows: list[dict]) -> dict:
    """The 15-epoch runs: per head, its tested seeds' best validation and test perplexities
    (mean and sample sd) and Press rank; and MoS against the softmax, paired by seed as in
    :func:`gain_table` (a positive gain: MoS lower)."""
    from scipy import stats

    tested = {(r["head"], r["seed"]): r for r in rows
              if r["arm"].startswith("long-") and r["test_ppl"] is not None}
    heads = []
    for head in LONG_HEADS:
        group = [tested[key] for key in sorted(tested) if key[0] == head]
        if not group:
            continue
        test = [r["test_ppl"] for r in group]
        heads.append({"head": head, "seeds": [r["seed"] for r in group],
                      "epochs": [r["epochs"] for r in group],
                      "valid_ppl": [r["valid_ppl"] for r in group], "test_ppl": test,
                      "test_ppl_mean": statistics.fmean(test),
                      "test_ppl_sd": statistics.stdev(test) if len(test) > 1 else None,
                      "press_rank": [r["press_rank"] for r in group]})
    seeds = sorted(s for h, s in tested if h == "mos" and ("softmax", s) in tested)
    if not seeds:
        return {"heads": heads, "mos_against_softmax": None}
    softmax = [math.log(tested["softmax", s]["test_ppl"]) for s in seeds]
    mos = [math.log(tested["mos", s]["test_ppl"]) for s in seeds]
    gains = [a - b for a, b in zip(softmax, mos, strict=True)]
    p = (float(stats.ttest_rel(softmax, mos).pvalue)
         if len(seeds) > 1 and statistics.stdev(gains) > 0 else None)
    return {"heads": heads, "mos_against_softmax": {
        "seeds": seeds, "gain_percent": [100 * (math.exp(g) - 1) for g in gains],
        "mean_gain_percent": 100 * (math.exp(statistics.fmean(gains)) - 1), "paired_p": p}}


def _shown(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(values) if values else None


def gain_table(rows: list[dict]) -> list[dict]:
    """Each high-rank head against the softmax and each control at every d: the per-seed
    differences of test log-perplexity (paired by seed: a positive gain is the head lower) and
    the paired t-test's two-sided p (None below 2 pairs)."""
    from scipy import stats

    by_cell = {(r["arm"], r["d"], r["seed"]): r for r in _tested(rows)}
    table = []
    for d in sorted(D_VALUES):
        for head in HEADS[1:]:
            for other in ("softmax", *CONTROLS):
                seeds = sorted(seed for arm, dd, seed in by_cell
                               if arm == head and dd == d and (other, d, seed) in by_cell)
                if not seeds:
                    continue
                gains = [math.log(by_cell[(other, d, s)]["test_ppl"])
                         - math.log(by_cell[(head, d, s)]["test_ppl"]) for s in seeds]
                p = None
                if len(gains) > 1 and statistics.stdev(gains) > 0:
                    p = float(stats.ttest_rel([math.log(by_cell[(other, d, s)]["test_ppl"])
                                               for s in seeds],
                                              [math.log(by_cell[(head, d, s)]["test_ppl"])
                                               for s in seeds]).pvalue)
                scores = {arm: [math.log(by_cell[(arm, d, s)]["test_ppl"]) for s in
                                sorted(s for a, dd, s in by_cell if a == arm and dd == d)]
                          for arm in (head, other)}
                clear = (beyond_two_spreads(scores[head], scores[other])
                         if min(len(v) for v in scores.values()) > 1 else None)
                table.append({"d": d, "head": head, "against": other, "seeds": seeds,
                              "gain_percent": [100 * (math.exp(g) - 1) for g in gains],
                              "mean_gain_percent": 100 * (math.exp(statistics.fmean(gains)) - 1),
                              "paired_p": p, "beyond_two_spreads": clear})
    return table


SIGNIFICANCE = 0.05


def beats_both_controls(gains: list[dict]) -> list[dict]:
    """Per high-rank head and tested width: whether it beats *both* controls. It beats one
    when its mean gain over it is positive and the gap is either beyond two spreads (the rule
    that gave a clear gap no third seed: :func:`third_seed_arms`) or, with 3 or more seeds,
    significant in the paired test (p < :data:`SIGNIFICANCE`; with 2 seeds, 1 degree of
    freedom, the rule does not use the test: it passes only when the two per-seed gains nearly
    agree, t > 12.7, and such p-values are descriptive). Per head: the widths where it beats
    both, those where it does not, and ``stops_at``, the smallest width above the narrowest
    win where it does not (None when it wins at every tested width above)."""
    by = {(g["head"], g["d"], g["against"]): g for g in gains}
    rows = []
    for head in HEADS[1:]:
        verdicts = {}
        for d in sorted({d for h, d, _ in by if h == head}):
            pairs = [by.get((head, d, control)) for control in CONTROLS]
            if None not in pairs:
                verdicts[d] = all(_wins(g) for g in pairs)
        if not verdicts:
            continue
        beaten = [d for d, won in verdicts.items() if won]
        failing = [d for d, won in verdicts.items() if not won]
        above = [d for d in failing if beaten and d > min(beaten)]
        rows.append({"head": head, "tested": sorted(verdicts), "beats_both_at": beaten,
                     "not_at": failing, "stops_at": min(above) if above else None})
    return rows


def _wins(gain: dict) -> bool:
    if gain["mean_gain_percent"] <= 0:
        return False
    significant = (len(gain["seeds"]) > 2 and gain["paired_p"] is not None
                   and gain["paired_p"] < SIGNIFICANCE)
    return bool(gain.get("beyond_two_spreads")) or significant


def check_rows() -> list[dict]:
    """Each finished learning-rate check beside the map cell it checks (same arm, width and
    seed at the pilot's lr), the softmax of that width and seed, and whether it was adopted."""
    records = OUT / "records"

    def field(kind: str, name: str, key: str) -> float | None:
        path = records / f"{kind}-{name}.json"
        return json.loads(path.read_text())[key] if path.is_file() else None

    rows = []
    for path in sorted(records.glob("check-*.json")):
        check = json.loads(path.read_text())
        cell = f"{check['arm']}-d{check['d']}-seed{check['seed']}"
        standing = standing_check(check["arm"], check["d"], check["seed"])
        rows.append({"arm": check["arm"], "d": check["d"], "seed": check["seed"],
                     "lr": check["lr"], "pilot_lr": check["pilot_lr"],
                     "epochs": check["epochs"], "valid_ppl": check["best_valid_ppl"],
                     "test_ppl": check["test_ppl"], "press_rank": check.get("press_rank"),
                     "pilot_lr_valid_ppl": field("train", cell, "best_valid_ppl"),
                     "pilot_lr_test_ppl": field("test", cell, "test_ppl"),
                     "softmax_test_ppl": field("test", f"softmax-d{check['d']}-seed"
                                               f"{check['seed']}", "test_ppl"),
                     "adopted": standing is not None and standing["stage"] == path.stem})
    return rows


def _checks_markdown(checks: list[dict]) -> list[str]:
    lines = ["", "Learning-rate checks (`LR_CHECKS`: a cell trained again at another lr than "
             "its pilot chose): best validation and test perplexity at the pilot's lr and at "
             "the check's, and the softmax's test perplexity of the same width and seed. A "
             "check of the cell's lowest checked seed with the lower validation perplexity is "
             "adopted: its lr is the cell's, and its run (and each other seed's check at that "
             "lr) the cell's run of that seed in the tables above.", "",
             "| d | arm | seed | pilot's lr: valid / test ppl | check's lr: valid / test ppl | "
             "epochs | softmax | check relative to the softmax | adopted |",
             "| ---: | --- | ---: | --- | --- | ---: | ---: | ---: | --- |"]
    for c in checks:
        pilot = (f"{c['pilot_lr']:g}: {_shown(c['pilot_lr_valid_ppl'], '.2f')} / "
                 f"{_shown(c['pilot_lr_test_ppl'], '.2f')}")
        softmax = _shown(c["softmax_test_ppl"], ".2f")
        relative = (f"{100 * (c['test_ppl'] / c['softmax_test_ppl'] - 1):+.1f}%"
                    if c["softmax_test_ppl"] else "-")
        lines.append(f"| {c['d']} | {c['arm']} | {c['seed']} | {pilot} | "
                     f"{c['lr']:g}: {c['valid_ppl']:.2f} / {c['test_ppl']:.2f} | {c['epochs']} "
                     f"| {softmax} | {relative} | {'yes' if c['adopted'] else 'no'} |")
    return lines


def summary_markdown(cells: list[dict], gains: list[dict], beats: list[dict] = (),
                     long: dict | None = None, checks: list[dict] = ()) -> str:
    lines = [f"# Bottleneck map: summary (written by `python -m {MODULE} "
             "--summarize`)", "", "Test perplexity (whole PTB test split) per cell, mean ± sd "
             "over seeds; Press rank of the first 2,000 test contexts' log-prob matrix.", "",
             "| d | arm | seeds | lr | params | epochs | test ppl | Press rank | gradient share "
             "| decoder top-10 energy | anisotropy | tanh units saturated |",
             "| ---: | --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for c in cells:
        sd = f" ± {c['test_ppl_sd']:.2f}" if c["test_ppl_sd"] is not None else ""
        rank = _shown(c["press_rank_mean"], ".0f")
        lines.append(f"| {c['d']} | {c['arm']} | {c['seeds']} | {c['lr']:g} | "
                     f"{c['params']:,} | {c['epochs']} | {c['test_ppl_mean']:.2f}{sd} | {rank} | "
                     f"{_shown(c['gradient_share_mean'], '.3f')} | "
                     f"{_shown(c['decoder_top10_energy_mean'], '.3f')} | "
                     f"{_shown(c['anisotropy_mean'], '.3f')} | "
                     f"{_shown(c.get('tanh_saturated_mean'), '.3f')} |")
    lines += ["", "Gradient share: the part of the logit gradient's norm that reaches the "
              "hidden state (`highrank analyze gradient-bottleneck`); decoder top-10 energy, "
              "anisotropy: `highrank analyze saturation` (each a mean over the seeds, on the "
              f"first {RANK_CONTEXTS:,} test contexts); tanh units saturated: of the tanh units "
              "that form the head's contexts (MoS's latents, Mixtape's contexts, the "
              "`mlp_softmax` control's hidden layer), the share with |tanh(a)| > 0.95, the same "
              "instrument."]
    lines += ["", "Learning rates chosen by the pilots (validation perplexity after "
              f"{PILOT_STEPS} steps at each lr of the grid; `pilots/`):", "",
              "| d | arm | lr | grid: validation perplexity |", "| ---: | --- | ---: | --- |"]
    for choice in pilot_choices():
        grid = ", ".join(f"{lr}: {ppl:,.0f}" if ppl < 1e6 else f"{lr}: {ppl:.1e}"
                         for lr, ppl in choice["valid_ppl"].items())
        lines.append(f"| {choice['d']} | {choice['arm']} | {choice['lr']:g} | {grid} |")
    lines += ["", "Gain of a head over the softmax and the controls: 100 (exp(log ppl_other - "
              "log ppl_head) - 1) per seed (positive: the head is better); paired t-test over "
              "the seeds.", "", "| d | head | against | per seed (%) | mean (%) | paired p |",
              "| ---: | --- | --- | --- | ---: | ---: |"]
    for g in gains:
        per_seed = ", ".join(f"{x:+.2f}" for x in g["gain_percent"])
        p = f"{g['paired_p']:.3f}" if g["paired_p"] is not None else "-"
        lines.append(f"| {g['d']} | {g['head']} | {g['against']} | {per_seed} | "
                     f"{g['mean_gain_percent']:+.2f} | {p} |")
    lines += ["", "Where a head beats both controls (over each: a positive mean gain, beyond two "
              f"spreads or, with 3 or more seeds, paired p < {SIGNIFICANCE}), where it does not, "
              "and the smallest width above its narrowest win where it does not:", "",
              "| head | widths tested | beats both at | not at | stops at |",
              "| --- | --- | --- | --- | --- |"]
    for b in beats:
        stops = b["stops_at"] if b["stops_at"] is not None else "-"
        lines.append(f"| {b['head']} | {b['tested']} | {b['beats_both_at'] or 'none'} | "
                     f"{b['not_at'] or 'none'} | {stops} |")
    if long and long["heads"]:
        lines += _long_markdown(long)
    if checks:
        lines += _checks_markdown(checks)
    return "\n".join(lines) + "\n"


def _long_markdown(long: dict) -> list[str]:
    lines = ["", f"The {LONG_EPOCHS}-epoch runs (the small recipes, output width 200; best "
             "validation perplexity per seed, test perplexity mean ± sd over the seeds):", "",
             "| head | seeds | epochs | best valid ppl | test ppl | Press rank |",
             "| --- | --- | --- | --- | ---: | --- |"]
    for h in long["heads"]:
        sd = f" ± {h['test_ppl_sd']:.2f}" if h["test_ppl_sd"] is not None else ""
        valid = ", ".join(f"{v:.2f}" for v in h["valid_ppl"])
        ranks = ", ".join(_shown(rank, "d") for rank in h["press_rank"])
        lines.append(f"| {h['head']} | {h['seeds']} | {h['epochs']} | {valid} | "
                     f"{h['test_ppl_mean']:.2f}{sd} | {ranks} |")
    pair = long["mos_against_softmax"]
    if pair:
        per_seed = ", ".join(f"{x:+.2f}" for x in pair["gain_percent"])
        p = f"{pair['paired_p']:.3f}" if pair["paired_p"] is not None else "-"
        lines += ["", f"MoS against the softmax (gain as above, seeds {pair['seeds']}): per seed "
                  f"{per_seed}%, mean {pair['mean_gain_percent']:+.2f}%, paired p {p}."]
    return lines


def pilot_choices() -> list[dict]:
    """The records of the finished learning-rate stages, by d then arm."""
    choices = [json.loads(p.read_text()) for p in (OUT / "records").glob("lr-*.json")]
    return sorted(choices, key=lambda c: (c["d"], ARMS.index(c["arm"])))


def figures(rows: list[dict], cells: list[dict], gains: list[dict]) -> None:
    """test-ppl-vs-d.png, press-rank-vs-d.png, gain-vs-d.png, curves.png and
    long-curves.png."""
    if not rows:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {arm: f"C{i}" for i, arm in enumerate(ARMS)}
    for key, name, label in (("test_ppl_mean", "test-ppl-vs-d.png", "test perplexity"),
                             ("press_rank_mean", "press-rank-vs-d.png", "Press rank")):
        if not cells:
            break
        figure, axis = plt.subplots(figsize=(6.4, 4.2))
        for arm in ARMS:
            points = [c for c in cells if c["arm"] == arm and c[key] is not None]
            if not points:
                continue
            errors = [c["test_ppl_sd"] or 0 for c in points] if key == "test_ppl_mean" else None
            axis.errorbar([c["d"] for c in points], [c[key] for c in points], yerr=errors,
                          marker="o", capsize=3, label=arm, color=colours[arm])
        if key == "press_rank_mean":
            axis.plot(sorted(D_VALUES), [d + 1 for d in sorted(D_VALUES)], "k:", label="d + 1")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("output width d")
        axis.set_ylabel(label)
        axis.legend(fontsize=8)
        figure.tight_layout()
        save_figure(figure, OUT / name, dpi=110)
        plt.close(figure)
    gain_figure(plt, gains, colours)
    _curves(plt, [r for r in rows if not r["arm"].startswith("long-")], "curves.png", colours)
    _curves(plt, [r for r in rows if r["arm"].startswith("long-")], "long-curves.png",
            {"long-softmax": "C0", "long-mos": "C1"})


SYNTHETIC = RESULTS / "synthetic-sweep" / "summary.json"
SMOLLM2 = RESULTS / "smollm2-warm-start" / "summary.json"
SMOLLM2_CONTEXT = RESULTS / "smollm2-warm-start" / "context-h100" / "summary.json"


def smollm2_pairs() -> tuple[tuple[Path, str, str], ...]:
    """SmolLM2's frozen warm start: each high-rank head that has a capacity control, with it,
    and the summary that pairs them (read at call time: a test points them elsewhere)."""
    return ((SMOLLM2, "mos4", "control3m"), (SMOLLM2_CONTEXT, "mfs", "control7m"),
            (SMOLLM2_CONTEXT, "moscpr", "control9m"))


def gain_points(gains: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """Nats per token a high-rank head saves, against the output width d, from three studies
    on one axis: the map (each head against the softmax, and MoS against the stronger of its two
    controls: the mean over shared seeds of the difference of test log-perplexities, from
    :func:`gain_table`), the synthetic sweep (MoS-15 against the softmax at true rank 64 and
    256, V = 256: the difference of their KLs, which is the difference of their
    cross-entropies) and SmolLM2-135M's frozen warm start (MoS-4, MFS and MoS + CPR, each
    against its rank-bounded capacity control, :func:`smollm2_pairs`, d = 576, V = 49,152). Each
    series is a list of (d, nats); a study whose summary is missing or lacks a figure is left
    out."""
    series: dict[str, list[tuple[int, float]]] = {}
    nats = {(g["head"], g["d"], g["against"]): math.log1p(g["mean_gain_percent"] / 100)
            for g in gains}
    for head, d, other in sorted(nats, key=lambda key: key[1]):
        if other == "softmax":
            series.setdefault(f"PTB map: {head} - softmax", []).append((d, nats[head, d, other]))
        if head == "mos" and other == CONTROLS[0] and (head, d, CONTROLS[1]) in nats:
            stronger = min(nats[head, d, control] for control in CONTROLS)
            series.setdefault("PTB map: mos - best control", []).append((d, stronger))
    try:
        kl = {(r["r"], r["d"], r["head"]): r["kl_mean"]
              for r in json.loads(SYNTHETIC.read_text())["rows"]}
        for rank in (64, 256):
            series[f"synthetic r = {rank}: mos - softmax"] = sorted(
                (d, kl[(rr, d, "softmax")] - kl[(rr, d, "mos")])
                for rr, d, head in kl if rr == rank and head == "mos" and (rr, d, "softmax") in kl)
    except (OSError, KeyError, ValueError):
        pass
    for summary, head, control in smollm2_pairs():
        try:
            for pair in json.loads(summary.read_text())["against_controls"]:
                if (pair["head"], pair["control"], pair["split"]) == (head, control, "test"):
                    series[f"SmolLM2 frozen: {head} - control"] = [
                        (576, math.log(pair["control_mean"] / pair["head_mean"]))]
        except (OSError, KeyError, ValueError):
            pass
    return {label: points for label, points in series.items() if points}


SMOLLM2_MARKERS = {"mos4": "*", "mfs": "P", "moscpr": "X"}
SMOLLM2_COLOURS = {"mos4": "C1", "mfs": "C8", "moscpr": "C9"}  # MoS-4 in the map's MoS colour


def gain_figure(plt, gains: list[dict], colours: dict) -> None:
    """gain-vs-d.png: :func:`gain_points` on one axis (the languages differ: V = 256, 10,000
    and 49,152; what is shared is the width d and the unit, nats per token)."""
    series = gain_points(gains)
    if not series:
        return
    figure, axis = plt.subplots(figsize=(6.4, 4.2))
    for label, points in series.items():
        arm = label.split(": ", 1)[1].split(" - ", 1)[0]
        style = {"marker": "o", "color": colours.get(arm, "C7")}
        if label.startswith("synthetic"):
            style.update(marker="s", color="k", linestyle=":" if "64" in label else "--")
        elif label.startswith("SmolLM2"):
            style.update(marker=SMOLLM2_MARKERS.get(arm, "*"), markersize=11, linestyle="none",
                         color=SMOLLM2_COLOURS.get(arm, "C7"))
        elif "control" in label:
            style.update(linestyle="--")
        axis.plot([d for d, _ in points], [g for _, g in points], label=label, **style)
    axis.axhline(0.0, color="grey", linewidth=0.8)
    axis.set_xscale("log", base=2)
    axis.set_xlabel("output width d")
    axis.set_ylabel("nats per token saved (> 0: head better)")
    axis.legend(fontsize=7)
    figure.tight_layout()
    save_figure(figure, OUT / "gain-vs-d.png", dpi=110)
    plt.close(figure)


def _curves(plt, rows: list[dict], name: str, colours: dict) -> None:
    """Validation perplexity per epoch of every finished run (one panel per d)."""
    if not rows:
        return
    ds = sorted({r["d"] for r in rows})
    figure, axes = plt.subplots(1, len(ds), figsize=(3.2 * len(ds), 3.2), squeeze=False)
    for axis, d in zip(axes[0], ds, strict=True):
        for row in (r for r in rows if r["d"] == d):
            record = json.loads((OUT / "records" / row["record"]).read_text())
            curve = [c for c in record["curve"] if c["valid_loss"] is not None]
            axis.plot([c["epoch"] for c in curve], [math.exp(c["valid_loss"]) for c in curve],
                      color=colours[row["arm"]], linestyle=SEED_LINES.get(row["seed"], "-."),
                      label=f"{row['arm']} s{row['seed']}")
        axis.set_title(f"d = {d}")
        axis.set_yscale("log")
        axis.set_xlabel("epoch")
    axes[0][0].set_ylabel("validation perplexity")
    axes[0][-1].legend(fontsize=6)
    figure.tight_layout()
    save_figure(figure, OUT / name, dpi=110)
    plt.close(figure)


SEED_LINES = {1: "-", 2: "--", THIRD_SEED: ":"}


PTB_TRAIN_TOKENS = 929_589
PRIOR_EPOCHS = EPOCH_CAP  # before any map run has finished (the first cell reached the cap)
PRIOR_TOKENS_PER_S = {"softmax": 3000.0, "mos": 1000.0}  # the 15-epoch runs, before measured
PRIOR_TEST_SECONDS = 300.0  # a test stage, before one has finished
# One width's 12 cells and their pilots on an H100, 12 processes side by side (measured
# 2026-11-27, bottleneck_map_device.sh): pilots 100-190 s, then 15-26 s an epoch per cell:
# 20 epochs and the tests after them, about 12 minutes.
GPU_MINUTES_PER_WIDTH = 12.0


class Rates:
    """What the estimates of the stages left are made of, read from the records so far: the
    median epochs of the finished map runs (:data:`PRIOR_EPOCHS` before), each (arm, d)'s
    tokens/s on this device (its runs' logged steps, else its pilots', else its nearest
    measured d's), and a test stage's seconds (:data:`PRIOR_TEST_SECONDS` before). A plan
    takes the typical case (medians); a deadline the worst measured (``worst=True``: the
    epoch cap, the slowest run's median rate, the longest test)."""

    def __init__(self) -> None:
        self.records = {p.stem: json.loads(p.read_text())
                        for p in (OUT / "records").glob("*.json")}
        trainings = [r for name, r in self.records.items() if name.startswith("train-")]
        self.epochs = [r["epochs"] for r in trainings]
        self.per_run = statistics.median(self.epochs) if self.epochs else PRIOR_EPOCHS
        self.pilots = _pilot_rates()
        per_run = _training_rates()
        self.trained = {key: statistics.median(v) for key, v in per_run.items()}
        self.slowest = {key: min(v) for key, v in per_run.items()}
        tests = [r["stage_seconds"] for name, r in self.records.items()
                 if name.startswith("test-")]
        self.per_test = statistics.median(tests) if tests else PRIOR_TEST_SECONDS
        self.longest_test = max(tests) if tests else PRIOR_TEST_SECONDS
        grids = [len(r["grid"]) for name, r in self.records.items()
                 if name.startswith("lr-") and "grid" in r]
        # pilots a learning-rate stage runs: its grid and the extensions the finished ones took
        self.pilots_per_lr = statistics.median(grids) if grids else len(PILOT_LRS)

    def tokens_per_s(self, arm: str, d: int, worst: bool = False) -> float:
        measured = (self.slowest if worst else self.trained).get((arm, d))
        return measured or _rate(self.pilots, arm, d)

    def seconds(self, name: str, worst: bool = False) -> float:
        """The estimated seconds of stage ``name`` from where it stands (a training with a
        checkpoint: its epochs left); validation adds 10% to a training."""
        kind, rest = name.split("-", 1)
        if kind == "train":
            arm, d, seed = _cell(rest)
            return self._training(arm, d, cell_dir(arm, d, seed), worst)
        if kind == "check":  # a training and its test
            arm, d, _, _ = _check(rest)
            return (self._training(arm, d, check_dir(rest), worst)
                    + self.seconds(f"test-{arm}-d{d}-seed1", worst))
        if kind == "long":
            head, seed = _long(rest)
            epochs = max(1, LONG_EPOCHS - _epochs_done(long_dir(head, seed)))
            return epochs * PTB_TRAIN_TOKENS / PRIOR_TOKENS_PER_S[head] * 1.1
        if kind == "lr":  # worst: every extension taken
            arm, d = rest.rsplit("-d", 1)
            pilots = len(PILOT_LRS) + MAX_EXTENSIONS if worst else self.pilots_per_lr
            return pilots * PILOT_STEPS * 1120 / _rate(self.pilots, arm, int(d)) + 60
        return self.longest_test if worst else self.per_test


    def _training(self, arm: str, d: int, directory: Path, worst: bool) -> float:
        epochs = EPOCH_CAP if worst else self.per_run
        epochs = max(1.0, epochs - _epochs_done(directory))
        return epochs * PTB_TRAIN_TOKENS / self.tokens_per_s(arm, d, worst) * 1.1


def _training_rates() -> dict[tuple[str, int], list[float]]:
    """Each (arm, d)'s runs on :data:`DEVICE`, by the median tokens/s of each run's logged
    steps (``runs/*/metrics.jsonl``: finished runs and those in progress alike)."""
    rates: dict[tuple[str, int], list[float]] = {}
    for config in (OUT / "runs").glob("*-d*-seed*/config.toml"):
        arm, d, _ = _cell(config.parent.name)
        if f'device = "{DEVICE}"' not in config.read_text():
            continue
        steps = [r["tokens_per_s"] for r in _metrics(config.parent)
                 if r.get("kind") == "step" and r.get("tokens_per_s")]
        if steps:
            rates.setdefault((arm, d), []).append(statistics.median(steps))
    return rates


def _epochs_done(directory: Path) -> int:
    """The epochs a run can resume after: 0 without a checkpoint (it starts again)."""
    if not (directory / "checkpoints" / "last.pt").is_file():
        return 0
    return sum(1 for r in _metrics(directory) if r.get("kind") == "epoch")


# A stage is let start before --until only if it would end by then at this many times its
# worst measured estimate: the load of other work can slow a one-thread run further still.
DEADLINE_SLACK = 1.3


def before(deadline: float, rates: Callable[[], Rates] = Rates) -> Callable[[str], bool]:
    """``Study(admit=...)`` for ``--until``: a training starts only if it and its test, at
    their worst measured estimates (:meth:`Rates.seconds`) times :data:`DEADLINE_SLACK`, end
    before ``deadline`` (a time.time()), so that a session's end takes no half-trained or
    untested run with it (checkpoints are not committed); a test always starts (its training
    is done here: refused, the run would be lost). An error in the estimate refuses the
    stage, in one line."""
    def admit(name: str) -> bool:
        kind, rest = name.split("-", 1)
        if kind == "test":
            return True
        try:
            estimate = rates()
            seconds = estimate.seconds(name, worst=True)
            if kind in ("train", "long"):
                seconds += estimate.seconds(f"test-{rest if kind == 'train' else name}",
                                            worst=True)
        except Exception as error:  # noqa: BLE001 - any error: the stage waits, said so
            print(f"{name}: not started, its estimate failed: {error!r}", flush=True)
            return False
        return time.time() + DEADLINE_SLACK * seconds <= deadline
    return admit


def plan(study: Study) -> None:
    """The stages left and their estimated process-hours (:class:`Rates`)."""
    pending = study.pending()
    rates = Rates()
    hours: dict[str, float] = {}
    by_d: dict[int, float] = {}
    for name in pending:
        kind = name.split("-", 1)[0]
        seconds = rates.seconds(name)
        if kind in ("train", "check"):  # a check is a training too (and its test)
            d = _width(name)
            by_d[d] = by_d.get(d, 0.0) + seconds / 3600
        hours[kind] = hours.get(kind, 0.0) + seconds / 3600
    epochs = rates.epochs
    print(f"{len(pending)} of {len(study.stages)} stages left; a map run takes "
          f"{rates.per_run} epochs "
          f"({'median of ' + str(len(epochs)) + ' finished' if epochs else 'assumed'})")
    for kind, value in sorted(hours.items()):
        print(f"  {kind}: about {value:.1f} process-hours")
    print("  train and check by d: "
          + ", ".join(f"d = {d}: {h:.1f}" for d, h in sorted(by_d.items())))
    print(f"  in all about {sum(hours.values()):.1f} process-hours "
          f"({sum(hours.values()) / 2:.1f} h with two processes)")
    spent = sum(r.get("stage_seconds", 0.0) for r in rates.records.values()) / 3600
    print(f"  spent so far: {spent:.1f} process-hours in {len(rates.records)} finished stages "
          "(a resumed stage counts its last process only; superseded rounds apart)")
    widths = sorted({_width(name) for name in pending} - {None})
    print(f"  (the totals above count every width of this process on the CPU) on an H100 "
          "instead (bottleneck_map_device.sh, measured with 12 processes): about "
          f"{GPU_MINUTES_PER_WIDTH:.0f} minutes a width with its pilots, {len(widths)} width(s) "
          "with stages left "
          f"({', '.join(map(str, widths))})")
    _, elsewhere = widths_of_this_device()
    for d, device in elsewhere.items():
        left = [s.name for s in map_stages((d,)) if not stage_done(s.name)]
        if left:
            why = "beyond the CPU's budget" if device == BUDGET_DEVICE else "where its pilots ran"
            print(f"  d = {d}: {len(left)} stages left to {device}, {why} "
                  f"(about {GPU_MINUTES_PER_WIDTH:.0f} minutes on an H100)")
    for name in pending[:6]:
        print(f"  next: {name} (about {rates.seconds(name) / 60:.0f} min)")


def _width(stage: str) -> int | None:
    """The output width of a map stage (``lr-mos-d8``, ``train-mos-d8-seed2``, ...), None for
    the 15-epoch runs'."""
    for part in stage.split("-"):
        if part[:1] == "d" and part[1:].isdigit():
            return int(part[1:])
    return None


def _pilot_rates() -> dict[tuple[str, int], float]:
    """Each (arm, d)'s median tokens/s over its pilots on :data:`DEVICE` (another device's are
    another machine's rates; pilots before the ``device`` field ran on the CPU)."""
    rates: dict[tuple[str, int], list[float]] = {}
    for path in (OUT / "pilots").glob("*.json"):
        record = json.loads(path.read_text())
        if record.get("tokens_per_s") and record.get("device", "cpu") == DEVICE:
            rates.setdefault((record["arm"], record["d"]), []).append(record["tokens_per_s"])
    return {key: statistics.median(values) for key, values in rates.items()}


def _rate(rates: dict, arm: str, d: int) -> float:
    """The pilot rate of (arm, d), else of the arm's nearest measured d (scaled by the output
    layer's width, the cost that grows with d), else 3,000 tokens/s."""
    if (arm, d) in rates:
        return rates[(arm, d)]
    known = [dd for a, dd in rates if a == arm] or [dd for a, dd in rates if a == "softmax"]
    if not known:
        return 3000.0
    nearest = min(known, key=lambda dd: abs(math.log(dd / d)))
    rate = rates.get((arm, nearest), rates.get(("softmax", nearest)))
    factor = {"mos": 5.0, "mixtape": 1.5}.get(arm, 1.0)  # output-layer cost per unit of d
    return rate * (1 + factor * nearest / 256) / (1 + factor * d / 256)


def summarize_after(stage: str) -> None:
    """The summary after each stage; a failure to write it is one line, not the end of the
    study (the records are what matter: ``--summarize`` rewrites it)."""
    try:
        summarize()
    except Exception as error:  # noqa: BLE001 - any error of the summary, reported
        print(f"summary not written after {stage}: {error!r} (rerun --summarize)", flush=True)


def main(argv: list[str] | None = None) -> int:
    global DEVICE, DATA_DIR
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--first", choices=("map", "long"), default="map",
                        help="which part this process starts with (default: the map)")
    parser.add_argument("--widths", type=_widths, default=None, metavar="D,D",
                        help="only the map's cells of these output widths (of "
                        f"{', '.join(map(str, D_VALUES))}; default: every width whose pilots "
                        "did not run on another device, and on the CPU only "
                        f"{', '.join(map(str, CPU_WIDTHS))}: the budget)")
    parser.add_argument("--no-long", action="store_true", help="not the 15-epoch runs")
    parser.add_argument("--device", default="cpu",
                        help="where the cells train and are tested (cpu, cuda; default cpu)")
    parser.add_argument("--data-dir", type=Path, default=DATA,
                        help=f"the folder holding ptb/ (default {DATA})")
    parser.add_argument("--until", type=clock_time, default=None, metavar="HH:MM",
                        help="start no stage that would not end by then (its estimate from "
                        f"the measured rates, x{DEADLINE_SLACK}): a machine that goes away at "
                        "a known time loses no half-trained run")
    parser.add_argument("--plan", action="store_true", help="print the stages left")
    parser.add_argument("--summarize", action="store_true", help="only write the summary")
    parser.add_argument("--stage", help=argparse.SUPPRESS)  # one stage, in a child process
    args = parser.parse_args(argv)
    DEVICE, DATA_DIR = args.device, args.data_dir.resolve()
    if not (DATA_DIR / "ptb" / "train.txt").is_file():
        print(f"skipped: Penn Treebank not found at {DATA_DIR / 'ptb'}", file=sys.stderr)
        return 0
    passed_on = ("--device", DEVICE, "--data-dir", str(DATA_DIR))  # to each child stage
    if args.widths is None:
        args.widths, elsewhere = widths_of_this_device()
        if elsewhere and not args.stage:
            print(f"widths {', '.join(f'{d} ({where})' for d, where in elsewhere.items())} "
                  "are left to another device: where their pilots ran (a width's arms train on "
                  "one) or, beyond the CPU's budget, a GPU (--widths takes them here)",
                  flush=True)
    study = Study(
        lambda: stages(args.first, args.widths, long=not args.no_long), work,
        records=OUT / "records", locks=OUT / ".locks", done=stage_done,
        child=lambda name: [sys.executable, "-m", MODULE, "--stage", name, *passed_on],
        extra=lambda: {"load_average": os.getloadavg(), "machine": machine(threads=THREADS)},
        after=summarize_after, cwd=REPO,
        admit=before(args.until) if args.until is not None else None,
    )
    if args.plan:
        plan(study)
        return 0
    if args.until is not None and not args.stage:
        left = (args.until - time.time()) / 3600
        print(f"--until: no stage starts that would end after "
              f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(args.until))} "
              f"(in {left:.1f} h) at {DEADLINE_SLACK}x its worst measured estimate", flush=True)
    return study.main(args.stage, summarize=summarize, only_summary=args.summarize)


def widths_of_this_device() -> tuple[tuple[int, ...], dict[int, str]]:
    """The map's widths this process takes without ``--widths``, and the others with where
    they are left: a width whose pilots ran on another device is that device's (a width's arms
    are compared on one device; pilots before the ``device`` field ran on the CPU), and on the
    CPU only :data:`CPU_WIDTHS` (the budget): the others wait for a GPU."""
    elsewhere: dict[int, str] = {}
    for path in (OUT / "pilots").glob("*.json"):
        record = json.loads(path.read_text())
        device = record.get("device", "cpu")
        if device != DEVICE and record.get("d") in D_VALUES:
            elsewhere[record["d"]] = device
    if DEVICE == "cpu":
        for d in D_VALUES:
            if d not in CPU_WIDTHS:
                elsewhere.setdefault(d, BUDGET_DEVICE)
    return tuple(d for d in D_VALUES if d not in elsewhere), dict(sorted(elsewhere.items()))


def clock_time(text: str, now: float | None = None) -> float:
    """``--until HH:MM``: the next time the local clock reads it (today, or tomorrow if it has
    passed), as a time.time()."""
    import datetime

    try:
        wall = datetime.datetime.strptime(text, "%H:%M").time()
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a clock time HH:MM, got {text!r}") from None
    current = datetime.datetime.fromtimestamp(time.time() if now is None else now)
    at = datetime.datetime.combine(current.date(), wall)
    if at <= current:
        at += datetime.timedelta(days=1)
    return at.timestamp()


def _widths(text: str) -> tuple[int, ...]:
    try:
        widths = tuple(int(w) for w in text.split(","))
    except ValueError:
        widths = ()
    if not widths or any(w not in D_VALUES for w in widths):
        raise argparse.ArgumentTypeError(
            f"expected widths among {', '.join(map(str, D_VALUES))}, comma-separated; got {text!r}")
    return widths


if __name__ == "__main__":
    sys.exit(main())
