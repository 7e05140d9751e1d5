"""The one training loop of a retrofit, for every mode, with one budget and one state file.

What is trained (a :class:`Trainee`) differs by mode; how it is trained does not:

* ``frozen``: a head alone, on random batches of cached hidden states (:func:`train_head`);
* ``lora`` / ``full``: the adapters (or every parameter) of the body and the head, on random
  batches of whole windows of the text (:func:`train_windows`).

:func:`train_loop` runs Adam for ``budget.steps`` steps on batches drawn without replacement
(:func:`batch_indices`: a pure function of the seed and the step, so a resumed run draws the
batches an uninterrupted one would), the learning rate warmed up linearly and decayed along a
cosine (:func:`highrank.train.schedule.lr_factor_from_zero`), the gradient norm clipped. The
core's non-finite guard (:mod:`highrank.train.steps`) skips a step whose loss or gradient norm
is not finite;
more than :data:`MAX_NONFINITE_STEPS` in a row stop training with the last finite state kept
(:class:`NonFiniteSteps`). With ``catch_signals`` a SIGINT or SIGTERM
(:class:`highrank.train.interrupts.SignalCatcher`, as the training loop of the core) is acted
on between two steps: the state is saved there and
:class:`~highrank.train.state.Interrupted` raised, naming it.

**The state file** (``state.pt``, written atomically, read weights-only) holds ``budget``,
the trained weights, ``optimizer``, ``history`` (one record a step), ``rng`` and
``python_rng``, and ``data`` (the sha256 of the token ids trained on; states written before
it was kept lack it), and under torchrun ``ranks`` (every process's ``rng`` and
``python_rng``) and ``world_size``; a rerun continues from it bit for bit, a finished one is
loaded and nothing is trained. Everything in it is checked before it is used
(:func:`load_train_state`: the budget, the data, a history of records no longer than the
budget, weights of the trainee's names and shapes, the optimizer's moments of their
parameters' shapes, the random generators' states): a damaged or foreign state is one
:class:`~highrank.integrations.retrofit.cache.SavedFileError` line, never a traceback, and
never taken as finished. The weights are a head's whole ``state_dict`` under ``head``
(frozen mode) or the trainable parameters of the model by name under ``trainable`` (lora /
full): the keys states were written with before the loops were one, so every retrofit folder
resumes.
"""

from __future__ import annotations

import functools
import math
import random
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from highrank.heads import OutputHead
from highrank.integrations.hf_parallel import is_sharded
from highrank.integrations.retrofit import sharded
from highrank.integrations.retrofit.cache import (
    FeatureCache,
    SavedFileError,
    check_head_fits,
    tokens_sha256,
)
from highrank.train import distributed
from highrank.train.interrupts import SignalCatcher
from highrank.train.schedule import lr_factor_from_zero
from highrank.train.state import Interrupted, TrainingError
from highrank.train.steps import backward_or_skip, clip_or_skip
from highrank.util.atomic import atomic_file
from highrank.util.checks import check_positive_int
from highrank.util.denormals import flush_denormals
from highrank.util.progress import progress_bar

# Consecutive non-finite steps a retrofit skips before it stops (the LM trainers' default of
# train.max_nonfinite_skips).
MAX_NONFINITE_STEPS = 10
STATE_KEYS = ("budget", "optimizer", "history", "rng", "python_rng")  # and the weights' key
RESTART_ADVICE = (
    "Lower --lr (now {lr:g}) and run the same command again to continue, or add --restart to "
    "train again from the warm start (the feature caches are kept)"
)
# How a state that cannot be resumed is left behind (the caches check themselves).
TRAIN_AGAIN = "add --restart to train again from the warm start (the feature caches are kept)"
HISTORY_KEYS = ("step", "loss", "lr", "seconds")


