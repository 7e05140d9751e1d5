"""Retrofitting a new output layer onto a frozen pretrained causal LM, on cached features.

The frozen-body protocol ("frozen mode" of ``highrank retrofit``): keep a pretrained
Transformer LM's body frozen, and train only its output layer, replaced by the layer under
study, so that every candidate head sees exactly the same hidden states. It is a cheaper
protocol of its own, not Softmax-CPR's: Chang & McCallum (2023, "Revisiting the
Architectures like Pointer Networks to Efficiently Improve the Next Word Distribution,
Summarization Factuality, and Beyond"; iesl/Softmax-CPR) fine-tune the *whole* GPT-2 with
the new head (one epoch of OpenWebText, lr 1e-5, batches of 4 x 200 tokens), which is
``highrank retrofit --mode full``. Because the body is frozen, its final hidden states (the
input of ``lm_head``: after the final norm) can be computed once and cached; every head is
then trained and evaluated on the cache alone, which is what makes the comparison affordable.

Three steps, each resumable:

1. :func:`cache_hidden_states`: read a token stream in non-overlapping windows of ``window``
   tokens (window ``i`` is ``ids[i L : i L + L]``; its targets are the same positions shifted
   by one, so position ``t`` of a window predicts ``ids[i L + t + 1]`` from the ``t + 1``
   tokens of its own window, and every token but the first is predicted exactly once). The
   hidden states go to ``features.npy`` (``(N, d)``; bfloat16 stored as its raw 16-bit
   pattern, or float32) and the targets to ``targets.npy``, both memory mapped; a killed run
   continues from the last finished batch of windows.
2. :func:`train_head`: Adam on random batches of cached tokens with a linear warm-up and a
   cosine decay (:class:`TrainBudget`): the same budget for every head. The full state
   (parameters, optimiser, step, history) is saved every few steps; a rerun continues it.
3. :func:`evaluate_head`: perplexity over a cache, optionally writing the first rows of
   its log-probability matrix to a float32 ``.npy`` for :mod:`highrank.analysis.rank`.

:func:`head_from_lm_head` builds any highrank head whose decoder E starts as a copy of the
model's ``lm_head`` (an untied copy: the model's embedding is never changed). A softmax head
built so, untrained, gives the model's own log-probabilities.

Nothing here imports ``transformers``: the model is used through ``base_model`` (the body,
whose ``last_hidden_state`` is the input of the output layer) and
``get_output_embeddings()``, which every ``transformers`` causal LM has.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from highrank.heads import OutputHead, build_head
from highrank.train.state import TrainingError
from highrank.train.steps import backward_or_skip, clip_or_skip
from highrank.util.progress import progress_bar

FEATURES_FILE = "features.npy"
TARGETS_FILE = "targets.npy"
META_FILE = "meta.json"
PROGRESS_FILE = "progress.json"
CACHE_DTYPES = {"bfloat16": np.uint16, "float32": np.float32}  # bf16 kept as its bit pattern
# Consecutive non-finite steps a retrofit skips before it stops (the LM trainers' default of
# train.max_nonfinite_skips).
MAX_NONFINITE_STEPS = 10


# ---- 1. caching the frozen body's final hidden states ------------------------------------------


class SavedFileError(ValueError):
    """A file a retrofit saved (a feature cache, the training state) cannot be read: damaged,
    or crafted (pickled objects are refused). The message names it and how to start again."""


@dataclass(frozen=True)
class FeatureCache:
    """A finished cache: ``features (N, d)`` (a read-only view of the memory map, in the
    cache's dtype) and ``targets (N,)`` (int64, in memory), plus the settings in ``meta``."""

    directory: Path
    features: torch.Tensor
    targets: torch.Tensor
    meta: dict

    def __len__(self) -> int:
        return self.targets.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.features.shape[1]

    def rows(self, index: torch.Tensor | slice) -> torch.Tensor:
        """Float32 hidden states of the cached tokens at ``index``: ``(n, d)``."""
        return self.features[index].float()


def window_tokens(token_ids: Sequence[int] | torch.Tensor, window: int) -> tuple[torch.Tensor,
                                                                                torch.Tensor]:
    """Non-overlapping windows of a token stream: ``(inputs, targets)``, both ``(W, window)``
    with ``W = (len(ids) - 1) // window``; ``targets`` are ``inputs`` shifted by one token."""
    ids = _as_token_tensor(token_ids)
    _check_positive("window", window)
    n_windows = (ids.numel() - 1) // window
    if n_windows == 0:
        raise ValueError(
            f"a stream of {ids.numel()} tokens holds no window of {window} tokens plus the "
            "target after it; give more tokens or a smaller window"
        )
    span = n_windows * window
    return ids[:span].view(n_windows, window), ids[1 : span + 1].view(n_windows, window)


def cache_hidden_states(
    model: nn.Module,
    token_ids: Sequence[int] | torch.Tensor,
    directory: str | os.PathLike,
    *,
    window: int,
    batch_windows: int = 4,
    dtype: str = "bfloat16",
    source: str = "",
    progress: bool = False,
) -> FeatureCache:
    """Cache ``model``'s final hidden states (the input of its output layer) for ``token_ids``
    read in non-overlapping windows of ``window`` tokens (see the module docstring), computed
    ``batch_windows`` windows at a time with the body frozen, under ``torch.no_grad``.

    Resumable: the settings (``window``, ``dtype``, ``source`` — e.g. the model's path — and a
    hash of the token ids) are kept in ``meta.json``; a rerun with the same settings
    continues after the last batch recorded in ``progress.json``, a rerun with other settings
    is refused (delete the folder to start again). A finished cache is just loaded.
    """
    if dtype not in CACHE_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(CACHE_DTYPES)}; got {dtype!r}")
    _check_positive("batch_windows", batch_windows)
    inputs, targets = window_tokens(token_ids, window)
    body, hidden_size = _body_and_hidden_size(model)
    directory = Path(directory)
    meta = {
        "window": window,
        "n_windows": inputs.shape[0],
        "n_tokens": inputs.numel(),
        "hidden_size": hidden_size,
        "dtype": dtype,
        "source": source,
        "token_ids_sha256": _sha256(inputs, targets),
        "rows": "window-major: row i*window + t is position t of window i",
        "context": "position t of a window sees the t + 1 tokens of its window (1..window)",
    }
    done = _start_or_resume(directory, meta, targets)
    if done is None:
        return load_cache(directory)
    features = np.lib.format.open_memmap(directory / FEATURES_FILE, mode="r+")
    was_training = model.training
    model.eval()
    try:
        _fill_features(body, inputs, features, directory, done, batch_windows, dtype, progress)
    finally:
        model.train(was_training)
    features.flush()
    del features
    _write_json(directory / PROGRESS_FILE, {"windows_done": meta["n_windows"], "complete": True})
    return load_cache(directory)


