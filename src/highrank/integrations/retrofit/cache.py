"""The frozen body's final hidden states (the input of its output layer), cached once.

:func:`cache_hidden_states` reads a token stream in non-overlapping windows of ``window``
tokens (:func:`highrank.causal_lm.window_tokens`: window ``i`` is ``ids[i L : i L + L]``, its
targets the same positions shifted by one, so every token but the first is predicted exactly
once, from the ``t + 1`` tokens of its own window). The hidden states go to ``features.npy``
(``(N, d)``; bfloat16 stored as its raw 16-bit pattern, or float32) and the targets to
``targets.npy``, both memory mapped; ``meta.json`` holds the settings and ``progress.json`` the
windows done, so a killed run continues from the last finished batch of windows. Under
torchrun N processes cache a round of N batches at a time (process r the r-th), and process 0
gathers the rows and writes every file. A finished
cache's ``progress.json`` also holds the crc32 of its contents (``features.npy``'s rows and
``targets.npy``'s ids, as the token-id caches of :mod:`highrank.data.streaming` keep theirs).
:func:`load_cache` opens a finished cache (:class:`FeatureCache`), verifying in one pass that
every row is finite and the contents have those checksums: a zero-filled ``features.npy`` or
changed targets are refused (they trained and scored silently before). A cache whose records
are damaged, missing or of another shape is one :class:`SavedFileError` naming the file.

A *sequence cache* (``layers=L``) is what a head that reads its context needs (Multi-Facet
Softmax and Softmax-CPR: ``OutputHead.reads``): each row holds the last ``L`` layers of the
body at that token (``(N, L d)``, bottom first, the top one the final hidden state, as
:mod:`highrank.integrations.hf_context` gives them to the head live), and ``meta.json`` the
first token of the stream, so that every window's input ids are known (the stream is that id
followed by the targets: windows are contiguous). Such a head trains and is scored on whole
windows of it (:meth:`FeatureCache.windows`), each seeing its own window as its context, as in
the live model.

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
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from highrank.causal_lm import first_line, window_tokens
from highrank.heads import OutputHead, build_head
from highrank.train import distributed
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


class CacheSettingsError(SavedFileError):
    """A cache folder made with other settings than asked now: ``changed`` maps each setting
    that differs to ``(cached, asked)`` (``token_ids_sha256``: the tokens themselves)."""

    def __init__(self, meta_path: Path, changed: dict[str, tuple]) -> None:
        self.meta_path, self.changed = meta_path, changed
        old = {k: v[0] for k, v in changed.items()}
        new = {k: v[1] for k, v in changed.items()}
        super().__init__(
            f"{meta_path} was written with other settings ({', '.join(changed)} differ: "
            f"{old} vs {new}); delete that folder to cache again"
        )

    def __reduce__(self):  # sent from process 0 to the others under torchrun
        return type(self), (self.meta_path, self.changed)


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
        return self.features.shape[1] // (self.layers or 1)

    @property
    def layers(self) -> int | None:
        """Layers per row of a sequence cache (module docstring); None for a token cache."""
        return self.meta.get("layers")

    @property
    def window(self) -> int:
        return self.meta["window"]

    @property
    def n_windows(self) -> int:
        return self.meta["n_windows"]

    def rows(self, index: torch.Tensor | slice) -> torch.Tensor:
        """Float32 final hidden states of the cached tokens at ``index``: ``(n, d)`` (of a
        sequence cache, the top layer)."""
        return self.features[index, -self.hidden_size :].float()

    def seen_in_window(self, block: int = 64) -> torch.Tensor:
        """``(N,)`` bool, a sequence cache's rows whose target already occurred in the
        context of its window (the window's input ids up to and including that position's
        own): the tokens Softmax-CPR's context partition C and pointer P can act on, which
        read the inputs before the position's own (a target repeating the current input
        counts as seen here, though C and P leave it alone). ``block`` windows at a time
        (``block x L x L`` comparisons)."""
        window = self.window
        seen = []
        for first in range(0, self.n_windows, block):
            index = torch.arange(first, min(first + block, self.n_windows))
            ids, targets = self.window_ids(index)  # position s is context of t >= s
            earlier = torch.ones(window, window, dtype=torch.bool).tril()  # (t, s): s <= t
            equal = targets[:, :, None] == ids[:, None, :]  # (b, t, s)
            seen.append((equal & earlier).any(dim=-1).reshape(-1))
        return torch.cat(seen)

    def windows(self, index: torch.Tensor, device: torch.device | str = "cpu",
                reads: tuple[str, ...] = ("hidden", "layers", "context_ids"),
                ) -> tuple[torch.Tensor, dict, torch.Tensor]:
        """Whole windows ``index (b,)`` of a sequence cache, batch first, on ``device``, as a
        head that reads its context takes them: ``(hidden (b, L, d), inputs, targets (b,
        L))``, ``inputs`` holding what ``reads`` names of ``layers`` (each ``(b, L, d)``
        float32, top last) and ``context_ids`` (``(b, L)``, the windows' input ids)."""
        ids, targets = self.window_ids(index)  # (b, L) each
        positions = (index[:, None] * self.window + torch.arange(self.window)).reshape(-1)
        rows = self.features[positions].to(device, torch.float32)
        rows = rows.reshape(*ids.shape, self.layers, self.hidden_size)  # (b, L, layers, d)
        inputs = {"layers": tuple(rows.unbind(2)), "context_ids": ids.to(device)}
        inputs = {name: value for name, value in inputs.items() if name in reads}
        return rows[:, :, -1], inputs, targets.to(device)

    def window_ids(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The input ids and the targets of windows ``index`` of a sequence cache, ``(b, L)``
        each: the stream is its first token followed by the targets (windows are contiguous),
        and window i's inputs are its positions ``i L .. i L + L - 1``."""
        if self.layers is None:
            raise ValueError(
                f"{self.directory} caches final hidden states only; a head that reads its "
                "context needs a sequence cache (cache_hidden_states(..., layers=L))"
            )
        positions = (index[:, None] * self.window + torch.arange(self.window)).reshape(-1)
        stream = torch.cat([torch.tensor([self.meta["first_token_id"]]), self.targets])
        shape = (-1, self.window)
        return stream[positions].view(shape), self.targets[positions].view(shape)


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
    layers: int | None = None,
) -> FeatureCache:
    """Cache ``model``'s final hidden states (the input of its output layer) for ``token_ids``
    read in non-overlapping windows of ``window`` tokens (see the module docstring), computed
    ``batch_windows`` windows at a time with the body frozen, under ``torch.no_grad``. With
    ``layers`` a sequence cache of the last ``layers`` layers (module docstring).

    Resumable: the settings (``window``, ``dtype``, ``source`` — e.g. the model's path — and a
    hash of the token ids) are kept in ``meta.json``; a rerun with the same settings
    continues after the last batch recorded in ``progress.json``, a rerun with other settings
    is refused (delete the folder to start again). A finished cache is just loaded.
    """
    check_positive_int("batch_windows", batch_windows)
    inputs, targets = window_tokens(token_ids, window)
    body, hidden_size = _body_and_hidden_size(model)
    directory = Path(directory)
    meta = _cache_meta(inputs, targets, hidden_size, dtype=dtype, source=source, layers=layers)
    # Under torchrun process 0 writes the folder; every process computes its share of windows.
    done = distributed.from_writer(lambda: _start_or_resume(directory, meta, targets))
    if done is None:
        return _load_everywhere(directory)
    writer = distributed.is_writer()
    features = _open_array(directory, FEATURES_FILE, meta, "r+") if writer else None
    was_training = model.training
    model.eval()
    try:
        _fill_features(body, inputs, features, directory, done, batch_windows, dtype, progress,
                       hidden_size, layers)
    finally:
        model.train(was_training)
    if not writer:
        return _load_everywhere(directory)
    features.flush()
    del features

    def finish() -> FeatureCache:
        cache = _open_cache(directory, meta)
        sums = _verify_contents(cache)  # one pass: the checksums of what is on disk now
        expected = _crc32(np.ascontiguousarray(targets.reshape(-1).numpy().astype("<i4")))
        if sums["targets_crc32"] != expected:  # targets.npy changed while being cached
            raise _changed(directory / TARGETS_FILE, sums["targets_crc32"], expected)
        write_json(directory / PROGRESS_FILE,
                   {"windows_done": meta["n_windows"], "complete": True, **sums})
        return cache

    return _load_everywhere(directory, finish)


def _load_everywhere(directory: Path, finish=None) -> FeatureCache:
    """The finished cache in every process: ``finish()`` (else :func:`load_cache`, which
    verifies the contents) on process 0; under torchrun the others open it once process 0 is
    done, without a second verifying pass (an error on process 0 is raised on all)."""
    opened = finish or (lambda: load_cache(directory))
    held: dict[str, FeatureCache] = {}

    def on_writer() -> None:
        held["cache"] = opened()

    distributed.from_writer(on_writer)
    return held["cache"] if "cache" in held else load_cache(directory, verify=False)


def _fill_features(body, inputs, features, directory, done, batch_windows, dtype, progress,
                   width, layers):
    """Run the body over windows ``done..W`` and write their rows, recording progress per batch.

    Under torchrun a round is N batches of ``batch_windows`` windows: process r runs the r-th
    (the batches one process would run, so the rows are the same), process 0 gathers the rows
    of the round, writes them and records the round done (``features`` is None elsewhere)."""
    n_windows, window = inputs.shape
    rank, world = distributed.rank(), distributed.world_size()
    device = next(body.parameters()).device
    bar = progress_bar(total=n_windows, initial=done, desc=f"cache {directory.name}",
                       unit="window", disable=not (progress and distributed.is_writer()))
    for first in range(done, n_windows, batch_windows * world):
        last = min(first + batch_windows * world, n_windows)
        starts = [min(first + r * batch_windows, last) for r in range(world + 1)]
        mine = inputs[starts[rank] : starts[rank + 1]]
        rows = _hidden_rows(body, mine, device, width, layers)
        if not distributed.all_finite(rows):
            raise TrainingError(
                f"the model's final hidden states are not finite in windows {first}..{last - 1} "
                f"of {directory.name}: the body itself overflows or holds NaN weights (load it "
                "in float32?); nothing of those windows was cached"
            )
        counts = [(starts[r + 1] - starts[r]) * window for r in range(world)]
        rows = _gathered_rows(rows, counts)
        if features is not None:
            features[first * window : last * window] = _to_storage(rows, dtype)
            features.flush()  # rows on disk before the progress record says so
            write_json(directory / PROGRESS_FILE, {"windows_done": last, "complete": False})
        bar.update(last - first)
    bar.close()


def _hidden_rows(body, windows: torch.Tensor, device, width: int,
                 layers: int | None = None) -> torch.Tensor:
    """The body's final hidden states of ``windows (b, L)`` as ``(b L, width)`` float32 CPU
    rows (exact for a bf16 body; none for no windows: a process without a share of the last
    round); with ``layers``, its last ``layers`` layers side by side, ``(b L, layers width)``,
    the top one its final hidden state."""
    if windows.shape[0] == 0:
        return torch.zeros(0, width * (layers or 1))
    many = layers is not None and layers > 1
    with torch.no_grad():
        output = body(input_ids=windows.to(device), use_cache=False, output_hidden_states=many)
    hidden = output.last_hidden_state  # (b, window, d)
    if many:  # the layers below the top as hf_context.head_inputs reads them
        states = output.hidden_states
        if states is None or len(states) < layers:
            raise ValueError(f"the body gave {0 if states is None else len(states)} layers; "
                             f"the head reads the last {layers}")
        below = [h.to(hidden.dtype) for h in states[len(states) - layers : -1]]
        hidden = torch.cat([*below, hidden], dim=-1)  # (b, window, layers d)
    return hidden.reshape(-1, hidden.shape[-1]).cpu().float()


def _cache_meta(inputs: torch.Tensor, targets: torch.Tensor, hidden_size: int, *, dtype: str,
                source: str, layers: int | None) -> dict:
    """The settings a cache of these windows ``inputs, targets (n_windows, window)`` keeps in
    its ``meta.json`` (module docstring)."""
    if dtype not in CACHE_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(CACHE_DTYPES)}; got {dtype!r}")
    if layers is not None:
        check_positive_int("layers", layers)
    meta = {
        "window": inputs.shape[1],
        "n_windows": inputs.shape[0],
        "n_tokens": inputs.numel(),
        "hidden_size": hidden_size,
        "dtype": dtype,
        "source": source,
        "token_ids_sha256": tokens_sha256(inputs, targets),
        "rows": "window-major: row i*window + t is position t of window i",
        "context": "position t of a window sees the t + 1 tokens of its window (1..window)",
    }
    if layers is not None:  # only then: token caches keep the settings they were made with
        meta["layers"] = layers
        meta["first_token_id"] = int(inputs[0, 0])
        meta["rows"] += f"; each row the last {layers} layers (bottom first), {hidden_size} each"
    return meta


