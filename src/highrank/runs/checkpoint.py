"""Checkpoints that lose nothing: atomic writes, ``weights_only`` loading, exact resume.

A checkpoint is one ``torch.save`` file holding only tensors, dicts, lists, numbers, strings
and None, so ``torch.load(path, weights_only=True)`` reads it (no pickled classes, no numpy)::

    {
      "format": "highrank-checkpoint", "version": 1,
      "kind": "last" | "best" | "finetune-last" | "finetuned",
      "stage": "train" | "finetune",
      "run_id": str,                           # the run directory's id (environment.json);
                                               # absent in checkpoints of older runs
      "config": {section: {key: value}},       # highrank.config.config_to_dict (None = unset)
      "vocab_size": int,
      "model": {name: tensor},                 # the weights to evaluate: the ASGD averages
                                               # after the switch (Merity et al., 2018, Sec. 3)
      "training": {                            # everything a resumed run needs
        "model": {name: tensor},               # the raw iterates being optimised (before the
                                               # switch the same tensors as "model": stored once)
        ...recipe.state_dict(),                # the training recipe's own keys; AWD-LSTM:
          "optimizer": optimizer.state_dict(), #   SGD, or ASGD with its averages "ax"
          "phase": "sgd" | "asgd",
          "trigger": trigger.state_dict(),     #   NT-ASGD history / ET-ASGD epoch count
          "hidden": [[h, c], ...],             #   recurrent state, each (1, B, H_layer)
        "rng": {"python", "numpy", "torch", "cuda", + the recipe's generators (AWD: "bptt")},
        "progress": {...},                     # epoch, position in the epoch, step,
                                               # best validation loss, skip and metric counters
        "metrics_offset": int,                 # bytes of metrics.jsonl written at this point
        "metrics_lines": int,                  # this stage's lines of it (newer checkpoints)
      },
    }

The loop (:mod:`highrank.train.loop`) writes everything but the recipe's keys; the recipes
(:mod:`highrank.train.recipe`) own theirs. Runs written before training became a loop plus
recipes have exactly this layout (tests/fixtures/run-v1).

Writing (:func:`save_checkpoint`, with the pieces of :mod:`highrank.util.atomic`) goes to a
temporary file in the same directory, is flushed and fsynced, replaces the target with
``os.replace`` and then fsyncs the directory, so a crash leaves either the old or the new
file, never a partial one. A sha256 of the contents is stored
under ``"digest"`` and checked on load. With ``keep_previous`` the file
being replaced is kept as ``<name>.prev.pt``. A checkpoint with a NaN or inf in any floating
tensor is refused (:class:`NonFiniteCheckpointError`): the previous file stays.

Reading (:func:`load_checkpoint`) turns a missing, truncated or corrupted file into a
:class:`CheckpointError` naming the file; :func:`load_resumable` falls back from ``last.pt`` to
``last.prev.pt`` and then ``best.pt`` with a warning.

For the evaluation verbs, :func:`read_run` reads a run directory's checkpoint (``which``:
``"best"``, ``"last"``, ``"finetuned"`` or a path to a ``.pt`` file), its config and the run's
``vocab.json``, checked against each other; :func:`highrank.models.load_run` builds the model
from them (this package imports no model).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import warnings
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from highrank.config import Config, ConfigError, config_from_dict, config_to_dict, load_config
from highrank.data import Vocab
from highrank.util.atomic import fsync_directory, sync, temporary_beside
from highrank.util.paths import is_retrofit_output, retrofit_output_note, run_dir_problem

FORMAT = "highrank-checkpoint"
VERSION = 1
CHECKPOINT_DIR = "checkpoints"
VOCAB_FILE = "vocab.json"
CONFIG_FILE = "config.toml"
ENVIRONMENT_FILE = "environment.json"
# ``load_run``'s short names -> file names under ``<run>/checkpoints``.
CHECKPOINT_FILES = {
    "best": "best.pt",
    "last": "last.pt",
    "finetuned": "finetuned.pt",
    "finetune-last": "finetune-last.pt",
}
REQUIRED_KEYS = ("format", "version", "kind", "config", "vocab_size", "model")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message names the file and what to do."""


