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

From Python, :func:`analyze_topk` takes the row sources (:mod:`highrank.analysis.rows`) of
either kind, one code path for both::

    analyze_topk([RowSource.from_run("runs/ptb-mos"), RowSource.from_run("runs/ptb-softmax")],
                 margin=2.0, count=10)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from highrank.analysis.contexts import count_contexts
from highrank.analysis.rows import RowSource, RunRows, vocabulary_difference
from highrank.data import Vocab
from highrank.models import LanguageModel

DEFAULT_BPTT = 70  # segment length of the context stream (the state is carried across)
MARK = "*"  # before the reference token in a model's column


class TopKError(ValueError):
    """A selection or a set of runs that the top-k comparison cannot use."""


# ---- rows of chosen contexts -----------------------------------------------------------------


def rows_at(
    model: LanguageModel,
    ids: torch.Tensor,
    positions: Sequence[int],
    *,
    bptt: int = DEFAULT_BPTT,
    progress: bool = False,
) -> torch.Tensor:
    """``(len(positions), V)`` float32 log-probs (CPU) of the contexts at ``positions``
    (any order, repeats allowed) of a highrank model on the stream ``ids``, streamed once up
    to the last of them (:meth:`~highrank.analysis.rows.RowSource.rows_at`)."""
    return RunRows.of_model(model, ids, bptt=bptt).rows_at(positions, progress=progress)


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
    source = RunRows.of_model(model, ids, bptt=bptt)
    return source.target_log_probs(max_contexts=max_contexts, progress=progress)


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
        problem = vocabulary_difference((names[0], name), vocabs[0], vocab)
        if problem is not None:
            raise TopKError(problem)


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


# ---- the whole comparison ---------------------------------------------------------------------

# What --margin says when one source is given, by the kind of source.
_MARGIN_NEEDS_TWO = {
    "run": "--margin compares two runs (A = first, B = second); got one RUN_DIR",
    "text": "--margin compares two models (A = first --hf, B = second); got one",
}


def analyze_topk(
    sources: Sequence[RowSource],
    *,
    positions: Sequence[int] | None = None,
    random: int | None = None,
    margin: float | None = None,
    count: int = 10,
    k: int = 5,
    context_words: int = 8,
    max_contexts: int | None = None,
    seed: int = 0,
    progress: bool = False,
) -> dict[str, Any]:
    """The top-``k`` next tokens of several :class:`~highrank.analysis.rows.RowSource` that
    read the same contexts (runs on one split, or causal LMs sharing a tokenizer on one text),
    side by side with the reference token, at the contexts chosen by exactly one of
    ``positions``, ``random`` (that many, seeded) or ``margin`` (where the first source gives
    the reference token at least ``margin`` nats more than the second; at most ``count``),
    among the first ``max_contexts``. Returns the record (``contexts``: one per position)."""
    sources = list(sources)
    if sum(x is not None for x in (positions, random, margin)) != 1:
        raise TopKError("choose the contexts with exactly one of positions, random, margin")
    if margin is not None and len(sources) < 2:
        raise TopKError(_MARGIN_NEEDS_TWO[sources[0].kind])
    for source in sources:  # all at once: a context's rows of every model are needed together
        source.load(progress=progress)
    names = run_names([source.name for source in sources])
    first = sources[0]
    for name, source in zip(names[1:], sources[1:], strict=True):
        problem = source.differs_from(first, (names[0], name))
        if problem is not None:
            raise TopKError(problem)
    n_contexts = first.n_contexts(max_contexts)
    if positions is not None:
        chosen = check_positions(positions, n_contexts)
        selection, margins = {"mode": "positions", "positions": chosen}, None
    elif random is not None:
        chosen = random_positions(n_contexts, random, seed)
        selection, margins = {"mode": "random", "count": random, "seed": seed}, None
    else:
        a, b = (s.target_log_probs(max_contexts=n_contexts, progress=progress) for s in sources[:2])
        found, differences = margin_positions(a, b, margin, count)
        chosen, margins = found.tolist(), differences.tolist()
        # runs are named by their folders here, models by their short names (as always)
        a_b = [s.name for s in sources[:2]] if first.kind == "run" else names[:2]
        selection = {
            "mode": "margin",
            "margin": margin,
            "count": count,
            "a": a_b[0],
            "b": a_b[1],
            "qualifying": int(np.count_nonzero(a - b >= margin)),
            "largest_difference": float(np.max(a - b)),
        }
    check_k(k, first.width)
    rows = [source.rows_at(chosen, progress=progress) for source in sources]
    records = context_records(
        rows, first.ids, first.vocab, chosen, names=names, k=k, context_words=context_words
    )
    for record, difference in zip(records, margins or [], strict=False):
        record["margin"] = difference
    return {
        **first.where(),
        "runs": [
            {"name": name, **source.entry(max_contexts)}
            for name, source in zip(names, sources, strict=True)
        ],
        "n_contexts": n_contexts,
        "selection": selection,
        "k": k,
        "contexts": records,
    }


def run_names(run_dirs: Sequence[str]) -> list[str]:
    """Short labels: each run directory's name, or its full path when names repeat."""
    names = [Path(run_dir).name or str(run_dir) for run_dir in run_dirs]
    return names if len(set(names)) == len(names) else [str(run_dir) for run_dir in run_dirs]


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


def report_title(record: dict[str, Any]) -> str:
    """The title line(s) of a top-k record's text report: the runs, and the selection by
    margin when that chose the contexts."""
    selection = record["selection"]
    runs = ", ".join(f"{r['name']} ({r['head']})" for r in record["runs"])
    text = f"top-{record['k']} next tokens on {record['split']} ({record['source']}): {runs}"
    if selection["mode"] != "margin":
        return text
    a, b = (run["name"] for run in record["runs"][:2])
    return text + (
        f"\nA = {a}, B = {b}: {selection['qualifying']} contexts where A gives the reference "
        f"token >= {selection['margin']} nats more than B (largest difference "
        f"{selection['largest_difference']:+.3f}); showing {len(record['contexts'])}"
    )


def format_report(records: Sequence[dict[str, Any]], title: str = "") -> str:
    """All blocks, numbered, after ``title`` and a legend line."""
    legend = f"{MARK} marks the reference token (the actual next word, in [brackets])\n"
    blocks = [format_record(record, i + 1) for i, record in enumerate(records)]
    return (title + "\n" if title else "") + legend + "\n" + "\n".join(blocks)
