"""One source of log-prob rows for every instrument: a run's split, or a causal LM on a text.

The instruments (rank, pairwise KL, top-k, hidden size) all read the same thing, the rows
``log P(. | context i)`` with the token that followed each context; only where the rows come
from differs. A :class:`RowSource` hides that, so each instrument has one code path:

* :meth:`RowSource.from_run`: a trained run (``RUN_DIR``, a checkpoint) on one split of its
  corpus (:mod:`~highrank.analysis.contexts`: the split read as evaluation reads it, row ``i``
  the context ending at stream position ``i`` when ``batch_size`` is 1);
* :meth:`RowSource.from_causal_lm`: a Hugging Face causal LM (a model folder or a ``.gguf``
  file) on a UTF-8 text, read in windows (:mod:`~highrank.analysis.hf_contexts`: row ``i``
  the context ending at token ``i``).

Both yield the same blocks, ``(positions (b,) int64, targets (b,) int64, rows (b, V) float32
CPU tensor)`` in ascending position (:meth:`RowSource.iter_rows`), can skip to the contexts
asked for (``needed``), and describe themselves for records (:meth:`RowSource.describe`).
Nothing is loaded until rows are first asked for: a path is checked at once, the model is
loaded on first use (:meth:`RowSource.load`), so an instrument that reuses a kept matrix
never loads a model.

    source = RowSource.from_run("runs/ptb-mos", "test")
    source = RowSource.from_causal_lm("SmolLM2-135M.Q4_1.gguf", "wikitext-2/test.txt", window=256)
    for positions, targets, rows in source.iter_rows(max_contexts=1000): ...
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from highrank.analysis.contexts import RunSplit, count_contexts, iter_contexts, load_run_split
from highrank.analysis.hf_contexts import (
    HFInputError,
    TextContexts,
    TokenizerVocab,
    causal_lm_rows_at,
    causal_lm_target_log_probs,
    check_record_owner,
    count_text_contexts,
    describe_contexts,
    hf_tag,
    iter_causal_lm_rows,
    load_text_contexts,
    model_source,
    path_fingerprint,
    vocab_width,
    write_hf_logprob_matrix,
)
from highrank.analysis.logprob_matrix import head_rows, write_log_prob_matrix
from highrank.analysis.output import ANALYSIS_DIR, record_tag
from highrank.config import load_config
from highrank.data.streaming import streams_equal
from highrank.evaluate.perplexity import check_segment_length, default_bptt
from highrank.runs.checkpoint import CheckpointError, checkpoint_path, missing_best_hint
from highrank.runs.run_dir import RunDir, RunDirError

# (positions (b,) int64, targets (b,) int64, rows (b, V) float32 on the CPU), ascending.
RowBlock = tuple[np.ndarray, np.ndarray, torch.Tensor]

# Keys of a matrix's side record that describe the file, not the analysis.
_MATRIX_ONLY = ("matrix", "shape", "dtype", "kind", "hf_settings")


class RowSource:
    """Where log-prob rows come from; see the module docstring. Use the two constructors."""

    kind: str  # "run" or "text"

    @staticmethod
    def from_run(
        run_dir: str | os.PathLike,
        split: str = "test",
        *,
        which: str = "best",
        data_dir: str | os.PathLike | None = None,
        device: str | torch.device = "cpu",
        bptt: int | None = None,
    ) -> RunRows:
        """A trained run's checkpoint ``which`` on ``split`` of its corpus (``data_dir``: another
        folder holding the same corpus); ``bptt`` None: the run's own segment length."""
        return RunRows(run_dir, split, which=which, data_dir=data_dir, device=device, bptt=bptt)

    @staticmethod
    def from_causal_lm(
        model_path: str | os.PathLike,
        text_path: str | os.PathLike,
        *,
        window: int | None = None,
        bos: bool = False,
        device: str | torch.device = "cpu",
        batch_windows: int | None = None,
    ) -> TextRows:
        """A Hugging Face causal LM (a model folder or a ``.gguf`` file) on the UTF-8 text at
        ``text_path``, read in windows of ``window`` tokens (default: the model's positions, at
        most 1024), with the tokenizer's BOS token before each window when ``bos``."""
        return TextRows(
            model_path,
            text_path,
            window=window,
            bos=bos,
            device=device,
            batch_windows=batch_windows,
        )

    # ---- what every source gives ---------------------------------------------------------

    @property
    def name(self) -> str:
        """How messages name the source."""
        raise NotImplementedError

    def check(self) -> None:
        """Refuse a path that does not exist, before any slow work (nothing is loaded)."""

    def check_record(self, path: Path) -> None:
        """Refuse to replace ``path`` when it is another source's record (before the work)."""

    def load(self, progress: bool = False) -> None:
        """Load the model and the token ids now (otherwise done on first use)."""
        raise NotImplementedError

    def release(self) -> None:
        """Drop the loaded model (one model in memory at a time); reloaded when needed."""
        raise NotImplementedError

    def n_contexts(self, max_contexts: int | None = None) -> int:
        """Rows of the source (contexts that have a next token), at most ``max_contexts``."""
        raise NotImplementedError

    @property
    def width(self) -> int:
        """Columns of a row: the size of the model's output."""
        raise NotImplementedError

    @property
    def vocab(self) -> Any:
        """``len``, ``word(i)`` and ``decode(ids)`` of the source's tokens (for tables)."""
        raise NotImplementedError

    @property
    def ids(self) -> torch.Tensor | np.ndarray:
        """The token ids the rows are read from (row ``i`` predicts ``ids[i + 1]``)."""
        raise NotImplementedError

    def iter_rows(
        self,
        *,
        max_contexts: int | None = None,
        needed: Sequence[int] | np.ndarray | None = None,
        progress: bool = False,
    ) -> Iterator[RowBlock]:
        """Blocks of the first ``max_contexts`` rows in ascending position; with ``needed``
        (sorted row indices) only those rows (the model runs no further than the last)."""
        raise NotImplementedError

    def rows_at(self, positions: Sequence[int], *, progress: bool = False) -> torch.Tensor:
        """``(len(positions), V)`` rows of the contexts at ``positions`` (any order)."""
        raise NotImplementedError

    def target_log_probs(
        self, *, max_contexts: int | None = None, progress: bool = False
    ) -> np.ndarray:
        """``(n,)`` float64 ``log P(next token | context i)`` of the first ``n`` rows."""
        raise NotImplementedError

    def describe(self, max_contexts: int | None = None) -> dict[str, Any]:
        """What a record says about the source (which run and split, or model and text)."""
        raise NotImplementedError

    def contexts_protocol(self) -> str:
        """How the contexts are read, in one sentence (for a record's protocol)."""
        raise NotImplementedError

    def where(self) -> dict[str, Any]:
        """Where the contexts come from, for a record over several sources that share them:
        ``split`` (and ``checkpoint``) and ``source`` (the file)."""
        raise NotImplementedError

    def entry(self, max_contexts: int | None = None) -> dict[str, Any]:
        """What a record over several sources lists about this one (run, head; or model)."""
        raise NotImplementedError

    def differs_from(self, first: RowSource, names: tuple[str, str]) -> str | None:
        """Why this source's rows cannot be compared context by context with ``first``'s
        (another vocabulary, stream or tokenisation), or None; ``names`` label the two."""
        raise NotImplementedError

    # ---- kept matrices (rank, hidden size) ---------------------------------------------------

    def tag(
        self,
        *,
        kind: str = "log_prob",
        max_contexts: int | None = None,
        batch_size: int = 1,
        bptt: int | None = None,
    ) -> str:
        """The tag of the source's records: ``test-best[-logits][-first<N>][-b<B>][-bptt<L>]``
        for a run (:func:`~highrank.analysis.output.record_tag`),
        ``<model>-<text stem>[-w<W>][-bos][-first<N>]`` for a causal LM on a text."""
        raise NotImplementedError

    def folder(self, out: str | os.PathLike | None) -> Path:
        """Where the source's records go: ``RUN_DIR/analysis`` for a run, ``out`` for a text."""
        raise NotImplementedError

    def matrix_settings(
        self, *, kind: str, batch_size: int, bptt: int | None, max_contexts: int | None
    ) -> dict[str, Any]:
        """What a kept matrix must have been written with to be reused (files' fingerprints
        included: a rewritten checkpoint, model or text no longer matches)."""
        raise NotImplementedError

    def matrix_matches(self, side: dict[str, Any], settings: dict[str, Any]) -> bool:
        """Whether the kept matrix whose side record is ``side`` has ``settings``."""
        raise NotImplementedError

    def record_matches(self, record: dict[str, Any], settings: dict[str, Any]) -> bool:
        """Whether a rank record was computed from rows with ``settings`` (and can be reused
        without its matrix); a record that cannot tell is not reused."""
        raise NotImplementedError

    def write_matrix(
        self, path: Path, settings: dict[str, Any], *, progress: bool = False
    ) -> dict[str, Any]:
        """Write the rows the ``settings`` ask for to the ``.npy`` at ``path`` (with its side
        files); returns the side record."""
        raise NotImplementedError

    def writing_note(self, settings: dict[str, Any], plan: str) -> str:
        """The line shown (with progress) before the matrix is written."""
        raise NotImplementedError

    def matrix_description(
        self,
        side: dict[str, Any],
        settings: dict[str, Any],
        seconds: dict[str, Any],
        folder: Path,
    ) -> dict[str, Any]:
        """The head of a record computed from a matrix kept in ``folder``: the source, the
        matrix's settings and the ``seconds`` spent (``matrix_reused``, ``load_seconds``,
        ``matrix_seconds``)."""
        raise NotImplementedError


