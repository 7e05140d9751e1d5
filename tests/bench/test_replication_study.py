"""benchmarks/studies/replication_study.py: equal parameter counts, the plan, resumability, the
results layer (--summarize on finished runs only, t-tests, Pearson, figures), the dynamic
evaluation stage, and (slow) the whole pipeline on a tiny corpus."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from highrank.config import load_config, save_config
from highrank.train import parameter_count

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "studies" / "replication_study.py"


@pytest.fixture(scope="module")
def study():
    from benchmarks.studies import replication_study

    return replication_study


def test_every_head_gets_the_softmax_parameter_count_within_two_percent(study):
    sizes = study.matched_hidden_sizes()
    assert set(sizes) == set(study.HEADS)
    counts = {
        head: parameter_count(
            load_config(study.config_path(head), [f"model.d_hidden={d}"]), study.PTB_VOCAB
        )
        for head, d in sizes.items()
    }
    target = counts["softmax"]
    assert all(abs(c - target) <= 0.02 * target for c in counts.values()), counts
    assert sizes["moc"] < sizes["softmax"]  # MoC-15's head is the largest: a narrower LSTM


def test_plan_counts_seeds_and_a_finished_stage_is_not_redone(study, tmp_path, capsys):
    args = study.parse_arguments(
        [
            "--heads",
            "softmax,gss",
            "--seeds",
            "2",
            "--extra-seeds",
            "1",
            "--runs",
            str(tmp_path / "runs"),
            "--results",
            str(tmp_path / "results"),
        ]
    )
    runs = study.plan(args)
    assert [r.name for r in runs] == [
        "softmax-seed1",
        "gss-seed1",
        "softmax-seed2",
        "gss-seed2",
        "softmax-seed3",
    ]  # seed-major
    assert len(study.remaining(args, runs)) == 5 * 5  # train, eval, rank, kl, dynamic
    done = tmp_path / "runs" / "gss-seed1"
    done.mkdir(parents=True)
    (done / "study-train.done").write_text("")
    (done / "eval-test-best.json").write_text("{}")
    left = study.remaining(args, runs)
    assert len(left) == 5 * 5 - 2
    assert all(t.run.name != "gss-seed1" or t.stage in ("rank", "kl", "dynamic") for t in left)
    study.print_plan(args, left)
    assert "remaining: 23 stages" in capsys.readouterr().out


def test_measured_stage_times_replace_the_prior_estimates(study, tmp_path):
    args = study.parse_arguments(["--results", str(tmp_path), "--runs", str(tmp_path / "r")])
    task = study.Task(study.Run("mos", 1), "train")
    assert study.estimate_seconds(args, task) == study.PRIOR_EPOCH_SECONDS["mos"] * args.epochs
    study.record_timing(args, task, 10.0)
    study.record_timing(args, task, 30.0)
    study.record_timing(args, task, 20.0)
    assert study.estimate_seconds(args, task) == 20.0
    assert json.loads((tmp_path / "timings.json").read_text()) == {"train:mos": [10.0, 30.0, 20.0]}


def test_bad_arguments_are_refused(study):
    with pytest.raises(SystemExit):
        study.parse_arguments(["--heads", "softmax,nope"])
    with pytest.raises(SystemExit):
        study.parse_arguments(["--epochs", "1"])
    with pytest.raises(SystemExit):
        study.parse_arguments(["--dynamic-tokens", "1"])
    with pytest.raises(SystemExit):
        study.parse_arguments(["--dynamic-stats-batches", "0"])


# ---- fake finished runs, in the records' real formats (see runs/softmax-seed1) -------------

RANK_TAG = "test-best-first50"


def write_json(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))


def fake_run(
    study,
    runs: Path,
    head: str,
    seed: int,
    ppl: float,
    *,
    rank: int | None = None,
    dynamic: tuple[float, float] | None = None,
    stats_batches: int = 10,
) -> Path:
    """A run directory as the study leaves it: training marker, resolved config, metrics, the
    test eval record, and (when given) rank + KL records and the dynamic-eval slice."""
    directory = runs / f"{head}-seed{seed}"
    (directory / "analysis").mkdir(parents=True)
    (directory / "study-train.done").write_text("")
    save_config(load_config(study.config_path(head)), directory / "config.toml")
    metrics = [
        {"kind": "step", "stage": "train", "epoch": 1, "step": 100, "train_loss": 7.0},
        {"kind": "epoch", "stage": "train", "epoch": 1, "step": 150, "val_ppl": ppl * 1.5},
        {"kind": "step", "stage": "train", "epoch": 2, "step": 200, "train_loss": 6.0},
        {"kind": "epoch", "stage": "train", "epoch": 2, "step": 300, "val_ppl": ppl * 1.1},
    ]
    (directory / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    write_json(
        directory / "eval-test-best.json",
        {
            "split": "test",
            "checkpoint": "best",
            "max_tokens": None,
            "default_data": True,
            "own_data_dir": True,
            "loss": math.log(ppl),
            "perplexity": ppl,
            "tokens": 82429,
        },
    )
    if rank is not None:
        values = np.geomspace(100.0, 1e-6, 60)
        np.save(directory / "analysis" / f"rank-{RANK_TAG}.singular_values.npy", values)
        write_json(
            directory / "analysis" / f"rank-{RANK_TAG}.json",
            {
                "run_dir": "/elsewhere/" + directory.name,
                "head": head,
                "checkpoint": "best",
                "split": "test",
                "which": "best",
                "kind": "log_prob",
                "max_contexts": 50,
                "shape": [50, 30],
                "press_rank": rank,
                "press_threshold": 1e-3,
                "resolution": 1e-5,
                "s_max": 100.0,
                "effective_rank": {"0.001": rank // 10, "0.0001": rank // 5, "1e-05": rank // 2},
                "singular_values_file": f"rank-{RANK_TAG}.singular_values.npy",
            },
        )
        write_json(
            directory / "analysis" / "kl-test-best.json",
            {"head": head, "split": "test", "mean": rank / 100, "pairs": 10000},
        )
    if dynamic is not None:
        static_ppl, dynamic_ppl = dynamic
        for kind, value in (("eval", static_ppl), ("dynamic-eval", dynamic_ppl)):
            write_json(
                directory / f"{kind}-test-best-first1000.json",
                {
                    "split": "test",
                    "max_tokens": 1000,
                    "default_data": False,
                    "perplexity": value,
                    "tokens": 999,
                    **({"max_stats_batches": stats_batches} if kind == "dynamic-eval" else {}),
                },
            )
    return directory


def study_argv(tmp_path: Path, heads: str, *more: str) -> list[str]:
    return [
        "--heads",
        heads,
        "--seeds",
        "2",
        "--extra-seeds",
        "0",
        "--epochs",
        "2",
        "--rank-contexts",
        "50",
        "--runs",
        str(tmp_path / "runs"),
        "--results",
        str(tmp_path / "results"),
        *more,
    ]


# ---- 1. --summarize: the finished runs only ------------------------------------------------


def test_summarize_publishes_a_partial_table_of_the_finished_runs_only(study, tmp_path, capsys):
    runs = tmp_path / "runs"
    for seed, ppl in ((1, 200.0), (2, 204.0)):
        fake_run(study, runs, "softmax", seed, ppl, rank=200 + seed, dynamic=(300.0, 250.0))
    for seed, ppl in ((1, 190.0), (2, 193.0)):
        fake_run(study, runs, "gss", seed, ppl, rank=400 + seed, dynamic=(290.0, 240.0))
    fake_run(study, runs, "mos", 1, 185.0, rank=900)  # one seed; no dynamic-eval yet
    unfinished = runs / "mos-seed2"  # trained, never evaluated: not a row of the table
    unfinished.mkdir()
    (unfinished / "study-train.done").write_text("")
    argv = study_argv(tmp_path, "softmax,gss,mos", "--summarize")

    assert study.main(argv) == 0
    results = tmp_path / "results"
    summary = json.loads((results / "summary.json").read_text())
    assert not summary["complete"]
    assert summary["missing_runs"] == ["mos-seed2"]
    assert summary["missing_stages"] == {"dynamic": ["mos-seed1"]}
    assert sorted(summary["runs"]) == [
        "gss-seed1",
        "gss-seed2",
        "mos-seed1",
        "softmax-seed1",
        "softmax-seed2",
    ]
    mos = summary["heads"]["mos"]
    assert mos["perplexity"] == {"n": 1, "mean": 185.0, "sd": None}  # mean only
    assert "needs 2 finished seeds" in mos["t_test_vs_softmax"]["skipped"]
    assert mos["slice_dynamic_ppl"]["n"] == 0
    gss = summary["heads"]["gss"]
    assert gss["perplexity"]["sd"] == pytest.approx(stats.tstd([190.0, 193.0]))
    welch = stats.ttest_ind([200.0, 204.0], [190.0, 193.0], equal_var=False)
    assert gss["t_test_vs_softmax"]["p"] == pytest.approx(welch.pvalue, rel=1e-9)
    assert gss["t_test_vs_softmax"]["source"].startswith("highrank compare")
    assert (results / "compare-gss" / "compare.json").is_file()
    assert not (results / "compare-mos").exists()
    assert (results / "report" / "report.html").is_file()
    # no stage ran: only compare and report were called
    commands = (results / "commands.txt").read_text().splitlines()
    assert [line.split()[1] for line in commands] == ["compare", "report"]
    markdown = (results / "summary.md").read_text()
    assert "PARTIAL, 5 of 6 planned runs" in markdown
    assert "Not finished yet, left out of the table: mos-seed2." in markdown
    assert "| mos | 1 (1) | 185.00 (1 seed: mean only) | - |" in markdown
    assert "Stage dynamic not done yet for: mos-seed1" in markdown
    assert "PARTIAL" in capsys.readouterr().out


def test_summarize_with_nothing_finished_says_so(study, tmp_path, capsys):
    assert study.main(study_argv(tmp_path, "softmax,mos", "--summarize")) == 0
    assert "nothing to show" in capsys.readouterr().out
    assert not (tmp_path / "results" / "summary.json").exists()


def test_a_broken_record_is_one_error_naming_its_file(study, tmp_path):
    directory = fake_run(study, tmp_path / "runs", "softmax", 1, 200.0)
    (directory / "eval-test-best.json").write_text('{"perplexity": ')
    args = study.parse_arguments(study_argv(tmp_path, "softmax"))
    with pytest.raises(SystemExit, match="eval-test-best.json: not valid JSON"):
        study.read_records(args, study.Run("softmax", 1))
    write_json(directory / "eval-test-best.json", {"loss": 5.3})
    with pytest.raises(SystemExit, match="eval-test-best.json: no key 'perplexity'"):
        study.read_records(args, study.Run("softmax", 1))


# ---- 2. the table: t-test, ranks, KL, Pearson ---------------------------------------------


def table_of(study, tmp_path, heads: str):
    args = study.parse_arguments(study_argv(tmp_path, heads, "--seeds", "3"))
    runs = study.plan(args)
    return args, study.summary_table(args, runs, study.finished_runs(args, runs))


def test_the_table_computes_welch_and_pearson_when_compare_has_no_record(study, tmp_path):
    softmax, mos = [200.0, 203.0, 201.0], [190.0, 196.0, 188.0]
    ranks = {"softmax": [201, 202, 203], "mos": [800, 950, 700]}
    for head, ppls in (("softmax", softmax), ("mos", mos)):
        for seed, ppl in enumerate(ppls, start=1):
            fake_run(study, tmp_path / "runs", head, seed, ppl, rank=ranks[head][seed - 1])
    _, table = table_of(study, tmp_path, "softmax,mos")
    test = table["heads"]["mos"]["t_test_vs_softmax"]
    welch = stats.ttest_ind(softmax, mos, equal_var=False)
    assert test["test"] == "Welch's t-test" and "computed by the study" in test["source"]
    assert (test["t"], test["p"]) == pytest.approx((welch.statistic, welch.pvalue), rel=1e-9)
    row = table["heads"]["mos"]
    assert row["press_rank"]["mean"] == pytest.approx(np.mean(ranks["mos"]))
    assert row["press_rank"]["sd"] == pytest.approx(np.std(ranks["mos"], ddof=1))
    assert row["effective_rank"]["1e-05"]["mean"] == pytest.approx(np.mean([400, 475, 350]))
    assert row["kl"]["mean"] == pytest.approx(np.mean(ranks["mos"]) / 100)
    pearson = stats.pearsonr(ranks["softmax"] + ranks["mos"], softmax + mos)
    correlation = table["rank_vs_perplexity"]
    assert (correlation["r"], correlation["p"], correlation["n"]) == pytest.approx(
        (pearson.statistic, pearson.pvalue, 6)
    )


def test_the_table_reads_compare_only_when_it_covers_these_runs(study, tmp_path):
    for seed, (a, b) in enumerate(((200.0, 190.0), (203.0, 196.0)), start=1):
        fake_run(study, tmp_path / "runs", "softmax", seed, a, rank=200)
        fake_run(study, tmp_path / "runs", "gss", seed, b)  # no rank record
    compare = tmp_path / "results" / "compare-gss" / "compare.json"
    record = {
        "test": "Welch's t-test",
        "t": 2.5,
        "df": 1.9,
        "p": 0.123,
        "groups": {
            "softmax": {"runs": ["/moved/softmax-seed1", "/moved/softmax-seed2"]},
            "gss": {"runs": ["/moved/gss-seed1", "/moved/gss-seed2"]},
        },
    }
    write_json(compare, record)
    _, table = table_of(study, tmp_path, "softmax,gss")  # plans 3 seeds, 2 finished
    assert table["heads"]["gss"]["t_test_vs_softmax"]["p"] == 0.123  # by run name: moved
    record["groups"]["gss"]["runs"] = ["/moved/gss-seed1"]  # a stale record: other runs
    write_json(compare, record)
    _, table = table_of(study, tmp_path, "softmax,gss")
    test = table["heads"]["gss"]["t_test_vs_softmax"]
    assert "computed by the study" in test["source"] and test["p"] != 0.123
    assert table["heads"]["gss"]["press_rank"] == {"n": 0, "mean": None, "sd": None}
    assert "needs 3" in table["rank_vs_perplexity"]["skipped"]  # 2 runs with a rank


def test_the_table_reads_the_committed_runs_records(study, tmp_path):
    """The study's own finished runs (benchmarks/results/replication/runs), as committed."""
    runs = SCRIPT.parents[1] / "results" / "replication" / "runs"
    args = study.parse_arguments(
        ["--epochs", "2", "--extra-seeds", "0", "--runs", str(runs), "--results", str(tmp_path)]
    )
    planned = study.plan(args)
    finished = study.finished_runs(args, planned)
    if not finished:
        pytest.skip(f"no finished run committed in {runs} yet")
    table = study.summary_table(args, planned, finished)
    for run in finished:
        directory = runs / run.name
        row = table["runs"][run.name]
        evaluated = json.loads((directory / "eval-test-best.json").read_text())
        assert row["perplexity"] == evaluated["perplexity"]
        rank = directory / "analysis" / "rank-test-best-first20000.json"
        if rank.is_file():
            assert row["press_rank"] == json.loads(rank.read_text())["press_rank"]
            assert set(row["effective_rank"]) == {"0.001", "0.0001", "1e-05"}
    assert table["missing_runs"] == [r.name for r in planned if r not in finished]