def _fill_features(body, inputs, features, directory, done, batch_windows, dtype, progress):
    """Run the body over windows ``done..W`` and write their rows, recording progress per batch."""
    n_windows, window = inputs.shape
    device = next(body.parameters()).device
    bar = progress_bar(total=n_windows, initial=done, desc=f"cache {directory.name}",
                       unit="window", disable=not progress)
    for first in range(done, n_windows, batch_windows):
        last = min(first + batch_windows, n_windows)
        with torch.no_grad():
            output = body(input_ids=inputs[first:last].to(device), use_cache=False)
        hidden = output.last_hidden_state  # (b, window, d)
        rows = hidden.reshape(-1, hidden.shape[-1]).cpu()
        if not bool(torch.isfinite(rows).all()):
            raise TrainingError(
                f"the model's final hidden states are not finite in windows {first}..{last - 1} "
                f"of {directory.name}: the body itself overflows or holds NaN weights (load it "
                "in float32?); nothing of those windows was cached"
            )
        features[first * window : last * window] = _to_storage(rows, dtype)
        features.flush()  # rows on disk before the progress record says so
        _write_json(directory / PROGRESS_FILE, {"windows_done": last, "complete": False})
        bar.update(last - first)
    bar.close()


def _start_or_resume(directory: Path, meta: dict, targets: torch.Tensor) -> int | None:
    """Windows already cached (0 for a new cache), or None when the cache is complete."""
    meta_path = directory / META_FILE
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        changed = sorted(k for k in meta if old.get(k) != meta[k])
        if changed:
            raise ValueError(
                f"{meta_path} was written with other settings ({', '.join(changed)} differ: "
                f"{ {k: old.get(k) for k in changed} } vs { {k: meta[k] for k in changed} }); "
                "delete that folder to cache again"
            )
        state = json.loads((directory / PROGRESS_FILE).read_text())
        return None if state["complete"] else int(state["windows_done"])
    directory.mkdir(parents=True, exist_ok=True)
    shape = (meta["n_tokens"], meta["hidden_size"])
    np.lib.format.open_memmap(
        directory / FEATURES_FILE, mode="w+", dtype=CACHE_DTYPES[meta["dtype"]], shape=shape
    ).flush()
    np.save(directory / TARGETS_FILE, targets.reshape(-1).numpy().astype(np.int32))
    _write_json(directory / PROGRESS_FILE, {"windows_done": 0, "complete": False})
    _write_json(meta_path, meta)  # last: a folder without meta.json is started afresh
    return 0


