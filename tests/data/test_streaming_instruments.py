"""A ``data.memmap`` run is evaluated and analysed from its memory map (issue 11, item 2).

``highrank eval``, ``dynamic-eval`` (its gradient statistics read the train split) and the
instruments of ``highrank analyze`` read the run's splits as :mod:`highrank.data.streaming`'s
memory maps, laid out by :class:`~highrank.data.streaming.StreamBatches`, never as a whole tensor:
a run trained on a corpus larger than memory can be analysed. The numbers equal the
in-memory path's (the same commands on the same run with the split read whole, as
:func:`highrank.data.batchify` lays it out), exactly.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from highrank.analysis import contexts
from highrank.cli import main
from highrank.config import load_config
from highrank.data import CorpusError, batchify, streaming
from highrank.data.zipf import write_zipf_corpus
from highrank.train import TrainOptions, train

# A 1-layer AWD-LSTM of a few hundred parameters; a small learning rate keeps its next-token
# distributions context-dependent (i.i.d. Zipf words would otherwise teach it a unigram).
TINY = [
    "model.d_embed=8",
    "model.d_hidden=12",
    "model.n_layers=1",
    "model.tie_weights=false",
    "train.batch_size=4",
    "train.bptt=6",
    "train.max_seq_len_delta=3",
    "train.eval_batch_size=2",
    "train.lr=0.5",
    "train.epochs=1",
]


@pytest.fixture(scope="module")
def mapped_run(tmp_path_factory) -> Path:
    """A run trained from a memory map on a tiny Zipf corpus (shared: treat as read-only,
    except for the records the commands write)."""
    root = tmp_path_factory.mktemp("mapped")
    corpus = root / "corpus"
    write_zipf_corpus(
        corpus, train_tokens=700, valid_tokens=150, test_tokens=150, types=30, mean_sentence=8
    )
    overrides = [f"data.dir={corpus}", f"data.cache_dir={root / 'cache'}", "data.memmap=true"]
    config = load_config(None, [*overrides, f"run.out_dir={root / 'run'}", *TINY])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train(config, options=TrainOptions(progress=False)).run_dir
    finally:
        torch.set_num_threads(threads)


def read_whole(corpus, name: str) -> torch.Tensor:
    """The in-memory path: the split as one int64 tensor (what every command read before)."""
    return corpus.split(name)


@pytest.fixture
def nothing_read_whole(monkeypatch):
    """A memory-mapped split read whole, a corpus loaded into memory, or a memory map given to
    batchify (whose contiguous copy is the whole split) is an error."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"a split was read whole: {args[1:]!r}")

    def guarded_batchify(ids, *args, **kwargs):
        if isinstance(ids, np.memmap):
            raise AssertionError("batchify was given a memory map: it copies the whole split")
        return batchify(ids, *args, **kwargs)

    monkeypatch.setattr(streaming.StreamCorpus, "split", refuse)
    monkeypatch.setattr("highrank.data.corpus.load_corpus", refuse)
    for module in list(sys.modules.values()):  # every module that imported batchify by name
        name = getattr(module, "__name__", "")  # sys.modules may hold objects of other kinds
        if name.startswith("highrank") and vars(module).get("batchify") is batchify:
            monkeypatch.setattr(module, "batchify", guarded_batchify)


# Each command, the record it writes (under RUN_DIR) and the fields that hold its numbers.
COMMANDS = {
    "eval": (
        ["eval", "{run}", "--split", "valid", "--token-nll", "{tmp}/nll.tsv"],
        "eval-valid-best.json",
        ("loss", "perplexity", "tokens", "batch_size"),
    ),
    "dynamic-eval": (  # gradient statistics over the whole train split, then the test split
        ["dynamic-eval", "{run}"],
        "dynamic-eval-test-best.json",
        ("loss", "perplexity", "tokens"),
    ),
    "rank": (  # 3 columns: the layout of the memory map's view, not only stream order
        ["analyze", "rank", "{run}", "--split", "train", "--batch-size", "3", "--bptt", "5"],
        "analysis/rank-train-best-b3-bptt5.json",
        ("shape", "press_rank", "effective_rank", "s_max"),
    ),
    "kl": (
        ["analyze", "kl", "{run}", "--split", "train", "--pairs", "300", "--max-contexts", "400"],
        "analysis/kl-train-best-first400-pairs300-seed0.json",
        ("n_contexts", "mean", "std"),
    ),
    "topk": (  # two runs: their streams are compared (streams_equal) before any is read
        ["analyze", "topk", "{run}", "{run}", "--split", "train", "--random", "4", "--k", "3"],
        "{tmp}/topk.json",
        ("n_contexts", "contexts"),
    ),
}