# ---- 3. the dynamic-evaluation stage -------------------------------------------------------


def test_the_dynamic_stage_is_done_by_its_records_with_these_statistics(study, tmp_path):
    directory = fake_run(study, tmp_path / "runs", "mos", 1, 185.0, rank=900)
    args = study.parse_arguments(study_argv(tmp_path, "softmax,mos"))
    task = study.Task(study.Run("mos", 1), "dynamic")
    assert not study.is_done(args, task)
    assert [t.stage for t in study.remaining(args, [task.run])] == ["dynamic"]
    fake_run(study, tmp_path / "other", "mos", 1, 185.0, dynamic=(300.0, 250.0))
    for name in ("eval-test-best-first1000.json", "dynamic-eval-test-best-first1000.json"):
        (directory / name).write_bytes((tmp_path / "other" / "mos-seed1" / name).read_bytes())
    assert study.is_done(args, task)
    more = study.parse_arguments(
        study_argv(tmp_path, "softmax,mos", "--dynamic-stats-batches", "20")
    )
    assert not study.is_done(more, task)  # other statistics: to be redone
    assert study.timing_key(task) == "dynamic:mos"
    assert study.estimate_seconds(args, task) == study.PRIOR_STAGE_SECONDS["dynamic"]


def tiny_run(tmp_path: Path, lines: int) -> Path:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    words = [f"w{i}" for i in range(30)]
    for split in ("train", "valid", "test"):
        text = "\n".join(" ".join(words[(i + j) % 30] for j in range(8)) for i in range(lines))
        (corpus / f"{split}.txt").write_text(text + "\n")
    directory = tmp_path / "run"
    directory.mkdir()
    config = load_config(None, [f"data.dir={corpus}", f"data.cache_dir={tmp_path / 'cache'}"])
    save_config(config, directory / "config.toml")
    return directory


