"""Tests for highrank.analysis.significance: the t-test against SciPy and closed forms,
Welch, Pearson, bad input, the two groups around ``--``, and the ``highrank compare`` verb."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from highrank.analysis.significance import (
    CompareError,
    compare_groups,
    compare_runs,
    holm_adjusted,
    pearson,
    read_eval,
    read_perplexity,
    read_press_rank,
    welch_df,
)
from highrank.cli import main
from highrank.cli.analyze.compare import split_groups

# ---- the t-test --------------------------------------------------------------------------------


def test_student_t_test_against_a_closed_form():
    # a = [1, 3], b = [4, 6]: means 2 and 5, variances 2 and 2, pooled variance 2,
    # t = (2 - 5) / sqrt(2 * (1/2 + 1/2)) = -3 / sqrt(2), df = 2. With 2 degrees of freedom
    # the t CDF is 1/2 + t / (2 sqrt(2 + t^2)), so p = 1 - |t| / sqrt(2 + t^2).
    result = compare_groups([1.0, 3.0], [4.0, 6.0])
    t = -3 / math.sqrt(2)
    assert (result.mean_a, result.mean_b) == (2.0, 5.0)
    assert result.std_a == pytest.approx(math.sqrt(2)) and result.std_b == pytest.approx(
        math.sqrt(2)
    )
    assert (result.n_a, result.n_b, result.df, result.welch) == (2, 2, 2.0, False)
    assert result.t == pytest.approx(t)
    assert result.p == pytest.approx(1 - abs(t) / math.sqrt(2 + t * t))


def test_student_t_test_matches_scipy_and_the_pooled_formula():
    rng = np.random.default_rng(0)
    a, b = 60 + rng.standard_normal(10), 59 + 1.5 * rng.standard_normal(10)
    result = compare_groups(a, b)
    expected = stats.ttest_ind(a, b, equal_var=True)
    assert result.t == pytest.approx(expected.statistic, rel=1e-12)
    assert result.p == pytest.approx(expected.pvalue, rel=1e-10)
    pooled = ((a.size - 1) * a.var(ddof=1) + (b.size - 1) * b.var(ddof=1)) / (a.size + b.size - 2)
    t = (a.mean() - b.mean()) / math.sqrt(pooled * (1 / a.size + 1 / b.size))
    assert result.t == pytest.approx(t, rel=1e-12) and result.df == 18
    assert result.p == pytest.approx(2 * stats.t.sf(abs(t), 18), rel=1e-10)
    assert result.std_a == pytest.approx(np.std(a, ddof=1))


def test_welch_t_test_matches_scipy_and_welch_satterthwaite():
    a, b = [58.1, 58.9, 59.4, 58.6], [57.0, 60.2, 55.9, 61.3, 58.8, 56.4, 59.9]
    result = compare_groups(a, b, welch=True)
    expected = stats.ttest_ind(a, b, equal_var=False)
    va, vb = np.var(a, ddof=1) / 4, np.var(b, ddof=1) / 7
    df = (va + vb) ** 2 / (va**2 / 3 + vb**2 / 6)
    assert result.welch and result.df == pytest.approx(df, rel=1e-12)
    assert result.df == pytest.approx(expected.df, rel=1e-12)
    assert result.t == pytest.approx((np.mean(a) - np.mean(b)) / math.sqrt(va + vb), rel=1e-12)
    assert result.p == pytest.approx(expected.pvalue, rel=1e-10)
    assert result.p == pytest.approx(2 * stats.t.sf(abs(result.t), df), rel=1e-10)
    # with equal sizes and equal variances Welch's df is the pooled test's 2n - 2
    assert welch_df(2.0, 5, 2.0, 5) == pytest.approx(8.0)


@pytest.mark.parametrize(
    ("a", "b", "words"),
    [
        ([1.0], [2.0, 3.0], ["group a has 1 value(s)", "at least 2"]),
        ([1.0, 2.0], [], ["group b has 0 value(s)"]),
        ([1.0, math.nan], [2.0, 3.0], ["group a", "non-finite", "#1=nan"]),
        ([1.0, 2.0], [math.inf, 3.0], ["group b", "#0=inf"]),
        ([5.0, 5.0], [6.0, 6.0], ["zero spread"]),
    ],
)
def test_bad_groups_are_clear_errors(a, b, words):
    with pytest.raises(CompareError) as info:
        compare_groups(a, b)
    assert all(word in str(info.value) for word in words), str(info.value)


def test_pearson_matches_scipy_and_numpy():
    x, y = [120, 340, 560, 800, 990], [70.1, 66.3, 64.0, 60.2, 59.9]
    result = pearson(x, y)
    expected = stats.pearsonr(x, y)
    assert result.r == pytest.approx(np.corrcoef(x, y)[0, 1], rel=1e-12)
    assert result.p == pytest.approx(expected.pvalue, rel=1e-10) and result.n == 5


@pytest.mark.parametrize(
    ("x", "y", "message"),
    [
        ([1, 2, 3, 4], [1, 2, 3], "equal lengths"),
        ([1, 2], [3, 4], "at least 3"),
        ([7, 7, 7], [1, 2, 3], "x is constant"),
        ([1, 2, 3], [1, math.nan, 3], "non-finite"),
    ],
)
def test_pearson_bad_input(x, y, message):
    with pytest.raises(CompareError, match=message):
        pearson(x, y)


# ---- the two groups around -- ------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["a1", "a2", "--", "b1", "b2", "b3"],
        ["--welch", "a1", "a2", "--", "b1", "b2", "b3", "--names", "X,Y"],
        ["a1", "--welch", "a2", "--", "b1", "b2", "--names=X,Y", "b3"],
        ["--names", "X,Y", "a1", "a2", "--", "b1", "b2", "b3"],
    ],
)
def test_two_groups_around_the_separator_with_options_anywhere(argv):
    from highrank.cli import build_parser

    args = build_parser().parse_args(["compare", *argv])
    assert split_groups(args.runs, args) == (["a1", "a2"], ["b1", "b2", "b3"])
    welch, names = "--welch" in argv, ("X", "Y") if "X,Y" in " ".join(argv) else ("A", "B")
    assert (args.welch, args.names) == (welch, names)


def test_split_groups_errors():
    with pytest.raises(CompareError, match="found 0 '--'.*separated by one --"):
        split_groups(["a1", "a2", "b1", "b2"])
    with pytest.raises(CompareError, match="found 2 '--'"):
        split_groups(["--", "a1", "a2", "--", "b1", "b2"])
    with pytest.raises(CompareError, match="group A has 1 run"):
        split_groups(["a1", "--", "b1", "b2"])
    with pytest.raises(CompareError, match="group B has 0 run"):
        split_groups(["a1", "a2", "--"])
    with pytest.raises(SystemExit):
        split_groups(["a1", "a2", "--", "b1", "b2", "--bogus"])


# ---- runs on disk ------------------------------------------------------------------------------


def fake_run(folder, perplexity, press_rank=None, split="test", which="best", seed=None):
    """A run directory holding only what compare reads: its config.toml (the seed), the eval
    record and a rank record."""
    make_run_dir(folder, seed)
    record = {"split": split, "checkpoint": which, "perplexity": perplexity}
    (folder / f"eval-{split}-{which}.json").write_text(json.dumps(record))
    if press_rank is not None:
        (folder / "analysis").mkdir()
        rank = {"press_rank": press_rank}
        (folder / "analysis" / f"rank-{split}-{which}.json").write_text(json.dumps(rank))
    return str(folder)


def make_run_dir(folder, seed=None):
    """An empty run of ``highrank train`` as compare sees it: a folder with its config.toml."""
    folder.mkdir(parents=True)
    (folder / "config.toml").write_text("[train]\n" + ("" if seed is None else f"seed = {seed}\n"))
    return folder


def test_a_missing_eval_record_says_which_run_and_the_command_to_make_it(tmp_path):
    make_run_dir(tmp_path / "r")
    with pytest.raises(CompareError) as info:
        read_perplexity(tmp_path / "r", "valid", "last")
    message = str(info.value)
    assert "eval-valid-last.json" in message
    assert f"`highrank eval {tmp_path / 'r'} --split valid --which last`" in message


def test_a_broken_eval_record_names_its_file_and_key(tmp_path):
    run = make_run_dir(tmp_path / "r")
    (run / "eval-test-best.json").write_text('{"perplexity": "high"}')
    with pytest.raises(CompareError, match=r"eval-test-best.json: key 'perplexity' is 'high'"):
        read_perplexity(run, "test", "best")


def test_rank_correlation_uses_every_run_or_says_why_it_was_skipped(tmp_path):
    a = [fake_run(tmp_path / f"a{i}", p, r) for i, (p, r) in enumerate([(70, 300), (71, 280)])]
    b = [fake_run(tmp_path / f"b{i}", p, r) for i, (p, r) in enumerate([(60, 900), (61, 850)])]
    record = compare_runs({"softmax": a, "mos": b})
    correlation = record["rank_vs_perplexity"]
    expected = stats.pearsonr([300, 280, 900, 850], [70, 71, 60, 61])
    assert correlation["r"] == pytest.approx(expected.statistic) and correlation["n"] == 4
    assert record["lower_perplexity"] == "mos" and record["groups"]["mos"]["perplexities"] == [
        60,
        61,
    ]

    b.append(fake_run(tmp_path / "b2", 62.0))  # no rank record
    skipped = compare_runs({"softmax": a, "mos": b})["rank_vs_perplexity"]["skipped"]
    assert "1 of 5 runs" in skipped and str(tmp_path / "b2") in skipped


def test_a_malformed_rank_record_is_an_error(tmp_path):
    a = [fake_run(tmp_path / "a0", 70, 3), fake_run(tmp_path / "a1", 71, 3.5)]
    b = [fake_run(tmp_path / "b0", 60, 9), fake_run(tmp_path / "b1", 61, 9)]
    with pytest.raises(CompareError, match=r"rank-test-best.json: key 'press_rank' is 3.5"):
        compare_runs({"A": a, "B": b})


def test_cli_compare_smoke_on_a_tiny_trained_run(tiny_run, tmp_path, capsys):
    real = tmp_path / "a0"
    shutil.copytree(tiny_run, real)
    assert main(["eval", str(real), "--split", "test", "--no-progress"]) == 0
    ppl = json.loads((real / "eval-test-best.json").read_text())["perplexity"]
    (real / "analysis").mkdir(exist_ok=True)
    (real / "analysis" / "rank-test-best.json").write_text('{"press_rank": 40}')
    a = [str(real), fake_run(tmp_path / "a1", ppl + 1.0, 41), fake_run(tmp_path / "a2", ppl, 39)]
    b = [fake_run(tmp_path / f"b{i}", ppl - 5.0 + i, 43 + i) for i in range(3)]
    out = tmp_path / "out"
    code = main(["compare", *a, "--", *b, "--names", "small,large", "--welch", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    record = json.loads((out / "compare.json").read_text())
    expected = stats.ttest_ind([ppl, ppl + 1, ppl], [ppl - 5, ppl - 4, ppl - 3], equal_var=False)
    assert record["p"] == pytest.approx(expected.pvalue) and record["welch"] is True
    assert record["significant"] == (expected.pvalue < 0.05)
    assert record["lower_perplexity"] == "large" and record["rank_vs_perplexity"]["n"] == 6
    assert "Welch's t-test" in printed and "press rank vs perplexity: Pearson r" in printed
    assert "| small |" in (out / "compare.md").read_text()


def test_cli_compare_input_errors_exit_2_in_one_line(tmp_path, capsys):
    a = [fake_run(tmp_path / "a0", 70), fake_run(tmp_path / "a1", 71)]
    make_run_dir(tmp_path / "b0")
    code = main(["compare", *a, "--", str(tmp_path / "b0"), fake_run(tmp_path / "b1", 60)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("highrank compare: error: run ")
    assert f"highrank eval {tmp_path / 'b0'} --split test --which best" in err
    assert main(["compare", *a]) == 2
    assert "separated by one --" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["compare", "--alpha", "2", *a, "--", *a])
    assert info.value.code == 2 and "--alpha" in capsys.readouterr().err


def test_runs_of_other_data_the_same_run_twice_and_stale_records_are_refused(
    tiny_run, tmp_path, capsys
):
    """A new user's walk: compare ran a t-test over runs scored on different corpora, took
    the same runs in both groups (t = 0), and read eval records of a best.pt that a resumed
    training had rewritten since."""
    a = [fake_run(tmp_path / "a0", 70), fake_run(tmp_path / "a1", 71)]
    b = [fake_run(tmp_path / "b0", 60), fake_run(tmp_path / "b1", 61)]
    for run, sha in zip([*a, *b], ["1" * 64, "1" * 64, "1" * 64, "2" * 64], strict=True):
        path = Path(run) / "eval-test-best.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "data_sha256": sha}))
    with pytest.raises(CompareError, match=r"scored on different data, .*b1 \(split sha256 "
                       r"222222222222\.\.\.\)$"):
        compare_runs({"A": a, "B": b})
    with pytest.raises(CompareError, match=r"^a run stands twice in the groups: .*a0$"):
        compare_runs({"A": a, "B": [a[0], b[0]]})
    real = shutil.copytree(tiny_run, tmp_path / "real")
    assert main(["eval", str(real), "--split", "test", "--no-progress"]) == 0
    read_eval(real, "test", "best")  # the record of the checkpoint as it is
    best = real / "checkpoints" / "best.pt"
    best.write_bytes(best.read_bytes() + b"\0")  # other bytes, as a resumed training writes
    with pytest.raises(CompareError, match=r"scored an earlier best.pt \(the checkpoint has "
                       r"changed since: .*re-evaluate with `highrank eval "):
        read_eval(real, "test", "best")


def test_compare_finds_rank_records_by_the_tag_analyze_rank_gave_them(tiny_run, tmp_path):
    from highrank.analysis.rank import analyze_run

    run = shutil.copytree(tiny_run, tmp_path / "r")
    record = analyze_run(run, max_contexts=30)
    assert read_press_rank(run, "test-best-first30") == record["press_rank"]
    assert read_press_rank(run, "test-best") is None
    (run / "eval-test-best.json").write_text(json.dumps({"perplexity": 40.0}))
    others = [fake_run(tmp_path / f"o{i}", 41.0 + i, 7 + i) for i in range(3)]
    skipped = compare_runs({"A": [run, others[0]], "B": others[1:]})["rank_vs_perplexity"]
    assert "rank-test-best.json" in skipped["skipped"] and "--rank-tag" in skipped["skipped"]


def test_holm_adjusted_p_values_by_hand():
    """m = 4: sorted 0.005, 0.01, 0.03, 0.04 scale by 4, 3, 2, 1 to 0.02, 0.03, 0.06, 0.04;
    the running maximum makes the last 0.06; results come back in the order given."""
    assert holm_adjusted([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm_adjusted([0.5, 0.6]) == [1.0, 1.0]  # capped at 1, then monotone
    assert holm_adjusted([0.2]) == [0.2]  # one test: nothing to adjust
    assert holm_adjusted([]) == []


@pytest.mark.parametrize("values", [[0.1, 1.5], [-0.1], [float("nan")], [[0.1, 0.2]]])
def test_holm_refuses_what_is_not_a_p_value(values):
    with pytest.raises(CompareError, match="p-values"):
        holm_adjusted(values)


def fake_retrofit(folder, perplexity, *, base=50.0, seed=1, head="mos", finished=True):
    """A ``highrank retrofit`` output holding what compare reads: plan.json, results.json."""
    folder.mkdir(parents=True)
    plan = {"head": head, "mode": "frozen", "seed": seed, "test": "test.txt", "valid": "v.txt"}
    (folder / "plan.json").write_text(json.dumps(plan))
    if finished:
        score = {split: {"tokens": 768, "perplexity": perplexity} for split in ("valid", "test")}
        base_score = {split: {"tokens": 768, "perplexity": base} for split in ("valid", "test")}
        (folder / "results.json").write_text(json.dumps(
            {"plan": plan, "base": base_score, "trained": score}))
    return str(folder)


def test_retrofit_outputs_compare_by_their_results(tmp_path, capsys):
    """A new user's walk: the decision page asks for a head and its capacity control over two
    seeds, and `compare` refused retrofit outputs, pointing at `highrank eval` (which said
    the finished retrofit "has saved no checkpoint yet")."""
    mos = [fake_retrofit(tmp_path / f"mos-s{s}", p, seed=s) for s, p in ((1, 20.1), (2, 20.3))]
    control = [fake_retrofit(tmp_path / f"ctl-s{s}", p, seed=s, head="mlp_softmax")
               for s, p in ((1, 20.6), (2, 20.5))]
    assert main(["compare", *mos, "--", *control, "--names", "mos4,control"]) == 0
    out = capsys.readouterr().out
    assert "lower mean perplexity: mos4" in out
    assert "retrofit outputs keep no rank records" in out
    assert f"mos4: {mos[0]}: retrofit mos (frozen, seed 1) on --test test.txt (768 tokens)" in out
    record = compare_runs({"a": mos, "b": control})
    assert record["groups"]["a"]["perplexities"] == [20.1, 20.3]
    expected = stats.ttest_ind([20.1, 20.3], [20.6, 20.5])
    assert record["t"] == pytest.approx(expected.statistic)
    assert compare_runs({"a": mos, "b": control}, split="valid")["mean_a"] == pytest.approx(20.2)


def test_retrofits_of_other_models_unfinished_or_mixed_with_runs_are_refused(tmp_path):
    mos = [fake_retrofit(tmp_path / f"mos-s{s}", 20 + s) for s in (1, 2)]
    other = [fake_retrofit(tmp_path / f"other-s{s}", 20 + s, base=51.0) for s in (1, 2)]
    with pytest.raises(CompareError, match=r"score their base model differently \(51 against "
                       r"50, more than a device or cache dtype moves it\): another model"):
        compare_runs({"a": mos, "b": other})
    runs = [fake_run(tmp_path / f"run-s{s}", 20 + s) for s in (1, 2)]
    with pytest.raises(CompareError, match=r"mix `highrank retrofit` outputs and `highrank "
                       r"train` runs"):
        compare_runs({"a": mos, "b": runs})
    pending = fake_retrofit(tmp_path / "pending", 0, finished=False)
    with pytest.raises(CompareError, match=r"retrofit .*pending has not finished \(no "
                       r"results.json\): run its command again"):
        compare_runs({"a": mos, "b": [pending, other[0]]})


def test_verbs_of_training_runs_say_where_a_retrofit_s_scores_and_model_are(tmp_path, capsys):
    out = fake_retrofit(tmp_path / "retrofit-mos4", 20.0)
    note = (f"{out} is the output of `highrank retrofit`, not a run of `highrank train`: its "
            f"valid and test scores are in {out}/results.json (`highrank compare` reads them)")
    assert main(["eval", out, "--split", "test"]) == 2
    assert note in capsys.readouterr().err
    assert main(["report", out, "--out", str(tmp_path / "report")]) == 2
    assert note in capsys.readouterr().err


def test_a_paired_test_pairs_the_runs_in_place_and_checks_retrofit_seeds(tmp_path, capsys):
    """The studies' paired test by seed, for a user's own seeds (the decision page)."""
    from highrank.analysis.significance import compare_paired

    a, b = [20.1, 20.3, 20.2], [20.6, 20.5, 20.8]
    result = compare_paired(a, b)
    expected = stats.ttest_rel(a, b)
    assert result.paired and result.df == 2
    assert result.t == pytest.approx(expected.statistic) and result.p == pytest.approx(
        expected.pvalue)
    diffs = np.subtract(a, b)  # the closed form: mean / (sd / sqrt(n))
    assert result.t == pytest.approx(diffs.mean() / (diffs.std(ddof=1) / math.sqrt(3)))
    with pytest.raises(CompareError, match="groups of one size; got 3 and 2"):
        compare_paired(a, b[:2])
    with pytest.raises(CompareError, match="every pair differs by the same amount"):
        compare_paired([1.0, 2.0], [0.5, 1.5])
    mos = [fake_retrofit(tmp_path / f"mos-s{s}", p, seed=s) for s, p in enumerate(a, start=1)]
    ctl = [fake_retrofit(tmp_path / f"ctl-s{s}", p, seed=s) for s, p in enumerate(b, start=1)]
    assert main(["compare", *mos, "--", *ctl, "--paired"]) == 0
    assert "paired t-test (each run of one group with the run in its place in the other)" in (
        capsys.readouterr().out)
    assert compare_runs({"a": mos, "b": ctl}, paired=True)["t"] == pytest.approx(result.t)
    with pytest.raises(CompareError, match=r"--paired pairs .*mos-s1 \(seed 1\) with .*ctl-s2 "
                       r"\(seed 2\): give the runs of both groups in the order of their seeds"):
        compare_runs({"a": mos, "b": [ctl[1], ctl[0], ctl[2]]}, paired=True)
    with pytest.raises(CompareError, match="--paired and --welch"):
        compare_runs({"a": mos, "b": ctl}, paired=True, welch=True)
    assert main(["compare", *mos, "--", *ctl[:2], "--paired"]) == 2  # a review: a traceback
    assert "the groups have 3 and 2 runs" in capsys.readouterr().err


def test_retrofits_on_other_devices_or_modes_still_compare(tmp_path):
    """A review: the study's own base scores of one model on one slice differ by 1.2e-5 to
    1.7e-5 (relative) between the CPU, an H100 and LoRA mode (bfloat16 caches, devices)."""
    cpu = [fake_retrofit(tmp_path / f"cpu-s{s}", 20 + s, base=33.920234) for s in (1, 2)]
    gpu = [fake_retrofit(tmp_path / f"gpu-s{s}", 21 + s, base=33.920806) for s in (1, 2)]
    assert compare_runs({"a": cpu, "b": gpu})["lower_perplexity"] == "a"


def test_folders_that_are_no_run_yet_say_what_they_are(tmp_path):
    """A review: a retrofit still loading its model (its OUT holds only the lock) read as a
    training run without an eval record, and compare told the user to evaluate it."""
    from highrank.runs.locks import LOCK_FILE

    starting = tmp_path / "starting"
    starting.mkdir()
    (starting / LOCK_FILE).write_text("")
    with pytest.raises(CompareError, match=r"starting holds a lock but no config.toml or "
                       r"plan.json yet: .*compare it once it has finished"):
        read_eval(starting, "test", "best")
    (tmp_path / "other").mkdir()
    with pytest.raises(CompareError, match=r"other is neither a run of `highrank train` \(no "
                       r"config.toml\) nor the output of `highrank retrofit` \(no plan.json\)"):
        read_eval(tmp_path / "other", "test", "best")
    with pytest.raises(CompareError, match=r"run directory .*missing does not exist"):
        read_eval(tmp_path / "missing", "test", "best")


def test_paired_training_runs_are_checked_by_the_seeds_of_their_configs(tmp_path):
    """A review: --paired checked the seeds of retrofits only; a training run's config.toml
    has its seed too."""
    a = [fake_run(tmp_path / f"a{s}", 70 + s, seed=s) for s in (1, 2, 3)]
    b = [fake_run(tmp_path / f"b{s}", 60 + s * s, seed=s) for s in (1, 2, 3)]
    assert compare_runs({"A": a, "B": b}, paired=True)["paired"]
    with pytest.raises(CompareError, match=r"--paired pairs .*a1 \(seed 1\) with .*b2 "
                       r"\(seed 2\): give the runs of both groups in the order of their seeds"):
        compare_runs({"A": a, "B": [b[1], b[0], b[2]]}, paired=True)
    others = [fake_run(tmp_path / f"d{s}", 60 + s * s, seed=s) for s in (4, 5, 6)]
    with pytest.raises(CompareError, match=r"the groups' seeds differ \(A: 1, 2, 3; D: 4, 5, "
                       r"6\): compare them unpaired"):  # no order can pair them (a review)
        compare_runs({"A": a, "D": others}, paired=True)
    unseeded = [fake_run(tmp_path / f"c{s}", 50 + s * s) for s in (1, 2, 3)]
    assert compare_runs({"A": a, "C": unseeded}, paired=True)["paired"]  # nothing to check
    (Path(b[0]) / "config.toml").write_text("not [toml")  # unreadable: not checked, not fatal
    assert compare_runs({"A": a, "B": b}, paired=True)["paired"]