def check_cache_settings(
    model: nn.Module,
    token_ids: Sequence[int] | torch.Tensor,
    directory: str | os.PathLike,
    *,
    window: int,
    dtype: str = "bfloat16",
    source: str = "",
    layers: int | None = None,
) -> bool:
    """Whether a cache of these arguments is in ``directory`` (made or begun), without
    computing or writing anything; one made with other settings raises the
    :class:`CacheSettingsError` that :func:`cache_hidden_states` would: a caller with several
    caches to make names every stale one before the first is made."""
    meta_path = Path(directory) / META_FILE
    if not meta_path.exists():
        return False
    inputs, targets = window_tokens(token_ids, window)
    meta = _cache_meta(inputs, targets, _body_and_hidden_size(model)[1], dtype=dtype,
                       source=source, layers=layers)
    _refuse_other_settings(meta_path, meta)
    return True


def _refuse_other_settings(meta_path: Path, meta: dict) -> None:
    old = read_record(meta_path, meta_path.parent)
    changed = sorted(k for k in meta if old.get(k) != meta[k])
    if changed:
        raise CacheSettingsError(meta_path, {k: (old.get(k), meta[k]) for k in changed})


def _gathered_rows(rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Every process's ``rows`` in rank order, on every process (``counts[r]`` rows from
    process r, padded to the largest for the exchange); ``rows`` itself in one process."""
    if len(counts) == 1:
        return rows
    padded = rows.new_zeros(max(counts), rows.shape[1])
    padded[: rows.shape[0]] = rows
    parts = distributed.gather_columns(padded[None], dim=0)  # (N, max, d)
    return torch.cat([parts[r, : counts[r]] for r in range(len(counts))])


def _start_or_resume(directory: Path, meta: dict, targets: torch.Tensor) -> int | None:
    """Windows already cached (0 for a new cache), or None when the cache is complete."""
    meta_path = directory / META_FILE
    if meta_path.exists():
        _refuse_other_settings(meta_path, meta)
        state = _read_progress(directory, meta)
        if state["complete"]:
            return None
        _open_array(directory, FEATURES_FILE, meta, "r")  # there, of its shape: refused if not
        return state["windows_done"]
    directory.mkdir(parents=True, exist_ok=True)
    shape = (meta["n_tokens"], _row_width(meta))
    np.lib.format.open_memmap(
        directory / FEATURES_FILE, mode="w+", dtype=CACHE_DTYPES[meta["dtype"]], shape=shape
    ).flush()
    np.save(directory / TARGETS_FILE, targets.reshape(-1).numpy().astype(np.int32))
    write_json(directory / PROGRESS_FILE, {"windows_done": 0, "complete": False})
    write_json(meta_path, meta)  # last: a folder without meta.json is started afresh
    return 0


def load_cache(directory: str | os.PathLike, *, verify: bool = True) -> FeatureCache:
    """Open a finished cache written by :func:`cache_hidden_states` (features memory mapped),
    verified in one pass: every row finite, the contents those the cache was finished with
    (its checksums; a cache finished before they were kept is checked for finite rows only).
    ``verify=False`` skips that pass (processes 1..N-1 under torchrun: process 0 verified)."""
    directory = Path(directory)
    meta_path = directory / META_FILE
    if not meta_path.exists():
        raise FileNotFoundError(f"{meta_path} not found: {directory} is not a feature cache")
    meta = _check_meta(read_record(meta_path, directory), directory)
    state = _read_progress(directory, meta)
    if not state["complete"]:
        raise SavedFileError(
            f"{directory} is an unfinished cache ({state['windows_done']} of "
            f"{meta['n_windows']} windows): run cache_hidden_states again to finish it"
        )
    cache = _open_cache(directory, meta)
    if not verify:
        return cache
    sums = _verify_contents(cache)
    for key, name in (("features_crc32", FEATURES_FILE), ("targets_crc32", TARGETS_FILE)):
        if key in state and sums[key] != state[key]:
            raise _changed(directory / name, sums[key], state[key])
    return cache


def read_record(path: Path, directory: Path) -> dict:
    """The JSON object in ``path`` (a cache's ``meta.json`` or ``progress.json``); missing,
    not JSON, or not an object is one :class:`SavedFileError`."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SavedFileError(
            f"{path} is missing: the feature cache {directory} is damaged; delete that folder "
            "to cache again"
        ) from None
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise SavedFileError(
            f"{path} is not JSON ({first_line(error)}): the feature cache {directory} is "
            "damaged; delete that folder to cache again"
        ) from None
    if not isinstance(value, dict):
        raise SavedFileError(
            f"{path} holds a JSON {type(value).__name__}, not an object: the feature cache "
            f"{directory} is damaged; delete that folder to cache again"
        )
    return value


