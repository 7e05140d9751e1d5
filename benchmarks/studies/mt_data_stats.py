"""Data statistics for the translation and character-level experiments (issue 10).

    python -m benchmarks.studies.mt_data_stats [--data ../shared/data] [--vocab-size 8000]
        [--model-type bpe] [--separate] [--max-tokens 1024,2048,4096,8192] [--seed 0]
        [--out benchmarks/results/mt-data]

Multi30k en->de (``<data>/multi30k``, raw text): pairs per split; the subword vocabulary
learned on train (joint BPE 8,000 by default, ``highrank.mt.subwords``); subword tokens per side
and split (``<eos>`` not counted), ``<unk>`` tokens, longest sentence; batches per epoch at
each ``max_tokens`` (``highrank.mt.bitext.TokenBatches``: train shuffled with ``--seed``, epochs
0-2, as the count varies a little with the shuffled tie order; valid/test in length order) and
the share of real tokens among the padded ones per side.

PTB characters (``<data>/ptb``, ``data.mode = "char"``, Mikolov's ptb.char symbols): symbols
per split with one ``<eos>`` per line, the vocabulary size, and the bits per character of the
train unigram distribution on each split (the baseline every character model must beat).

Writes ``stats.json`` and ``stats.txt`` (the printed tables) to ``--out``. Everything is
deterministic.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
from importlib.metadata import version
from pathlib import Path

import numpy as np

from benchmarks._common import DATA, REPO, module_name, write_json, write_text
from highrank.data import load_corpus
from highrank.data.chars import bits_per_char
from highrank.mt.bitext import SpecialIds, TokenBatches, encode_pairs, load_bitext
from highrank.mt.subwords import UNK_ID, SubwordSettings, learn_subwords

MODULE = module_name(__file__)  # benchmarks.studies.mt_data_stats


def multi30k_stats(folder: Path, settings: SubwordSettings, max_tokens: list[int], seed: int):
    bitext = load_bitext(folder, "en", "de")
    train = bitext.split("train")
    subwords = learn_subwords(train.src, train.tgt, settings, src_lang="en", tgt_lang="de")
    special = SpecialIds(pad=subwords.tgt.pad_id, bos=subwords.tgt.bos_id, eos=subwords.tgt.eos_id)
    result = {
        "folder": str(folder),
        "direction": "en->de",
        "subwords": {
            **vars(settings),
            "src_size": len(subwords.src),
            "tgt_size": len(subwords.tgt),
        },
        "splits": {},
    }
    for name, split in bitext.splits.items():
        pairs = encode_pairs(split, subwords.src.encode_lines, subwords.tgt.encode_lines)
        row = {"pairs": len(split)}
        for side, ids, lengths in (
            ("en", pairs.src_ids, pairs.src_lengths),
            ("de", pairs.tgt_ids, pairs.tgt_lengths),
        ):
            row[side] = {
                "subword_tokens": int(lengths.sum()),
                "unk_tokens": int(np.count_nonzero(ids == UNK_ID)),
                "mean_length": round(float(lengths.mean()), 2),
                "max_length": int(lengths.max()),
            }
        row["batches"] = batch_stats(pairs, special, max_tokens, seed, train=name == "train")
        result["splits"][name] = row
    return result


def batch_stats(pairs, special: SpecialIds, max_tokens: list[int], seed: int, *, train: bool):
    rows = {}
    for budget in max_tokens:
        row = {}
        for sort_key in ("longest", "target"):
            plans = [
                TokenBatches(
                    pairs,
                    max_tokens=budget,
                    special=special,
                    shuffle=train,
                    seed=seed,
                    epoch=epoch,
                    sort_key=sort_key,
                )
                for epoch in (range(3) if train else range(1))
            ]
            stats = plans[0].padding_stats()
            row[sort_key] = {
                "batches_per_epoch": [len(p) for p in plans],
                "src_real_share": round(stats["src_real"] / stats["src_padded"], 4),
                "tgt_real_share": round(stats["tgt_real"] / stats["tgt_padded"], 4),
                "mean_pairs_per_batch": round(len(pairs) / len(plans[0]), 1),
            }
        rows[str(budget)] = row
    return rows


def ptb_char_stats(folder: Path) -> dict:
    corpus = load_corpus(folder, mode="char", use_cache=False)
    counts = np.bincount(corpus.train.numpy(), minlength=len(corpus.vocab)).astype(np.float64)
    log_p = np.log(counts / counts.sum())  # train unigram, nats; every symbol occurs in train
    splits = {}
    for name in ("train", "valid", "test"):
        stream = corpus.split(name).numpy()
        nll = -float(log_p[stream].sum())
        splits[name] = {
            "lines": corpus.lines[name],
            "symbols_with_eos": int(stream.size),
            "unigram_bpc": round(bits_per_char(nll, int(stream.size)), 4),
        }
    return {
        "folder": str(folder),
        "vocab_size": len(corpus.vocab),
        "uniform_bpc": round(math.log2(len(corpus.vocab)), 4),
        "splits": splits,
    }


def format_tables(mt: dict, chars: dict) -> str:
    sw = mt["subwords"]
    kind = "joint" if sw["joint"] else "separate"
    lines = [
        f"Multi30k {mt['direction']} ({mt['folder']}), {kind} {sw['model_type']} "
        f"{sw['vocab_size']:,} (sizes en {sw['src_size']:,}, de {sw['tgt_size']:,}), "
        "learned on train",
        f"{'split':6} {'pairs':>7} {'en tokens':>10} {'de tokens':>10} {'en <unk>':>8} "
        f"{'de <unk>':>8} {'en mean/max':>12} {'de mean/max':>12}",
    ]
    for name, row in mt["splits"].items():
        en, de = row["en"], row["de"]
        lines.append(
            f"{name:6} {row['pairs']:>7,} {en['subword_tokens']:>10,} {de['subword_tokens']:>10,} "
            f"{en['unk_tokens']:>8,} {de['unk_tokens']:>8,} "
            f"{en['mean_length']:>6}/{en['max_length']:<5} "
            f"{de['mean_length']:>6}/{de['max_length']:<5}"
        )
    lines += [
        "",
        "batches per epoch by max_tokens (train: epochs 0, 1, 2; real share of the padded "
        "tokens, epoch 0); sort 'longest' = max(src, tgt), tgt, src (highrank), "
        "'target' = tgt, src (fairseq)",
    ]
    lines.append(
        f"{'split':6} {'max_tokens':>10} {'sort':>8} {'batches':>16} {'pairs/batch':>11} "
        f"{'en real':>8} {'de real':>8}"
    )
    for name, row in mt["splits"].items():
        for budget, by_key in row["batches"].items():
            for sort_key, b in by_key.items():
                counts = "/".join(str(n) for n in b["batches_per_epoch"])
                lines.append(
                    f"{name:6} {int(budget):>10,} {sort_key:>8} {counts:>16} "
                    f"{b['mean_pairs_per_batch']:>11} "
                    f"{b['src_real_share']:>8.1%} {b['tgt_real_share']:>8.1%}"
                )
    lines += [
        "",
        f'PTB characters ({chars["folder"]}, data.mode = "char"): vocabulary '
        f"{chars['vocab_size']} symbols (<eos> included), uniform {chars['uniform_bpc']} bits",
        f"{'split':6} {'lines':>7} {'symbols (+eos)':>15} {'unigram BPC':>12}",
    ]
    for name, row in chars["splits"].items():
        lines.append(
            f"{name:6} {row['lines']:>7,} {row['symbols_with_eos']:>15,} {row['unigram_bpc']:>12}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DATA))
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--model-type", default="bpe", choices=("bpe", "unigram"))
    parser.add_argument("--separate", action="store_true", help="one vocabulary per language")
    parser.add_argument("--max-tokens", default="1024,2048,4096,8192")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "mt-data"))
    args = parser.parse_args()
    data = Path(args.data)
    for needed in ("multi30k", "ptb"):
        if not (data / needed).is_dir():
            print(f"{data / needed} not found; pass --data <folder with multi30k/ and ptb/>")
            return 2
    settings = SubwordSettings(
        model_type=args.model_type, vocab_size=args.vocab_size, joint=not args.separate
    )
    budgets = [int(x) for x in args.max_tokens.split(",")]
    mt = multi30k_stats(data / "multi30k", settings, budgets, args.seed)
    chars = ptb_char_stats(data / "ptb")
    text = format_tables(mt, chars)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "command": f"python -m {MODULE} " + " ".join(sys.argv[1:]),
        "python": platform.python_version(),
        "sentencepiece": version("sentencepiece"),
        "numpy": np.__version__,
        "multi30k": mt,
        "ptb_char": chars,
    }
    write_json(out / "stats.json", record, indent=1)
    write_text(out / "stats.txt", text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
