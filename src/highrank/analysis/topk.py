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

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from highrank.analysis.commands import add_run_arguments
from highrank.analysis.contexts import RunSplit, count_contexts, iter_contexts, load_run_split
from highrank.analysis.logprob_matrix import head_rows
from highrank.analysis.output import record_tag, run_record_path, write_json
from highrank.data import Vocab
from highrank.data.streaming import streams_equal
from highrank.model import LanguageModel
from highrank.util.argtypes import positive_int
from highrank.util.atomic import write_text_atomic

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


# ---- command line: highrank analyze topk -----------------------------------------------------


def parse_positions(text: str) -> list[int]:
    """``"10,200"`` -> ``[10, 200]`` (argparse type of ``--positions``)."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated stream positions such as 10,200; got {text!r}"
        ) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``highrank analyze topk``."""
    add_run_arguments(parser, hf=True)
    choose = parser.add_mutually_exclusive_group(required=True)
    choose.add_argument(
        "--positions", type=parse_positions, help="stream positions of the contexts, e.g. 10,200"
    )
    choose.add_argument("--random", type=positive_int, metavar="N", help="N random contexts")
    choose.add_argument(
        "--margin",
        type=float,
        metavar="M",
        help="contexts where the first run beats the second by >= M nats on the reference",
    )
    parser.add_argument(
        "--count", type=positive_int, default=10, help="contexts --margin shows at most (10)"
    )
    parser.add_argument("--k", type=positive_int, default=5, help="tokens per model (5)")
    parser.add_argument(
        "--context-words", type=positive_int, default=8, help="context words shown (8)"
    )
    parser.add_argument("--max-contexts", type=positive_int, help="choose among the first N only")
    parser.add_argument("--seed", type=int, default=0, help="seed of --random (0)")
    parser.add_argument("--device", default="cpu", help="where the models run (cpu)")
    parser.add_argument(
        "--out", help="also write topk.json and topk.txt here (with --hf: the records)"
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")


def run(args: argparse.Namespace) -> int:
    """``highrank analyze topk``: print the side-by-side blocks; write JSON and text."""
    from highrank.analysis.hf_contexts import HFInputError, hf_mode

    try:
        record = _hf_record(args) if hf_mode(args) else _record(args)
    except (TopKError, HFInputError) as error:
        print(f"highrank analyze topk: error: {error}", file=sys.stderr)
        return 2
    text = format_report(record["contexts"], _title(record))
    print(text, end="")
    written = []
    if len(args.run_dirs) == 1:
        tag = record_tag(args.split, args.which, max_contexts=args.max_contexts)
        written.append(write_json(run_record_path(args.run_dirs[0], "topk", tag), record))
    if args.out:
        out = Path(args.out)
        written.append(write_json(out / "topk.json", record))
        written.append(write_text_atomic(out / "topk.txt", text))
    if written:
        print("wrote " + ", ".join(map(str, written)))
    return 0


def _record(args: argparse.Namespace) -> dict[str, Any]:
    if args.margin is not None and len(args.run_dirs) < 2:
        raise TopKError("--margin compares two runs (A = first, B = second); got one RUN_DIR")
    splits = [
        load_run_split(
            run_dir, args.split, which=args.which, data_dir=args.data_dir, device=args.device
        )
        for run_dir in args.run_dirs
    ]
    names = run_names(args.run_dirs)
    check_same_vocabulary(names, [split.vocab for split in splits])
    _check_same_stream(names, splits)
    ids = splits[0].ids
    n_contexts = count_contexts(len(ids))  # len: a data.memmap run's ids are a memory map
    if args.max_contexts is not None:
        n_contexts = min(n_contexts, args.max_contexts)
    positions, selection, margins = _select(args, splits, n_contexts)
    records = topk_records(
        [split.model for split in splits],
        ids,
        splits[0].vocab,
        positions,
        names=names,
        k=args.k,
        context_words=args.context_words,
        bptt=[split.bptt for split in splits],
        progress=not args.no_progress,
    )
    for record, margin in zip(records, margins or [], strict=False):
        record["margin"] = margin
    return {
        "split": args.split,
        "checkpoint": args.which,
        "source": splits[0].source,
        "runs": [
            {
                "name": name,
                "run_dir": str(split.run_dir),
                "head": split.config.head.name,
                "bptt": split.bptt,
            }
            for name, split in zip(names, splits, strict=True)
        ],
        "n_contexts": n_contexts,
        "selection": selection,
        "k": args.k,
        "contexts": records,
    }


def _select(args: argparse.Namespace, splits: list[RunSplit], n_contexts: int):
    """``(positions, selection record, margins or None)`` for the chosen mode."""

    def targets(split: RunSplit) -> np.ndarray:
        return target_log_probs(
            split.model,
            split.ids,
            max_contexts=n_contexts,
            bptt=split.bptt,
            progress=not args.no_progress,
        )

    names = [str(split.run_dir) for split in splits[:2]]
    return _choose(args, n_contexts, lambda: [targets(s) for s in splits[:2]], names)


def _choose(args: argparse.Namespace, n_contexts: int, margins_of, names: Sequence[str]):
    """The selection of ``args`` among ``n_contexts`` contexts; ``margins_of()`` gives the
    target log-probs of models A and B (named ``names``) when ``--margin`` asks for them."""
    if args.positions is not None:
        positions = check_positions(args.positions, n_contexts)
        return positions, {"mode": "positions", "positions": positions}, None
    if args.random is not None:
        positions = random_positions(n_contexts, args.random, args.seed)
        return positions, {"mode": "random", "count": args.random, "seed": args.seed}, None
    a, b = margins_of()
    positions, margins = margin_positions(a, b, args.margin, args.count)
    selection = {
        "mode": "margin",
        "margin": args.margin,
        "count": args.count,
        "a": names[0],
        "b": names[1],
        "qualifying": int(np.count_nonzero(a - b >= args.margin)),
        "largest_difference": float(np.max(a - b)),
    }
    return positions.tolist(), selection, margins.tolist()


def _hf_record(args: argparse.Namespace) -> dict[str, Any]:
    """The top-k record of the ``--hf`` models on ``--text`` (all loaded at once: a
    context's rows of every model are needed together)."""
    from highrank.analysis.hf_contexts import (
        TokenizerVocab,
        causal_lm_rows_at,
        causal_lm_target_log_probs,
        count_text_contexts,
        load_text_contexts,
        vocab_width,
    )

    if args.margin is not None and len(args.hf) < 2:
        raise TopKError("--margin compares two models (A = first --hf, B = second); got one")
    loaded = [
        load_text_contexts(
            path,
            args.text,
            window=args.window,
            bos=args.bos,
            device=args.device,
            progress=not args.no_progress,
        )
        for path in args.hf
    ]
    names = run_names([str(path) for path in args.hf])
    _check_same_tokens(names, loaded)
    ids, width = loaded[0].ids, vocab_width(loaded[0].model) or len(loaded[0].tokenizer)
    vocab = TokenizerVocab(loaded[0].tokenizer, width)
    check_k(args.k, width)
    n_contexts = count_text_contexts(ids.numel(), args.max_contexts)
    progress = not args.no_progress

    def reading(model):
        return {"window": model.window, "bos_token_id": model.bos_token_id, "progress": progress}

    def margins_of():
        return [
            causal_lm_target_log_probs(m.model, ids, max_contexts=n_contexts, **reading(m))
            for m in loaded[:2]
        ]

    positions, selection, margins = _choose(args, n_contexts, margins_of, names[:2])
    rows = [causal_lm_rows_at(m.model, ids, positions, **reading(m)) for m in loaded]
    records = context_records(
        rows, ids, vocab, positions, names=names, k=args.k, context_words=args.context_words
    )
    for record, margin in zip(records, margins or [], strict=False):
        record["margin"] = margin
    return {
        "split": Path(args.text).name,
        "source": str(args.text),
        "runs": [
            {"name": name, **m.record(args.max_contexts)}
            for name, m in zip(names, loaded, strict=True)
        ],
        "n_contexts": n_contexts,
        "selection": selection,
        "k": args.k,
        "contexts": records,
    }


def _check_same_tokens(names: Sequence[str], loaded: Sequence[Any]) -> None:
    """Every model's tokenizer read the text into the same ids (one vocabulary)."""
    for name, other in zip(names[1:], loaded[1:], strict=True):
        if not torch.equal(other.ids, loaded[0].ids):
            raise TopKError(
                f"models {names[0]} and {name} tokenise {loaded[0].text} differently; top-k "
                "comparison needs models that share one tokenizer"
            )


def run_names(run_dirs: Sequence[str]) -> list[str]:
    """Short labels: each run directory's name, or its full path when names repeat."""
    names = [Path(run_dir).name or str(run_dir) for run_dir in run_dirs]
    return names if len(set(names)) == len(names) else [str(run_dir) for run_dir in run_dirs]


def _check_same_stream(names: Sequence[str], splits: Sequence[RunSplit]) -> None:
    for name, split in zip(names[1:], splits[1:], strict=True):
        if not streams_equal(split.ids, splits[0].ids):  # memory maps: a block at a time
            raise TopKError(
                f"runs {names[0]} and {name} read different {split.split} streams "
                f"({splits[0].source}, {split.source}); pass one corpus with --data-dir"
            )


def _title(record: dict[str, Any]) -> str:
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
