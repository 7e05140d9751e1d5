"""Contexts of a text as a Hugging Face causal language model sees them, for the analyses.

The instruments of :mod:`highrank.analysis` (rank, pairwise KL, top-k) read the log-prob rows
``log P(. | context)`` of highrank's own runs through :mod:`~highrank.analysis.contexts`; this
module gives them the same rows from any ``transformers`` causal LM (``AutoModelForCausalLM``):
a local model folder (``save_pretrained`` output) or a ``.gguf`` file, loaded offline by
:mod:`highrank.causal_lm` (loading, the text's token ids and the windows live there; their
names are importable from here too).

**How contexts are read.** The text file is tokenised whole by the model's tokenizer, without
special tokens: ids ``x_0 .. x_{N-1}``. The stream is cut into non-overlapping windows of ``W``
tokens, ``x_{kW} .. x_{kW+W-1}``, each run through the model as a sequence of its own (positions
restart at 0, no state carried from the window before). Row ``i`` is the distribution the model
gives after token ``i``, from the tokens of its window up to ``i``::

    row i = log_softmax(logits at x_i), context x_{kW} .. x_i  (k = i // W),  target x_{i+1}

so contexts hold 1 .. W tokens (``i mod W + 1``), every token but the first is predicted once,
and row ``i`` is context ``i`` exactly as for a run read with ``batch_size=1`` (the stream
position of the context's last token): the analyses need no other indexing. There are
``N - 1`` rows, the first ``max_contexts`` of them when that is given. ``W`` defaults to
``min(the model's maximum positions, 1024)``; a text shorter than one window is refused.
With ``bos_token_id`` that token is put before every window (the model then sees ``W + 1``
positions; the default ``W`` leaves room for it) and its own output is dropped: rows and their
numbering do not change. By default no token is added: the rows are the model's view of the
text alone.

Log-probabilities are ``log_softmax`` of the logits computed in float64 and stored as float32
(never ``log(softmax + eps)``), so a model whose ``logits`` are already normalised
log-probabilities (highrank's heads attached by ``highrank.integrations.hf``) gives the same
rows (log_softmax of log-probs is the identity).

Windows of equal length are batched (``batch_windows``, by default as many as keep the
``(B, W, V)`` logits under :data:`BATCH_ELEMENTS` entries) and run without autograd.

    model, tokenizer = load_causal_lm("SmolLM2-135M-Instruct.Q4_1.gguf")
    ids = text_token_ids(tokenizer, "wikitext-2/test.txt")
    write_hf_logprob_matrix(model, ids, "smol.npy", max_contexts=8192)

``transformers`` (the ``hf`` extra) is imported by the functions that need it, never when this
module is imported, so ``highrank --help`` works without it.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from highrank.analysis.logprob_matrix import ContextRows, write_context_matrix
from highrank.causal_lm import (  # noqa: F401  (loading and windows live there; old imports)
    DEFAULT_MAX_WINDOW,
    INSTALL_HINT,
    HFInputError,
    check_finite_weights,
    check_token_ids,
    check_window,
    default_window,
    load_causal_lm,
    max_positions,
    model_source,
    require_hf,
    text_token_ids,
    vocab_width,
)
from highrank.util.paths import is_retrofit_output
from highrank.util.progress import progress_bar

# Logits entries of one batch of windows: 256 MB of float32 logits, about 6 times that at the
# peak of their float64 normalisation.
BATCH_ELEMENTS = 2**26


# ---- windows -------------------------------------------------------------------------------


def count_text_contexts(n_tokens: int, max_contexts: int | None = None) -> int:
    """Rows of a text of ``n_tokens`` tokens: ``N - 1`` (the last token predicts nothing),
    at most ``max_contexts``."""
    if max_contexts is not None and max_contexts < 1:
        raise HFInputError(f"max_contexts must be a positive int or None; got {max_contexts!r}")
    rows = max(n_tokens - 1, 0)
    return rows if max_contexts is None else min(rows, max_contexts)


def describe_contexts(window: int, bos_token_id: int | None = None) -> str:
    """The reading protocol in one sentence, for records."""
    bos = (
        f"BOS token {bos_token_id} before every window"
        if bos_token_id is not None
        else ("no BOS token added")
    )
    return (
        f"the text's tokens (no special tokens) in non-overlapping windows of {window} tokens, "
        f"each run as its own sequence ({bos}); row i is the model's log_softmax after token "
        f"i, its context the tokens of its window up to i (1 .. {window} tokens), target "
        "token i + 1"
    )


def _windows(n_rows: int, window: int, needed: np.ndarray | None) -> Iterator[tuple[int, int]]:
    """``(start, end)`` token ranges to run: rows ``start .. end - 1`` of each window that
    holds a needed row, cut after its last needed row (the model is causal)."""
    for start in range(0, n_rows, window):
        end = min(start + window, n_rows)
        if needed is not None:
            inside = needed[(needed >= start) & (needed < end)]
            if len(inside) == 0:
                continue
            end = int(inside[-1]) + 1
        yield start, end


def _batches(
    windows: Iterator[tuple[int, int]], batch_windows: int
) -> Iterator[list[tuple[int, int]]]:
    """Consecutive windows of equal length, at most ``batch_windows`` at a time (no padding)."""
    batch: list[tuple[int, int]] = []
    for span in windows:
        length = span[1] - span[0]
        if batch and (len(batch) == batch_windows or batch[0][1] - batch[0][0] != length):
            yield batch
            batch = []
        batch.append(span)
    if batch:
        yield batch


def auto_batch_windows(window: int, vocab_size: int) -> int:
    """Windows per batch keeping the ``(B, W, V)`` logits under :data:`BATCH_ELEMENTS`."""
    return max(1, BATCH_ELEMENTS // max(1, window * vocab_size))


# ---- the rows ------------------------------------------------------------------------------


@torch.no_grad()
def iter_causal_lm_rows(
    model: Any,
    ids: torch.Tensor,
    *,
    window: int,
    bos_token_id: int | None = None,
    max_contexts: int | None = None,
    needed: Sequence[int] | np.ndarray | None = None,
    batch_windows: int | None = None,
    progress: bool = False,
) -> Iterator[ContextRows]:
    """``(positions (b,), targets (b,), rows (b, V))`` blocks of the text ``ids`` read in
    windows as the module says: float32 log-probs on the CPU, in ascending position.

    ``needed`` (sorted row indices) runs only the windows that hold one and yields only
    those rows. The model is in eval mode for the duration (its flag is restored after).
    """
    if not isinstance(window, int) or window < 1:
        raise HFInputError(f"window must be a positive number of tokens; got {window!r}")
    ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
    n_rows = count_text_contexts(ids.numel(), max_contexts)
    if needed is not None:
        needed = np.asarray(needed, dtype=np.int64)
        needed = needed[needed < n_rows]
    if batch_windows is None:
        batch_windows = auto_batch_windows(window, vocab_width(model) or 1)
    spans = list(_windows(n_rows, window, needed))
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        total = sum(end - start for start, end in spans)
        with progress_bar(total=total, desc="contexts", unit="ctx", disable=not progress) as bar:
            for batch in _batches(iter(spans), batch_windows):
                rows = _window_log_probs(model, ids, batch, bos_token_id, device)  # (B, L, V)
                for (start, end), window_rows in zip(batch, rows, strict=True):
                    positions = torch.arange(start, end)
                    if needed is None:
                        yield positions, ids[start + 1 : end + 1], window_rows
                    else:
                        keep = torch.from_numpy(np.isin(positions.numpy(), needed))
                        yield positions[keep], ids[positions[keep] + 1], window_rows[keep]
                    bar.update(end - start)
    finally:
        model.train(was_training)


def _window_log_probs(
    model: Any, ids: torch.Tensor, batch: list[tuple[int, int]], bos_token_id, device
) -> torch.Tensor:
    """``(B, L, V)`` float32 CPU log-probs of the windows ``batch`` (all of length L)."""
    inputs = torch.stack([ids[start:end] for start, end in batch])  # (B, L)
    if bos_token_id is not None:
        bos = torch.full((inputs.shape[0], 1), int(bos_token_id), dtype=torch.int64)
        inputs = torch.cat([bos, inputs], dim=1)  # (B, 1 + L)
    output = model(input_ids=inputs.to(device), use_cache=False)
    logits = output.logits if hasattr(output, "logits") else output[0]
    if bos_token_id is not None:
        logits = logits[:, 1:]  # the BOS position's prediction is not a row
    # Normalised in float64, then stored as float32: with a float32 log-sum-exp over
    # SmolLM2's 49,152 words, log sum_w p(w) of 40 rows was up to 1.4e-5 away from 0; in
    # float64 it stays under 1e-6 (the slow test), only each stored entry's rounding left.
    return torch.log_softmax(logits.double(), dim=-1).float().cpu()


def causal_lm_rows_at(
    model: Any,
    ids: torch.Tensor,
    positions: Sequence[int],
    *,
    window: int,
    bos_token_id: int | None = None,
    progress: bool = False,
) -> torch.Tensor:
    """``(len(positions), V)`` float32 log-prob rows of the contexts at ``positions`` (any
    order, repeats allowed); only the windows holding them are run."""
    wanted = np.unique(np.asarray(positions, dtype=np.int64))
    if len(wanted) == 0:
        return torch.empty(0, vocab_width(model) or 0)
    found: dict[int, torch.Tensor] = {}
    for block_positions, _, rows in iter_causal_lm_rows(
        model, ids, window=window, bos_token_id=bos_token_id, needed=wanted, progress=progress
    ):
        found.update(zip(block_positions.tolist(), rows, strict=True))
    missing = [int(p) for p in wanted if int(p) not in found]
    if missing:
        raise HFInputError(f"positions {missing[:5]} are beyond the text's last context")
    return torch.stack([found[int(p)] for p in positions])


def causal_lm_target_log_probs(
    model: Any,
    ids: torch.Tensor,
    *,
    window: int,
    bos_token_id: int | None = None,
    max_contexts: int | None = None,
    progress: bool = False,
) -> np.ndarray:
    """``(n,)`` float64 ``log P(x_{i+1} | context i)`` of the first ``n`` rows."""
    values = [
        rows.gather(1, targets[:, None])[:, 0].double()
        for _, targets, rows in iter_causal_lm_rows(
            model,
            ids,
            window=window,
            bos_token_id=bos_token_id,
            max_contexts=max_contexts,
            progress=progress,
        )
    ]
    return torch.cat(values).numpy()


def write_hf_logprob_matrix(
    model: Any,
    ids: torch.Tensor,
    path: str | os.PathLike,
    *,
    window: int | None = None,
    bos_token_id: int | None = None,
    max_contexts: int | None = None,
    batch_windows: int | None = None,
    progress: bool = False,
    source: str = "token stream",
    metadata: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write the ``(n, V)`` log-prob matrix of ``model`` on the text ``ids`` to ``path`` (a
    ``.npy``), with the ``.contexts.npz`` and ``.json`` side files of
    :func:`~highrank.analysis.logprob_matrix.write_context_matrix`; returns the record.

    ``window`` defaults to :func:`default_window`; ``max_contexts`` keeps the first rows.
    """
    ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
    window = check_window(model, ids.numel(), window, bos_token_id=bos_token_id, source=source)
    n_rows = count_text_contexts(ids.numel(), max_contexts)
    blocks = iter_causal_lm_rows(
        model,
        ids,
        window=window,
        bos_token_id=bos_token_id,
        max_contexts=max_contexts,
        batch_windows=batch_windows,
        progress=progress,
    )
    first = next(blocks)  # its width is the matrix's: the model's real output size
    record = {
        **(metadata or {}),
        "kind": "log_prob",
        "model_class": type(model).__name__,
        "source": source,
        "n_tokens": ids.numel(),
        "window": window,
        "bos_token_id": bos_token_id,
        "contexts": describe_contexts(window, bos_token_id),
    }
    shape = (n_rows, first[2].shape[1])
    return write_context_matrix(path, itertools.chain([first], blocks), shape, record)