def run_command(name: str, run_dir: Path, tmp_path: Path) -> dict:
    """Run the command ``name`` quietly; the fields of its record that hold its numbers."""
    argv, record, fields = COMMANDS[name]
    tmp_path.mkdir(parents=True, exist_ok=True)
    fill = {"run": str(run_dir), "tmp": str(tmp_path)}
    extra = ["--out", str(tmp_path)] if name == "topk" else []
    assert main([arg.format(**fill) for arg in argv] + extra + ["--no-progress"]) == 0
    path = Path(record.format(**fill))
    data = json.loads((path if path.is_absolute() else run_dir / path).read_text())
    numbers = {field: _find(data, field) for field in fields}
    if name == "eval":  # every token's NLL, not only their mean
        numbers["token_nll"] = (tmp_path / "nll.tsv").read_text()
    if name == "rank":  # the singular values themselves, beside the record
        numbers["singular_values"] = np.load(run_dir / "analysis" / data["singular_values_file"])
    return numbers


def _find(record: dict, field: str):
    """``record[field]``, or in its first nested record (kl keeps its numbers per run)."""
    if field in record:
        return record[field]
    for value in record.values():
        if isinstance(value, list) and value and isinstance(value[0], dict):
            return _find(value[0], field)
        if isinstance(value, dict) and field in value:
            return value[field]
    raise KeyError(f"{field} not in record {sorted(record)}")


@pytest.mark.parametrize("command", list(COMMANDS))
def test_commands_on_a_mapped_run_equal_the_in_memory_path(
    mapped_run, tmp_path, monkeypatch, command
):
    mapped = run_command(command, mapped_run, tmp_path)
    with monkeypatch.context() as patch:
        patch.setattr(streaming, "split_stream", read_whole)
        patch.setattr(contexts, "split_stream", read_whole)
        whole = run_command(command, mapped_run, tmp_path / "whole")
    assert mapped.keys() == whole.keys()
    for field, value in mapped.items():
        if isinstance(value, np.ndarray):
            assert np.array_equal(value, whole[field]), field
        else:
            assert value == whole[field], field  # exact: the same ids in the same layout


@pytest.mark.parametrize("command", list(COMMANDS))
def test_no_command_reads_a_mapped_split_whole(mapped_run, tmp_path, nothing_read_whole, command):
    numbers = run_command(command, mapped_run, tmp_path)
    assert all(value is not None for value in numbers.values())


def test_instruments_are_handed_the_memory_map(mapped_run, monkeypatch):
    """What the analyses and dynamic evaluation read is the cache's memory map itself."""
    import highrank.evaluate.dynamic as evaluate

    loaded = contexts.load_run_split(mapped_run, "train")
    assert isinstance(loaded.ids, np.memmap)
    cache = Path(loaded.ids.filename)
    assert cache.name == "train.ids" and cache.parent.name.startswith("corpus-word-stream-")
    handed = {}

    def spy(function):
        def wrapped(model, ids, *args, **kwargs):
            handed[function.__name__] = ids
            return function(model, ids, *args, **kwargs)

        return wrapped

    for name in ("gradient_statistics", "dynamic_evaluate"):
        monkeypatch.setattr(evaluate, name, spy(getattr(evaluate, name)))
    assert main(["dynamic-eval", str(mapped_run), "--max-stats-batches", "2", "--no-progress"]) == 0
    assert isinstance(handed["gradient_statistics"], np.memmap)
    assert Path(handed["gradient_statistics"].filename) == cache
    assert isinstance(handed["dynamic_evaluate"], np.memmap)
    view = streaming.batch_view(loaded.ids, 3, name="train")
    assert isinstance(view, streaming.StreamBatches)
    assert torch.equal(view[0 : view.size(0)], batchify(torch.from_numpy(np.array(loaded.ids)), 3))


