"""Top-k comparison: several models' most likely next tokens for the same contexts.

For each chosen context, every model's ``k`` most probable next tokens with their
probabilities, side by side, under the reference continuation (the token that actually
follows, after the last few words of the context) — the qualitative table of Yang et al.
(2018, Table 6), where MoS spreads its mass over continuations a softmax cannot all rank high.

Contexts are those of :func:`~highrank.analysis.contexts.iter_contexts` with ``batch_size=1``
(stream order: context ``i`` ends at token ``i`` and predicts token ``i + 1``). They are chosen

* explicitly, by stream position (``--positions 10,200``);
* at random: ``N`` distinct positions drawn uniformly without replacement by
  ``numpy.random.default_rng(seed).choice(n, N, replace=False)``, shown in stream order;
* by margin: the contexts where model A (the first run) gives the reference token at least
  ``M`` nats more log-probability than model B (the second run), largest margin first (ties
  by position), the first ``count`` of them. This needs one float per context and model.

Only the chosen rows of the ``(n, V)`` log-prob matrix are ever kept: each model's contexts
are streamed once and the head runs on the chosen contexts only.

    highrank analyze topk runs/ptb-mos runs/ptb-softmax --margin 2 --count 10

Hugging Face causal LMs (``--hf MODEL``, repeated to compare; one tokenizer) are read on a
text as :mod:`highrank.analysis.hf_contexts` says: position ``i`` is the context ending at
token ``i`` of its window, tokens are shown as the ``repr`` of their decoded text::

    highrank analyze topk --hf model-a/ --hf model-b/ --text test.txt --random 5 --out topk/
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from highrank.analysis.contexts import count_contexts, iter_contexts
from highrank.analysis.logprob_matrix import head_rows
from highrank.data import Vocab
from highrank.model import LanguageModel

DEFAULT_BPTT = 70  # segment length of the context stream (the state is carried across)
MARK = "*"  # before the reference token in a model's column


class TopKError(ValueError):
    """A selection or a set of runs that the top-k comparison cannot use."""


# ---- rows of chosen contexts -----------------------------------------------------------------


@torch.no_grad()
def rows_at(
    model: LanguageModel,
    ids: torch.Tensor,
    positions: Sequence[int],
    *,
    bptt: int = DEFAULT_BPTT,
    progress: bool = False,
) -> torch.Tensor:
    """``(len(positions), V)`` float32 log-probs (CPU) of the contexts at ``positions``
    (any order, repeats allowed), streamed once up to the last of them."""
    wanted = sorted({int(p) for p in positions})
    if not wanted:
        return torch.empty(0, model.head.vocab_size)
    mask = torch.zeros(wanted[-1] + 1, dtype=torch.bool)
    mask[wanted] = True
    found: dict[int, torch.Tensor] = {}
    for block in iter_contexts(model, ids, max_contexts=len(mask), bptt=bptt, progress=progress):
        chosen = mask[block.positions]  # (b,)
        if chosen.any():
            rows = head_rows(model.head, block.hidden[chosen.to(block.hidden.device)]).cpu()
            found.update(zip(block.positions[chosen].tolist(), rows, strict=True))
    return torch.stack([found[int(p)] for p in positions])


@torch.no_grad()
def target_log_probs(
    model: LanguageModel,
    ids: torch.Tensor,
    *,
    max_contexts: int | None = None,
    bptt: int = DEFAULT_BPTT,
    progress: bool = False,
) -> np.ndarray:
    """``(n,)`` float64 ``log P(ids[i + 1] | context i)`` of the first ``n`` contexts, from
    the same float32 rows as :func:`rows_at` (one number per context is kept)."""
    values = []
    for block in iter_contexts(model, ids, max_contexts=max_contexts, bptt=bptt, progress=progress):
        rows = head_rows(model.head, block.hidden)  # (b, V)
        target = block.targets.to(rows.device)[:, None]
        values.append(rows.gather(1, target)[:, 0].cpu().double())
    return torch.cat(values).numpy()


# ---- choosing contexts -----------------------------------------------------------------------


def check_positions(positions: Sequence[int], n_contexts: int) -> list[int]:
    """``positions`` without repeats (first occurrence kept), each in ``0 .. n_contexts-1``."""
    bad = [p for p in positions if not 0 <= p < n_contexts]
    if bad:
        raise TopKError(
            f"--positions {', '.join(map(str, bad[:5]))}: out of range; the split has "
            f"{n_contexts} contexts, positions 0 .. {n_contexts - 1}"
        )
    return list(dict.fromkeys(int(p) for p in positions))


def random_positions(n_contexts: int, count: int, seed: int) -> list[int]:
    """``count`` distinct positions uniform without replacement, in stream order."""
    if not 1 <= count <= n_contexts:
        raise TopKError(f"--random {count}: expected 1 .. {n_contexts} (the split's contexts)")
    chosen = np.random.default_rng(seed).choice(n_contexts, size=count, replace=False)
    return sorted(int(p) for p in chosen)


def margin_positions(
    log_probs_a: np.ndarray, log_probs_b: np.ndarray, margin: float, count: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(positions, margins)``: the contexts where ``a - b >= margin`` (target log-probs of
    models A and B), largest difference first, ties by position, at most ``count``."""
    a, b = np.asarray(log_probs_a, np.float64), np.asarray(log_probs_b, np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"expected two (n,) vectors of one length; got {a.shape}, {b.shape}")
    difference = a - b  # (n,)
    candidates = np.flatnonzero(difference >= margin)
    order = np.lexsort((candidates, -difference[candidates]))[:count]
    chosen = candidates[order]
    return chosen, difference[chosen]