class NonFiniteCheckpointError(CheckpointError):
    """Refused to write a checkpoint holding NaN or inf values."""


# ---- writing ----------------------------------------------------------------------------------


def previous_path(path: str | os.PathLike) -> Path:
    """``last.pt`` -> ``last.prev.pt``: where :func:`save_checkpoint` keeps the replaced file."""
    path = Path(path)
    return path.with_name(f"{path.stem}.prev{path.suffix}")


def save_checkpoint(
    payload: Mapping[str, Any], path: str | os.PathLike, *, keep_previous: bool = False
) -> None:
    """Write ``payload`` to ``path`` atomically (temp file, fsync, rename, fsync the folder).

    With ``keep_previous`` an existing complete ``path`` is first renamed to
    :func:`previous_path`. Raises :class:`NonFiniteCheckpointError` (writing nothing) when a
    floating tensor holds NaN or inf.
    """
    path = Path(path)
    check_finite(payload, path)
    payload = {**payload, "digest": content_digest(payload)}
    handle, tmp = temporary_beside(path)
    try:
        with handle:
            torch.save(payload, handle)
            sync(handle)
        # A torch.save file is a zip: a file without a readable zip directory is no "good" one.
        if keep_previous and path.is_file() and zipfile.is_zipfile(path):
            os.replace(path, previous_path(path))
        os.replace(tmp, path)
    except (OSError, RuntimeError) as error:  # disk full, quota, I/O error (torch: RuntimeError)
        tmp.unlink(missing_ok=True)
        reason = getattr(error, "strerror", None) or str(error).strip().splitlines()[0]
        raise CheckpointError(
            f"cannot write checkpoint {path}: {reason}; nothing was replaced (the previous "
            "checkpoint is intact): free space, then resume from it"
        ) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def check_finite(payload: Mapping[str, Any], path: str | os.PathLike) -> None:
    """Raise :class:`NonFiniteCheckpointError` naming the first tensor with a NaN or inf."""
    for where, tensor in _floating_tensors(payload, ""):
        bad = int((~torch.isfinite(tensor)).sum())
        if bad:
            raise NonFiniteCheckpointError(
                f"refusing to write checkpoint {path}: {where} holds {bad} non-finite value(s) "
                f"(NaN/inf) of {tensor.numel()}; the weights have diverged, so the previous "
                f"checkpoint is kept. Resume from it with a lower learning rate (train.lr) or "
                f"a tighter gradient clip (train.clip)"
            )


