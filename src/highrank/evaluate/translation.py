"""A trained translation run: loading it, translating a split and scoring it with BLEU.

The run's data (parallel text and its saved subword vocabulary) is read by
:mod:`highrank.mt.translation_data`; the model is built by
:func:`highrank.models.build_seq2seq` and decoded by :mod:`highrank.models.decoding`.

Translating a split (:func:`translate_split`): sources are encoded, cut into batches of at most
``train.max_tokens`` padded tokens in length order (:class:`highrank.mt.bitext.TokenBatches`),
decoded by beam search (or greedy search) with at most ``decode.max_len_a * S +
decode.max_len_b`` tokens per sentence (``S``: the longest source of the batch, ``<eos>``
included; never beyond ``model.max_len``), put back in file order and detokenised by the target
vocabulary. BLEU (:mod:`highrank.mt.bleu`) is sacreBLEU's on the raw target lines of the split.

Records (:func:`write_translation`): ``RUN_DIR/translate-<split>-<checkpoint>-<search>.json``
(BLEU, signature, settings, time) and the hypotheses, one per line, beside it as ``.txt`` (or
where ``--out`` says), both written atomically. ``<search>`` is e.g. ``greedy-len1.5x+10`` or
``beam5-lp1-len1.5x+10``.

Needs the optional extra ``mt`` (sentencepiece, sacrebleu) when used; importing it does not.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from highrank.config import Config
from highrank.models import beam_search, build_seq2seq, greedy_search
from highrank.mt.bitext import BitextSplit, TokenBatches, encode_pairs
from highrank.mt.bleu import corpus_bleu  # sacrebleu is imported when used
from highrank.mt.subwords import Subwords
from highrank.mt.translation_data import load_subwords, read_bitext
from highrank.runs.checkpoint import (
    CheckpointError,
    checkpoint_path,
    config_of,
    load_checkpoint,
    load_weights,
)
from highrank.util.atomic import write_text_atomic
from highrank.util.denormals import flush_denormals
from highrank.util.progress import progress_bar

# ---- a trained run ----------------------------------------------------------------------------


def load_translation_run(
    run_dir: str | os.PathLike, which: str = "best", *, device: str | torch.device = "cpu"
) -> tuple[torch.nn.Module, Config, Subwords, dict[str, Any]]:
    """``(model in eval mode, config, subwords, checkpoint payload)`` of a translation run."""
    if not Path(run_dir).is_dir():
        raise CheckpointError(f"run directory {run_dir} does not exist")
    path = checkpoint_path(run_dir, which)
    if which == "best" and not path.is_file() and checkpoint_path(run_dir, "last").is_file():
        raise CheckpointError(
            f"checkpoint {path} does not exist: best.pt is written at the first validation, "
            "and this run stopped before one; use --which last"
        )
    payload = load_checkpoint(path)
    config = config_of(payload, path)
    if config.model.backbone != "seq2seq":
        raise CheckpointError(
            f"{path} is a {config.model.backbone!r} run, not a translation (seq2seq) run"
        )
    subwords = load_subwords(run_dir, config)
    with torch.random.fork_rng(devices=[]):  # initialisation draws; keep the caller's stream
        model = build_seq2seq(config, (len(subwords.src), len(subwords.tgt)))
    load_weights(model, payload["model"], path)
    return model.to(device).eval(), config, subwords, payload


# ---- translating a split ----------------------------------------------------------------------


@dataclass(frozen=True)
class Search:
    """How to decode: beam search (``beam_size``, GNMT ``length_penalty``) or greedy."""

    beam_size: int
    length_penalty: float
    max_len_a: float
    max_len_b: int
    greedy: bool = False

    @classmethod
    def from_config(cls, config: Config, **changes: Any) -> Search:
        d = config.decode
        values = {
            "beam_size": d.beam_size,
            "length_penalty": d.length_penalty,
            "max_len_a": d.max_len_a,
            "max_len_b": d.max_len_b,
        }
        values.update({k: v for k, v in changes.items() if v is not None})
        return cls(**values)

    @property
    def name(self) -> str:
        """``greedy-len1.5x+10`` or ``beam5-lp1-len1.5x+10``: part of the record's file name."""
        length = f"len{self.max_len_a:g}x+{self.max_len_b}"
        if self.greedy:
            return f"greedy-{length}"
        return f"beam{self.beam_size}-lp{self.length_penalty:g}-{length}"

    def max_len(self, source_length: int, limit: int) -> int:
        return max(1, min(limit, math.floor(self.max_len_a * source_length) + self.max_len_b))


