"""Tests for highrank.analysis.similarity: benchmark files and their quirks, OOV counting,
Spearman against SciPy and a closed form, tied and untied embeddings, the CLI verb."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch
from scipy import stats

from highrank.analysis.similarity import (
    WordSimError,
    benchmark_paths,
    cosine_similarities,
    evaluate_benchmark,
    lookup,
    model_embeddings,
    pair_ids,
    read_benchmark,
    similarity_record,
    spearman,
)
from highrank.cli import main
from highrank.data import Vocab

# ---- reading files: CRLF, no final newline, duplicates, malformed lines ---------------------


def write_bytes(path, data: bytes):
    path.write_bytes(data)
    return path


def test_crlf_without_final_newline_and_a_duplicated_pair(tmp_path):
    path = write_bytes(
        tmp_path / "EN-TINY.txt",
        b"money\tcash\t9.15\r\nbank\tmoney\t8.12\r\nMoney\tcash\t9.08\r\nmoney\tbank\t8.50",
    )
    bench = read_benchmark(path)
    assert bench.name == "EN-TINY"
    assert bench.lines == 4 and bench.duplicates == 1
    # "Money cash" repeats "money cash" (case-folded): one pair with the mean score; the
    # reversed "money bank" is a separate item; no "\r" survives; the last line is read.
    assert bench.pairs == (("money", "cash"), ("bank", "money"), ("money", "bank"))
    np.testing.assert_allclose(bench.scores, [(9.15 + 9.08) / 2, 8.12, 8.50])


def test_lf_file_with_blank_lines_reads_like_the_crlf_one(tmp_path):
    crlf = read_benchmark(write_bytes(tmp_path / "a.txt", b"a\tb\t1\r\nc\td\t2\r\n"))
    lf = read_benchmark(write_bytes(tmp_path / "b.txt", b"\na\tb\t1\n\nc\td\t2\n\n"))
    assert crlf.pairs == lf.pairs == (("a", "b"), ("c", "d"))
    assert crlf.scores.tolist() == lf.scores.tolist() == [1.0, 2.0]


@pytest.mark.parametrize(
    ("line", "words"),
    [
        (b"three\tfields\tplus\tone", ["4 field(s)", "three"]),
        (b"only\ttwo", ["2 field(s)"]),
        (b"word\tother\thigh", ["'high' is not a number"]),
        (b"word\tother\tnan", ["'nan' is not a finite number"]),
    ],
)
def test_a_malformed_line_names_the_file_and_line(tmp_path, line, words):
    path = write_bytes(tmp_path / "EN-BAD.txt", b"a\tb\t1.0\r\n\r\n" + line + b"\r\nc\td\t2\r\n")
    with pytest.raises(WordSimError) as info:
        read_benchmark(path)
    message = str(info.value)
    assert f"{path}, line 3" in message  # the blank line 2 still counts
    assert all(word in message for word in words), message


def test_empty_missing_and_non_utf8_files_are_clear_errors(tmp_path):
    with pytest.raises(WordSimError, match="holds no word pairs"):
        read_benchmark(write_bytes(tmp_path / "empty.txt", b"\r\n\n"))
    with pytest.raises(WordSimError, match="missing.txt does not exist"):
        read_benchmark(tmp_path / "missing.txt")
    with pytest.raises(WordSimError, match="not UTF-8"):
        read_benchmark(write_bytes(tmp_path / "latin.txt", b"caf\xe9\ttea\t1\n"))


def test_benchmark_paths_selects_by_name_and_names_unknown_ones(tmp_path):
    for name in ("EN-B", "EN-A"):
        (tmp_path / f"{name}.txt").write_text("a b 1\n")
    assert [p.name for p in benchmark_paths(tmp_path)] == ["EN-A.txt", "EN-B.txt"]
    assert [p.name for p in benchmark_paths(tmp_path, ["EN-B.txt", "EN-A"])] == [
        "EN-B.txt",
        "EN-A.txt",
    ]
    with pytest.raises(WordSimError, match=r"'EN-C' not in .*expected some of EN-A, EN-B"):
        benchmark_paths(tmp_path, ["EN-C"])
    with pytest.raises(WordSimError, match="does not exist"):
        benchmark_paths(tmp_path / "nowhere")
    with pytest.raises(WordSimError, match="expected some of"):
        benchmark_paths(tmp_path, [])


# ---- looking words up, OOV -----------------------------------------------------------------


def test_lookup_lower_cases_first_then_as_written_and_never_uses_unk():
    vocab = Vocab(["<unk>", "jerusalem", "Israel", "Mars", "mars"])
    assert lookup("Jerusalem", vocab) == 1  # lower-cased form found
    assert lookup("Israel", vocab) == 2  # only the cased form is in the vocabulary
    assert lookup("Mars", vocab) == 4  # lower-cased preferred over the written form
    assert lookup("Paris", vocab) is None  # not <unk>'s id 0


def test_pairs_with_an_out_of_vocabulary_word_are_skipped_and_counted(tmp_path):
    path = tmp_path / "EN-OOV.txt"
    path.write_text("a\tb\t1\nb\tzzz\t2\nc\ta\t3\nQQQ\tzzz\t4\nb\tc\t5\n")
    vocab = Vocab(["a", "b", "c", "<unk>"])
    bench = read_benchmark(path)
    ids_a, ids_b, kept, oov = pair_ids(bench, vocab)
    assert kept.tolist() == [True, False, True, False, True]
    assert ids_a.tolist() == [0, 2, 1] and ids_b.tolist() == [1, 0, 2]
    assert oov == ["qqq", "zzz"]
    result = evaluate_benchmark(bench, vocab, {"input": torch.randn(4, 3)})
    assert (result["pairs"], result["pairs_used"], result["oov_skipped"]) == (5, 3, 2)


def test_a_benchmark_entirely_out_of_vocabulary_has_no_spearman(tmp_path):
    path = tmp_path / "EN-X.txt"
    path.write_text("x\ty\t1\nx\tz\t2\ny\tz\t3\n")
    result = evaluate_benchmark(read_benchmark(path), Vocab(["a"]), {"input": torch.ones(1, 2)})
    assert result["pairs_used"] == 0 and math.isnan(result["spearman"]["input"])


# ---- Spearman ------------------------------------------------------------------------------


def test_spearman_matches_the_closed_form_without_ties():
    x = np.array([0.3, -0.1, 0.8, 0.5, 0.0, 0.9])
    y = np.array([2.0, 1.0, 5.0, 3.0, 4.0, 6.0])
    # ranks x: 3 1 5 4 2 6; y: 2 1 5 3 4 6; d^2 = 1+0+0+1+4+0 = 6; 1 - 6*6 / (6*35) = 29/35
    assert spearman(x, y) == pytest.approx(1 - 6 * 6 / (6 * 35))
    assert spearman(x, -y) == pytest.approx(-29 / 35)


def test_spearman_is_nan_when_undefined():
    assert math.isnan(spearman([1.0, 2.0], [1.0, 3.0]))  # fewer than 3 pairs
    assert math.isnan(spearman([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]))  # constant cosines
    with pytest.raises(ValueError, match="one length"):
        spearman([1.0, 2.0, 3.0], [1.0, 2.0])


def test_cosine_similarities_match_numpy():
    matrix = torch.randn(6, 4)
    ids_a, ids_b = np.array([0, 1, 5]), np.array([2, 1, 3])
    m = matrix.double().numpy()
    expected = [
        m[a] @ m[b] / np.linalg.norm(m[a]) / np.linalg.norm(m[b])
        for a, b in zip(ids_a, ids_b, strict=True)
    ]
    np.testing.assert_allclose(cosine_similarities(matrix, ids_a, ids_b), expected, rtol=1e-12)


def test_spearman_on_a_real_benchmark_matches_scipy(word_sim_dir):
    bench = read_benchmark(word_sim_dir / "EN-WS-353-ALL.txt")
    assert (bench.lines, len(bench.pairs), bench.duplicates) == (353, 352, 1)  # money cash
    words = sorted({w.lower() for pair in bench.pairs for w in pair})
    skipped = {"tiger", "cash"}  # out of the vocabulary: skipped pairs
    vocab = Vocab([w for w in words if w not in skipped])
    matrix = torch.randn(len(vocab), 16, generator=torch.Generator().manual_seed(1))
    result = evaluate_benchmark(bench, vocab, {"input": matrix})

    keep = [i for i, p in enumerate(bench.pairs) if not {p[0].lower(), p[1].lower()} & skipped]
    m = matrix.double().numpy()
    unit = m / np.linalg.norm(m, axis=1, keepdims=True)
    ids = [(vocab.id(bench.pairs[i][0].lower()), vocab.id(bench.pairs[i][1].lower())) for i in keep]
    cosines = [unit[a] @ unit[b] for a, b in ids]
    expected = stats.spearmanr(cosines, bench.scores[keep]).statistic
    assert result["pairs_used"] == len(keep) and result["oov_skipped"] == 352 - len(keep)
    assert result["spearman"]["input"] == pytest.approx(expected, abs=1e-12)


def test_every_real_benchmark_reads_with_the_documented_counts(word_sim_dir):
    # Pair lines per file, from ../shared/data/README.md (EN-VERB-143 has 144 lines).
    lines = {"EN-WS-353-ALL": 353, "EN-MTurk-287": 287, "EN-MTurk-771": 771, "EN-VERB-143": 144}
    lines |= {"EN-SimVerb-3500": 3500, "EN-SIMLEX-999": 999, "EN-MC-30": 30, "EN-RG-65": 65}
    benchmarks = {b.name: b for b in map(read_benchmark, benchmark_paths(word_sim_dir))}
    assert len(benchmarks) == 13
    for name, count in lines.items():
        assert benchmarks[name].lines == count, name
    assert sum(b.duplicates for b in benchmarks.values()) == 1


# ---- embeddings of a model -----------------------------------------------------------------


def build(tied: bool, vocab_size: int = 12):
    from highrank.config import load_config
    from highrank.models import build_model

    settings = ["model.d_embed=6", "model.d_hidden=8", "model.n_layers=1"]
    config = load_config(None, [*settings, f"model.tie_weights={str(tied).lower()}"])
    return build_model(config, vocab_size)


@pytest.mark.parametrize("tied", [True, False])
def test_input_and_output_embeddings_are_one_tensor_exactly_when_tied(tmp_path, tied):
    model = build(tied)
    matrices, is_tied = model_embeddings(model)
    assert is_tied is tied
    assert matrices["input"] is model.backbone.embedding.weight
    assert matrices["output"] is model.head.weight
    path = tmp_path / "EN-T.txt"
    path.write_text("w0\tw1\t3\nw2\tw3\t1\nw4\tw5\t2\nw6\tw7\t0.5\n")
    vocab = Vocab([f"w{i}" for i in range(12)])
    record = similarity_record(model, vocab, [read_benchmark(path)])
    assert record["tied"] is tied and record["shapes"]["input"] == [12, 6]
    rho = record["benchmarks"]["EN-T"]["spearman"]
    assert (rho["input"] == rho["output"]) is tied


# ---- the command line ------------------------------------------------------------------------


def tiny_benchmarks(folder):
    """Two benchmarks over the tiny run's words (see tests/conftest.py, WORDS) plus OOV pairs."""
    folder.mkdir()
    (folder / "EN-ONE.txt").write_bytes(
        b"car\tautomobile\t3.9\r\ngem\tjewel\t3.8\r\nnoon\tstring\t0.1\r\n"
        b"car\tunseenword\t2\r\nbird\tcrane\t3.0\r\ncar\tautomobile\t3.7"
    )
    (folder / "EN-TWO.txt").write_text("boy\tlad\t9\ncoast\tshore\t8\nglass\tmagician\t1\n")
    return folder


