"""The frozen body's final hidden states (the input of its output layer), cached once.

:func:`cache_hidden_states` reads a token stream in non-overlapping windows of ``window``
tokens (:func:`highrank.causal_lm.window_tokens`: window ``i`` is ``ids[i L : i L + L]``, its
targets the same positions shifted by one, so every token but the first is predicted exactly
once, from the ``t + 1`` tokens of its own window). The hidden states go to ``features.npy``
(``(N, d)``; bfloat16 stored as its raw 16-bit pattern, or float32) and the targets to
``targets.npy``, both memory mapped; ``meta.json`` holds the settings and ``progress.json`` the
windows done, so a killed run continues from the last finished batch of windows.
:func:`load_cache` opens a finished cache (:class:`FeatureCache`).

:func:`head_from_lm_head` builds any highrank head whose decoder E starts as a copy of the
model's ``lm_head`` (an untied copy: the model's embedding is never changed). A softmax head
built so, untrained, gives the model's own log-probabilities.

Nothing here imports ``transformers``: the model is used through ``base_model`` (the body,
whose ``last_hidden_state`` is the input of the output layer) and
``get_output_embeddings()``, which every ``transformers`` causal LM has.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from highrank.causal_lm import window_tokens
from highrank.heads import OutputHead, build_head
from highrank.train.state import TrainingError
from highrank.util.atomic import write_json
from highrank.util.checks import check_positive_int
from highrank.util.progress import progress_bar

FEATURES_FILE = "features.npy"
TARGETS_FILE = "targets.npy"
META_FILE = "meta.json"
PROGRESS_FILE = "progress.json"
CACHE_DTYPES = {"bfloat16": np.uint16, "float32": np.float32}  # bf16 kept as its bit pattern


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
    check_positive_int("batch_windows", batch_windows)
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
    write_json(directory / PROGRESS_FILE, {"windows_done": meta["n_windows"], "complete": True})
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
        write_json(directory / PROGRESS_FILE, {"windows_done": last, "complete": False})
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
    write_json(directory / PROGRESS_FILE, {"windows_done": 0, "complete": False})
    write_json(meta_path, meta)  # last: a folder without meta.json is started afresh
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
    with warnings.catch_warnings():  # torch: a read-only memory map is not writable (only read)
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
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


def check_head_fits(head: OutputHead, cache: FeatureCache) -> None:
    """``head`` reads the cache's hidden states and predicts every one of its targets."""
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


# ---- the model's own output layer ---------------------------------------------------------------


def head_from_lm_head(model: nn.Module, name: str, **knobs) -> OutputHead:
    """A highrank head ``name`` sized for ``model``, its decoder E (and bias, when the model's
    output layer has one; zero otherwise) copied from ``model.get_output_embeddings()``.

    The copy is untied: training the head never changes the model's input embedding, which
    ``lm_head`` shares in tied models such as SmolLM2. With ``name="softmax"`` and no knobs
    the untrained head computes exactly the model's own log-probabilities.
    """
    decoder = output_layer(model)
    head = build_head(name, d_in=decoder.in_features, vocab_size=decoder.out_features, **knobs)
    with torch.no_grad():
        head.weight.copy_(decoder.weight)
        head.bias.copy_(decoder.bias if decoder.bias is not None else 0.0)
    return head


def output_layer(model: nn.Module) -> nn.Linear:
    """``model.get_output_embeddings()``: the linear layer a causal LM ends in."""
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
    decoder = output_layer(model)
    body = getattr(model, "base_model", None)
    if body is None or body is model:
        raise TypeError(
            f"{type(model).__name__} has no separate base_model (body); expected a "
            "transformers causal LM such as LlamaForCausalLM"
        )
    return body, decoder.in_features


def _to_storage(rows: torch.Tensor, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return rows.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return rows.float().numpy()


def _sha256(*tensors: torch.Tensor) -> str:
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.numpy().astype(np.int64).tobytes())
    return digest.hexdigest()


__all__ = [
    "CACHE_DTYPES",
    "FEATURES_FILE",
    "META_FILE",
    "PROGRESS_FILE",
    "TARGETS_FILE",
    "FeatureCache",
    "SavedFileError",
    "cache_hidden_states",
    "check_head_fits",
    "head_from_lm_head",
    "load_cache",
    "output_layer",
    "window_tokens",
]