def _check_meta(meta: dict, directory: Path) -> dict:
    """``meta`` with the sizes and dtype a cache is opened by (its own file, unchecked by a
    comparison when the cache is opened directly)."""
    sizes = [meta.get(k) for k in ("n_windows", "n_tokens", "hidden_size", "window")]
    if not (all(_count(v) for v in sizes) and meta.get("dtype") in CACHE_DTYPES
            and meta["n_tokens"] == meta["n_windows"] * meta["window"]):
        raise SavedFileError(
            f"{directory / META_FILE} does not give the cache's sizes and dtype (n_windows, "
            "n_tokens, hidden_size, window, dtype): damaged; delete that folder to cache again"
        )
    sequence = [meta.get(k) for k in ("layers", "first_token_id") if k in meta]
    if sequence and not (len(sequence) == 2 and _count(sequence[0])
                         and _count(sequence[1], zero=True)):
        raise SavedFileError(
            f"{directory / META_FILE} does not give a sequence cache's layers and first token "
            "id: damaged; delete that folder to cache again"
        )
    return meta


def _read_progress(directory: Path, meta: dict) -> dict:
    """``progress.json``, checked: ``windows_done`` in ``0..n_windows``, ``complete`` a bool
    (true only with every window done)."""
    path = directory / PROGRESS_FILE
    state = read_record(path, directory)
    done, complete, total = state.get("windows_done"), state.get("complete"), meta["n_windows"]
    if not (isinstance(complete, bool) and _count(done, zero=True) and done <= total
            and (done == total or not complete)):
        raise SavedFileError(
            f"{path} does not say how many of the {total} windows are cached (windows_done "
            f"{done!r}, complete {complete!r}): damaged; delete {directory} to cache again"
        )
    return state