def test_cli_analyze_similarity_writes_records_and_prints_the_table(tiny_run, tmp_path, capsys):
    tiny_run = shutil.copytree(tiny_run, tmp_path / "run")  # the shared run stays untouched
    data = tiny_benchmarks(tmp_path / "word-sim")
    out = tmp_path / "summary"
    assert (
        main(["analyze", "similarity", str(tiny_run), "--data-dir", str(data), "--out", str(out)])
        == 0
    )
    printed = capsys.readouterr().out
    record = json.loads((tiny_run / "analysis" / "similarity-best.json").read_text())
    subset = ["analyze", "similarity", str(tiny_run), "--data-dir", str(data), "--benchmarks",
              "EN-ONE"]
    assert main(subset) == 0  # a subset has a record of its own, the full one stays
    assert set(json.loads((tiny_run / "analysis" / "similarity-best-EN-ONE.json").read_text())[
        "benchmarks"]) == {"EN-ONE"}
    assert json.loads((tiny_run / "analysis" / "similarity-best.json").read_text()) == record
    one = record["benchmarks"]["EN-ONE"]
    assert record["tied"] is False and record["checkpoint"] == "best"
    assert (one["lines"], one["duplicates_merged"], one["pairs"]) == (6, 1, 5)
    assert (one["pairs_used"], one["oov_skipped"], one["oov_words"]) == (4, 1, ["unseenword"])
    assert all(-1 <= v <= 1 for v in one["spearman"].values())
    assert "Spearman (input)" in printed and "EN-TWO" in printed
    summary = json.loads((out / "similarity.json").read_text())
    assert summary["runs"][0]["benchmarks"] == record["benchmarks"]
    assert "| EN-ONE |" in (out / "similarity.md").read_text()