def check_same_vocabulary(names: Sequence[str], vocabs: Sequence[Vocab]) -> None:
    """Every vocabulary equals the first (same tokens, same ids); the error names both runs."""
    for name, vocab in zip(names[1:], vocabs[1:], strict=True):
        if vocab.words == vocabs[0].words:
            continue
        pairs = zip(vocabs[0].words, vocab.words, strict=False)  # up to the shorter
        differ = next(
            (i for i, (u, v) in enumerate(pairs) if u != v), min(len(vocab), len(vocabs[0]))
        )
        raise TopKError(
            f"runs {names[0]} and {name} have different vocabularies ({len(vocabs[0])} vs "
            f"{len(vocab)} tokens, first difference at id {differ}); top-k comparison needs "
            "models trained on one corpus"
        )


# ---- records ---------------------------------------------------------------------------------


def model_entry(row: torch.Tensor, target: int, vocab: Vocab, k: int) -> dict[str, Any]:
    """One model's top ``k`` of a log-prob ``row (V,)`` and how it rates the ``target``."""
    values, indices = torch.topk(row, k)
    target_log_prob = float(row[target])
    return {
        "top": [
            {"id": int(i), "word": vocab.word(int(i)), "prob": float(v.exp()), "log_prob": float(v)}
            for v, i in zip(values, indices, strict=True)
        ],
        "target_log_prob": target_log_prob,
        "target_prob": float(np.exp(target_log_prob)),
        "target_rank": int((row > row[target]).sum()) + 1,
        "target_in_top": target in indices.tolist(),
    }


def topk_records(
    models: Sequence[LanguageModel],
    ids: torch.Tensor,
    vocab: Vocab,
    positions: Sequence[int],
    *,
    names: Sequence[str] | None = None,
    k: int = 5,
    context_words: int = 8,
    bptt: int | Sequence[int] = DEFAULT_BPTT,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """One plain record per position: the context's last words, the reference token, and
    each model's top ``k`` (models share ``vocab``; ``names`` label them). ``bptt``: one
    segment length for every model, or one per model (each run read as it was trained)."""
    check_k(k, len(vocab))
    positions = check_positions(positions, count_contexts(len(ids)))  # ids may be a memmap
    bptts = [bptt] * len(models) if isinstance(bptt, int) else list(bptt)
    rows = [
        rows_at(m, ids, positions, bptt=b, progress=progress)
        for m, b in zip(models, bptts, strict=True)
    ]
    names = list(names) if names is not None else [f"model {i + 1}" for i in range(len(models))]
    return context_records(
        rows, ids, vocab, positions, names=names, k=k, context_words=context_words
    )


def check_k(k: int, vocab_size: int) -> None:
    if not 1 <= k <= vocab_size:
        raise TopKError(f"--k {k}: expected 1 .. {vocab_size} (the vocabulary size)")


def context_records(
    rows: Sequence[torch.Tensor],
    ids: torch.Tensor,
    vocab: Vocab,
    positions: Sequence[int],
    *,
    names: Sequence[str],
    k: int = 5,
    context_words: int = 8,
) -> list[dict[str, Any]]:
    """The records of :func:`topk_records` from each model's log-prob ``rows``
    ``(len(positions), V)`` at ``positions`` (any source of rows: a run, a causal LM)."""
    records = []
    for index, position in enumerate(positions):
        target = int(ids[position + 1])
        start = max(0, position - context_words + 1)
        records.append(
            {
                "position": int(position),
                "context": vocab.decode(ids[start : position + 1]),
                "context_truncated": start > 0,
                "target": vocab.word(target),
                "target_id": target,
                "models": [
                    {"name": name, **model_entry(r[index], target, vocab, k)}
                    for name, r in zip(names, rows, strict=True)
                ],
            }
        )
    return records


# ---- text ------------------------------------------------------------------------------------


def format_prob(prob: float) -> str:
    """``p=0.123``, or ``p=1.2e-05`` below 0.001."""
    return f"p={prob:.3f}" if prob >= 0.001 else f"p={prob:.1e}"


def format_record(record: dict[str, Any], number: int | None = None) -> str:
    """The text block of one context: header, words ... [target], one column per model."""
    label = f"#{number}  " if number is not None else ""
    header = f"{label}position {record['position']}"
    if "margin" in record:
        header += f"  (A - B: {record['margin']:+.3f} nats on the reference token)"
    words = ["..."] if record["context_truncated"] else []
    sentence = " ".join([*words, *record["context"], f"[{record['target']}]"])
    columns = [_column(entry, record["target_id"]) for entry in record["models"]]
    widths = [max(map(len, column)) for column in columns]
    lines = [
        "  " + "   ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True))
        for cells in zip(*columns, strict=True)
    ]
    return "\n".join([header, "  " + sentence, *(line.rstrip() for line in lines)]) + "\n"


def _column(entry: dict[str, Any], target_id: int) -> list[str]:
    """A model's column: its name, ``k`` lines ``word p=...`` (reference marked), the target."""
    width = max(len(token["word"]) for token in entry["top"])
    cells = [entry["name"]]
    for token in entry["top"]:
        mark = MARK if token["id"] == target_id else " "
        cells.append(f"{mark} {token['word'].ljust(width)} {format_prob(token['prob'])}")
    cells.append(f"reference {format_prob(entry['target_prob'])} rank {entry['target_rank']}")
    return cells


def format_report(records: Sequence[dict[str, Any]], title: str = "") -> str:
    """All blocks, numbered, after ``title`` and a legend line."""
    legend = f"{MARK} marks the reference token (the actual next word, in [brackets])\n"
    blocks = [format_record(record, i + 1) for i, record in enumerate(records)]
    return (title + "\n" if title else "") + legend + "\n" + "\n".join(blocks)