def _count(value, zero: bool = False) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= (0 if zero else 1)


def _open_array(directory: Path, name: str, meta: dict, mode: str | None) -> np.ndarray:
    """``features.npy`` (memory mapped, ``mode``) or ``targets.npy`` (read whole), of the
    shape and dtype ``meta`` gives; anything else is one :class:`SavedFileError`."""
    path = directory / name
    features = name == FEATURES_FILE
    try:  # allow_pickle stays False: an object array is refused, not unpickled
        if features and mode == "r+":
            array = np.lib.format.open_memmap(path, mode="r+")
        else:
            array = np.load(path, mmap_mode=mode if features else None)
    except (OSError, ValueError, EOFError) as error:
        raise SavedFileError(
            f"{directory} holds a feature cache that cannot be read ({type(error).__name__}: "
            f"{first_line(error) if str(error).strip() else ''}); delete that folder to cache "
            "again"
        ) from None
    shape = (meta["n_tokens"], _row_width(meta)) if features else (meta["n_tokens"],)
    dtype = np.dtype(CACHE_DTYPES[meta["dtype"]]) if features else np.dtype(np.int32)
    if array.shape != shape or array.dtype != dtype:
        raise SavedFileError(
            f"{path} holds {array.dtype} {array.shape}, not the {dtype} {shape} its "
            f"{META_FILE} gives: damaged; delete {directory} to cache again"
        )
    return array