@dataclass(frozen=True)
class TrainBudget:
    """One budget for every head: ``steps`` Adam steps on batches of ``batch_tokens`` rows
    (cached tokens; whole windows in lora / full mode) drawn without replacement (a new seeded
    permutation each pass), learning rate ``lr`` with a linear warm-up over ``warmup_steps``
    then a cosine decay, gradient-norm clip ``clip`` (None: none)."""

    steps: int
    batch_tokens: int
    lr: float
    warmup_steps: int = 0
    clip: float | None = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        check_positive_int("steps", self.steps)
        check_positive_int("batch_tokens", self.batch_tokens)
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive finite number; got {self.lr!r}")
        if not (isinstance(self.warmup_steps, int) and 0 <= self.warmup_steps <= self.steps):
            raise ValueError(
                f"warmup_steps must be an int in [0, steps]; got {self.warmup_steps!r}"
            )
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"clip must be > 0 or None; got {self.clip!r}")

    def lr_factor(self, step: int) -> float:
        """Multiplier of the base lr at ``step`` (0-based): the core's
        :func:`highrank.train.schedule.lr_factor_from_zero` (its docstring says how it differs
        from the Transformer recipes' curve, and why it is kept: every recorded retrofit
        resumes bit for bit on it; tests/integrations/test_retrofit.py holds the relation)."""
        return lr_factor_from_zero(
            step, warmup_steps=self.warmup_steps, total_steps=self.steps
        )


def batch_indices(budget: TrainBudget, n_tokens: int, step: int) -> torch.Tensor:
    """Rows (of the cache, or windows) that batch ``step`` uses: a pure function of (seed,
    step), so a resumed run draws exactly the batches an uninterrupted one would."""
    if budget.batch_tokens > n_tokens:
        raise ValueError(
            f"batch_tokens={budget.batch_tokens} exceeds the {n_tokens} tokens of the cache"
        )
    per_pass = n_tokens // budget.batch_tokens
    epoch, offset = divmod(step, per_pass)
    order = torch.randperm(n_tokens, generator=torch.Generator().manual_seed(budget.seed + epoch))
    return order[offset * budget.batch_tokens : (offset + 1) * budget.batch_tokens]


# ---- what is trained ---------------------------------------------------------------------------


def _groups_with_the_heads_own(model: nn.Module, params: list, lr: float) -> list[dict]:
    """One group at ``lr``, and apart the parameters the model's head trains at a learning
    rate of its own (:meth:`OutputHead.parameter_groups`: PLIF's slopes), as in frozen mode.
    A head with none keeps one group (and the optimizer states saved before this split)."""
    head = next((m for m in model.modules() if isinstance(m, OutputHead)), None)
    own = [group for group in (head.parameter_groups(lr) if head is not None else ())
           if group.get("lr", lr) != lr]
    apart = {id(p) for group in own for p in group["params"]}
    groups = [{"params": [p for p in params if id(p) not in apart], "lr": lr}]
    for group in own:
        trained = [p for p in group["params"] if p.requires_grad]
        if trained:
            groups.append({**group, "params": trained})
    return groups


@dataclass(frozen=True)
class Trainee:
    """What one loop trains: ``module`` (in train mode during the loop, eval after), the
    optimizer's parameter ``groups`` (each with its base lr), the ``params`` whose gradient
    norm is clipped (in the order the norm sums them), and how the weights go into
    ``state.pt`` (``key``: ``head`` for a head's state_dict, ``trainable`` for a model's
    trainable parameters). A model FSDP2 sharded (``sharded``) is trained as it is (not
    wrapped in DDP) and its state gathered whole (:mod:`.sharded`)."""

    module: nn.Module
    groups: list[dict]
    params: list[torch.Tensor]
    key: str
    what: str  # for messages: "a head's" training state
    sharded: bool = False

    @classmethod
    def head(cls, head: OutputHead, lr: float) -> Trainee:
        return cls(head, head.parameter_groups(lr), list(head.parameters()), "head", "a head's")

    @classmethod
    def model(cls, model: nn.Module, lr: float) -> Trainee:
        params = [p for p in model.parameters() if p.requires_grad]
        return cls(model, _groups_with_the_heads_own(model, params, lr), params, "trainable",
                   "a model's", is_sharded(model))

    def weights(self) -> dict[str, torch.Tensor]:
        """What ``state.pt`` keeps of the weights (sharded: gathered, on process 0 only;
        every process calls it)."""
        if self.key == "head":
            return self.module.state_dict()
        if self.sharded:
            return sharded.full_weights(self.module)
        return {n: p.detach() for n, p in self.module.named_parameters() if p.requires_grad}

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """``optimizer.state_dict()`` (sharded: gathered whole, on process 0 only)."""
        if self.sharded:
            return sharded.full_optimizer_state(self.module, optimizer)
        return optimizer.state_dict()

    def load_weights(self, path: Path, saved: dict) -> None:
        try:
            if self.sharded:  # the names and (whole) shapes, without gathering
                _same_tensors(saved, {n: p for n, p in self.module.named_parameters()
                                      if p.requires_grad})
                sharded.load_full_weights(self.module, saved)
                return
            expected = self.weights()
            _same_tensors(saved, expected)
            if self.key == "head":
                self.module.load_state_dict(saved)
                return
            with torch.no_grad():
                for name, value in expected.items():
                    value.copy_(saved[name])  # a detached view of the parameter
        except (KeyError, RuntimeError) as error:
            reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
            raise SavedFileError(
                f"{path} does not fit this {'head' if self.key == 'head' else 'model'} "
                f"({type(error).__name__}: {reason}); add --restart to train again from the "
                "warm start"
            ) from None