# ---- a model with a text, as a row source loads it (analysis.rows.TextRows) ------------------


@dataclass(frozen=True, eq=False)
class TextContexts:
    """A loaded causal LM with the token ids of a text and how they are read."""

    model_path: Path
    model: Any
    tokenizer: Any
    text: Path
    ids: torch.Tensor  # (N,)
    window: int
    bos_token_id: int | None

    @property
    def name(self) -> str:
        return model_name(self.model_path)

    def record(self, max_contexts: int | None) -> dict[str, Any]:
        """What every record of an analysis of this model on this text says about them."""
        return {
            "model": str(self.model_path.resolve()),
            "model_name": self.name,
            "model_class": type(self.model).__name__,
            "model_type": getattr(self.model.config, "model_type", None),
            "head": type(self.model).__name__,
            "text": str(self.text.resolve()),
            "n_tokens": self.ids.numel(),
            "window": self.window,
            "bos_token_id": self.bos_token_id,
            "contexts": describe_contexts(self.window, self.bos_token_id),
            "max_contexts": max_contexts,
            "n_contexts": count_text_contexts(self.ids.numel(), max_contexts),
        }


def load_text_contexts(
    model_path: str | os.PathLike,
    text_path: str | os.PathLike,
    *,
    window: int | None = None,
    bos: bool = False,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> TextContexts:
    """Check both paths, then load the model and tokenise the text (the slow part last)."""
    model_source(model_path)
    text_path = Path(text_path)
    if not text_path.is_file():
        raise HFInputError(f"text file {text_path} does not exist")
    model, tokenizer = load_causal_lm(model_path, device=device, progress=progress)
    bos_token_id = None
    if bos:
        bos_token_id = tokenizer.bos_token_id
        if bos_token_id is None:
            raise HFInputError(f"--bos: the tokenizer of {model_path} has no BOS token")
    ids = text_token_ids(tokenizer, text_path)
    check_token_ids(model, ids, model_path=model_path, source=f"--text {text_path}")
    window = check_window(
        model, ids.numel(), window, bos_token_id=bos_token_id, source=str(text_path)
    )
    return TextContexts(Path(model_path), model, tokenizer, text_path, ids, window, bos_token_id)


def model_name(path: str | os.PathLike) -> str:
    """A model's short name: the ``.gguf`` file's stem, or the folder's name; a retrofit's
    model (``OUT/model``, every one so named) is named by its retrofit, ``OUT``'s name."""
    path = Path(path)
    if path.suffix.lower() == ".gguf":
        return path.stem
    path = path.resolve()
    return path.parent.name if path.name == "model" and is_retrofit_output(path.parent) else (
        path.name)


def hf_tag(
    model_path: str | os.PathLike,
    text_path: str | os.PathLike,
    *,
    window: int | None = None,
    bos: bool = False,
    max_contexts: int | None = None,
) -> str:
    """``<model>-<text stem>[-w<W>][-bos][-first<N>]``: the tag of a record in ``--out``."""
    tag = f"{model_name(model_path)}-{Path(text_path).stem}"
    if window is not None:
        tag += f"-w{window}"
    if bos:
        tag += "-bos"
    if max_contexts is not None:
        tag += f"-first{max_contexts}"
    return tag


def check_record_owner(path: str | os.PathLike, model: str | os.PathLike | None) -> None:
    """Refuse to replace a record in ``--out`` that another model wrote: records are named by a
    model's short name (:func:`hf_tag`), which two models in different folders can share. A
    record of the same model (a rerun, a rewritten model) is replaced as before."""
    path = Path(path)
    if model is None or not path.is_file():
        return
    import json

    try:
        owner = json.loads(path.read_text(encoding="utf-8")).get("model")
    except (OSError, ValueError, AttributeError):
        return  # not a record this check can read: the writer's own checks apply
    mine = str(Path(model).resolve())
    # an owner written as a relative path (records before this check) is not known
    if isinstance(owner, str) and Path(owner).is_absolute() and owner != mine:
        raise HFInputError(
            f"{path} is the record of another model of the same name ({owner}); give {mine} "
            "another --out (or move that record away)"
        )


def path_fingerprint(path: str | os.PathLike) -> dict[str, Any]:
    """Resolved path, size and modification time of a file, or of each file directly in a
    model folder: a rewritten model or text no longer matches a kept matrix."""
    path = Path(path).resolve()
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    return {
        "path": str(path),
        "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files],
    }


class TokenizerVocab:
    """The three things the top-k table needs of a vocabulary (``len``, ``word``,
    ``decode``) over a tokenizer: a token shows as the Python ``repr`` of its decoded text,
    so spaces and newlines are visible (``' the'``, ``'\\n'``)."""

    def __init__(self, tokenizer: Any, size: int) -> None:
        self.tokenizer, self.size = tokenizer, size

    def __len__(self) -> int:
        return self.size

    def word(self, index: int) -> str:
        return repr(self.tokenizer.decode([int(index)]))

    def decode(self, ids: Sequence[int] | torch.Tensor) -> list[str]:
        return [repr(self.tokenizer.decode([int(i) for i in ids]))]