@pytest.mark.parametrize("batches", [2, 50])
def test_dynamic_knobs_scale_eta_and_epsilon_to_a_full_pass(study, tmp_path, batches):
    directory = tiny_run(tmp_path, lines=300)
    # 300 lines x (8 words + <eos>) = 2,700 tokens; 100 columns of 27; segments of 5 over
    # the 26 targets: a full pass has 6 segments
    knobs = study.dynamic_knobs(directory, batches)
    assert knobs[:2] == ["--max-stats-batches", str(batches)]
    scale = math.sqrt(min(batches, 6) / 6)
    defaults = load_config(directory / "config.toml").dynamic_eval
    assert float(knobs[3]) == pytest.approx(defaults.lr * scale, rel=1e-12)
    assert float(knobs[5]) == pytest.approx(defaults.epsilon * scale, rel=1e-12)


def test_the_dynamic_stage_scores_the_slice_statically_then_dynamically(
    study, tmp_path, monkeypatch
):
    directory = tiny_run(tmp_path, lines=300)
    args = study.parse_arguments(
        [
            "--runs",
            str(tmp_path),
            "--results",
            str(tmp_path / "r"),
            "--dynamic-tokens",
            "500",
            "--dynamic-stats-batches",
            "3",
        ]
    )
    called = []
    monkeypatch.setattr(study, "highrank", lambda args, *words, **_: called.append(words))
    monkeypatch.setattr(study, "run_dir", lambda args, run: directory)
    study.run_task(args, study.Task(study.Run("softmax", 1), "dynamic"), 650)
    slice_words = ("--split", "test", "--max-tokens", "500", "--no-progress")
    assert called[0] == ("eval", str(directory), *slice_words)
    assert called[1][:7] == ("dynamic-eval", str(directory), *slice_words)
    assert called[1][7:9] == ("--max-stats-batches", "3")