# ---- the loop ------------------------------------------------------------------------------------


@flush_denormals()
def train_loop(
    trainee: Trainee,
    n_rows: int,
    loss_of: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    budget: TrainBudget,
    state_path: str | Path,
    *,
    checkpoint_every: int = 10,
    stop_after: int | None = None,
    progress: bool = False,
    lr_may_change: bool = False,
    catch_signals: bool = False,
    desc: str = "train",
    data: str | None = None,
) -> dict:
    """Train ``trainee`` for ``budget``: step ``s`` draws ``batch_indices(budget, n_rows, s)``
    and minimises ``loss_of(forward, those rows)``, where ``forward`` is the module to call
    (``trainee.module``, or under torchrun its DistributedDataParallel wrapper). The state is
    saved to ``state_path`` every ``checkpoint_every`` steps and at the end; an existing one is
    resumed (one trained on other ``data``, a digest of the rows, is refused). ``stop_after``
    returns after that many steps of this call (the state saved), as an interruption would.
    Returns :func:`training_summary`.

    Under torchrun (:mod:`highrank.train.distributed`) the batch is the global one: process r
    takes the r-th contiguous share of its rows (``batch_tokens`` must divide by N), DDP
    averages the gradients, the history records the loss averaged over the processes, the
    non-finite guard and a signal to any process stop all at the same step, and process 0
    writes the state, which holds every process's random generators (a resume with the same
    N continues bit for bit)."""
    check_positive_int("checkpoint_every", checkpoint_every)
    state_path = Path(state_path)
    _check_shares(budget)
    # Wrapped first: DDP starts every process from process 0's weights and processes 1..N-1
    # reseed their generators (dropout masks of their own); a saved state then restores both.
    # A model FSDP2 sharded is called as it is (its shards are alike: built alike everywhere).
    forward = distributed.distribute(trainee.module, budget.seed, wrap=not trainee.sharded)
    optimizer = torch.optim.Adam(trainee.groups, lr=budget.lr)
    base_lrs = [group["lr"] for group in optimizer.param_groups]
    history: list[dict] = []
    start = load_train_state(state_path, trainee, optimizer, budget, history, lr_may_change,
                             data=data)
    end = budget.steps if stop_after is None else min(budget.steps, start + stop_after)
    guard = NonFiniteSteps(state_path, budget.lr)
    save = functools.partial(save_train_state, state_path, trainee, optimizer, budget, history,
                             data=data)
    trainee.module.train()
    shown = progress and distributed.is_writer()
    with progress_bar(total=budget.steps, initial=start, desc=desc, unit="step",
                      disable=not shown) as bar, \
            SignalCatcher(catch_signals, once=not distributed.active()) as caught:
        for step in range(start, end):
            began = time.perf_counter()
            factor = budget.lr_factor(step)
            for group, base in zip(optimizer.param_groups, base_lrs, strict=True):
                group["lr"] = base * factor
            rows = _own_share(batch_indices(budget, n_rows, step))
            optimizer.zero_grad(set_to_none=True)
            loss = loss_of(forward, rows)
            skipped = guard.backward_and_step(loss, optimizer, trainee.params, budget.clip)
            history.append(step_record(step, _averaged(loss), base_lrs[0] * factor, began,
                                       skipped))
            bar.update(1)
            bar.set_postfix(loss=_shown_loss(history[-1]))
            if guard.exhausted:
                guard.stop(step + 1, trainee.module, save)
            number = distributed.any_rank(caught.signal)  # a signal to any process stops all
            if (step + 1) % checkpoint_every == 0 or step + 1 == end or number:
                save()
            if number:  # between two steps, the state just saved: as the core's loop
                name = signal.Signals(number).name
                raise Interrupted(name, 128 + number, state_path, step + 1)
    trainee.module.eval()
    summary = training_summary(history, budget)
    return {**summary, "sharded": "fsdp2"} if trainee.sharded else summary