def _row_width(meta: dict) -> int:
    """Values per cached token: ``hidden_size``, times ``layers`` in a sequence cache."""
    return meta["hidden_size"] * meta.get("layers", 1)


def _open_cache(directory: Path, meta: dict) -> FeatureCache:
    raw = _open_array(directory, FEATURES_FILE, meta, "r")
    targets = torch.from_numpy(_open_array(directory, TARGETS_FILE, meta, None).astype(np.int64))
    with warnings.catch_warnings():  # torch: a read-only memory map is not writable (only read)
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        features = torch.from_numpy(raw)
    if meta["dtype"] == "bfloat16":
        features = features.view(torch.bfloat16)
    return FeatureCache(directory, features, targets, meta)


def _verify_contents(cache: FeatureCache, block: int = 65536) -> dict[str, str]:
    """``{"features_crc32", "targets_crc32"}`` of the cache as stored (the features' raw
    bytes, the targets as int32), in one pass over the memory map, a block of rows at a time,
    refusing a NaN/inf hidden state (it trained a NaN head silently) and a negative target."""
    directory, features = cache.directory, cache.features
    raw = features.view(torch.int16) if features.dtype == torch.bfloat16 else features
    crc = 0
    for start in range(0, features.shape[0], block):
        rows = features[start : start + block]
        finite = torch.isfinite(rows.float()).all(dim=1)
        if not bool(finite.all()):
            row = start + int((~finite).nonzero()[0])
            raise SavedFileError(
                f"{directory / FEATURES_FILE} holds a non-finite hidden state at row {row}: "
                "damaged; delete that folder to cache again"
            )
        crc = zlib.crc32(raw[start : start + block].numpy(), crc)
    if len(cache) and int(cache.targets.min()) < 0:
        raise SavedFileError(
            f"{directory / TARGETS_FILE} holds the target id {int(cache.targets.min())}: "
            "damaged; delete that folder to cache again"
        )
    targets = np.ascontiguousarray(cache.targets.numpy().astype("<i4"))
    return {"features_crc32": f"{crc:08x}", "targets_crc32": _crc32(targets)}