def load_cache(directory: str | os.PathLike) -> FeatureCache:
    """Open a finished cache written by :func:`cache_hidden_states` (features memory mapped)."""
    directory = Path(directory)
    meta_path = directory / META_FILE
    if not meta_path.exists():
        raise FileNotFoundError(f"{meta_path} not found: {directory} is not a feature cache")
    meta = json.loads(meta_path.read_text())
    state = json.loads((directory / PROGRESS_FILE).read_text())
    if not state.get("complete"):
        raise ValueError(
            f"{directory} is an unfinished cache ({state['windows_done']} of "
            f"{meta['n_windows']} windows): run cache_hidden_states again to finish it"
        )
    try:  # allow_pickle stays False: an object array is refused, not unpickled
        raw = np.load(directory / FEATURES_FILE, mmap_mode="r")
        targets = torch.from_numpy(np.load(directory / TARGETS_FILE).astype(np.int64))
    except (OSError, ValueError, EOFError) as error:
        raise SavedFileError(
            f"{directory} holds a feature cache that cannot be read ({type(error).__name__}: "
            f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}); delete that "
            "folder to cache again"
        ) from None
    with _quiet_readonly_warning():
        features = torch.from_numpy(raw)
    if meta["dtype"] == "bfloat16":
        features = features.view(torch.bfloat16)
    _check_finite_rows(directory, features)
    return FeatureCache(directory, features, targets, meta)


def _check_finite_rows(directory: Path, features: torch.Tensor, block: int = 65536) -> None:
    """Refuse a cache with a NaN/inf hidden state (it trained a NaN head silently), naming
    the first such row; one pass over the memory map, a block of rows at a time."""
    for start in range(0, features.shape[0], block):
        finite = torch.isfinite(features[start : start + block].float()).all(dim=1)
        if not bool(finite.all()):
            row = start + int((~finite).nonzero()[0])
            raise SavedFileError(
                f"{directory / FEATURES_FILE} holds a non-finite hidden state at row {row}: "
                "damaged; delete that folder to cache again"
            )


# ---- initialising a head from the model's own output layer ------------------------------------


def head_from_lm_head(model: nn.Module, name: str, **knobs) -> OutputHead:
    """A highrank head ``name`` sized for ``model``, its decoder E (and bias, when the model's
    output layer has one; zero otherwise) copied from ``model.get_output_embeddings()``.

    The copy is untied: training the head never changes the model's input embedding, which
    ``lm_head`` shares in tied models such as SmolLM2. With ``name="softmax"`` and no knobs
    the untrained head computes exactly the model's own log-probabilities.
    """
    decoder = _output_layer(model)
    head = build_head(name, d_in=decoder.in_features, vocab_size=decoder.out_features, **knobs)
    with torch.no_grad():
        head.weight.copy_(decoder.weight)
        head.bias.copy_(decoder.bias if decoder.bias is not None else 0.0)
    return head


# ---- 2. training a head on cached features with a fixed budget --------------------------------


