"""The studies ported onto benchmarks.study: their plans, record names and record format, with
fake stages (no model, no data beyond an empty WikiText-2 file)."""

from __future__ import annotations

import json

import pytest

from benchmarks import study
from benchmarks.studies import (
    multi30k_table,
    ptb_transformer_lm,
    smollm2_retrofit,
    smollm2_warm_start,
)


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """Run the warm-start study in this process with stages that only name themselves."""
    complete: set[str] = set()

    def stage_work(args):
        def work(stage):
            kind, _, rest = stage.partition("-")
            if kind in ("cache", "cache3"):
                complete.add((rest, kind == "cache3"))
            if kind == "train":  # the trained state its eval reads (the work folder's)
                args.work_dir.mkdir(parents=True, exist_ok=True)
                (args.work_dir / f"state-{rest}.pt").touch()
            return {"work": stage}

        return work

    monkeypatch.setattr(smollm2_warm_start, "stage_work", stage_work)
    monkeypatch.setattr(study, "module_command", lambda *a: None)  # stages in this process
    monkeypatch.setattr(smollm2_warm_start, "summarize", lambda args: None)
    monkeypatch.setattr(smollm2_warm_start, "settings", lambda args: {"fake": True})
    monkeypatch.setattr(smollm2_warm_start, "cache_complete",
                        lambda split, args, layers=None: (split, bool(layers)) in complete)
    (tmp_path / "data" / "wikitext-2").mkdir(parents=True)
    (tmp_path / "data" / "wikitext-2" / "test.txt").write_text("")
    return ["--data-dir", str(tmp_path / "data"), "--work-dir", str(tmp_path / "work"),
            "--out", str(tmp_path / "out"), "--seeds", "1", "--heads", "own", "--no-rank"]


def test_the_warm_start_study_writes_its_records_as_before(fake, tmp_path):
    assert smollm2_warm_start.main(fake) == 0
    out = tmp_path / "out"
    assert sorted(p.stem for p in out.glob("*.json")) == [
        "cache-test", "cache-train", "cache-valid", "eval-base-s0", "eval-own-s1", "train-own-s1"
    ]  # fmt: skip
    text = (out / "train-own-s1.json").read_text()
    assert text.startswith('{\n "work"') and not text.endswith("\n")  # indent 1, no newline
    assert list(json.loads(text)) == ["work", "stage", "stage_seconds", "peak_rss_mib", "settings"]
    assert (tmp_path / "work" / ".train-own-s1.lock").exists()  # the lock files as before


def test_in_process_runs_every_stage_here_and_summarizes_once(fake, monkeypatch):
    def no_child(*args):
        raise AssertionError("--in-process must not start a process per stage")

    summaries = []
    monkeypatch.setattr(study, "module_command", no_child)
    monkeypatch.setattr(smollm2_warm_start, "summarize", lambda args: summaries.append(1))
    assert smollm2_warm_start.main([*fake, "--in-process", "--device", "cpu"]) == 0
    assert len(summaries) == 1  # at the end only, not after each of the six stages


def test_the_warm_start_study_without_its_caches_stops_naming_the_stages(fake, capsys):
    assert smollm2_warm_start.main([*fake, "--only", "train"]) == 1
    assert ("stopped: the stages left wait for inputs no process is making: eval-base-s0, "
            "train-own-s1, eval-own-s1") in capsys.readouterr().out


def test_records_brought_from_another_machine_make_the_caches_again(fake, tmp_path, monkeypatch):
    """A fresh machine given the records (a GPU machine continuing its earlier records): the
    cache stages run again, since their caches are not there; the other stages do not."""
    assert smollm2_warm_start.main(fake) == 0
    made = []
    monkeypatch.setattr(smollm2_warm_start, "cache_complete",
                        lambda split, args, layers=None: (split, bool(layers)) in made)

    def work_of(args):
        def work(stage):
            kind, _, split = stage.partition("-")
            made.append((split, kind == "cache3"))
            return {"work": stage}

        return work

    monkeypatch.setattr(smollm2_warm_start, "stage_work", work_of)
    assert smollm2_warm_start.main(fake) == 0
    assert made == [("train", False), ("valid", False), ("test", False)]  # the caches alone