# ---- 4. figures ------------------------------------------------------------------------------


def test_figures_are_drawn_from_the_records(study, tmp_path):
    for seed in (1, 2):
        fake_run(study, tmp_path / "runs", "softmax", seed, 200.0 + seed, rank=200 + seed)
        fake_run(study, tmp_path / "runs", "mos", seed, 190.0 - seed, rank=900 + 50 * seed)
    args, table = table_of(study, tmp_path, "softmax,mos")
    finished = study.finished_runs(args, study.plan(args))
    figures = study.draw_figures(args, table, finished)
    assert figures == {
        "learning curves": "learning-curves.png",
        "spectrum": "spectrum.png (softmax-seed1, mos-seed1)",  # one run per head
        "rank vs perplexity": "rank-vs-perplexity.png",
    }
    for name in ("learning-curves.png", "spectrum.png", "rank-vs-perplexity.png"):
        assert (tmp_path / "results" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_figures_without_rank_records_say_why(study, tmp_path):
    fake_run(study, tmp_path / "runs", "softmax", 1, 200.0)
    args, table = table_of(study, tmp_path, "softmax,mos")
    figures = study.draw_figures(args, table, study.finished_runs(args, study.plan(args)))
    assert figures["learning curves"] == "learning-curves.png"
    assert figures["spectrum"].startswith("not drawn: no finished run has a rank record")
    assert figures["rank vs perplexity"] == "not drawn: no finished run has a rank record"


def test_learning_curves_count_a_resumed_runs_repeated_records_once(study, tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [
        {"kind": "step", "stage": "train", "epoch": 1, "step": 100, "train_loss": 7.0},
        {"kind": "step", "stage": "train", "epoch": 1, "step": 200, "train_loss": 6.5},
        {"kind": "step", "stage": "train", "epoch": 1, "step": 200, "train_loss": 6.4},  # resumed
        {"kind": "epoch", "stage": "train", "epoch": 1, "step": 250, "val_ppl": 300.0},
        {"kind": "epoch", "stage": "finetune", "epoch": 1, "step": 900, "val_ppl": 100.0},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    steps, epochs = study.training_metrics(path)
    assert [(r["step"], r["train_loss"]) for r in steps] == [(100, 7.0), (200, 6.4)]
    assert [r["val_ppl"] for r in epochs] == [300.0]


@pytest.mark.slow
def test_the_whole_study_runs_and_resumes_on_a_tiny_corpus(study, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    words = [f"w{i}" for i in range(30)]
    for split, lines in (("train", 300), ("valid", 40), ("test", 40)):
        text = "\n".join(" ".join(words[(i * 7 + j) % 30] for j in range(8)) for i in range(lines))
        (corpus / f"{split}.txt").write_text(text + "\n")
    tiny = [
        f"--data.dir={corpus}",
        "--model.d_embed=8",
        "--model.n_layers=1",
        "--train.batch_size=4",
        "--train.bptt=8",
        "--train.eval_batch_size=2",
        "--train.log_every=10",
    ]
    argv = [
        "--heads",
        "softmax,mos",
        "--seeds",
        "2",
        "--extra-seeds",
        "0",
        "--epochs",
        "2",
        "--rank-contexts",
        "50",
        "--runs",
        str(tmp_path / "runs"),
        "--results",
        str(tmp_path / "results"),
    ]
    for override in tiny:
        argv.append(f"--override={override}")
    argv += ["--dynamic-tokens", "100", "--dynamic-stats-batches", "2"]
    assert study.main(argv) == 0
    summary = json.loads((tmp_path / "results" / "summary.json").read_text())
    assert set(summary["heads"]) == {"softmax", "mos"}
    assert len(summary["runs"]) == 4
    assert summary["complete"]
    assert all(v["slice_dynamic_ppl"] > 0 for v in summary["runs"].values())
    assert "p" in summary["heads"]["mos"]["t_test_vs_softmax"]
    assert "r" in summary["rank_vs_perplexity"] or "skipped" in summary["rank_vs_perplexity"]
    for name in ("learning-curves.png", "spectrum.png", "rank-vs-perplexity.png"):
        assert (tmp_path / "results" / name).is_file()
    commands = (tmp_path / "results" / "commands.txt").read_text().splitlines()
    assert study.main(argv) == 0  # a rerun trains nothing again
    again = (tmp_path / "results" / "commands.txt").read_text().splitlines()
    assert not any(" train " in line for line in again[len(commands) :])


def test_studies_of_some_heads_each_keep_every_heads_width(study, tmp_path):
    path = tmp_path / "hidden-sizes.json"
    study.record_hidden_sizes(path, {"softmax": 650, "mos": 620})
    study.record_hidden_sizes(path, {"gss": 650, "plif": 635})
    assert json.loads(path.read_text()) == {"softmax": 650, "mos": 620, "gss": 650, "plif": 635}


def test_a_head_whose_runs_have_no_rank_yet_gets_dashes(study, tmp_path):
    runs = tmp_path / "runs"
    fake_run(study, runs, "softmax", 1, 200.0, rank=201)
    fake_run(study, runs, "gss", 1, 190.0)  # trained and evaluated; rank and KL still to come
    assert study.main(study_argv(tmp_path, "softmax,gss", "--summarize")) == 0
    markdown = (tmp_path / "results" / "summary.md").read_text()
    row = next(line for line in markdown.splitlines() if line.startswith("| gss |"))
    assert "190.00 (1 seed: mean only)" in row and "| - / - / - |" in row


def test_stages_another_process_finished_or_holds_are_skipped(study, tmp_path):
    """Two studies with overlapping --heads: each skips what the other finished since its plan
    was made, or is working on now, instead of redoing it or stopping on its lock."""
    import subprocess
    import textwrap

    args = study.parse_arguments(["--runs", str(tmp_path / "runs"), "--results", str(tmp_path)])
    run = study.Run("mixtape", 3)
    directory = tmp_path / "runs" / run.name
    directory.mkdir(parents=True)
    train, rank = study.Task(run, "train"), study.Task(run, "rank")
    assert study.why_skip(args, train) is None  # nobody has it
    assert "training is not done" in study.why_skip(args, rank)

    holder = textwrap.dedent(
        f"""
        import fcntl, os, sys, time
        handle = os.open({str(directory / ".lock")!r}, os.O_RDWR | os.O_CREAT)
        fcntl.flock(handle, fcntl.LOCK_EX)
        os.write(handle, f"{{os.getpid()}} highrank train\\n".encode())
        print("held", flush=True)
        sys.stdin.read()
        """
    )
    process = subprocess.Popen(
        [sys.executable, "-c", holder], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout.readline().strip() == "held"
        why = study.why_skip(args, train)
        assert why is not None and f"pid {process.pid}" in why
    finally:
        process.communicate("", timeout=30)
    assert study.why_skip(args, train) is None  # the holder is gone: its lock with it

    (directory / "study-train.done").write_text("")
    assert study.why_skip(args, train) == "done by another process"
    assert study.why_skip(args, rank) is None


def test_each_heads_p_value_is_also_holm_adjusted_over_the_heads_tested(study, tmp_path):
    ppls = {
        "softmax": [200.0, 203.0, 201.0],
        "mos": [190.0, 196.0, 188.0],
        "gss": [199.0, 204.0, 202.0],
        "moc": [250.0, 262.0],
    }
    for head, values in ppls.items():
        for seed, ppl in enumerate(values, start=1):
            fake_run(study, tmp_path / "runs", head, seed, ppl, rank=200 + seed)
    _, table = table_of(study, tmp_path, "softmax,mos,gss,moc")
    raw = {
        head: stats.ttest_ind(ppls["softmax"], ppls[head], equal_var=False).pvalue
        for head in ("mos", "gss", "moc")
    }
    ordered = sorted(raw, key=raw.get)  # Holm by hand: x3, x2, x1, then a running maximum
    expected, running = {}, 0.0
    for factor, head in zip((3, 2, 1), ordered, strict=True):
        running = max(running, min(1.0, factor * raw[head]))
        expected[head] = running
    for head in raw:
        test = table["heads"][head]["t_test_vs_softmax"]
        assert test["holm_tests"] == 3
        assert test["p_holm"] == pytest.approx(expected[head], rel=1e-9)
    assert "p_holm" not in table["heads"]["softmax"]["t_test_vs_softmax"]
    markdown = study.summary_markdown(study.parse_arguments(["--heads", "softmax,mos"]), table)
    assert f"({expected['gss']:.3g})" in markdown and "Holm-adjusted over the 3 tests" in markdown
