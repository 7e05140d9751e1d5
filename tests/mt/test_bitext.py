"""highrank.mt.bitext: reading aligned files (and their errors), token-bounded batches, resume."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from highrank.mt.bitext import (
    BitextSplit,
    CorpusError,
    EncodedPairs,
    SpecialIds,
    TokenBatches,
    collate,
    encode_pairs,
    load_bitext,
    plan_batches,
    read_bitext_split,
)
from tests.conftest import SHARED_DATA

MULTI30K = SHARED_DATA / "multi30k"
SPECIAL = SpecialIds(pad=1, bos=0, eos=2)


def write_pair(folder: Path, split: str, src: str | bytes, tgt: str | bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for lang, text in (("en", src), ("de", tgt)):
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        (folder / f"{split}.{lang}").write_bytes(data)
    return folder


def write_corpus(folder: Path) -> Path:
    write_pair(folder, "train", "a man\n  a dog \r\nthe cat", "ein Mann\nein Hund\ndie Katze\n")
    write_pair(folder, "valid", "a cat\n", "eine Katze\n")
    return write_pair(folder, "test", "the man\n", "der Mann\n")


# ---- reading ------------------------------------------------------------------------------


def test_reads_aligned_stripped_lines(tmp_path):
    bitext = load_bitext(write_corpus(tmp_path), "en", "de")
    train = bitext.split("train")
    assert train.src == ("a man", "a dog", "the cat")  # stripped; last line without "\n" counts
    assert train.tgt == ("ein Mann", "ein Hund", "die Katze")
    assert train.line_numbers == (1, 2, 3) and train.skipped == ()
    assert train.src_path == tmp_path / "train.en" and len(bitext.split("test")) == 1
    with pytest.raises(CorpusError, match="split 'dev' was not read"):
        bitext.split("dev")


def test_mismatched_line_counts_name_both_files_and_the_line(tmp_path):
    write_pair(tmp_path, "train", "a\nb\nc\n", "x\ny\n")
    with pytest.raises(CorpusError) as info:
        read_bitext_split(tmp_path, "train", "en", "de")
    message = str(info.value)
    assert f"{tmp_path / 'train.en'} has 3 lines but {tmp_path / 'train.de'} has 2" in message
    assert f"{tmp_path / 'train.de'} ends after line 2, so line 3 of {tmp_path / 'train.en'}" in (
        message
    )


def test_non_utf8_is_reported_with_file_and_byte_offset(tmp_path):
    write_pair(tmp_path, "train", "ok\n", b"gut\nK\xe4se\n")
    with pytest.raises(
        CorpusError,
        match=r"train\.de is not valid UTF-8: byte 0xe4 at byte "
        r"offset 5 \(line 2\)",
    ):
        read_bitext_split(tmp_path, "train", "en", "de")


def test_missing_file_names_the_expected_path(tmp_path):
    write_pair(tmp_path, "train", "a\n", "b\n")
    (tmp_path / "train.de").unlink()
    with pytest.raises(
        CorpusError,
        match=rf"missing file {tmp_path / 'train.de'}: .* holds: "
        r"train\.en",
    ):
        read_bitext_split(tmp_path, "train", "en", "de")
    with pytest.raises(CorpusError, match="does not exist or is not a directory"):
        load_bitext(tmp_path / "nowhere", "en", "de")
    with pytest.raises(CorpusError, match="nowhere does not exist or is not a directory"):
        read_bitext_split(tmp_path / "nowhere", "test", "en", "de")


def test_empty_lines_are_an_error_or_skipped_as_pairs(tmp_path):
    write_pair(tmp_path, "train", "a\n\nc\nd\n", "x\ny\n  \nw\n")
    with pytest.raises(CorpusError, match=r"train\.en line 2 is empty; .*empty='skip'"):
        read_bitext_split(tmp_path, "train", "en", "de")
    split = read_bitext_split(tmp_path, "train", "en", "de", empty="skip")
    assert split.src == ("a", "d") and split.tgt == ("x", "w")
    assert split.line_numbers == (1, 4) and split.skipped == (2, 3)
    with pytest.raises(CorpusError, match="empty='drop' is not known"):
        read_bitext_split(tmp_path, "train", "en", "de", empty="drop")


def test_a_split_without_pairs_is_an_error(tmp_path):
    write_pair(tmp_path, "valid", "", "")
    with pytest.raises(CorpusError, match=r"valid\.de hold no sentence pair \(0 lines"):
        read_bitext_split(tmp_path, "valid", "en", "de")
    write_pair(tmp_path, "test", "\n", "x\n")
    with pytest.raises(CorpusError, match=r"\(1 lines, 1 skipped as empty\)"):
        read_bitext_split(tmp_path, "test", "en", "de", empty="skip")


@pytest.mark.parametrize(
    "src, tgt, match",
    [
        ("en", "en", "both 'en'; expected two languages"),
        (".en", "de", r"data.src_lang = '.en'"),
        ("en", "", "data.tgt_lang = ''"),
    ],
)
def test_bad_language_names_name_the_key(tmp_path, src, tgt, match):
    with pytest.raises(CorpusError, match=match):
        load_bitext(write_corpus(tmp_path), src, tgt)


@pytest.mark.skipif(not MULTI30K.is_dir(), reason=f"Multi30k not found at {MULTI30K}")
def test_multi30k_sizes():
    bitext = load_bitext(MULTI30K, "en", "de")
    assert {name: len(split) for name, split in bitext.splits.items()} == {
        "train": 29000,
        "valid": 1014,
        "test": 1000,
    }
    assert bitext.split("test").tgt[0].startswith("Ein Mann mit einem orangefarbenen Hut")


# ---- ids ----------------------------------------------------------------------------------


def whitespace_ids(lines: list[str]) -> list[list[int]]:
    """A toy encoder: each word's length + 3 (ids >= 4, clear of the specials)."""
    return [[len(word) + 3 for word in line.split()] for line in lines]