def _floating_tensors(value: Any, where: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(path like ``model['head.bias']``, tensor) for every floating tensor in ``value``."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex():
            yield where, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _floating_tensors(item, f"{where}[{key!r}]" if where else str(key))
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from _floating_tensors(item, f"{where}[{index}]")


def content_digest(payload: Mapping[str, Any]) -> str:
    """sha256 over every key path, value and tensor byte of ``payload`` (but its "digest").

    Stored in the file and checked on load: torch's zip reader does not verify its CRCs, so a
    flipped byte inside a tensor would otherwise load silently.
    """
    digest = hashlib.sha256()
    for where, value in _leaves({k: v for k, v in payload.items() if k != "digest"}, ""):
        digest.update(where.encode())
        if isinstance(value, torch.Tensor):
            flat = value.detach().cpu().contiguous().reshape(-1)
            digest.update(f"{flat.dtype}{tuple(value.shape)}".encode())
            digest.update(flat.view(torch.uint8).numpy().tobytes())
        else:
            digest.update(repr(value).encode())
    return digest.hexdigest()


def _leaves(value: Any, where: str) -> Iterator[tuple[str, Any]]:
    """(key path, value) for every non-container value, in order."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from _leaves(item, f"{where}[{key!r}]")
    elif isinstance(value, list | tuple):
        yield where, type(value).__name__  # a list and a tuple differ
        for index, item in enumerate(value):
            yield from _leaves(item, f"{where}[{index}]")
    else:
        yield where, value


# ---- reading ----------------------------------------------------------------------------------


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """The payload of the checkpoint at ``path``, loaded onto the CPU with ``weights_only``.

    A missing, truncated, corrupted or foreign file is a :class:`CheckpointError` naming it.
    """
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(
            f"checkpoint {path} is a directory, not a checkpoint file; move it out of the way"
        )
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # truncated zip, bad CRC, unpickling error, ...
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(
            f"checkpoint {path} cannot be read: the file is truncated or corrupted "
            f"({type(error).__name__}: {reason}); use another checkpoint of the run "
            f"(last.prev.pt, best.pt) or restart"
        ) from None
    _check_payload(payload, path)
    if "digest" in payload and payload["digest"] != content_digest(payload):
        raise CheckpointError(
            f"checkpoint {path} is corrupted: its contents do not match the checksum written "
            f"with them; use another checkpoint of the run (last.prev.pt, best.pt) or restart"
        )
    return payload


def _check_payload(payload: Any, path: Path) -> None:
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} is not a highrank checkpoint (expected a dict with format {FORMAT!r})"
        )
    missing = [key for key in REQUIRED_KEYS if key not in payload]
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks the key(s) {', '.join(missing)}")
    if payload["version"] > VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format version {payload['version']}, newer than this "
            f"highrank reads ({VERSION}); upgrade highrank"
        )


def load_resumable(
    directory: str | os.PathLike, names: Sequence[str] = ("last.pt", "last.prev.pt", "best.pt")
) -> tuple[dict[str, Any], Path]:
    """The first readable checkpoint with training state among ``directory/<names>``.

    Each file skipped because it is missing, unreadable or has no training state is reported
    with a warning once a later one loads; if none loads, a :class:`CheckpointError` lists why
    each failed.
    """
    directory = Path(directory)
    problems: list[str] = []
    for name in names:
        path = directory / name
        try:
            payload = load_checkpoint(path)
        except CheckpointError as error:
            problems.append(str(error))
            continue
        if "training" not in payload:
            problems.append(f"checkpoint {path} holds weights only, no training state")
            continue
        if problems:
            warnings.warn(
                f"resuming from {path} instead: " + "; ".join(problems), RuntimeWarning, 2
            )
        return payload, path
    raise CheckpointError(f"no checkpoint to resume from in {directory}: " + "; ".join(problems))


# ---- random number generators -----------------------------------------------------------------


def capture_rng(bptt_generator: torch.Generator | None = None) -> dict[str, Any]:
    """Every RNG state a training run draws from, as tensors, lists and numbers."""
    version, internal, gauss_next = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": {
            "version": version,
            "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
        "numpy": {
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    if bptt_generator is not None:
        state["bptt"] = bptt_generator.get_state()
    return state


def restore_rng(state: Mapping[str, Any], bptt_generator: torch.Generator | None = None) -> None:
    """Inverse of :func:`capture_rng`."""
    python = state["python"]
    internal = tuple(int(v) for v in python["internal"].tolist())
    random.setstate((python["version"], internal, python["gauss_next"]))
    numpy = state["numpy"]
    keys = numpy["keys"].numpy().astype(np.uint32)
    np.random.set_state(
        ("MT19937", keys, numpy["pos"], numpy["has_gauss"], numpy["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    _restore_cuda_rng(state["cuda"])
    if bptt_generator is not None:
        bptt_generator.set_state(state["bptt"])


def _restore_cuda_rng(states: list[torch.Tensor]) -> None:
    if not states:
        return
    if not torch.cuda.is_available() or torch.cuda.device_count() != len(states):
        warnings.warn(
            f"the checkpoint holds CUDA RNG states for {len(states)} device(s) but this machine "
            f"has {torch.cuda.device_count() if torch.cuda.is_available() else 0}; CUDA "
            "dropout masks will differ from the interrupted run",
            RuntimeWarning,
            3,
        )
        return
    torch.cuda.set_rng_state_all(states)


# ---- model weights ----------------------------------------------------------------------------


def evaluation_state_dict(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every parameter that has an ASGD average ``ax`` replaced by
    that average (the very tensor, so ``torch.save`` stores it once with the optimizer state).

    Before the switch (no ``ax`` anywhere) this is the plain state dict.
    """
    state = model.state_dict()
    if optimizer is None:
        return state
    averages = {
        id(p): optimizer.state[p]["ax"]
        for group in optimizer.param_groups
        for p in group["params"]
        if "ax" in optimizer.state.get(p, {})
    }
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in averages:
            state[name] = averages[id(param)]
    return state


def checkpoint_path(run_dir: str | os.PathLike, which: str) -> Path:
    """``run_dir/checkpoints/<file>`` for a short name of :data:`CHECKPOINT_FILES`, or
    ``which`` itself when it names a ``.pt`` file."""
    if which in CHECKPOINT_FILES:
        return Path(run_dir) / CHECKPOINT_DIR / CHECKPOINT_FILES[which]
    if which.endswith(".pt"):
        return Path(which)
    raise CheckpointError(
        f"which={which!r} names no checkpoint; expected one of "
        f"{', '.join(CHECKPOINT_FILES)} or a path to a .pt file"
    )


def config_of(payload: Mapping[str, Any], path: str | os.PathLike) -> Config:
    """The validated :class:`Config` stored in a checkpoint."""
    return config_from_dict(payload["config"], source=f"{path} (stored config)")


def missing_best_hint(run_dir: str | os.PathLike) -> str:
    """What every verb (eval, dynamic-eval, finetune, analyze) says when ``run_dir`` has no
    ``best.pt``: one helper, one wording."""
    path = Path(run_dir) / CHECKPOINT_DIR / CHECKPOINT_FILES["best"]
    if is_retrofit_output(run_dir):
        return retrofit_output_note(run_dir)
    if (Path(run_dir) / CHECKPOINT_DIR / CHECKPOINT_FILES["last"]).is_file():
        return (
            f"checkpoint {path} does not exist: best.pt is written at the end of an epoch, and "
            f"this run stopped before one (e.g. --max-steps); pass --which last, or train "
            f"further with `highrank train --resume {run_dir}`"
        )
    return f"checkpoint {path} does not exist: the run has saved no checkpoint yet"


def read_run(
    run_dir: str | os.PathLike, which: str = "best", *, own_config: Config | None = None
) -> RunState:
    """What a run directory's checkpoint ``which`` holds, checked, but the model itself:
    :func:`highrank.models.load_run` builds that (this package knows no model).

    Args:
        run_dir: a directory written by ``highrank train``.
        which: ``"best"`` (lowest validation loss; averaged weights after the ASGD switch),
            ``"last"``, ``"finetuned"`` (best of ``highrank finetune``), ``"finetune-last"``,
            or a path to a ``.pt`` file.
        own_config: the run's ``config.toml`` when the caller has read it already (it is then
            not read again); read here when None.

    A missing run, checkpoint or vocabulary, or a vocabulary of another run, is a
    :class:`CheckpointError` saying what to do.
    """
    problem = run_dir_problem(run_dir)  # missing, or a file: each says which
    if problem:
        raise CheckpointError(problem)
    path = checkpoint_path(run_dir, which)  # missing: what to do; a folder: load_checkpoint says
    if which == "best" and not path.exists():
        raise CheckpointError(missing_best_hint(run_dir))
    if which == "finetuned" and not path.exists():
        raise CheckpointError(
            f"checkpoint {path} does not exist: run `highrank finetune {run_dir}` first, or "
            "finetuning never improved on best.pt (then use which='best')"
        )
    payload = load_checkpoint(path)
    if Path(run_dir).resolve() in path.resolve().parents:  # a file of the run: it must be its own
        check_own_checkpoint(run_dir, payload, path, own_config=own_config)
    else:  # a .pt named from elsewhere: not another run's, whose figures would be filed here
        check_run_id(run_dir, payload, path)
    config = config_of(payload, path)
    vocab = Vocab.load(Path(run_dir) / VOCAB_FILE)
    if len(vocab) != payload["vocab_size"]:
        raise CheckpointError(
            f"{Path(run_dir) / VOCAB_FILE} has {len(vocab)} tokens but checkpoint {path} was "
            f"trained with {payload['vocab_size']}; the files are from different runs"
        )
    return RunState(payload, config, vocab, path)


def check_own_checkpoint(
    run_dir: str | os.PathLike,
    payload: Mapping[str, Any],
    path: Path,
    *,
    own_config: Config | None = None,
) -> None:
    """Refuse a checkpoint of another run: its ``run_id`` differs from the run directory's
    (environment.json), or (checkpoints without an id) its model differs from the one
    config.toml describes (``own_config`` when the caller read it already). Resume, finetune,
    eval and every analysis read a run through it."""
    run_dir = Path(run_dir)
    check_run_id(run_dir, payload, path)
    try:
        stored = config_to_dict(config_of(payload, path))
        if own_config is None:
            own_config = load_config(run_dir / CONFIG_FILE)
        own = config_to_dict(own_config)
    except (ConfigError, CheckpointError, OSError):
        return  # an old config the schema no longer reads: the weights check still applies
    for section in ("model", "head"):
        if stored[section] != own[section]:
            raise CheckpointError(
                f"checkpoint {path} holds a different [{section}] from {run_dir / CONFIG_FILE} "
                f"({stored[section]} vs {own[section]}): it belongs to another run"
            )


def check_run_id(run_dir: str | os.PathLike, payload: Mapping[str, Any], path: Path) -> None:
    """Refuse a checkpoint whose ``run_id`` is another run's (both ids known)."""
    run_dir = Path(run_dir)
    ours, theirs = _run_id(run_dir), payload.get("run_id")
    if ours is not None and theirs is not None and ours != theirs:
        raise CheckpointError(
            f"checkpoint {path} belongs to another run (run id {theirs}, this run's is {ours} "
            f"in {run_dir / ENVIRONMENT_FILE}); put this run's own checkpoint back, or "
            "use the run it came from"
        )


def _run_id(run_dir: Path) -> str | None:
    try:
        record = json.loads((run_dir / ENVIRONMENT_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record.get("run_id") if isinstance(record, dict) else None


class RunState(NamedTuple):
    """:func:`read_run`'s result: a checkpoint's payload, its config, the run's vocabulary
    and the checkpoint file."""

    payload: dict[str, Any]
    config: Config
    vocab: Vocab
    path: Path


def load_weights(model: torch.nn.Module, state: Mapping[str, torch.Tensor], path: Any) -> None:
    """``model.load_state_dict(state)``, a mismatch reported with the checkpoint's name."""
    try:
        model.load_state_dict(state)
    except RuntimeError as error:
        raise CheckpointError(
            f"checkpoint {path} does not fit the model its config describes: {error}"
        ) from None


__all__ = [
    "CHECKPOINT_DIR",
    "CHECKPOINT_FILES",
    "FORMAT",
    "VERSION",
    "CheckpointError",
    "NonFiniteCheckpointError",
    "capture_rng",
    "check_finite",
    "checkpoint_path",
    "config_of",
    "evaluation_state_dict",
    "load_checkpoint",
    "load_resumable",
    "RunState",
    "load_weights",
    "missing_best_hint",
    "previous_path",
    "read_run",
    "restore_rng",
    "save_checkpoint",
]