@torch.no_grad()
@flush_denormals()
def translate_split(
    model: torch.nn.Module,
    subwords: Subwords,
    split: BitextSplit,
    search: Search,
    *,
    max_tokens: int,
    max_len: int,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> list[str]:
    """Detokenised translations of the sources of ``split``, in file order (a progress bar
    counts the sentences: decoding a test set takes minutes on a CPU)."""
    pairs = encode_pairs(split, subwords.src.encode_lines, subwords.tgt.encode_lines)
    special = subwords.special_ids()
    batches = TokenBatches(pairs, max_tokens=max_tokens, special=special, shuffle=False)
    out: list[str] = [""] * len(split)
    ids = {"bos_id": special.bos, "eos_id": special.eos, "pad_id": special.pad}
    bar = progress_bar(total=len(split), desc=f"translate ({search.name})", unit="sentence",
                       disable=not progress)
    for batch in batches:
        src = batch.src.to(device)  # (B, S)
        limit = search.max_len(src.shape[1], max_len)
        if search.greedy:
            tokens = [h.tokens for h in greedy_search(model, src, max_len=limit, **ids)]
        else:
            hyps = beam_search(
                model,
                src,
                beam_size=search.beam_size,
                length_penalty_alpha=search.length_penalty,
                max_len=limit,
                **ids,
            )
            tokens = [h[0].tokens for h in hyps]
        texts = subwords.tgt.decode_lines(tokens)
        for index, text in zip(batch.index.tolist(), texts, strict=True):
            out[index] = text
        bar.update(len(texts))
    bar.close()
    return out


def record_stem(split: str, which: str, search: Search) -> str:
    """``translate-<split>-<checkpoint>-<search>``."""
    return f"translate-{split}-{Path(which).stem}-{search.name}"


def write_translation(
    run_dir: str | os.PathLike,
    record: dict[str, Any],
    hypotheses: list[str],
    stem: str,
    out: str | os.PathLike | None = None,
) -> tuple[Path, Path]:
    """Write the hypotheses (``out`` or ``RUN_DIR/<stem>.txt``) and the record
    ``RUN_DIR/<stem>.json``, each atomically; returns their paths."""
    text_path = Path(out) if out is not None else Path(run_dir) / f"{stem}.txt"
    write_text_atomic(text_path, "".join(h + "\n" for h in hypotheses))
    record = {**record, "hypotheses": str(text_path)}
    json_path = Path(run_dir) / f"{stem}.json"
    write_text_atomic(json_path, json.dumps(record, indent=2) + "\n")
    return json_path, text_path


@flush_denormals()
def evaluate_bleu(
    run_dir: str | os.PathLike,
    *,
    split: str = "test",
    which: str = "best",
    search: Search | None = None,
    data_dir: str | None = None,
    out: str | os.PathLike | None = None,
    device: str | torch.device = "cpu",
    **search_changes: Any,
) -> dict[str, Any]:
    """Translate ``split`` with a run's checkpoint, score it, write the record and the
    hypotheses; returns the record. ``search`` defaults to the run's ``[decode]`` with
    ``search_changes`` (beam_size=, length_penalty=, greedy=, ...) applied."""
    model, config, subwords, payload = load_translation_run(run_dir, which, device=device)
    search = search or Search.from_config(config, **search_changes)
    corpus = read_bitext(config, (split,), data_dir).split(split)
    start = time.perf_counter()
    hypotheses = translate_split(
        model,
        subwords,
        corpus,
        search,
        max_tokens=config.train.max_tokens,
        max_len=config.model.max_len,
        device=device,
    )
    seconds = time.perf_counter() - start
    bleu = corpus_bleu(hypotheses, list(corpus.tgt))
    record = {
        "split": split,
        "checkpoint": which,
        "step": payload["training"]["progress"]["step"] if "training" in payload else None,
        "references": str(corpus.tgt_path),
        "sentences": len(corpus),
        **bleu.as_dict(),
        "search": {**search.__dict__, "name": search.name},
        "seconds": round(seconds, 3),
        "torch_threads": torch.get_num_threads(),
    }
    json_path, text_path = write_translation(
        run_dir, record, hypotheses, record_stem(split, which, search), out
    )
    return {**record, "record": str(json_path), "hypotheses": str(text_path)}


__all__ = [
    "Search",
    "evaluate_bleu",
    "load_translation_run",
    "record_stem",
    "translate_split",
    "write_translation",
]