def test_encode_pairs_is_csr_and_names_lines_that_encode_to_nothing(tmp_path):
    split = load_bitext(write_corpus(tmp_path), "en", "de").split("train")
    pairs = encode_pairs(split, whitespace_ids, whitespace_ids)
    assert len(pairs) == 3 and pairs.src(1).tolist() == [4, 6] and pairs.tgt(2).tolist() == [6, 8]
    assert pairs.src_lengths.tolist() == [2, 2, 2]
    with pytest.raises(CorpusError, match=r"train\.de line 2 encodes to no tokens"):
        encode_pairs(split, whitespace_ids, lambda lines: [[5], [], [5]])


def random_pairs(n: int, seed: int = 0, longest: int = 30) -> EncodedPairs:
    rng = np.random.default_rng(seed)
    src = [rng.integers(3, 50, rng.integers(1, longest)).tolist() for _ in range(n)]
    tgt = [rng.integers(3, 50, rng.integers(1, longest)).tolist() for _ in range(n)]
    lines = tuple(str(i) for i in range(n))
    split = BitextSplit("train", Path("x.en"), Path("x.de"), lines, lines, tuple(range(1, n + 1)))
    return encode_pairs(split, lambda _: src, lambda _: tgt)


# ---- batches ------------------------------------------------------------------------------


def test_every_pair_once_and_every_batch_within_budget():
    pairs = random_pairs(500)
    src_len, tgt_len = pairs.src_lengths + 1, pairs.tgt_lengths + 1
    for shuffle in (False, True):
        plan = plan_batches(src_len, tgt_len, 200, shuffle=shuffle, seed=3)
        assert np.array_equal(np.sort(np.concatenate(plan)), np.arange(500))
        for batch in plan:
            assert len(batch) * max(src_len[batch].max(), tgt_len[batch].max()) <= 200


def test_unshuffled_batches_are_sorted_and_greedy():
    pairs = random_pairs(300)
    src_len, tgt_len = pairs.src_lengths + 1, pairs.tgt_lengths + 1
    plan = plan_batches(src_len, tgt_len, 150, shuffle=False)
    order = np.concatenate(plan)
    longest = np.maximum(src_len, tgt_len)
    keys = list(zip(longest[order], tgt_len[order], src_len[order], strict=True))
    assert keys == sorted(keys)  # by the longer side, then target length, then source length
    fairseq = np.concatenate(plan_batches(src_len, tgt_len, 150, shuffle=False, sort_key="target"))
    assert list(zip(tgt_len[fairseq], src_len[fairseq], strict=True)) == sorted(
        zip(tgt_len, src_len, strict=True)
    )
    for batch, following in zip(plan, plan[1:], strict=False):
        grown = np.append(batch, following[0])  # the next pair would not have fitted
        assert len(grown) * longest[grown].max() > 150


def test_shuffle_is_a_function_of_seed_and_epoch():
    pairs = random_pairs(400)
    lengths = (pairs.src_lengths + 1, pairs.tgt_lengths + 1)

    def plan(seed, epoch):
        return [
            b.tolist() for b in plan_batches(*lengths, 120, shuffle=True, seed=seed, epoch=epoch)
        ]

    assert plan(1, 0) == plan(1, 0)
    assert plan(1, 0) != plan(1, 1) and plan(1, 0) != plan(2, 0)