# ---- a run's split --------------------------------------------------------------------------


class RunRows(RowSource):
    """The rows of a trained run on one split (:meth:`RowSource.from_run`)."""

    kind = "run"

    def __init__(
        self,
        run_dir: str | os.PathLike,
        split: str = "test",
        *,
        which: str = "best",
        data_dir: str | os.PathLike | None = None,
        device: str | torch.device = "cpu",
        bptt: int | None = None,
        loaded: RunSplit | None = None,
    ) -> None:
        self.run_dir, self.split, self.which = Path(run_dir), split, which
        self.data_dir, self.device, self._bptt, self._loaded = data_dir, device, bptt, loaded

    @classmethod
    def of(cls, run_split: RunSplit, *, which: str = "best") -> RunRows:
        """The rows of a run split already loaded (:func:`load_run_split`)."""
        return cls(run_split.run_dir, run_split.split, which=which, loaded=run_split)

    @classmethod
    def of_model(
        cls,
        model: Any,
        ids: torch.Tensor | np.ndarray,
        *,
        bptt: int = 70,
        name: str = "token stream",
    ) -> RunRows:
        """The rows of a highrank model in memory on the stream ``ids`` (no run directory:
        such a source reads rows but names no run for records)."""
        loaded = RunSplit(Path(name), model, None, None, ids, "", name)
        return cls(name, "", bptt=bptt, loaded=loaded)

    @property
    def name(self) -> str:
        return str(self.run_dir)

    @property
    def loaded(self) -> RunSplit:
        if self._loaded is None:
            self._loaded = load_run_split(
                self.run_dir,
                self.split,
                which=self.which,
                data_dir=self.data_dir,
                device=self.device,
            )
        return self._loaded

    def load(self, progress: bool = False) -> None:
        self.loaded  # noqa: B018 (loads)

    def release(self) -> None:
        self._loaded = None

    @property
    def bptt(self) -> int:
        """The segment length the contexts are read with: as asked, else the run's own (read
        from its config.toml without loading the model)."""
        if self._bptt is None:
            self._bptt = self._loaded.bptt if self._loaded is not None else _run_bptt(self.run_dir)
        return self._bptt

    @property
    def ids(self) -> torch.Tensor | np.ndarray:
        return self.loaded.ids

    @property
    def vocab(self) -> Any:
        return self.loaded.vocab

    @property
    def width(self) -> int:
        return self.loaded.model.head.vocab_size

    def n_contexts(self, max_contexts: int | None = None) -> int:
        n = count_contexts(len(self.ids))  # len: a data.memmap run's ids are a memory map
        return n if max_contexts is None else min(n, max_contexts)

    def iter_rows(self, *, max_contexts=None, needed=None, progress=False) -> Iterator[RowBlock]:
        model, ids = self.loaded.model, self.ids
        if needed is not None:
            needed = np.asarray(needed, dtype=np.int64)
            if max_contexts is not None:
                needed = needed[needed < max_contexts]
            if len(needed) == 0:
                return
            wanted = np.zeros(int(needed[-1]) + 1, dtype=bool)
            wanted[needed] = True
            max_contexts = len(wanted)
        check_segment_length(self.loaded.config, self.bptt)
        with torch.no_grad():
            for block in iter_contexts(
                model,
                ids,
                bptt=self.bptt,
                max_contexts=max_contexts,
                progress=progress,
                name=self.loaded.source,
            ):
                positions, targets, hidden = block.positions.numpy(), block.targets, block.hidden
                if needed is not None:
                    mask = wanted[positions]
                    if not mask.any():
                        continue
                    positions, targets = positions[mask], targets[torch.from_numpy(mask)]
                    hidden = hidden[torch.from_numpy(mask).to(hidden.device)]
                rows = head_rows(model.head, hidden).cpu()  # the head runs on these only
                yield positions, targets.numpy(), rows

    def rows_at(self, positions, *, progress=False) -> torch.Tensor:
        wanted = np.unique(np.asarray(positions, dtype=np.int64))
        if len(wanted) == 0:
            return torch.empty(0, self.width)
        found: dict[int, torch.Tensor] = {}
        for block_positions, _, rows in self.iter_rows(needed=wanted, progress=progress):
            found.update(zip(block_positions.tolist(), rows, strict=True))
        return torch.stack([found[int(p)] for p in positions])

    def target_log_probs(self, *, max_contexts=None, progress=False) -> np.ndarray:
        values = [
            rows.gather(1, torch.from_numpy(targets)[:, None])[:, 0].double()
            for _, targets, rows in self.iter_rows(max_contexts=max_contexts, progress=progress)
        ]
        return torch.cat(values).numpy()

    def describe(self, max_contexts=None) -> dict[str, Any]:
        return {
            "run_dir": str(self.run_dir),
            "bptt": self.bptt,
            "head": self.loaded.config.head.name,
            "split": self.split,
            "source": self.loaded.source,
        }

    def contexts_protocol(self) -> str:
        return "the first n contexts of the split in stream order (iter_contexts, batch_size 1)"

    def where(self) -> dict[str, Any]:
        return {"split": self.split, "checkpoint": self.which, "source": self.loaded.source}

    def entry(self, max_contexts=None) -> dict[str, Any]:
        return {
            "run_dir": str(self.run_dir),
            "head": self.loaded.config.head.name,
            "bptt": self.bptt,
        }

    def differs_from(self, first, names) -> str | None:
        problem = vocabulary_difference(names, first.vocab, self.vocab)
        if problem is not None:
            return problem
        if not streams_equal(self.ids, first.ids):  # memory maps: a block at a time
            return (
                f"runs {names[0]} and {names[1]} read different {self.split} streams "
                f"({first.loaded.source}, {self.loaded.source}); pass one corpus with --data-dir"
            )
        return None

    def tag(self, *, kind="log_prob", max_contexts=None, batch_size=1, bptt=None) -> str:
        return record_tag(self.split, self.which, kind=kind, max_contexts=max_contexts,
                          batch_size=batch_size, bptt=bptt)

    def folder(self, out) -> Path:
        return self.run_dir / ANALYSIS_DIR

    def matrix_settings(self, *, kind, batch_size, bptt, max_contexts) -> dict[str, Any]:
        if bptt is not None:
            self._bptt = bptt
        return {
            "split": self.split,
            "which": self.which,
            "kind": kind,
            "batch_size": batch_size,
            "bptt": self.bptt,
            "max_contexts": max_contexts,
            "checkpoint_file": file_fingerprint(checkpoint_path(self.run_dir, self.which)),
            "data_dir": None if self.data_dir is None else str(Path(self.data_dir).resolve()),
        }

    def matrix_matches(self, side, settings) -> bool:
        return "head_name" in side and all(side.get(k) == v for k, v in settings.items())

    def record_matches(self, record, settings) -> bool:
        keys = ("split", "max_contexts", "data_dir", "checkpoint_file")  # the rest is in the tag
        return all(record.get(key) == settings[key] for key in keys)

    def configured_d_embed(self) -> int:
        """The hidden size the run's config gives its head (read without the model)."""
        return RunDir.open(self.run_dir).load_config().model.d_embed

    def write_matrix(self, path, settings, *, progress=False) -> dict[str, Any]:
        loaded = self.loaded
        check_segment_length(loaded.config, settings["bptt"])
        return write_log_prob_matrix(
            path,
            loaded.model,
            loaded.ids,
            kind=settings["kind"],
            batch_size=settings["batch_size"],
            bptt=settings["bptt"],
            max_contexts=settings["max_contexts"],
            progress=progress,
            source=loaded.source,
            metadata={
                **settings,
                "run_dir": str(self.run_dir),
                "head_name": loaded.config.head.name,
            },
        )

    def writing_note(self, settings, plan) -> str:
        return f"{self.run_dir}: writing the {settings['kind']} matrix of {self.loaded.source}"

    def matrix_description(self, side, settings, seconds, folder) -> dict[str, Any]:
        return {
            "run_dir": str(self.run_dir),
            "head": side["head_name"],
            "checkpoint": self.which,  # as the other analyses' records name it
            **settings,
            "matrix_seconds": round(seconds["load_seconds"] + seconds["matrix_seconds"], 2),
        }