@dataclass(frozen=True)
class TrainBudget:
    """One budget for every head: ``steps`` Adam steps on batches of ``batch_tokens`` cached
    tokens drawn without replacement (a new seeded permutation each pass over the cache),
    learning rate ``lr`` with a linear warm-up over ``warmup_steps`` then a cosine decay to 0,
    gradient-norm clip ``clip`` (None: none)."""

    steps: int
    batch_tokens: int
    lr: float
    warmup_steps: int = 0
    clip: float | None = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        _check_positive("steps", self.steps)
        _check_positive("batch_tokens", self.batch_tokens)
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive finite number; got {self.lr!r}")
        if not (isinstance(self.warmup_steps, int) and 0 <= self.warmup_steps <= self.steps):
            raise ValueError(
                f"warmup_steps must be an int in [0, steps]; got {self.warmup_steps!r}"
            )
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"clip must be > 0 or None; got {self.clip!r}")

    def lr_factor(self, step: int) -> float:
        """Multiplier of the base lr at ``step`` (0-based)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        decay_steps = max(1, self.steps - self.warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * (step - self.warmup_steps) / decay_steps))


def batch_indices(budget: TrainBudget, n_tokens: int, step: int) -> torch.Tensor:
    """Rows of the cache that batch ``step`` uses: a pure function of (seed, step), so a
    resumed run draws exactly the batches an uninterrupted one would."""
    if budget.batch_tokens > n_tokens:
        raise ValueError(
            f"batch_tokens={budget.batch_tokens} exceeds the {n_tokens} tokens of the cache"
        )
    per_pass = n_tokens // budget.batch_tokens
    epoch, offset = divmod(step, per_pass)
    order = torch.randperm(n_tokens, generator=torch.Generator().manual_seed(budget.seed + epoch))
    return order[offset * budget.batch_tokens : (offset + 1) * budget.batch_tokens]


def train_head(
    head: OutputHead,
    cache: FeatureCache,
    budget: TrainBudget,
    state_path: str | os.PathLike,
    *,
    checkpoint_every: int = 25,
    stop_after: int | None = None,
    progress: bool = False,
    lr_may_change: bool = False,
) -> dict:
    """Train ``head`` on ``cache`` for ``budget``, saving its whole state to ``state_path``
    every ``checkpoint_every`` steps and at the end; an existing state is resumed (a finished
    one is loaded and nothing is trained). ``stop_after`` returns after that many steps of
    this call (the state saved), as an interruption would. Returns the summary: steps done,
    per-step history (loss, lr, seconds) and the median seconds per step.

    A step whose loss or gradient norm is not finite changes nothing (its history entry has
    ``loss`` None and the reason under ``skipped``); more than :data:`MAX_NONFINITE_STEPS` in
    a row raise :class:`~highrank.train.state.TrainingError`, with the last finite state saved
    (:class:`NonFiniteSteps`). ``lr_may_change`` resumes a state saved with another ``lr``
    (the one such a stop advised to lower).
    """
    _check_head_fits(head, cache)
    _check_positive("checkpoint_every", checkpoint_every)
    state_path = Path(state_path)
    optimizer = torch.optim.Adam(head.parameter_groups(budget.lr))
    base_lrs = [group["lr"] for group in optimizer.param_groups]
    history: list[dict] = []
    start = _load_train_state(state_path, head, optimizer, budget, history, lr_may_change)
    end = budget.steps if stop_after is None else min(budget.steps, start + stop_after)
    guard = NonFiniteSteps(state_path, budget.lr)
    save = functools.partial(_save_train_state, state_path, head, optimizer, budget, history)
    head.train()
    with progress_bar(total=budget.steps, initial=start, desc="train head", unit="step",
                      disable=not progress) as bar:
        for step in range(start, end):
            history.append(_train_step(head, cache, budget, optimizer, base_lrs, step, guard))
            bar.update(1)
            bar.set_postfix(loss=_shown_loss(history[-1]))
            if guard.exhausted:
                guard.stop(step + 1, head, save)
            if (step + 1) % checkpoint_every == 0 or step + 1 == end:
                save()
    head.eval()
    return training_summary(history, budget)


def _train_step(head, cache, budget, optimizer, base_lrs, step, guard) -> dict:
    started = time.perf_counter()
    for group, base in zip(optimizer.param_groups, base_lrs, strict=True):
        group["lr"] = base * budget.lr_factor(step)
    rows = batch_indices(budget, len(cache), step)
    device = next(head.parameters()).device  # the cache lives on the CPU; the head may not
    hidden, target = cache.rows(rows).to(device), cache.targets[rows].to(device)
    optimizer.zero_grad(set_to_none=True)
    loss = head.loss(hidden, target)
    skipped = guard.backward_and_step(loss, optimizer, list(head.parameters()), budget.clip)
    return step_record(step, loss, base_lrs[0] * budget.lr_factor(step), started, skipped)


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


class NonFiniteSteps:
    """The LM trainers' non-finite guard (:mod:`highrank.train.steps`) for a retrofit loop: a
    step whose loss or gradient norm is NaN/inf changes nothing (no optimizer step); more than
    ``allowed`` in a row stop training with the last finite state kept, in one line saying
    what to change."""

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


RESTART_ADVICE = (
    "Lower --lr (now {lr:g}) and run the same command again to continue, or add --restart to "
    "train again from the warm start (the feature caches are kept)"
)


def all_finite_parameters(model: nn.Module) -> bool:
    """Whether every parameter and buffer of ``model`` is finite."""
    tensors = [*model.parameters(), *model.buffers()]
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


def finite_perplexity(nll_per_token: float) -> float:
    """``exp(nll)``, ``inf`` where that overflows a float (a diverged head's 2e20 nats)."""
    return math.exp(nll_per_token) if nll_per_token < 709.0 else math.inf


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


def _save_train_state(path: Path, head, optimizer, budget, history) -> None:
    state = {
        "budget": asdict(budget),
        "head": head.state_dict(),
        "optimizer": optimizer.state_dict(),
        "history": history,
        "rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.partial")
    torch.save(state, temporary)
    os.replace(temporary, path)


def _load_train_state(path: Path, head, optimizer, budget, history: list,
                      lr_may_change: bool = False) -> int:
    """Steps already done (0 when there is no state); fills ``history`` in place."""
    if not path.exists():
        return 0
    state = _read_train_state(path)
    check_saved_budget(path, state["budget"], budget, lr_may_change)
    check_finite_tensors(path, state["head"])
    head.load_state_dict(state["head"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])  # dropout masks continue as they would have
    random.setstate(state["python_rng"])
    history.extend(state["history"])
    return len(history)


def _read_train_state(path: Path) -> dict:
    """The saved training state at ``path``, read with ``weights_only`` (tensors, numbers,
    strings and containers only): a crafted file cannot run code when a run resumes."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # unpickling refused, truncated zip, bad CRC, ...
        reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise SavedFileError(
            f"{path} cannot be read as a head's training state ({type(error).__name__}: "
            f"{reason}); delete it to train again"
        ) from None
    missing = [key for key in _TRAIN_STATE_KEYS if not isinstance(state, dict) or key not in state]
    if missing:
        raise SavedFileError(
            f"{path} is not a head's training state (lacks {', '.join(missing)}); delete it to "
            "train again"
        )
    return state


_TRAIN_STATE_KEYS = ("budget", "head", "optimizer", "history", "rng", "python_rng")


def check_saved_budget(path: Path, saved: dict, budget: TrainBudget,
                       lr_may_change: bool = False) -> None:
    """Refuse a state trained with another budget (``lr`` aside when ``lr_may_change``)."""
    ignored = {"lr"} if lr_may_change else set()
    expected = {k: v for k, v in asdict(budget).items() if k not in ignored}
    if not isinstance(saved, dict) or {k: v for k, v in saved.items()
                                       if k not in ignored} != expected:
        raise SavedFileError(
            f"{path} was trained with budget {saved}, not {asdict(budget)}; delete it or add "
            "--restart to train again"
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


# ---- 3. evaluation ------------------------------------------------------------------------------


def evaluate_head(
    head: OutputHead,
    cache: FeatureCache,
    *,
    block_tokens: int = 512,
    matrix_path: str | os.PathLike | None = None,
    matrix_rows: int | None = None,
    reference: OutputHead | None = None,
) -> dict:
    """Perplexity ``exp(total NLL / N)`` of ``head`` over every token of ``cache`` (eval mode,
    no autograd, float32). With ``matrix_path`` the log-probabilities of the first
    ``matrix_rows`` tokens (all when None) are written there as a float32 ``(rows, V)``
    ``.npy``, from the same forward pass, for the rank instruments. With a ``reference`` head
    (e.g. the base model's own), ``kl_from_reference`` is the mean over the tokens of
    KL(p_reference || p_head) in nats: how far ``head`` has moved from it."""
    from highrank.analysis.logprob_matrix import write_matrix

    _check_head_fits(head, cache)
    _check_positive("block_tokens", block_tokens)
    rows = len(cache) if matrix_rows is None else matrix_rows
    if matrix_path is not None and not 0 < rows <= len(cache):
        raise ValueError(f"matrix_rows must lie in 1..{len(cache)}; got {matrix_rows!r}")
    totals = {"nll": 0.0, "seconds": 0.0, "kl": 0.0}

    def matrix_blocks() -> Iterator[torch.Tensor]:
        for start, log_probs in blocks:
            if start < rows:
                yield log_probs[: rows - start]

    modes = [(module, module.training) for module in (head, reference) if module is not None]
    for module, _ in modes:
        module.eval()
    try:
        blocks = _log_prob_blocks(head, cache, block_tokens, totals, reference)
        if matrix_path is None:
            for _ in blocks:
                pass
        else:
            write_matrix(matrix_path, matrix_blocks(), (rows, head.vocab_size))
            for _ in blocks:  # the tokens after the matrix's rows still count
                pass
    finally:
        for module, mode in modes:
            module.train(mode)
    n = len(cache)
    return {
        "tokens": n,
        "nll_per_token": totals["nll"] / n,
        "perplexity": finite_perplexity(totals["nll"] / n),
        "kl_from_reference": totals["kl"] / n if reference is not None else None,
        "seconds": totals["seconds"],
        "matrix_rows": rows if matrix_path is not None else None,
    }


def _log_prob_blocks(
    head, cache, block_tokens, totals, reference=None
) -> Iterator[tuple[int, torch.Tensor]]:
    """``(start, log_probs (b, V))`` per block of cached tokens; adds the NLL (and the KL from
    ``reference``) to ``totals``."""
    for start in range(0, len(cache), block_tokens):
        began = time.perf_counter()
        stop = min(start + block_tokens, len(cache))
        hidden = cache.rows(slice(start, stop)).to(next(head.parameters()).device)
        with torch.no_grad():
            log_probs = head.log_prob(hidden).float()
            if reference is not None:
                base = reference.log_prob(hidden).float()
                totals["kl"] += float((base.exp() * (base - log_probs)).sum().double())
        target = cache.targets[start:stop].to(log_probs.device)
        totals["nll"] -= float(log_probs.gather(1, target.unsqueeze(1)).double().sum())
        totals["seconds"] += time.perf_counter() - began
        yield start, log_probs.cpu()


# ---- helpers ----------------------------------------------------------------------------------


def _output_layer(model: nn.Module) -> nn.Linear:
    get = getattr(model, "get_output_embeddings", None)
    decoder = get() if callable(get) else None
    if not isinstance(decoder, nn.Linear):
        raise TypeError(
            f"{type(model).__name__} has no linear output layer (get_output_embeddings() gave "
            f"{type(decoder).__name__}); expected a transformers causal LM with an lm_head"
        )
    return decoder


def _body_and_hidden_size(model: nn.Module) -> tuple[nn.Module, int]:
    """The body whose ``last_hidden_state`` feeds the output layer, and its width."""
    decoder = _output_layer(model)
    body = getattr(model, "base_model", None)
    if body is None or body is model:
        raise TypeError(
            f"{type(model).__name__} has no separate base_model (body); expected a "
            "transformers causal LM such as LlamaForCausalLM"
        )
    return body, decoder.in_features


def _check_head_fits(head: OutputHead, cache: FeatureCache) -> None:
    if head.d_in != cache.hidden_size:
        raise ValueError(
            f"the head takes d_in={head.d_in} but {cache.directory} holds hidden states of "
            f"size {cache.hidden_size}"
        )
    top = int(cache.targets.max())
    if top >= head.vocab_size:
        raise ValueError(
            f"{cache.directory} has target id {top}, outside the head's vocabulary of "
            f"{head.vocab_size}"
        )


def _to_storage(rows: torch.Tensor, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return rows.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return rows.float().numpy()


def _as_token_tensor(token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    ids = torch.as_tensor(token_ids)
    if ids.ndim != 1 or ids.dtype in (torch.float16, torch.bfloat16, torch.float32,
                                      torch.float64, torch.bool):
        raise ValueError(
            f"token_ids must be a 1-D sequence of integer ids; got {ids.dtype} of shape "
            f"{tuple(ids.shape)}"
        )
    if ids.numel() and int(ids.min()) < 0:
        raise ValueError(f"token_ids hold a negative id ({int(ids.min())})")
    return ids.long()


def _sha256(*tensors: torch.Tensor) -> str:
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.numpy().astype(np.int64).tobytes())
    return digest.hexdigest()


def _check_positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int; got {value!r}")
    return value


def _write_json(path: Path, payload: dict) -> None:
    temporary = path.with_name(f".{path.name}.partial")
    temporary.write_text(json.dumps(payload, indent=1))
    os.replace(temporary, path)


class _quiet_readonly_warning:
    """torch warns that a read-only memory map is not writable; the cache is only read."""

    def __enter__(self):
        import warnings

        self._context = warnings.catch_warnings()
        self._context.__enter__()
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

    def __exit__(self, *exc):
        return self._context.__exit__(*exc)