def test_a_train_record_whose_state_is_not_here_trains_again(fake, tmp_path, monkeypatch):
    """Records from another machine cut off between a run's train and eval stages: the state
    the eval reads is in that machine's work folder, so the run trains again here (it stopped
    the study on a missing file); a run whose eval is recorded does not."""
    assert smollm2_warm_start.main(fake) == 0
    (tmp_path / "out" / "eval-own-s1.json").unlink()  # cut off after train-own-s1 ...
    (tmp_path / "work" / "state-own-s1.pt").unlink()  # ... on a machine given back since
    again = []

    def work_of(args):
        def work(stage):
            again.append(stage)
            if stage.startswith("train-"):  # what a training leaves in the work folder
                (args.work_dir / f"state-{stage.removeprefix('train-')}.pt").touch()
            return {"work": stage}

        return work

    monkeypatch.setattr(smollm2_warm_start, "stage_work", work_of)
    assert smollm2_warm_start.main(fake) == 0  # no state file in tmp_path before
    assert "train-own-s1" in again and "eval-own-s1" in again
    assert "eval-base-s0" not in again  # recorded, and --no-rank: no matrix needed
    args = smollm2_warm_start.parse_args([*fake[:-1]])  # the rank stages planned
    assert not smollm2_warm_start.stage_done("eval-own-s1", args)  # its matrix is not here


def test_the_retrofit_plan_orders_its_stages_after_their_inputs():
    study = smollm2_retrofit.study(smollm2_retrofit.parse_args(["--heads", "own,mos"]), [])
    names = [stage.name for stage in study.stages]
    assert names[0] == "cache" and names[-1] == "rank-own"
    for stage in study.stages:
        assert all(names.index(need) < names.index(stage.name) for need in stage.needs)
    assert study.child("eval-own")[1:3] == ["-m", "benchmarks.studies.smollm2_retrofit"]


def test_the_multi30k_plan_runs_each_stage_in_its_own_process_after_its_inputs(tmp_path):
    args = multi30k_table.parse_args(["--runs", str(tmp_path), "--heads", "softmax,mos"])
    study = multi30k_table.study(("softmax", "mos"), args, tmp_path, ["--heads", "softmax,mos"])
    names = [stage.name for stage in study.stages]
    assert names == ["train-softmax", "bleu-softmax", "train-mos", "bleu-mos", "timing",
                     "memory-softmax", "memory-mos", "sentences"]  # the old order, old records
    for stage in study.stages:
        assert all(names.index(need) < names.index(stage.name) for need in stage.needs)
    assert study.child("timing")[-2:] == ["--stage", "timing"]


def test_the_ptb_transformer_stages_are_done_by_the_runs_records(tmp_path):
    args = ptb_transformer_lm.parse_args(["--runs", str(tmp_path), "--experiments", "char"])
    study = ptb_transformer_lm.study(args)
    run = tmp_path / "char" / "softmax"
    assert study.pending()[0] == "char-softmax-train"
    run.mkdir(parents=True)
    (run / "benchmark-train.done").write_text("")
    for split in ("valid", "test"):
        (run / f"eval-{split}-best.json").write_text("{}")
    assert study.pending()[0] == "char-softmax-rank"


def test_the_warm_start_study_tests_each_high_rank_head_against_its_capacity_control():
    from scipy import stats

    rows = {
        "mos4": {"seeds": ["1", "2"], "valid_ppl": [16.0, 16.2], "test_ppl": [20.1, 20.4]},
        "control3m": {"seeds": ["1", "2"], "valid_ppl": [16.5, 16.3], "test_ppl": [20.3, 20.2]},
        "mixtape": {"seeds": ["1"], "valid_ppl": [16.0], "test_ppl": [20.0]},  # one seed: none
    }
    found = smollm2_warm_start.against_controls(rows)
    assert [(c["head"], c["control"], c["split"]) for c in found] == [
        ("mos4", "control3m", "valid"), ("mos4", "control3m", "test")]
    valid, test = found
    assert valid["per_seed_difference"] == pytest.approx({"1": -0.5, "2": -0.1})
    assert test["per_seed_difference"] == pytest.approx({"1": -0.2, "2": 0.2})
    expected = stats.ttest_ind([16.0, 16.2], [16.5, 16.3], equal_var=False)
    assert valid["p"] == pytest.approx(expected.pvalue)
    assert valid["welch_t"] == pytest.approx(expected.statistic)
    paired = stats.ttest_rel([16.0, 16.2], [16.5, 16.3])  # the seeds pair
    assert valid["paired_p"] == pytest.approx(paired.pvalue)
    assert valid["paired_t"] == pytest.approx(paired.statistic) and valid["paired_df"] == 1
    rows["control3m"] = {"seeds": ["1"], "valid_ppl": [16.5], "test_ppl": [20.3]}
    assert smollm2_warm_start.against_controls(rows) == []  # the control's seed 2 not yet in
    table = smollm2_warm_start.against_controls_table(found)
    assert table[2].startswith(
        "| mos4 | control3m | valid | 16.100 | 16.400 | s1 -0.500, s2 -0.100 |"
    )