def test_cli_analyze_similarity_on_a_real_benchmark(tiny_run, word_sim_dir, tmp_path, capsys):
    tiny_run = shutil.copytree(tiny_run, tmp_path / "run")
    argv = ["analyze", "similarity", str(tiny_run), "--data-dir", str(word_sim_dir)]
    assert main([*argv, "--benchmarks", "EN-MC-30,EN-WS-353-ALL"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    mc30 = next(row for row in rows if "EN-MC-30" in row)
    assert mc30[2:5] == ["30", "30", "0"]  # the tiny corpus holds every MC-30 word
    assert all(-1 <= float(value) <= 1 for value in mc30[5:7])


def test_cli_analyze_similarity_input_errors_exit_2(tiny_run, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ../shared/data/word-sim from here
    assert main(["analyze", "similarity", str(tiny_run)]) == 2
    assert "no --data-dir given" in capsys.readouterr().err
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "EN-BAD.txt").write_text("a\tb\t1\nc\td\n")
    assert main(["analyze", "similarity", str(tiny_run), "--data-dir", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("highrank analyze similarity: error: ") and "EN-BAD.txt, line 2" in err
    data = tiny_benchmarks(tmp_path / "word-sim")
    assert main(["analyze", "similarity", str(tmp_path / "norun"), "--data-dir", str(data)]) == 2
    assert "norun" in capsys.readouterr().err