def _crc32(array: np.ndarray) -> str:
    return f"{zlib.crc32(array):08x}"


def _changed(path: Path, got: str, expected: str) -> SavedFileError:
    return SavedFileError(
        f"{path} does not match the checksum written when its cache was finished (crc32 "
        f"{got}, expected {expected}): it was changed or damaged since; delete "
        f"{path.parent} to cache again"
    )


def check_head_fits(head: OutputHead, cache: FeatureCache) -> None:
    """``head`` reads the cache's hidden states (and layers, for a head that reads its
    context) and predicts every one of its targets."""
    if head.d_in != cache.hidden_size:
        raise ValueError(
            f"the head takes d_in={head.d_in} but {cache.directory} holds hidden states of "
            f"size {cache.hidden_size}"
        )
    if head.reads != ("hidden",):
        wanted = max(head.input_layers, 1)
        if cache.layers != wanted:
            have = "final hidden states only" if cache.layers is None else (
                f"the last {cache.layers} layers")
            raise ValueError(
                f"{type(head).__name__} reads the last {wanted} layers and the context's tokens "
                f"but {cache.directory} holds {have}: cache again with layers={wanted}"
            )
    top = int(cache.targets.max())
    if top >= head.vocab_size:  # a damaged targets.npy (or another model's cache)
        raise SavedFileError(
            f"{cache.directory} has target id {top}, outside the head's vocabulary of "
            f"{head.vocab_size}: delete that folder to cache again"
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


def tokens_sha256(*tensors: torch.Tensor) -> str:
    """sha256 of token-id tensors as int64 (a cache's ``token_ids_sha256``, a training state's
    ``data``: the same digest of the same windows)."""
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
    "CacheSettingsError",
    "FeatureCache",
    "SavedFileError",
    "cache_hidden_states",
    "check_cache_settings",
    "check_head_fits",
    "head_from_lm_head",
    "load_cache",
    "output_layer",
    "read_record",
    "tokens_sha256",
    "window_tokens",
]