def vocabulary_difference(names: Sequence[str], first: Any, other: Any) -> str | None:
    """Why the runs ``names`` (their vocabularies ``first`` and ``other``) cannot be
    compared token by token, or None when the vocabularies are equal."""
    if other.words == first.words:
        return None
    pairs = zip(first.words, other.words, strict=False)  # up to the shorter
    differ = next((i for i, (u, v) in enumerate(pairs) if u != v), min(len(other), len(first)))
    return (
        f"runs {names[0]} and {names[1]} have different vocabularies ({len(first)} vs "
        f"{len(other)} tokens, first difference at id {differ}); top-k comparison needs "
        "models trained on one corpus"
    )


def _run_bptt(run_dir: Path) -> int:
    """The segment length the run's saved config implies (read without loading the model)."""
    path = run_dir / "config.toml"
    if not path.is_file():
        raise RunDirError(
            f"{run_dir} holds no config.toml; expected a run directory of `highrank train`"
        )
    return default_bptt(load_config(path))


def file_fingerprint(path: Path) -> dict[str, Any]:
    """Name, size and modification time: a rewritten checkpoint no longer matches."""
    if not path.is_file():
        if path.name == "best.pt":  # the same hint as every verb
            raise CheckpointError(missing_best_hint(path.parent.parent))
        raise CheckpointError(f"checkpoint {path} does not exist")
    stat = path.stat()
    return {"file": path.name, "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


# ---- a causal LM on a text ------------------------------------------------------------------


class TextRows(RowSource):
    """The rows of a Hugging Face causal LM on a text (:meth:`RowSource.from_causal_lm`)."""

    kind = "text"

    def __init__(
        self,
        model_path: str | os.PathLike | None,
        text_path: str | os.PathLike | None,
        *,
        window: int | None = None,
        bos: bool = False,
        device: str | torch.device = "cpu",
        batch_windows: int | None = None,
        loaded: TextContexts | None = None,
    ) -> None:
        self.model_path, self.text_path = model_path, text_path
        self.window_asked, self.bos, self.device = window, bos, device
        self.batch_windows, self._loaded = batch_windows, loaded

    @classmethod
    def of_model(
        cls,
        model: Any,
        ids: torch.Tensor,
        *,
        window: int,
        bos_token_id: int | None = None,
        batch_windows: int | None = None,
    ) -> TextRows:
        """The rows of a model already in memory on the token ids of a text (no paths: such
        a source reads rows but names no files for records)."""
        ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
        loaded = TextContexts(None, model, None, None, ids, window, bos_token_id)
        return cls(None, None, window=window, batch_windows=batch_windows, loaded=loaded)

    @property
    def name(self) -> str:
        return str(self.model_path)

    def check(self) -> None:
        model_source(self.model_path)  # a bad path fails before anything else
        if not Path(self.text_path).is_file():
            raise HFInputError(f"text file {self.text_path} does not exist")

    def check_record(self, path: Path) -> None:
        check_record_owner(path, self.model_path)

    @property
    def loaded(self) -> TextContexts:
        if self._loaded is None:
            self.load(progress=False)
        return self._loaded

    def load(self, progress: bool = False) -> None:
        if self._loaded is None:
            self._loaded = load_text_contexts(
                self.model_path,
                self.text_path,
                window=self.window_asked,
                bos=self.bos,
                device=self.device,
                progress=progress,
            )

    def release(self) -> None:
        self._loaded = None

    @property
    def ids(self) -> torch.Tensor:
        return self.loaded.ids

    @property
    def width(self) -> int:
        return vocab_width(self.loaded.model) or len(self.loaded.tokenizer)

    @property
    def vocab(self) -> Any:
        return TokenizerVocab(self.loaded.tokenizer, self.width)

    def _reading(self) -> dict[str, Any]:
        return {"window": self.loaded.window, "bos_token_id": self.loaded.bos_token_id}

    def n_contexts(self, max_contexts: int | None = None) -> int:
        return count_text_contexts(self.ids.numel(), max_contexts)

    def iter_rows(self, *, max_contexts=None, needed=None, progress=False) -> Iterator[RowBlock]:
        for positions, targets, rows in iter_causal_lm_rows(
            self.loaded.model,
            self.ids,
            **self._reading(),
            max_contexts=max_contexts,
            needed=needed,
            batch_windows=self.batch_windows,
            progress=progress,
        ):
            yield positions.numpy(), targets.numpy(), rows

    def rows_at(self, positions, *, progress=False) -> torch.Tensor:
        return causal_lm_rows_at(
            self.loaded.model, self.ids, positions, **self._reading(), progress=progress
        )

    def target_log_probs(self, *, max_contexts=None, progress=False) -> np.ndarray:
        return causal_lm_target_log_probs(
            self.loaded.model,
            self.ids,
            **self._reading(),
            max_contexts=max_contexts,
            progress=progress,
        )

    def describe(self, max_contexts=None) -> dict[str, Any]:
        return {
            "tag": self.tag(max_contexts=max_contexts),
            **self.loaded.record(max_contexts),
            "source": str(self.text_path),
            "split": Path(self.text_path).name,  # what summaries name
        }

    def contexts_protocol(self) -> str:
        contexts = describe_contexts(self.loaded.window, self.loaded.bos_token_id)
        return f"the first n contexts of the text: {contexts}"

    def where(self) -> dict[str, Any]:
        return {"split": Path(self.text_path).name, "source": str(self.text_path)}

    def entry(self, max_contexts=None) -> dict[str, Any]:
        return self.loaded.record(max_contexts)

    def differs_from(self, first, names) -> str | None:
        if not torch.equal(self.ids, first.ids):
            return (
                f"models {names[0]} and {names[1]} tokenise {first.loaded.text} differently; "
                "top-k comparison needs models that share one tokenizer"
            )
        return None

    def tag(self, *, kind="log_prob", max_contexts=None, batch_size=1, bptt=None) -> str:
        # a text is read in windows: batch_size and bptt say nothing of its rows
        if kind != "log_prob":
            raise HFInputError("--kind logits needs a highrank head; --hf models give log_prob")
        return hf_tag(
            self.model_path,
            self.text_path,
            window=self.window_asked,
            bos=self.bos,
            max_contexts=max_contexts,
        )

    def folder(self, out) -> Path:
        if out is None:
            raise HFInputError("--hf needs --out DIR: the records are written there")
        return Path(out)

    def matrix_settings(self, *, kind, batch_size, bptt, max_contexts) -> dict[str, Any]:
        return {
            "model_fingerprint": path_fingerprint(self.model_path),
            "text_fingerprint": path_fingerprint(self.text_path),
            "window_asked": self.window_asked,
            "bos": self.bos,
            "max_contexts": max_contexts,
        }

    def matrix_matches(self, side, settings) -> bool:
        return side.get("hf_settings") == settings

    def record_matches(self, record, settings) -> bool:
        return record.get("hf_settings") == settings  # a rank record keeps no file fingerprints

    def write_matrix(self, path, settings, *, progress=False) -> dict[str, Any]:
        loaded = self.loaded
        return write_hf_logprob_matrix(
            loaded.model,
            loaded.ids,
            path,
            window=loaded.window,
            bos_token_id=loaded.bos_token_id,
            max_contexts=settings["max_contexts"],
            batch_windows=self.batch_windows,
            progress=progress,
            source=str(self.text_path),
            metadata={**loaded.record(settings["max_contexts"]), "hf_settings": settings},
        )

    def writing_note(self, settings, plan) -> str:
        loaded = self.loaded
        return f"{loaded.name}: {loaded.ids.numel():,} tokens of {self.text_path}; {plan}"

    def matrix_description(self, side, settings, seconds, folder) -> dict[str, Any]:
        return {
            "tag": self.tag(max_contexts=settings["max_contexts"]),
            "out_dir": str(folder),
            **{key: value for key, value in side.items() if key not in _MATRIX_ONLY},
            **seconds,
            "threads": torch.get_num_threads(),
        }
