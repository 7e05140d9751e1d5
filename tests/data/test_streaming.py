"""highrank.data.streaming: the one-pass vocabulary, data.max_vocab, memory-mapped ids, shard
folders, stream views, sentence-shuffled batching (and its exact resume), bad input;
highrank.data.zipf.
"""

from __future__ import annotations

import json
import random
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from highrank.config import ConfigError, load_config
from highrank.data import EOS, UNK, CorpusError, Vocab, batchify, get_batch, load_corpus, streaming
from highrank.data.streaming import (
    corpus_checksums,
    epoch_view,
    frequency_order,
    load_stream_corpus,
)
from highrank.data.zipf import write_zipf_corpus, zipf_probabilities
from highrank.runs.checkpoint import CheckpointError
from highrank.runs.run_dir import read_metrics
from highrank.train import TrainOptions, resume, train
from tests.conftest import TINY_AWD_LSTM, TRAIN_WORDS, write_splits

# Blank lines, a tab, a no-break space inside a word, multi-byte characters, a literal <unk>,
# \r (whitespace to str.split), a last line without "\n": the tokenisation's corner cases.
AWKWARD = "the cat <unk>\n\n  a\tb  c\ncafé über\xa0ß the\r\nthe  end"


def random_text(seed: int, lines: int) -> str:
    rng = random.Random(seed)
    text = (" ".join(rng.choices(TRAIN_WORDS, k=rng.randint(0, 9))) for _ in range(lines))
    return "\n".join(text) + "\n"


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 7 bytes: lines cross block boundaries, and most lines are longer."""
    monkeypatch.setattr(streaming, "BLOCK_BYTES", 7)


# ---- the vocabulary and the ids equal the in-memory loader's ------------------------------


@pytest.mark.parametrize("mode", ["word", "char"])
@pytest.mark.parametrize("text", [AWKWARD, random_text(0, 200)], ids=["awkward", "random"])
def test_one_pass_vocab_and_memmap_ids_equal_the_in_memory_corpus(
    tmp_path, cache, small_blocks, mode, text
):
    held_out = "the end\nc a\n" if mode == "word" else "the\n"
    if text != AWKWARD:
        held_out = "w1 w2\n"
    folder = write_splits(tmp_path / "c", text, valid=held_out, test=held_out)
    memory = load_corpus(folder, mode=mode, use_cache=False)
    mapped = load_stream_corpus(folder, mode=mode, cache_dir=cache)
    assert mapped.vocab == memory.vocab
    tokens = Counter(memory.vocab.decode(memory.train))
    assert mapped.vocab == Vocab.from_tokens(memory.vocab.decode(memory.train))
    assert len(tokens) == len(mapped.vocab)
    for split in ("train", "valid", "test"):
        assert isinstance(mapped.ids[split], np.memmap)
        assert mapped.ids[split].dtype == np.int32
        assert torch.equal(mapped.split(split), memory.split(split)), split
    assert mapped.lines == memory.lines and mapped.oov == memory.oov


def test_frequency_order_matches_vocab_from_tokens_on_ties():
    # first appearance: b c a <eos> d; counts: b 2, c 3, a 2, <eos> 3, d 1
    words, counts = ["b", "c", "a", EOS, "d"], np.array([2, 3, 2, 3, 1])
    vocab, remap = frequency_order(words, counts, None)
    tokens = "b c a <eos> c a b <eos> c d <eos>".split()
    assert vocab == Vocab.from_tokens(tokens) and vocab.words == ("c", EOS, "b", "a", "d")
    assert [vocab.words[i] for i in remap] == words


# ---- data.max_vocab -----------------------------------------------------------------------


def test_max_vocab_keeps_the_most_frequent_and_maps_the_rest_to_unk(tmp_path, cache):
    # counts: x 4, <eos> 3, y 2, z 2 (y first), <unk> 1 (literal), q 1, r 1.
    train = "x y z x\nq <unk> x z\nx y r\n"
    folder = write_splits(tmp_path / "c", train, valid="x q y\n", test="r r\n")
    corpus = load_stream_corpus(folder, max_vocab=4, cache_dir=cache)
    # kept: <eos>, x, y (wins the tie with z by first appearance); <unk> = z 2 + <unk> 1 +
    # q 1 + r 1 = 5, the most frequent entry now.
    assert corpus.vocab.words == (UNK, "x", EOS, "y")
    decoded = corpus.vocab.decode(corpus.train)
    expected = "x y <unk> x <eos> <unk> <unk> x <unk> <eos> x y <unk> <eos>".split()
    assert decoded == expected
    assert corpus.vocab.decode(corpus.valid) == ["x", UNK, "y", EOS]
    assert corpus.oov == {"train": 4, "valid": 1, "test": 2}  # the literal <unk> not counted


def test_max_vocab_at_least_the_types_leaves_the_vocabulary_whole(tmp_path, cache):
    folder = write_splits(tmp_path / "c", "a b a\nb c\n", valid="a\n", test="c\n")
    whole = load_corpus(folder, use_cache=False)
    assert len(whole.vocab) == 4
    for limit in (4, 5, 100):
        corpus = load_stream_corpus(folder, max_vocab=limit, cache_dir=cache)
        assert corpus.vocab == whole.vocab and UNK not in corpus.vocab


def test_max_vocab_two_is_eos_and_unk(tmp_path, cache):
    folder = write_splits(tmp_path / "c", "a b\nc\n", valid="a\n", test="z\n")
    corpus = load_stream_corpus(folder, max_vocab=2, cache_dir=cache)
    assert corpus.vocab.words == (UNK, EOS)
    assert corpus.vocab.decode(corpus.train) == [UNK, UNK, EOS, UNK, EOS]


def test_max_vocab_ids_match_an_in_memory_truncation_of_a_zipf_corpus(tmp_path, cache):
    write_zipf_corpus(tmp_path / "z", train_tokens=20_000, types=400, seed=3)
    corpus = load_stream_corpus(tmp_path / "z", max_vocab=100, cache_dir=cache)
    text = (tmp_path / "z" / "train.txt").read_text().replace("\n", f" {EOS} ").split()
    counts = Counter(text)
    full = Vocab.from_tokens(text).words
    kept = [EOS] + [w for w in full if w != EOS][:98]
    expected = [w if w in kept else UNK for w in text]
    assert corpus.vocab.decode(corpus.train) == expected
    assert len(corpus.vocab) == 100
    unk_count = sum(c for w, c in counts.items() if w not in kept)
    ranked = sorted(Counter(expected).items(), key=lambda kv: -kv[1])
    assert [c for _, c in ranked] == sorted([counts[w] for w in kept] + [unk_count], reverse=True)
    assert corpus.oov["train"] == unk_count - counts[UNK]  # train's own <unk> line is no OOV


# ---- shards -------------------------------------------------------------------------------


def test_a_shard_folder_reads_as_the_concatenated_file(tmp_path, cache, small_blocks):
    lines = random_text(1, 90).splitlines(keepends=True)
    parts = ["".join(lines[:30]), "".join(lines[30:31]), "", "".join(lines[31:])]
    single = write_splits(tmp_path / "single", "".join(lines), valid="w1\n", test="w2\n")
    sharded = write_splits(tmp_path / "sharded", "x\n", valid="w1\n", test="w2\n")
    (sharded / "train.txt").unlink()
    (sharded / "train").mkdir()
    names = ["news-00003", "news-00010", "news-00002", "news-00001"]  # written out of order
    for name, part in zip(names, [parts[3], "", parts[1], parts[0]], strict=True):
        (sharded / "train" / name).write_text(part)
    (sharded / "train" / ".hidden").write_text("never read\n")
    a = load_stream_corpus(single, cache_dir=cache)
    b = load_stream_corpus(sharded, cache_dir=cache)
    assert b.vocab == a.vocab and b.lines == a.lines
    assert np.array_equal(b.ids["train"], a.ids["train"])
    assert b.path("train") == sharded / "train"
    assert [p.name for p in b.files["train"]] == sorted(names)


def test_data_stats_reads_a_shard_folder(tmp_path, cache, capsys):
    """Campaign: `highrank data stats` of the folder `data zipf --shards` writes said "missing
    split file train.txt"; it counts the shards as the memmap loader reads them."""
    from highrank.cli import main

    text = random_text(2, 40) + "a b\n"
    single = write_splits(tmp_path / "single", text)
    sharded = write_splits(tmp_path / "sharded", "x\n")
    (sharded / "train.txt").unlink()
    (sharded / "train").mkdir()
    lines = text.splitlines(keepends=True)
    (sharded / "train" / "part-00000.txt").write_text("".join(lines[:25]))
    (sharded / "train" / "part-00001.txt").write_text("".join(lines[25:]))
    args = ["data", "stats", "--json", "--cache-dir", str(cache)]
    assert main([*args, str(single)]) == 0
    want = json.loads(capsys.readouterr().out)
    assert main([*args, str(sharded)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["splits"]["train"]["file"] == str(sharded / "train")
    for key in ("vocab_size", "splits"):
        for split in got["splits"]:
            got["splits"][split]["file"] = want["splits"][split]["file"]
        assert got[key] == want[key]


# ---- stream views -------------------------------------------------------------------------


def test_stream_views_give_the_batchify_rows_of_every_get_batch(tmp_path, cache):
    folder = write_splits(tmp_path / "c", random_text(2, 60), valid="w1\n", test="w2\n")
    corpus = load_stream_corpus(folder, cache_dir=cache)
    for batch_size in (1, 3, 4):
        view = corpus.batchify("train", batch_size)
        tensor = batchify(corpus.split("train"), batch_size)
        assert view.shape == tensor.shape and view.size(1) == tensor.size(1)
        for seq_len in (1, 5, 70):
            for i in range(0, tensor.size(0) - 1):
                for ours, theirs in zip(
                    get_batch(view, i, seq_len), get_batch(tensor, i, seq_len), strict=True
                ):
                    assert ours.dtype == torch.int64 and torch.equal(ours, theirs)
        if batch_size == 4:  # a process's share of the columns under torchrun
            assert torch.equal(view.narrow(1, 2, 2)[3:9], tensor.narrow(1, 2, 2)[3:9])
    assert epoch_view(view, 5) is view  # stream batching ignores the epoch


def test_stream_view_errors_name_the_split(tmp_path, cache):
    folder = write_splits(tmp_path / "c", "a b c\n", valid="a\n", test="b\n")
    corpus = load_stream_corpus(folder, cache_dir=cache)
    with pytest.raises(CorpusError, match=r"train\.txt is shorter than one batch: 4 tokens"):
        corpus.batchify("train", 3)
    with pytest.raises(CorpusError, match="batch_size must be a positive int"):
        corpus.batchify("train", 0)


def test_a_process_share_of_the_columns_reads_as_the_tensor_share(tmp_path, cache, monkeypatch):
    """Under torchrun, shard_columns gives process r of N columns [r B/N, (r+1) B/N)."""
    from highrank.train import distributed

    folder = write_splits(tmp_path / "c", random_text(7, 40), valid="w1\n", test="w2\n")
    corpus = load_stream_corpus(folder, cache_dir=cache)
    tensor = batchify(corpus.split("train"), 4)
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    for process in (0, 1):
        monkeypatch.setattr(distributed, "rank", lambda process=process: process)
        ours = distributed.shard_columns(corpus.batchify("train", 4), "train.batch_size")
        theirs = distributed.shard_columns(tensor, "train.batch_size")
        assert ours.shape == theirs.shape == (tensor.size(0), 2)
        assert torch.equal(ours[0 : ours.size(0)], theirs)


def test_processes_loading_together_build_the_cache_once(tmp_path, cache, monkeypatch):
    import threading
    import time

    folder = write_splits(tmp_path / "c", random_text(8, 30), valid="w1\n", test="w2\n")
    built, build = [], streaming._build

    def slow_build(*args):
        built.append(1)
        time.sleep(0.3)  # long enough for the other loader to find the cache missing
        return build(*args)

    monkeypatch.setattr(streaming, "_build", slow_build)
    loaded = []
    threads = [
        threading.Thread(target=lambda: loaded.append(load_stream_corpus(folder, cache_dir=cache)))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(loaded) == 2 and len(built) == 1
    assert np.array_equal(loaded[0].ids["train"], loaded[1].ids["train"])


# ---- sentence-shuffled batching -----------------------------------------------------------


def sentences(tokens: list[str]) -> list[tuple[str, ...]]:
    out, current = [], []
    for token in tokens:
        current.append(token)
        if token == EOS:
            out.append(tuple(current))
            current = []
    assert not current
    return out


def shuffled_stream(corpus, epoch: int) -> list[str]:
    view = corpus.batchify("train", 1).for_epoch(epoch)
    return corpus.vocab.decode(view[0 : view.size(0)])


def test_sentence_batching_is_a_seeded_permutation_of_sentences_per_epoch(tmp_path, cache):
    folder = write_splits(tmp_path / "c", random_text(3, 40), valid="w1\n", test="w2\n")
    corpus = load_stream_corpus(folder, batching="sentences", seed=7, cache_dir=cache)
    stored = sentences(corpus.vocab.decode(corpus.train))
    epochs = {epoch: shuffled_stream(corpus, epoch) for epoch in (1, 2, 3)}
    for stream in epochs.values():
        assert Counter(sentences(stream)) == Counter(stored)  # B = 1: nothing trimmed
    assert len({tuple(s) for s in epochs.values()}) == 3  # each epoch its own order
    assert shuffled_stream(corpus, 2) == epochs[2]  # a function of (seed, epoch)
    again = load_stream_corpus(folder, batching="sentences", seed=7, cache_dir=cache)
    assert shuffled_stream(again, 1) == epochs[1]
    other = load_stream_corpus(folder, batching="sentences", seed=8, cache_dir=cache)
    assert shuffled_stream(other, 1) != epochs[1]
    expected = [stored[k] for k in corpus.batchify("train", 1).order.permutation(1)]
    assert sentences(epochs[1]) == expected


def test_sentence_batches_lay_the_shuffled_stream_out_as_batchify_does(tmp_path, cache):
    folder = write_splits(tmp_path / "c", random_text(4, 50), valid="w1\n", test="w2\n")
    corpus = load_stream_corpus(folder, batching="sentences", seed=1, cache_dir=cache)
    stream = torch.tensor(corpus.vocab.encode(shuffled_stream(corpus, 4)))
    view = corpus.batchify("train", 3).for_epoch(4)
    assert torch.equal(view[0 : view.size(0)], batchify(stream, 3))
    with pytest.raises(CorpusError, match=r"read per epoch; call for_epoch"):
        corpus.batchify("train", 3)[0:2]


# ---- training from a memory map -----------------------------------------------------------

TINY = [*TINY_AWD_LSTM, "train.epochs=2"]
TRANSFORMER = [
    "model.backbone=transformer",
    "model.d_embed=8",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.d_ff=16",
    "model.positions=learned",
    "model.max_len=6",
    "train.batch_size=4",
    "train.bptt=6",
    "train.eval_batch_size=2",
    "train.lr=0.01",
    "train.warmup_steps=2",
    "train.eval_every=5",
    "train.epochs=2",
    "train.log_every=1",
]
QUIET = TrainOptions(progress=False)


@pytest.fixture
def lm_corpus(tmp_path) -> Path:
    text = random_text(5, 120).replace("\n\n", "\n")
    return write_splits(tmp_path / "corpus", text, valid=random_text(6, 30), test="w1\n")


def run_config(corpus: Path, out: Path, cache: Path, family: list[str], *extra: str):
    return load_config(
        None,
        [f"data.dir={corpus}", f"data.cache_dir={cache}", f"run.out_dir={out}", *family, *extra],
    )


def trajectory(run_dir: Path) -> list[tuple]:
    steps = read_metrics(run_dir / "metrics.jsonl", "step")
    epochs = read_metrics(run_dir / "metrics.jsonl", "epoch")
    return [(r["step"], r["train_loss"]) for r in steps] + [
        (r["epoch"], r["val_loss"]) for r in epochs
    ]


@pytest.mark.parametrize("family", [TINY, TRANSFORMER], ids=["awd-lstm", "transformer"])
def test_a_memory_mapped_run_repeats_the_in_memory_run_exactly(lm_corpus, tmp_path, cache, family):
    train(run_config(lm_corpus, tmp_path / "memory", cache, family), options=QUIET)
    mapped = tmp_path / "mapped"
    train(run_config(lm_corpus, mapped, cache, family, "data.memmap=true"), options=QUIET)
    assert trajectory(mapped) == trajectory(tmp_path / "memory")
    assert any(p.name.startswith("corpus-word-stream-") for p in cache.iterdir())


@pytest.mark.parametrize("family", [TINY, TRANSFORMER], ids=["awd-lstm", "transformer"])
def test_a_sentence_shuffled_run_resumes_exactly(lm_corpus, tmp_path, cache, family):
    shuffled = ("data.memmap=true", "data.batching=sentences")
    straight = tmp_path / "straight"
    train(run_config(lm_corpus, straight, cache, family, *shuffled), options=QUIET)
    stream = tmp_path / "stream"
    train(run_config(lm_corpus, stream, cache, family, "data.memmap=true"), options=QUIET)
    assert trajectory(straight) != trajectory(stream)  # the shuffle changes what is read
    steps = read_metrics(straight / "metrics.jsonl", "step")
    out = tmp_path / "interrupted"
    stop = steps[-1]["step"] - 3  # in epoch 2: its order must be rebuilt from (seed, epoch)
    train(
        run_config(lm_corpus, out, cache, family, *shuffled),
        options=TrainOptions(progress=False, max_steps=stop),
    )
    resume(out, options=QUIET)
    assert trajectory(out) == trajectory(straight)


def test_eval_reads_a_max_vocab_run_through_its_memory_map(lm_corpus, tmp_path, cache, capsys):
    """`highrank eval` opens the run's corpus as it trained on it: truncated to data.max_vocab
    (the in-memory loader would give another vocabulary and be refused)."""
    from highrank.cli import main
    from highrank.models import load_run_corpus

    out = tmp_path / "run"
    config = run_config(
        lm_corpus, out, cache, TINY, "data.memmap=true", "data.max_vocab=12", "train.epochs=1"
    )
    train(config, options=QUIET)
    _, _, corpus = load_run_corpus(out)
    assert len(corpus.vocab) == 12 and corpus.vocab.unk_id is not None
    capsys.readouterr()
    assert main(["eval", str(out), "--split", "valid", "--bptt", "6", "--no-progress"]) == 0
    assert "perplexity" in capsys.readouterr().out.lower()


# ---- bad input ----------------------------------------------------------------------------


def test_an_empty_shard_folder_is_named(tmp_path, cache):
    folder = write_splits(tmp_path / "c", "a\n")
    (folder / "train.txt").unlink()
    (folder / "train").mkdir()
    (folder / "train" / ".keep").write_text("")
    with pytest.raises(CorpusError, match=r"shard folder .*c/train holds no files") as info:
        load_stream_corpus(folder, cache_dir=cache)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("strange", ["folder", "broken link"])
def test_a_shard_folder_with_a_subfolder_or_a_broken_link_is_refused(tmp_path, cache, strange):
    """Issue: such entries were skipped silently, losing part of the split."""
    folder = write_splits(tmp_path / "c", "a\n")
    (folder / "train.txt").unlink()
    (folder / "train").mkdir()
    (folder / "train" / "01.txt").write_text("a b\n")
    if strange == "folder":
        (folder / "train" / "02").mkdir()
    else:
        (folder / "train" / "02.txt").symlink_to(tmp_path / "gone.txt")
    with pytest.raises(CorpusError, match=r"shard folder .*c/train holds 02") as info:
        load_stream_corpus(folder, cache_dir=cache)
    assert "\n" not in str(info.value)


def test_the_in_memory_loader_points_a_shard_folder_at_data_memmap(tmp_path):
    folder = write_splits(tmp_path / "c", "a\n")
    (folder / "train.txt").unlink()
    (folder / "train").mkdir()
    (folder / "train" / "part-0").write_text("a b\n")
    with pytest.raises(CorpusError, match=r"a shard folder train/ is read with data.memmap = true"):
        load_corpus(folder, use_cache=False)


def test_a_shard_that_is_not_utf8_names_the_file_offset_and_line(tmp_path, cache, small_blocks):
    folder = write_splits(tmp_path / "c", "a\n")
    (folder / "train.txt").unlink()
    (folder / "train").mkdir()
    (folder / "train" / "part-0").write_text("a b\n")
    (folder / "train" / "part-1").write_bytes(b"a b\nc d e\nf \xe9t\xe9\n")
    with pytest.raises(CorpusError) as info:
        load_stream_corpus(folder, cache_dir=cache)
    message = str(info.value)
    assert "train/part-1 is not valid UTF-8: byte 0xe9 at byte offset 12 (line 3)" in message
    assert "\n" not in message


def test_bad_shard_bytes_bom_and_nul_are_named(tmp_path, cache):
    folder = write_splits(tmp_path / "c", "a\n")
    (folder / "valid.txt").write_bytes(b"\xef\xbb\xbfa\n")
    with pytest.raises(CorpusError, match=r"valid\.txt starts with a UTF-8 byte-order mark"):
        load_stream_corpus(folder, cache_dir=cache)
    (folder / "valid.txt").write_bytes(b"a\nb\0\n")
    with pytest.raises(
        CorpusError, match=r"valid\.txt holds a NUL byte at byte offset 3 \(line 2\)"
    ):
        load_stream_corpus(folder, cache_dir=cache)


def test_split_file_and_shard_folder_together_or_missing_are_named(tmp_path, cache):
    folder = write_splits(tmp_path / "c", "a\n")
    (folder / "test").mkdir()
    with pytest.raises(CorpusError, match=r"holds both test\.txt and a folder test/"):
        load_stream_corpus(folder, cache_dir=cache)
    (folder / "test.txt").unlink()
    (folder / "test").rmdir()
    with pytest.raises(CorpusError, match=r"missing split test: neither .*test\.txt nor"):
        load_stream_corpus(folder, cache_dir=cache)


@pytest.mark.parametrize("split", ["train", "valid"])
def test_a_split_without_words_is_named(tmp_path, cache, split):
    folder = write_splits(tmp_path / "c", "a b\n")
    (folder / f"{split}.txt").write_text("\n\n")
    with pytest.raises(CorpusError, match=rf"{split}\.txt is empty \(2 line\(s\), all blank\)"):
        load_stream_corpus(folder, cache_dir=cache)


def test_an_unknown_word_without_unk_names_file_and_line(tmp_path, cache, small_blocks):
    folder = write_splits(tmp_path / "c", "a b\n", valid="a\nb a\na zz\n")
    with pytest.raises(CorpusError, match=r"valid\.txt line 3: word 'zz' does not occur"):
        load_stream_corpus(folder, cache_dir=cache)


def test_max_vocab_below_two_is_refused_by_config_and_loader(tmp_path, cache):
    for value in (1, 0):
        with pytest.raises(
            ConfigError, match=rf"data\.max_vocab = {value} is out of range; expected >= 2"
        ):
            load_config(None, ["data.memmap=true", f"data.max_vocab={value}"])
    folder = write_splits(tmp_path / "c", "a\n")
    with pytest.raises(CorpusError, match=r"data\.max_vocab = 1; expected an int >= 2"):
        load_stream_corpus(folder, max_vocab=1, cache_dir=cache)


@pytest.mark.parametrize("key", ["data.max_vocab=100", "data.batching=sentences"])
def test_memmap_only_keys_need_memmap(key):
    with pytest.raises(ConfigError, match=rf"{key.split('=')[0]} = .* needs the memory-mapped"):
        load_config(None, [key])
    config = load_config(None, [key, "data.memmap=true"])
    assert config.data.memmap


@pytest.mark.parametrize("key", ["data.memmap=true", "data.max_vocab=5"])
def test_seq2seq_does_not_read_the_stream_keys(key):
    with pytest.raises(ConfigError, match=rf"{key.split('=')[0]} is a key of model.backbone"):
        load_config(None, ["model.backbone=seq2seq", key])


# ---- the cache ----------------------------------------------------------------------------


def test_the_second_load_reads_the_cache_and_a_change_rebuilds(tmp_path, cache, monkeypatch):
    folder = write_splits(tmp_path / "c", "a b a\n", valid="a\n", test="b\n")
    first = load_stream_corpus(folder, cache_dir=cache)
    meta = json.loads((first.cache / "meta.json").read_text())
    assert meta["tokens"] == {"train": 4, "valid": 2, "test": 2}
    assert not list(cache.glob(".*"))  # no temporary folder left behind
    with monkeypatch.context() as patch:
        patch.setattr(streaming, "_build", lambda *a: pytest.fail("rebuilt a valid cache"))
        again = load_stream_corpus(folder, cache_dir=cache)
    assert again.vocab == first.vocab and again.cache == first.cache
    assert load_stream_corpus(folder, max_vocab=2, cache_dir=cache).cache != first.cache
    (folder / "train.txt").write_text("b b a\n")
    changed = load_stream_corpus(folder, cache_dir=cache)
    assert changed.cache != first.cache and changed.vocab.words[0] == "b"


def test_a_truncated_cache_file_is_rebuilt(tmp_path, cache):
    folder = write_splits(tmp_path / "c", "a b a\n", valid="a\n", test="b\n")
    first = load_stream_corpus(folder, cache_dir=cache)
    ids = first.cache / "train.ids"
    del first
    ids.write_bytes(ids.read_bytes()[:-2])
    again = load_stream_corpus(folder, cache_dir=cache)
    assert again.vocab.decode(again.train) == ["a", "b", "a", EOS]


# ---- the Zipf corpus ----------------------------------------------------------------------


def test_zipf_corpus_is_seeded_exact_in_size_and_zipfian(tmp_path, cache):
    info = write_zipf_corpus(tmp_path / "a", train_tokens=30_000, types=50, seed=4, shards=3)
    write_zipf_corpus(tmp_path / "b", train_tokens=30_000, types=50, seed=4, shards=3)
    write_zipf_corpus(tmp_path / "c", train_tokens=30_000, types=50, seed=5, shards=3)
    shards = sorted((tmp_path / "a" / "train").iterdir())
    assert [p.name for p in shards] == ["part-00000.txt", "part-00001.txt", "part-00002.txt"]
    for shard in shards:
        assert shard.read_bytes() == (tmp_path / "b" / "train" / shard.name).read_bytes()
    assert shards[0].read_bytes() != (tmp_path / "c" / "train" / shards[0].name).read_bytes()
    corpus = load_stream_corpus(tmp_path / "a", cache_dir=cache)
    assert {s: corpus.ids[s].size for s in corpus.ids} == info["tokens"]
    assert info["tokens"] == {"train": 30_000, "valid": 1_000, "test": 1_000}
    words = corpus.vocab.decode(corpus.train)
    counts = Counter(w for w in words if w != EOS)
    n = sum(counts.values())
    expected = zipf_probabilities(50) * n
    for rank in (0, 1, 9):  # observed within 5 binomial standard deviations of n P(r)
        sd = np.sqrt(n * zipf_probabilities(50)[rank])
        assert abs(counts[f"w{rank}"] - expected[rank]) < 5 * sd
    assert json.loads((tmp_path / "a" / "zipf.json").read_text())["seed"] == 4
    with pytest.raises(ValueError, match="is not empty"):
        write_zipf_corpus(tmp_path / "a", train_tokens=100)


@pytest.mark.parametrize(
    ("option", "value"),
    [("valid_tokens", 0), ("test_tokens", 0), ("valid_tokens", 1), ("test_tokens", True)],
)
def test_zipf_held_out_sizes_below_two_are_refused_by_name(tmp_path, option, value):
    """0 is not "the default" (both loaders refuse a split without words): an error naming
    the option, and nothing written."""
    with pytest.raises(ValueError, match=rf"^{option} = {value!r}; expected an int >= 2"):
        write_zipf_corpus(tmp_path / "z", train_tokens=500, types=20, **{option: value})
    assert not (tmp_path / "z").exists()


def test_zipf_held_out_sizes_are_exact_down_to_one_word(tmp_path, cache):
    info = write_zipf_corpus(
        tmp_path / "z", train_tokens=500, valid_tokens=2, test_tokens=None, types=20
    )
    assert info["tokens"] == {"train": 500, "valid": 2, "test": 1_000}  # None: the default
    corpus = load_stream_corpus(tmp_path / "z", cache_dir=cache)
    assert corpus.ids["valid"].size == 2 and corpus.vocab.word(int(corpus.ids["valid"][1])) == EOS


def test_a_zipf_corpus_trains_without_max_vocab(tmp_path, cache):
    """Issue: its held-out words unseen in train made every loader refuse the default corpus."""
    write_zipf_corpus(tmp_path / "z", train_tokens=3_000, types=2_000, seed=1)
    assert "<unk>" in (tmp_path / "z" / "valid.txt").read_text()
    corpus = load_stream_corpus(tmp_path / "z", cache_dir=cache)
    assert corpus.oov["valid"] == 0 and UNK in corpus.vocab


def test_zipf_cli_writes_a_corpus(tmp_path, capsys):
    from highrank.cli import main

    assert main(["data", "zipf", str(tmp_path / "z"), "--tokens", "500", "--types", "20"]) == 0
    assert (tmp_path / "z" / "train.txt").is_file() and "wrote" in capsys.readouterr().out
    assert main(["data", "zipf", str(tmp_path / "y"), "--tokens", "1"]) == 2
    assert "tokens = 1; expected an int >= 4" in capsys.readouterr().err


def test_a_rebuild_removes_what_killed_builds_left_behind(tmp_path, cache):
    folder = write_splits(tmp_path / "c", "a b a\nb c\n")
    built = load_stream_corpus(folder, cache_dir=cache).cache
    shutil.rmtree(built)  # the next load builds again
    leftovers = [built.parent / f".{built.name}.k1ll3d", built.parent / f".{built.name}.x.stale"]
    for leftover in leftovers:
        leftover.mkdir()
        (leftover / "train.ids").write_bytes(b"\0" * 64)
    other_key = built.parent / ".another-key.k1ll3d"
    other_key.mkdir()
    corpus = load_stream_corpus(folder, cache_dir=cache)
    assert corpus.cache == built and not any(p.exists() for p in leftovers)
    assert other_key.is_dir()  # another key's build may still be running


def test_sentence_ends_of_a_slice_of_a_memory_map_count_from_the_slice(tmp_path):
    path = tmp_path / "ids"
    np.array([5, 0, 5, 5, 0, 5, 5, 5, 0], dtype=streaming.ID_DTYPE).tofile(path)
    mapped = np.memmap(path, dtype=streaming.ID_DTYPE, mode="r")
    assert streaming.sentence_ends(mapped, 0).tolist() == [2, 5, 9]
    assert streaming.sentence_ends(mapped[2:], 0).tolist() == [3, 7]


def test_a_cache_folder_that_is_a_file_is_one_line(tmp_path):
    """Issue: HIGHRANK_CACHE_DIR naming a file gave a FileExistsError traceback."""
    folder = write_splits(tmp_path / "c", "a b\n")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CorpusError, match=r"token cache folder .*file cannot be made: .* is a fi"):
        load_stream_corpus(folder, cache_dir=tmp_path / "file")


@pytest.mark.parametrize("bad", [-1, 10_000])
def test_a_cached_id_outside_the_vocabulary_is_refused(tmp_path, cache, bad):
    """Issue: a negative id in valid.ids was accepted, ids beyond the vocabulary ended in a
    traceback later."""
    folder = write_splits(tmp_path / "c", "a b c\nb c\n")
    load_stream_corpus(folder, cache_dir=cache)
    ids_file = next(cache.rglob("valid.ids"))
    damaged = np.fromfile(ids_file, dtype=np.int32)
    damaged[0] = bad
    damaged.tofile(ids_file)
    with pytest.raises(CorpusError, match=rf"holds the id {bad}, outside the vocabulary"):
        load_stream_corpus(folder, cache_dir=cache)


def test_a_cached_id_changed_to_another_valid_id_fails_the_checksum(tmp_path, cache):
    """Issue: wrong in-range ids trained silently (the cache carried no checksum)."""
    folder = write_splits(tmp_path / "c", "a b c\nb c\n")
    load_stream_corpus(folder, cache_dir=cache)
    ids_file = next(cache.rglob("train.ids"))
    damaged = np.fromfile(ids_file, dtype=np.int32)
    damaged[0] = (damaged[0] + 1) % 4  # still inside the vocabulary of 4
    damaged.tofile(ids_file)
    with pytest.raises(CorpusError, match=r"train.ids does not match the checksum written"):
        load_stream_corpus(folder, cache_dir=cache)


def test_the_checksums_of_a_memory_map_equal_the_in_memory_corpus(lm_corpus, cache):
    mapped = load_stream_corpus(lm_corpus, cache_dir=cache)
    in_memory = load_corpus(lm_corpus, cache_dir=cache)
    assert corpus_checksums(mapped) == corpus_checksums(in_memory)
    assert set(corpus_checksums(mapped)) == {"train", "valid", "test"}


@pytest.mark.parametrize("memmap", [True, False], ids=["memmap", "in-memory"])
def test_a_run_does_not_resume_on_a_changed_corpus_with_the_same_vocabulary(
    lm_corpus, tmp_path, cache, memmap
):
    """Issue: a memmap run resumed after its corpus changed continued when the vocabulary did
    not change."""
    out = tmp_path / "run"
    config = run_config(lm_corpus, out, cache, TINY, f"data.memmap={str(memmap).lower()}")
    train(config, options=TrainOptions(progress=False, max_steps=5))
    train_file = lm_corpus / "train.txt"
    lines = train_file.read_text().splitlines()
    edited = [*lines[:-1], " ".join(reversed(lines[-1].split()))]  # its words appear earlier
    train_file.write_text("\n".join(edited) + "\n")  # same counts and first appearances
    with pytest.raises(CheckpointError, match=r"is not the one the run started on \(train ids"):
        resume(out, options=QUIET)
    train_file.write_text("\n".join(lines) + "\n")  # put back: the run continues
    assert resume(out, options=QUIET).stop_reason == "epochs"