def _check_shares(budget: TrainBudget) -> None:
    n = distributed.world_size()
    if budget.batch_tokens % n:
        raise ValueError(
            f"batch_tokens={budget.batch_tokens} is the global batch, split among {n} "
            f"processes: it must divide by {n}"
        )


def _own_share(rows: torch.Tensor) -> torch.Tensor:
    """This process's contiguous share of a step's rows (all of them in one process)."""
    n = distributed.world_size()
    share = rows.shape[0] // n
    return rows[distributed.rank() * share : (distributed.rank() + 1) * share]


def _averaged(loss: torch.Tensor) -> torch.Tensor:
    """The step's loss as the history records it: the mean over the processes (each process's
    loss is the mean over its equal share of the batch); ``loss`` itself in one process."""
    if not distributed.active():
        return loss
    return torch.tensor(distributed.average(loss.detach()))


def train_head(
    head: OutputHead,
    cache: FeatureCache,
    budget: TrainBudget,
    state_path: str | Path,
    *,
    checkpoint_every: int = 25,
    stop_after: int | None = None,
    progress: bool = False,
    lr_may_change: bool = False,
    catch_signals: bool = False,
) -> dict:
    """Train ``head`` on ``cache`` for ``budget`` (frozen mode: batches of cached tokens),
    saving its whole state to ``state_path`` every ``checkpoint_every`` steps and at the end;
    an existing state is resumed (a finished one is loaded and nothing is trained).
    ``stop_after`` returns after that many steps of this call (the state saved), as an
    interruption would. Returns the summary: steps done, per-step history (loss, lr, seconds)
    and the median seconds per step.

    A step whose loss or gradient norm is not finite changes nothing (its history entry has
    ``loss`` None and the reason under ``skipped``); more than :data:`MAX_NONFINITE_STEPS` in
    a row raise :class:`~highrank.train.state.TrainingError`, with the last finite state saved
    (:class:`NonFiniteSteps`). ``lr_may_change`` resumes a state saved with another ``lr``
    (the one such a stop advised to lower).

    A head that reads its context (``head.reads``: MFS, CPR) trains on whole windows of a
    sequence cache instead (``budget.batch_tokens`` counts windows, as in lora / full mode),
    each window its own context, batch first (the head's ``time_dim`` is 1, as
    ``attach_head`` builds it).
    """
    check_head_fits(head, cache)
    device = next(head.parameters()).device  # the cache lives on the CPU; the head may not

    def token_loss(forward: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        # forward(hidden, target) is head.loss(hidden, target), through DDP under torchrun
        return forward(cache.rows(rows).to(device), cache.targets[rows].to(device))

    def window_loss(forward: nn.Module, windows: torch.Tensor) -> torch.Tensor:
        hidden, inputs, targets = cache.windows(windows, device, head.reads)
        return forward(hidden, targets, **inputs)

    whole_windows = head.reads != ("hidden",)
    n_rows, loss_of = (cache.n_windows, window_loss) if whole_windows else (len(cache),
                                                                            token_loss)
    return train_loop(Trainee.head(head, budget.lr), n_rows, loss_of, budget, state_path,
                      checkpoint_every=checkpoint_every, stop_after=stop_after,
                      progress=progress, lr_may_change=lr_may_change,
                      catch_signals=catch_signals, desc="train head",
                      data=cache.meta.get("token_ids_sha256"))


def train_windows(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    budget: TrainBudget,
    state_path: str | Path,
    *,
    progress: bool = False,
    lr_may_change: bool = False,
    catch_signals: bool = False,
) -> dict:
    """Train the parameters of ``model`` (a causal LM) that require gradients end to end on
    batches of whole windows ``inputs (W, L)`` with their ``targets`` (``budget.batch_tokens``
    counts windows here), checkpointing every 10 steps; see :func:`train_loop`."""

    def loss_of(forward: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        device = next(model.parameters()).device
        return forward(input_ids=inputs[rows].to(device),
                       shift_labels=targets[rows].to(device)).loss

    return train_loop(Trainee.model(model, budget.lr), inputs.shape[0], loss_of, budget,
                      state_path, checkpoint_every=10, progress=progress,
                      lr_may_change=lr_may_change, catch_signals=catch_signals, desc="retrofit",
                      data=tokens_sha256(inputs, targets))


def step_record(step: int, loss: torch.Tensor, lr: float, started: float, skipped: str) -> dict:
    """One step's history entry: ``loss`` None (and the reason under ``skipped``) for a step
    the non-finite guard skipped, so that the history stays valid JSON."""
    record = {"step": step + 1, "loss": None if skipped else float(loss.detach()), "lr": lr,
              "seconds": time.perf_counter() - started}
    if skipped:
        record["skipped"] = skipped
    return record


def _shown_loss(record: dict) -> str:
    return "skipped" if record["loss"] is None else f"{record['loss']:.4f}"


def training_summary(history: list[dict], budget: TrainBudget) -> dict:
    """Steps done, their history and the median seconds per step, with the budget."""
    seconds = [h["seconds"] for h in history]
    return {
        "budget": asdict(budget),
        "steps_done": len(history),
        "complete": len(history) == budget.steps,
        "median_step_seconds": float(np.median(seconds)) if seconds else None,
        "history": history,
    }


# ---- the non-finite guard ------------------------------------------------------------------------


class NonFiniteSteps:
    """The LM trainers' non-finite guard (:mod:`highrank.train.steps`) for the retrofit loop:
    a step whose loss or gradient norm is NaN/inf changes nothing (no optimizer step); more
    than ``allowed`` in a row stop training with the last finite state kept, in one line
    saying what to change."""

    def __init__(self, state_path: Path, lr: float, allowed: int = MAX_NONFINITE_STEPS) -> None:
        self.state_path, self.lr, self.allowed = state_path, lr, allowed
        self.in_a_row, self.reason = 0, ""

    def backward_and_step(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer,
                          params: list[torch.Tensor], clip: float | None) -> str:
        """Backward, clip (``None``: none, the norm still checked) and step; the reason the
        step was skipped, or ``""``."""
        reason = backward_or_skip(loss, optimizer) or clip_or_skip(optimizer, params, clip or 0)
        if reason:
            self.in_a_row, self.reason = self.in_a_row + 1, reason
        else:
            optimizer.step()
            self.in_a_row = 0
        return reason

    @property
    def exhausted(self) -> bool:
        return self.in_a_row > self.allowed

    def stop(self, step: int, model: nn.Module, save) -> None:
        """Save the state (the skipped steps changed nothing, so it is the last finite one,
        unless a finite step itself produced non-finite weights: then nothing is written)
        and raise the one-line :class:`~highrank.train.state.TrainingError`."""
        if all_finite_parameters(model):
            save()
        kept = (f"{self.state_path} holds the last finite state" if self.state_path.exists()
                else "no training state was saved")
        raise TrainingError(
            f"retrofit step {step}: the {self.reason}; {self.in_a_row} consecutive steps were "
            f"non-finite, more than {self.allowed}. Those steps changed nothing and {kept}. "
            f"{RESTART_ADVICE.format(lr=self.lr)}"
        )


def all_finite_parameters(model: nn.Module) -> bool:
    """Whether every parameter and buffer of ``model`` is finite."""
    tensors = [*model.parameters(), *model.buffers()]
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


# ---- the state file ------------------------------------------------------------------------------


def save_train_state(path: Path, trainee: Trainee, optimizer, budget: TrainBudget,
                     history: list[dict], data: str | None = None) -> None:
    """``state.pt`` (see the module docstring), replaced atomically. Under torchrun every
    process calls it: their random generators are gathered (``ranks``, in rank order, with
    ``world_size``) and process 0 writes."""
    own = {"rng": torch.get_rng_state(), "python_rng": random.getstate()}
    ranks = distributed.gather_rng(own).get("ranks")  # a collective: every process is here
    weights, moments = trainee.weights(), trainee.optimizer_state(optimizer)  # sharded: too
    if not distributed.is_writer():
        return
    state = {
        "budget": asdict(budget),
        trainee.key: weights,
        "optimizer": moments,
        "history": history,
        **own,
        **({} if data is None else {"data": data}),
        **({} if ranks is None else {"ranks": ranks, "world_size": len(ranks)}),
    }
    with atomic_file(path) as handle:
        torch.save(state, handle)


def load_train_state(path: Path, trainee: Trainee, optimizer, budget: TrainBudget,
                     history: list, lr_may_change: bool = False, *,
                     data: str | None = None) -> int:
    """Steps already done (0 when there is no state); loads the weights, the optimizer and
    the random generators, and fills ``history`` in place. A state of another budget (``lr``
    aside when ``lr_may_change``) or other ``data``, with non-finite weights, or damaged in
    any part (see the module docstring) is one
    :class:`~highrank.integrations.retrofit.cache.SavedFileError`, before anything is loaded."""
    if not path.exists():
        return 0
    state = read_train_state(path, trainee.key, trainee.what)
    check_saved_budget(path, state["budget"], budget, lr_may_change)
    if data is not None and state.get("data", data) != data:
        raise SavedFileError(
            f"{path} was trained on other tokens than the training text gives now (the text "
            f"was edited, or --max-train-tokens changed); {TRAIN_AGAIN}, or give another --out"
        )
    check_history(path, state["history"], budget)
    weights = state[trainee.key]
    if not (isinstance(weights, dict) and all(torch.is_tensor(v) for v in weights.values())):
        raise SavedFileError(f"{path} holds no weights under {trainee.key!r}; {TRAIN_AGAIN}")
    check_finite_tensors(path, weights)
    generators = _own_generators(path, state)
    trainee.load_weights(path, weights)
    _load_optimizer(path, optimizer, state["optimizer"], trainee)
    try:
        if generators is not None:  # dropout masks continue as they would have
            torch.set_rng_state(generators["rng"])
            random.setstate(generators["python_rng"])
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise SavedFileError(
            f"{path} holds a random generator state that cannot be restored ("
            f"{type(error).__name__}: {_first_line(error)}); {TRAIN_AGAIN}"
        ) from None
    history.extend(state["history"])
    return len(history)


def _own_generators(path: Path, state: dict) -> dict | None:
    """The random generator states this process restores from ``state``: its own when as
    many processes wrote it (``ranks``), process 0's where the number differs (one line
    says so; the others keep their fresh streams: None), the top-level ones in one process."""
    saved_world = state.get("world_size", 1)
    ranks = state.get("ranks")
    if saved_world != 1 and not (isinstance(ranks, list) and len(ranks) == saved_world
                                 and all(isinstance(r, dict) for r in ranks)):
        raise SavedFileError(
            f"{path} holds no random generator states of its {saved_world!r} processes; "
            f"{TRAIN_AGAIN}"
        )
    distributed.note_world_size(saved_world, str(path))
    if saved_world == distributed.world_size() and ranks is not None:
        own = ranks[distributed.rank()]
    elif distributed.is_writer():
        own = state
    else:
        return None
    rng = own.get("rng")
    if not (torch.is_tensor(rng) and rng.dtype == torch.uint8 and rng.ndim == 1):
        raise SavedFileError(f"{path} holds no random generator state (rng); {TRAIN_AGAIN}")
    return own


def check_history(path: Path, history, budget: TrainBudget) -> None:
    """A state's ``history``: a list of step records (:func:`step_record`) no longer than
    the budget (a longer one was taken as finished)."""
    if not isinstance(history, list):
        raise SavedFileError(
            f"{path} holds a history of type {type(history).__name__}, not a list of steps; "
            f"{TRAIN_AGAIN}"
        )
    if len(history) > budget.steps:
        raise SavedFileError(
            f"{path} holds {len(history)} steps of history, more than the budget's "
            f"{budget.steps}: it is not this run's state; {TRAIN_AGAIN}"
        )
    for i, record in enumerate(history):
        if not (isinstance(record, dict) and all(k in record for k in HISTORY_KEYS)
                and (record["loss"] is None or _number(record["loss"]))
                and _number(record["seconds"])):
            raise SavedFileError(
                f"{path} holds a damaged history: step record {i} is not "
                f"{{{', '.join(HISTORY_KEYS)}}}; {TRAIN_AGAIN}"
            )


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _same_tensors(saved: dict, expected: dict[str, torch.Tensor]) -> None:
    """``saved`` has exactly the names of ``expected`` with their shapes (a RuntimeError
    naming the first that differs)."""
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    if missing or unexpected:
        name = (missing or unexpected)[0]
        raise RuntimeError(f"{'lacks' if missing else 'has an unknown'} {name}")
    for name, value in expected.items():
        if tuple(saved[name].shape) != tuple(value.shape):
            raise RuntimeError(f"{name} is {tuple(saved[name].shape)}, not {tuple(value.shape)}")


def _load_optimizer(path: Path, optimizer, saved, trainee: Trainee) -> None:
    """The optimizer's saved state, its Adam moments of their parameters' shapes."""
    try:
        if trainee.sharded:
            sharded.load_full_optimizer_state(trainee.module, optimizer, saved)
        else:
            optimizer.load_state_dict(saved)
        for group in optimizer.param_groups:
            for param in group["params"]:
                for key, value in optimizer.state.get(param, {}).items():
                    if key != "step" and torch.is_tensor(value) and value.shape != param.shape:
                        raise ValueError(
                            f"its {key} is {tuple(value.shape)}, its parameter "
                            f"{tuple(param.shape)}"
                        )
    except (KeyError, ValueError, TypeError, RuntimeError, IndexError, AttributeError) as error:
        raise SavedFileError(
            f"{path} holds an optimizer state that does not fit ({type(error).__name__}: "
            f"{_first_line(error)}); {TRAIN_AGAIN}"
        ) from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else ""


def read_train_state(path: Path, key: str = "head", what: str = "a head's") -> dict:
    """The saved training state at ``path``, read with ``weights_only`` (tensors, numbers,
    strings and containers only): a crafted file cannot run code when a run resumes."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # unpickling refused, truncated zip, bad CRC, ...
        reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise SavedFileError(
            f"{path} cannot be read as {what} training state ({type(error).__name__}: "
            f"{reason}); delete it to train again"
        ) from None
    missing = [k for k in (*STATE_KEYS, key) if not isinstance(state, dict) or k not in state]
    if missing:
        raise SavedFileError(
            f"{path} is not {what} training state (lacks {', '.join(missing)}); delete it to "
            "train again"
        )
    return state


def check_saved_budget(path: Path, saved: dict, budget: TrainBudget,
                       lr_may_change: bool = False) -> None:
    """Refuse a state trained with another budget (``lr`` aside when ``lr_may_change``)."""
    ignored = {"lr"} if lr_may_change else set()
    expected = {k: v for k, v in asdict(budget).items() if k not in ignored}
    if not isinstance(saved, dict):
        raise SavedFileError(
            f"{path} holds a budget of type {type(saved).__name__}, not {asdict(budget)}; "
            f"{TRAIN_AGAIN}"
        )
    if {k: v for k, v in saved.items() if k not in ignored} != expected:
        changed = sorted(k for k in {*expected, *saved} - ignored
                         if saved.get(k) != expected.get(k))
        differ = ", ".join(f"{k} {saved.get(k)!r}, not {expected.get(k)!r}" for k in changed)
        raise SavedFileError(
            f"{path} was trained with budget {saved}, not {asdict(budget)} ({differ}); "
            f"{TRAIN_AGAIN}"
        )


def check_finite_tensors(path: Path, tensors: dict) -> None:
    """Refuse saved weights holding NaN/inf (resuming them gave a NaN model and exit 0)."""
    for name, value in tensors.items():
        if torch.is_tensor(value) and value.is_floating_point() and not bool(
                torch.isfinite(value).all()):
            raise SavedFileError(
                f"{path} holds non-finite values in {name}; add --restart to train again from "
                "the warm start (the feature caches are kept)"
            )


__all__ = [
    "MAX_NONFINITE_STEPS",
    "RESTART_ADVICE",
    "NonFiniteSteps",
    "TrainBudget",
    "Trainee",
    "all_finite_parameters",
    "batch_indices",
    "check_finite_tensors",
    "check_history",
    "check_saved_budget",
    "load_train_state",
    "read_train_state",
    "save_train_state",
    "step_record",
    "train_head",
    "train_loop",
    "train_windows",
    "training_summary",
]