def test_max_sentences_and_oversized_pairs():
    pairs = random_pairs(100)
    lengths = (pairs.src_lengths + 1, pairs.tgt_lengths + 1)
    plan = plan_batches(*lengths, 10_000, shuffle=False, max_sentences=7)
    assert max(len(b) for b in plan) == 7
    with pytest.raises(
        CorpusError,
        match=r"pair \d+ has \d+ source and \d+ target tokens .* "
        r"more than max_tokens=10",
    ):
        plan_batches(*lengths, 10, shuffle=False)
    with pytest.raises(CorpusError, match="max_tokens must be a positive int; got 0"):
        plan_batches(*lengths, 0, shuffle=False)


def test_collate_layout_with_bos_eos_and_padding():
    pairs = EncodedPairs(
        np.array([5, 6, 7, 8]), np.array([0, 3, 4]), np.array([9, 10, 11]), np.array([0, 1, 3])
    )
    batch = collate(pairs, np.array([1, 0]), SPECIAL)
    assert batch.src.tolist() == [[8, 2, 1, 1], [5, 6, 7, 2]]  # x <eos> <pad>..
    assert batch.tgt_in.tolist() == [[0, 10, 11], [0, 9, 1]]  # <bos> y <pad>..
    assert batch.tgt_out.tolist() == [[10, 11, 2], [9, 2, 1]]  # y <eos> <pad>..
    assert batch.src_lengths.tolist() == [2, 4] and batch.tgt_lengths.tolist() == [3, 2]
    assert batch.index.tolist() == [1, 0] and batch.n_target_tokens == 5 and len(batch) == 2
    assert batch.src_padding.tolist() == [[False, False, True, True], [False] * 4]
    assert batch.tgt_padding.tolist() == [[False] * 3, [False, False, True]]
    assert batch.src.dtype == torch.long
    time_major = collate(pairs, np.array([1, 0]), SPECIAL, batch_first=False)
    assert torch.equal(time_major.src, batch.src.t()) and time_major.src.is_contiguous()
    assert torch.equal(time_major.tgt_out, batch.tgt_out.t())
    assert torch.equal(time_major.src_padding, batch.src_padding)  # masks stay (B, S)


def test_resuming_at_a_batch_index_gives_the_same_batches():
    pairs = random_pairs(300)
    kwargs = {"max_tokens": 160, "special": SPECIAL, "shuffle": True, "seed": 7, "epoch": 2}
    full = list(TokenBatches(pairs, **kwargs))
    resumed = list(TokenBatches(pairs, **kwargs).iter_from(5))  # a fresh object, as on resume
    assert len(resumed) == len(full) - 5
    for a, b in zip(full[5:], resumed, strict=True):
        assert torch.equal(a.src, b.src) and torch.equal(a.tgt_out, b.tgt_out)
        assert torch.equal(a.index, b.index)
    with pytest.raises(IndexError, match="cannot resume at batch"):
        next(TokenBatches(pairs, **kwargs).iter_from(len(full) + 1))


def test_max_len_drops_long_pairs_and_padding_stats_count_tokens():
    pairs = random_pairs(200)
    batches = TokenBatches(pairs, max_tokens=300, special=SPECIAL, shuffle=False, max_len=20)
    src_len, tgt_len = pairs.src_lengths + 1, pairs.tgt_lengths + 1
    expected = np.flatnonzero((src_len > 20) | (tgt_len > 20))
    assert np.array_equal(batches.dropped, expected) and expected.size > 0
    seen = np.concatenate([b.index.numpy() for b in batches])
    assert np.array_equal(np.sort(seen), np.setdiff1d(np.arange(200), expected))
    stats = batches.padding_stats()
    assert stats["src_real"] == int(src_len[seen].sum())
    assert stats["tgt_padded"] == sum(b.tgt_out.numel() for b in batches)
    assert stats["src_padded"] == sum(b.src.numel() for b in batches)


def test_special_ids_must_be_distinct():
    with pytest.raises(CorpusError, match="expected three distinct ints"):
        SpecialIds(pad=1, bos=1, eos=2)


def test_core_package_imports_no_translation_extra():
    """``import highrank`` (and its heads, model, data) loads neither these modules nor the
    mt extra; importing bitext, subwords and bleu loads no extra either (they import it on use)."""
    code = (
        "import sys, highrank, highrank.heads, highrank.model, highrank.models, highrank.data\n"
        "mt = {'highrank.mt.bitext', 'highrank.mt.subwords', 'highrank.mt.bleu'}\n"
        "assert not mt & set(sys.modules)\n"
        "import highrank.mt.bitext, highrank.mt.subwords, highrank.mt.bleu\n"
        "assert not {'sentencepiece', 'sacrebleu'} & set(sys.modules), sys.modules.keys()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