def test_the_context_heads_read_a_sequence_cache_after_their_pilots(fake, tmp_path):
    plan = smollm2_warm_start.study(smollm2_warm_start.parse_args(
        [*fake, "--heads", "own,mfs,control7m", "--seeds", "1,3"]), [])
    names = [stage.name for stage in plan.stages]
    assert names[:6] == ["cache-train", "cache3-train", "cache-valid", "cache3-valid",
                         "cache-test", "cache3-test"]
    needs = {stage.name: stage.needs for stage in plan.stages}
    assert needs["train-mfs-s1"] == ("pilot-mfs",) and needs["train-own-s1"] == ()
    assert names.index("pilot-mfs") < names.index("train-mfs-s1")
    # own's seed 1 (recorded on the token cache) and everything else on the sequence cache
    args = smollm2_warm_start.parse_args([*fake, "--heads", "own,mfs", "--seeds", "1,3"])
    assert not smollm2_warm_start.reads_sequence_cache("own", 1, args)
    assert smollm2_warm_start.reads_sequence_cache("own", 3, args)
    assert smollm2_warm_start.reads_sequence_cache("mfs", 1, args)
    assert smollm2_warm_start.reads_sequence_cache("control7m", 2, args)
    assert not smollm2_warm_start.reads_sequence_cache("base", 0, args)  # a token cache made
    only_new_args = smollm2_warm_start.parse_args([*fake, "--heads", "cpr", "--seeds", "1,2,3"])
    only_new = smollm2_warm_start.study(only_new_args, [])
    names = [stage.name for stage in only_new.stages]
    assert not any(name.startswith("cache-") for name in names)  # one cache, not two
    # the untouched model then reads the sequence cache: its eval is not left waiting
    assert smollm2_warm_start.reads_sequence_cache("base", 0, only_new_args)


def test_a_study_of_context_heads_alone_scores_the_untouched_model_too(fake, tmp_path):
    """With no token cache in the plan (--heads cpr), eval-base-s0 reads the sequence cache
    (it was left waiting for a token cache no stage makes)."""
    assert smollm2_warm_start.main([*fake, "--heads", "cpr", "--seeds", "1"]) == 0
    assert (tmp_path / "out" / "eval-base-s0.json").exists()


def test_the_context_heads_controls_hold_at_least_their_new_parameters():
    """The counts the HEADS comments give, at SmolLM2's size, built on the meta device."""
    import torch

    from highrank.heads import base_init_knobs, build_head

    d, vocab = smollm2_warm_start.D_MODEL, 49_152

    def new_parameters(name):
        kind, knobs = smollm2_warm_start.HEADS[name]
        with torch.device("meta"):
            head = build_head(kind, d_in=d, vocab_size=vocab, **base_init_knobs(kind, knobs))
        return sum(p.numel() for p in head.parameters()) - vocab * d - vocab

    counts = {name: new_parameters(name)
              for name in ("mfs", "cpr", "moscpr", "control7m", "control9m", "mfs1")}
    assert counts == {"mfs": 6_974_787, "cpr": 6_971_328, "moscpr": 8_968_324,
                      "control7m": 6_975_650, "control9m": 8_969_187, "mfs1": 3_650_688}
    assert counts["control7m"] >= max(counts["mfs"], counts["cpr"])
    assert counts["control9m"] >= counts["moscpr"]


def test_the_gain_on_tokens_seen_earlier_in_the_window_is_base_minus_head():
    def record(seen, unseen):
        groups = {"seen": {"nll_per_token": seen, "tokens": 30},
                  "unseen": {"nll_per_token": unseen, "tokens": 70}}
        return groups

    base = record(3.0, 4.0)
    records = {
        f"eval-cpr-s{seed}": {"valid": {"groups": record(2.5, 4.0)},
                              "test": {"groups": record(seen, 3.9)},
                              "valid_base_groups": base, "test_base_groups": base}
        for seed, seen in ((1, 2.0), (2, 2.4))
    }
    records["eval-own-s1"] = {"valid": {}, "test": {}}  # a token-cache run: no groups
    found = smollm2_warm_start.seen_gains(records)
    assert list(found) == ["cpr"]
    test = found["cpr"]["test"]
    assert test["seen_gain_per_seed"] == pytest.approx([1.0, 0.6])
    assert test["seen_gain_mean"] == pytest.approx(0.8)
    assert test["unseen_gain_mean"] == pytest.approx(0.1)
    assert test["seen_tokens"] == 30
    table = smollm2_warm_start.seen_gains_table(found)
    assert table[-1] == "| cpr | 2 | 30 | +0.8000 | 70 | +0.1000 |"  # 2 seeds
