"""highrank.data: reading, vocabulary order, errors, the token cache, char mode, batching, stats."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from highrank.data import (
    EOS,
    UNK,
    CorpusError,
    Vocab,
    batchify,
    corpus_stats,
    format_stats,
    get_batch,
    iter_batches,
    load_corpus,
)
from highrank.data import corpus as data
from tests.conftest import SHARED_DATA, write_splits


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def load(folder: Path, cache: Path, **kwargs) -> data.Corpus:
    return load_corpus(folder, cache_dir=cache, **kwargs)


def shared_corpus(name: str) -> Path:
    folder = SHARED_DATA / name
    if not (folder / "train.txt").is_file():
        pytest.skip(f"benchmark data not found at {folder} (expected the repo's sibling shared/)")
    return folder


# ---- reading and the vocabulary -----------------------------------------------------------


def test_vocab_is_ordered_by_train_frequency_with_ties_by_first_appearance(tmp_path, cache):
    # counts: c 3, <eos> 3, a 2, b 2, d 1; b and a tie (b seen first), c and <eos> tie (c first).
    folder = write_splits(tmp_path / "c", "b c a\nc a b\nc d\n", valid="a\n", test="d\n")
    corpus = load(folder, cache)
    assert corpus.vocab.words == ("c", EOS, "b", "a", "d")
    assert corpus.train.tolist() == corpus.vocab.encode("b c a <eos> c a b <eos> c d <eos>".split())


def test_valid_and_test_do_not_enter_the_vocabulary(tmp_path, cache):
    folder = write_splits(tmp_path / "c", f"a {UNK}\n", valid="a zzz\n", test="a\n")
    corpus = load(folder, cache)
    assert "zzz" not in corpus.vocab and len(corpus.vocab) == 3


def test_eos_per_line_and_blank_lines(tmp_path, cache):
    folder = write_splits(tmp_path / "c", " a  b \n\n\na\n", valid="a\n\n", test="a")
    corpus = load(folder, cache)
    v = corpus.vocab
    assert v.decode(corpus.train) == ["a", "b", EOS, EOS, EOS, "a", EOS]
    assert v.decode(corpus.valid) == ["a", EOS, EOS]
    assert v.decode(corpus.test) == ["a", EOS]  # a last line without "\n" still ends in <eos>
    assert corpus.lines == {"train": 4, "valid": 2, "test": 1}
    assert corpus.train.dtype == torch.int64


def test_unknown_words_map_to_unk_and_are_counted(tmp_path, cache):
    folder = write_splits(tmp_path / "c", f"a {UNK} b\n", valid=f"a x {UNK} y\n", test="b\n")
    corpus = load(folder, cache)
    assert corpus.vocab.decode(corpus.valid) == ["a", UNK, UNK, UNK, EOS]
    assert corpus.oov == {"train": 0, "valid": 2, "test": 0}  # the literal <unk> is not OOV


def test_unknown_word_without_unk_names_file_line_and_word(tmp_path, cache):
    folder = write_splits(tmp_path / "c", "a b\n", valid="a\nb b\nb zebra a\n")
    with pytest.raises(CorpusError) as info:
        load(folder, cache)
    message = str(info.value)
    assert "valid.txt line 3" in message and "'zebra'" in message and UNK in message


def test_vocab_api_round_trip_and_errors(tmp_path):
    vocab = Vocab(["x", EOS, UNK, "ü"])
    assert len(vocab) == 4 and vocab.id("ü") == 3 and vocab.word(1) == EOS
    assert vocab.eos_id == 1 and vocab.unk_id == 2
    assert vocab.encode(["x", "never-seen"]) == [0, 2]
    assert vocab.decode(torch.tensor([3, 0])) == ["ü", "x"]
    vocab.save(tmp_path / "vocab.json")
    assert Vocab.load(tmp_path / "vocab.json") == vocab
    with pytest.raises(CorpusError, match="out of range"):
        vocab.word(4)
    with pytest.raises(CorpusError, match="no '<unk>'"):
        Vocab(["x"]).id("y")
    with pytest.raises(CorpusError, match="twice"):
        Vocab(["x", "x"])
    (tmp_path / "bad.json").write_text('{"words": ["a"]}', encoding="utf-8")
    with pytest.raises(CorpusError, match="bad.json"):
        Vocab.load(tmp_path / "bad.json")


# ---- input errors -------------------------------------------------------------------------


def test_missing_split_is_named(tmp_path, cache):
    folder = write_splits(tmp_path / "c", "a\n")
    (folder / "test.txt").unlink()
    with pytest.raises(CorpusError, match=r"missing split file .*test\.txt"):
        load(folder, cache)


def test_missing_directory(tmp_path, cache):
    with pytest.raises(CorpusError, match="does not exist"):
        load(tmp_path / "nowhere", cache)


@pytest.mark.parametrize("content", ["", "\n\n", "  \n"])
def test_empty_split_is_named(tmp_path, cache, content):
    folder = write_splits(tmp_path / "c", "a\n", valid=content)
    with pytest.raises(CorpusError, match=r"valid\.txt is empty"):
        load(folder, cache)


def test_non_utf8_reports_file_byte_offset_and_line(tmp_path, cache):
    folder = write_splits(tmp_path / "c", "a b\n")
    (folder / "test.txt").write_bytes(b"a b\ncaf\xe9 a\n")  # latin-1 e-acute at offset 7
    with pytest.raises(CorpusError) as info:
        load(folder, cache)
    message = str(info.value)
    assert "test.txt" in message and "byte offset 7" in message and "line 2" in message


def test_byte_order_mark_is_reported_not_swallowed_into_the_first_word(tmp_path, cache):
    folder = write_splits(tmp_path / "c", "a b\n")
    (folder / "train.txt").write_bytes(b"\xef\xbb\xbfa b\n")
    with pytest.raises(CorpusError, match=r"train\.txt starts with a UTF-8 byte-order mark"):
        load(folder, cache)


def test_nul_byte_is_reported_with_offset_and_line(tmp_path, cache):
    folder = write_splits(tmp_path / "c", "a b\n")
    (folder / "valid.txt").write_bytes(b"a\nb\x00a\n")  # NUL at offset 3, line 2
    with pytest.raises(CorpusError) as info:
        load(folder, cache)
    message = str(info.value)
    assert "valid.txt holds a NUL byte at byte offset 3 (line 2)" in message


def test_unknown_mode(tmp_path, cache):
    folder = write_splits(tmp_path / "c", "a\n")
    with pytest.raises(CorpusError, match="expected one of word, char"):
        load(folder, cache, mode="byte")


# ---- the cache ----------------------------------------------------------------------------


def _forbid_tokenising(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("tokenised again although the cache should have been used")

    monkeypatch.setattr(data, "tokenize", fail)


def test_second_load_comes_from_the_cache(tmp_path, cache, monkeypatch):
    folder = write_splits(tmp_path / "c", f"a b a\n{UNK}\n", valid="a zz\n")
    first = load(folder, cache)
    assert len(list(cache.glob("*.npz"))) == 1
    _forbid_tokenising(monkeypatch)
    second = load(folder, cache)
    assert second.vocab == first.vocab and second.lines == first.lines and second.oov == first.oov
    for split in data.SPLITS:
        assert torch.equal(second.split(split), first.split(split))
        assert second.split(split).dtype == torch.int64


def test_changed_file_invalidates_the_cache(tmp_path, cache):
    folder = write_splits(tmp_path / "c", "a b\n")
    load(folder, cache)
    (folder / "test.txt").write_text("b b b\n", encoding="utf-8")
    corpus = load(folder, cache)
    assert corpus.vocab.decode(corpus.test) == ["b", "b", "b", EOS]


def test_word_and_char_modes_are_cached_apart(tmp_path, cache):
    folder = write_splits(tmp_path / "c", "ab ba\n", valid="ba\n", test="ab\n")
    assert len(load(folder, cache, mode="word").vocab) == 3
    assert len(load(folder, cache, mode="char").vocab) == 4  # a, b, " ", <eos>
    assert len(list(cache.glob("*.npz"))) == 2


@pytest.mark.parametrize(
    "damage",
    [
        lambda raw: raw[: len(raw) // 2],  # truncated
        lambda raw: raw[:200] + bytes(b ^ 0xFF for b in raw[200:260]) + raw[260:],  # bit flips
        lambda raw: b"not a zip at all",
    ],
    ids=["truncated", "flipped", "garbage"],
)
def test_corrupted_cache_is_rebuilt(tmp_path, cache, damage):
    folder = write_splits(tmp_path / "c", "a b c a\n" * 50)
    expected = load(folder, cache)
    (cache_file,) = cache.glob("*.npz")
    cache_file.write_bytes(damage(cache_file.read_bytes()))
    rebuilt = load(folder, cache)
    assert torch.equal(rebuilt.train, expected.train) and rebuilt.vocab == expected.vocab
    assert load(folder, cache).vocab == expected.vocab  # and it was written back whole


def test_cache_with_a_different_stored_key_is_ignored(tmp_path, cache, monkeypatch):
    folder = write_splits(tmp_path / "c", "a b\n")
    load(folder, cache)
    (cache_file,) = cache.glob("*.npz")
    with np.load(cache_file) as archive:
        arrays = dict(archive)
    arrays["key"] = data._text_array("0" * 64)
    arrays["train"] = np.zeros(5, dtype=np.int32)  # would show if the stale file were used
    with open(cache_file, "wb") as handle:
        np.savez(handle, **arrays)
    assert load(folder, cache).train.numel() == 3


def test_use_cache_false_writes_nothing(tmp_path, cache):
    folder = write_splits(tmp_path / "c", "a b\n")
    load(folder, cache, use_cache=False)
    assert not cache.exists()


def test_default_cache_dir_is_the_users_cache_never_the_corpus(tmp_path, monkeypatch):
    monkeypatch.delenv("HIGHRANK_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert data.default_cache_dir(tmp_path) == tmp_path / "home" / ".cache" / "highrank"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert data.default_cache_dir() == tmp_path / "xdg" / "highrank"
    monkeypatch.setenv("HIGHRANK_CACHE_DIR", str(tmp_path / "mine"))
    assert data.default_cache_dir() == tmp_path / "mine"


def test_unwritable_cache_warns_and_still_loads(tmp_path):
    folder = write_splits(tmp_path / "c", "a b\n")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory", encoding="utf-8")
    with pytest.warns(UserWarning, match="could not write the token cache"):
        corpus = load_corpus(folder, cache_dir=blocker / "cache")
    assert corpus.train.numel() == 3


# ---- character level ----------------------------------------------------------------------


def test_char_mode_normalises_whitespace_to_single_spaces(tmp_path, cache):
    folder = write_splits(tmp_path / "c", " ab  a\t\n\nb\n", valid="ba\n", test="a b\n")
    corpus = load(folder, cache, mode="char")
    assert corpus.vocab.decode(corpus.train) == ["a", "b", " ", "a", EOS, EOS, "b", EOS]
    assert corpus.vocab.words == (EOS, "a", "b", " ")  # counts 3, 2, 2, 1
    assert corpus.lines["train"] == 3


def test_char_mode_unknown_character_is_named(tmp_path, cache):
    folder = write_splits(tmp_path / "c", "ab\n", valid="ab\nabc\n")
    with pytest.raises(CorpusError, match=r"valid\.txt line 2: character 'c'"):
        load(folder, cache, mode="char")


# ---- batching -----------------------------------------------------------------------------


def test_batchify_trims_and_lays_out_contiguous_columns():
    source = batchify(torch.arange(23), 4)  # 23 -> 20 tokens, 5 per column
    assert source.shape == (5, 4)
    assert source[:, 0].tolist() == [0, 1, 2, 3, 4]
    assert source[:, 3].tolist() == [15, 16, 17, 18, 19]


def test_get_batch_shapes_and_shifted_targets():
    source = batchify(torch.arange(40), 4)  # (10, 4)
    inputs, targets = get_batch(source, 0, 3)
    assert inputs.shape == targets.shape == (3, 4)
    assert torch.equal(targets, inputs + 1)  # each column is consecutive text
    last_in, last_target = get_batch(source, 7, 3)  # only 2 rows left with a target
    assert last_in.shape == (2, 4) and last_target[-1].tolist() == [9, 19, 29, 39]
    segments = list(iter_batches(source, 4))
    assert [len(x) for x, _ in segments] == [4, 4, 1]


def test_batchify_too_short_names_the_stream_and_what_it_needs():
    with pytest.raises(CorpusError, match=r"test\.txt is shorter than one batch.*at least 20"):
        batchify(torch.arange(19), 10, name="test.txt")
    assert batchify(torch.arange(20), 10).shape == (2, 10)


def test_batching_argument_errors():
    with pytest.raises(CorpusError, match="batch_size"):
        batchify(torch.arange(10), 0)
    with pytest.raises(CorpusError, match="1-D integer"):
        batchify(torch.zeros(10), 2)
    source = batchify(torch.arange(10), 2)  # (5, 2)
    with pytest.raises(CorpusError, match=r"0 <= i <= 3"):
        get_batch(source, 4, 2)
    with pytest.raises(CorpusError, match="seq_len"):
        get_batch(source, 0, 0)


def test_corpus_batchify_names_its_file(tmp_path, cache):
    corpus = load(write_splits(tmp_path / "c", "a b c d e\n"), cache)
    assert corpus.batchify("train", 3).shape == (2, 3)
    with pytest.raises(CorpusError, match=r"valid\.txt is shorter than one batch"):
        corpus.batchify("valid", 10)


# ---- statistics on the benchmarks ---------------------------------------------------------


def _check_stats(folder: Path, cache: Path, lines, tokens, vocab_size) -> None:
    stats = corpus_stats(folder, cache_dir=cache)
    assert [stats["splits"][s]["lines"] for s in data.SPLITS] == lines
    assert [stats["splits"][s]["tokens"] for s in data.SPLITS] == tokens
    assert stats["vocab_size"] == vocab_size
    assert [stats["splits"][s]["oov"] for s in data.SPLITS] == [0, 0, 0]
    assert f"{tokens[0]:,}" in format_stats(stats) and f"{vocab_size:,}" in format_stats(stats)
    assert len(list(cache.glob("*.npz"))) == 1
    assert corpus_stats(folder, cache_dir=cache) == stats  # the same from the cache


def test_ptb_stats(cache):
    folder = shared_corpus("ptb")
    _check_stats(folder, cache, [42_068, 3_370, 3_761], [929_589, 73_760, 82_430], 10_000)
    corpus = load(folder, cache)
    assert corpus.vocab.words[:3] == ("the", UNK, EOS)


def test_wikitext2_stats(cache):
    folder = shared_corpus("wikitext-2")
    _check_stats(folder, cache, [36_718, 3_760, 4_358], [2_088_628, 217_646, 245_569], 33_278)