def test_max_tokens_reads_a_prefix_of_the_map(mapped_run, nothing_read_whole, capsys):
    argv = ["eval", str(mapped_run), "--split", "test", "--max-tokens", "40", "--no-progress"]
    assert main(argv) == 0
    record = json.loads((mapped_run / "eval-test-best-first40.json").read_text())
    assert record["tokens"] == 39  # batch size 1: every token after the first is predicted
    assert "over 39 tokens" in capsys.readouterr().out


def test_a_too_short_mapped_split_names_its_file(mapped_run, capsys):
    argv = ["eval", str(mapped_run), "--max-tokens", "1", "--no-progress"]
    assert main(argv) == 2
    assert "test.txt is shorter than one batch: 1 tokens" in capsys.readouterr().err


def test_streams_equal_compares_maps_and_tensors_a_block_at_a_time(tmp_path):
    path = tmp_path / "ids"
    values = np.arange(10, dtype=streaming.ID_DTYPE) % 4
    values.tofile(path)
    mapped = np.memmap(path, dtype=streaming.ID_DTYPE, mode="r")
    same = torch.from_numpy(values.astype(np.int64))
    assert streaming.streams_equal(mapped, same, block=3)
    assert streaming.streams_equal(same, mapped, block=3)
    assert streaming.streams_equal(mapped, mapped[:], block=3)
    last = same.clone()
    last[-1] += 1  # in the last block only
    assert not streaming.streams_equal(mapped, last, block=3)
    assert not streaming.streams_equal(mapped, same[:-1], block=3)
    assert not streaming.streams_equal(same, last)


def test_split_stream_copies_nothing(mapped_run):
    from highrank.models import load_run_corpus

    _, _, corpus = load_run_corpus(mapped_run)
    for split in ("train", "valid", "test"):
        assert streaming.split_stream(corpus, split) is corpus.ids[split]
    with pytest.raises(CorpusError, match="split"):
        streaming.split_stream(corpus, "dev")


def test_a_shard_folder_test_split_is_evaluated_like_the_file_it_was_cut_from(mapped_run, tmp_path):
    """The record's data sha256 of a shard folder is over its shards (a folder has no bytes)."""
    from highrank.evaluate.records import file_sha256, split_sha256

    corpus = Path(load_config(mapped_run / "config.toml").data.dir)
    sharded = tmp_path / "sharded"
    shutil.copytree(corpus, sharded)
    lines = (sharded / "test.txt").read_text().splitlines(keepends=True)
    (sharded / "test.txt").unlink()
    (sharded / "test").mkdir()
    (sharded / "test" / "part-0.txt").write_text("".join(lines[:5]))
    (sharded / "test" / "part-1.txt").write_text("".join(lines[5:]))
    for data_dir in (corpus, sharded):
        argv = ["dynamic-eval", str(mapped_run), "--data-dir", str(data_dir), "--no-progress"]
        assert main([*argv, "--max-stats-batches", "3"]) == 0
    whole = json.loads((mapped_run / "dynamic-eval-test-best.json").read_text())
    digest = split_sha256(sharded / "test")
    cut = json.loads((mapped_run / f"dynamic-eval-test-best-data{digest[:8]}.json").read_text())
    assert (cut["loss"], cut["tokens"]) == (whole["loss"], whole["tokens"])
    assert cut["data_sha256"] == digest != file_sha256(corpus / "test.txt")
    (sharded / "test" / "part-1.txt").write_text("".join(lines[6:]))
    assert split_sha256(sharded / "test") != digest
