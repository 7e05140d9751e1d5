"""benchmarks.studies.bottleneck_map: the cells differ by their output layer alone, the controls
reach MoS's parameter count, the learning-rate pilot's grid grows past a winning end, and the
summary pairs seeds (issue 30)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import benchmarks.studies.bottleneck_map as bm


@pytest.fixture(autouse=True)
def no_recorded_study(tmp_path, monkeypatch):
    """Every test starts from an empty study folder: the records the real study commits as it
    runs (a third seed, a pilot on the GPU) change its stages, and must not change a test. Nor
    do the other studies' summaries the gain figure reads (the synthetic sweep's, SmolLM2's,
    rewritten as those studies run): a test that wants them writes its own."""
    monkeypatch.setattr(bm, "OUT", tmp_path / "empty-study")
    monkeypatch.setattr(bm, "SYNTHETIC", tmp_path / "no-synthetic-sweep" / "summary.json")
    monkeypatch.setattr(bm, "SMOLLM2", tmp_path / "no-smollm2-warm-start" / "summary.json")
    monkeypatch.setattr(bm, "SMOLLM2_CONTEXT", tmp_path / "no-smollm2-context" / "summary.json")


def body(overrides) -> set[str]:
    """The overrides that are not about the output layer."""
    return {o for o in overrides if not o.startswith(("model.d_project", "head."))}


@pytest.mark.parametrize("d", [8, 64])
def test_every_arm_shares_the_body_and_the_controls_reach_the_mos_count(d):
    arms = {arm: bm.arm_overrides(arm, d) for arm in bm.ARMS}
    assert len({frozenset(body(o)) for o in arms.values()}) == 1
    assert all(f"model.d_project={d}" in o for arm, o in arms.items() if arm != "wide_softmax")
    counts = {arm: bm.parameter_count(bm.RECIPE[arm][0], o) for arm, o in arms.items()}
    for control in bm.CONTROLS:
        assert counts[control] >= counts["mos"] > counts["softmax"]
    # the smallest such: one unit less falls short
    wide = int(next(o for o in arms["wide_softmax"] if "d_project" in o).split("=")[1])
    narrower = [*arms["wide_softmax"][:-1], f"model.d_project={wide - 1}"]
    assert bm.parameter_count("softmax", tuple(narrower)) < counts["mos"]


def test_smallest_finds_the_first_width_that_reaches_a_target():
    assert bm._smallest(lambda w: 3 * w, 30, start=1) == 10
    assert bm._smallest(lambda w: 3 * w, 31, start=1) == 11
    assert bm._smallest(lambda w: w * w, 50, start=5) == 8


def test_the_pilot_grid_grows_past_a_winning_end(monkeypatch):
    losses = {5.0: 6.0, 10.0: 5.5, 20.0: 5.2, 40.0: 5.1, 80.0: 5.05, 160.0: math.nan}
    asked = []

    def fake_pilot(arm, d, lr):
        asked.append(lr)
        return {"valid_loss": losses[lr], "valid_ppl": math.exp(losses[lr]),
                "tokens_per_s": 1000.0}

    monkeypatch.setattr(bm, "pilot", fake_pilot)
    choice = bm.choose_lr("softmax", 8)
    assert choice["grid"] == [5.0, 10.0, 20.0, 40.0, 80.0, 160.0]
    assert choice["lr"] == 80.0  # the NaN at 160 loses
    assert asked == [5.0, 10.0, 20.0, 40.0, 80.0, 160.0]


def test_an_interior_best_keeps_the_grid(monkeypatch):
    monkeypatch.setattr(bm, "pilot", lambda arm, d, lr: {
        "valid_loss": abs(math.log(lr / 10)), "valid_ppl": 1.0, "tokens_per_s": 1.0})
    choice = bm.choose_lr("mos", 16)
    assert choice["grid"] == list(bm.PILOT_LRS) and choice["lr"] == 10.0


def test_stages_run_d_by_d_and_each_training_needs_its_pilot():
    stages = bm.map_stages()
    names = [s.name for s in stages]
    second = names.index("lr-softmax-d32")  # the range first: 8, 32, 128, then 16, 64, 256
    assert all(n.endswith(("-d8", "-d8-seed1", "-d8-seed2")) for n in names[:second])
    assert names.index("lr-softmax-d128") < names.index("lr-softmax-d16")
    train = next(s for s in stages if s.name == "train-mos-d32-seed2")
    assert train.needs == ("lr-mos-d32",)
    assert bm.stages("long")[0].name.startswith("long-")


def test_each_test_comes_right_after_its_training():
    """A test reads the run's best.pt, which is not committed: tested in the same session as
    its training, or trained again on the next machine."""
    names = [s.name for s in bm.map_stages((16,))]
    trainings = [n for n in names if n.startswith("train-")]
    assert len(trainings) == len(bm.ARMS) * len(bm.SEEDS)
    for name in trainings:
        assert names[names.index(name) + 1] == "test-" + name.removeprefix("train-")


def test_a_stage_that_would_end_after_the_deadline_is_not_started(tmp_path, monkeypatch):
    """--until: a training is let start only if it and its test, at their worst measured
    estimates (the epoch cap, the slowest run's rate, the longest test) x the slack, end by the
    deadline; a test always starts (its run's best.pt is here: refused, the run is lost)."""
    monkeypatch.setattr(bm, "OUT", tmp_path)
    records = tmp_path / "records"
    records.mkdir()
    (records / "train-softmax-d16-seed1.json").write_text(json.dumps({"epochs": 12}))
    for seed, seconds in ((1, 30.0), (3, 90.0)):
        (records / f"test-softmax-d16-seed{seed}.json").write_text(json.dumps(
            {"stage_seconds": seconds}))
    # each run's rate: the median of its logged steps; a GPU run's are not the CPU's
    for seed, rates, device in ((1, (6000.0, 7000.0, 9000.0), "cpu"),
                                (3, (4000.0, 5000.0, 5500.0), "cpu"), (4, (50000.0,), "cuda")):
        run = bm.cell_dir("softmax", 16, seed)
        run.mkdir(parents=True)
        (run / "config.toml").write_text(f'[run]\ndevice = "{device}"\n')
        # a torn last line, as a run writing its metrics leaves it
        (run / "metrics.jsonl").write_text("".join(
            json.dumps({"kind": "step", "tokens_per_s": r}) + "\n" for r in rates) + '{"ki')
    rates = bm.Rates()
    assert rates.tokens_per_s("softmax", 16) == 6000.0  # the median of the runs' 7000 and 5000
    assert rates.tokens_per_s("softmax", 16, worst=True) == 5000.0
    typical = 12 * bm.PTB_TRAIN_TOKENS / 6000.0 * 1.1
    worst = bm.EPOCH_CAP * bm.PTB_TRAIN_TOKENS / 5000.0 * 1.1
    assert rates.seconds("train-softmax-d16-seed2") == pytest.approx(typical)
    assert rates.seconds("train-softmax-d16-seed2", worst=True) == pytest.approx(worst)
    assert rates.seconds("test-mos-d16-seed2") == 60.0
    assert rates.seconds("test-mos-d16-seed2", worst=True) == 90.0
    now = 1_000_000.0
    monkeypatch.setattr(bm.time, "time", lambda: now)
    admit = bm.before(now + bm.DEADLINE_SLACK * (worst + 90.0) + 1)
    assert admit("train-softmax-d16-seed2")
    admit = bm.before(now + bm.DEADLINE_SLACK * worst + 1)  # the training fits, not its test
    assert not admit("train-softmax-d16-seed2")
    assert bm.before(now)("test-mos-d16-seed2")  # past the deadline, a test still starts
    # a run with a checkpoint after 15 of the cap's 20 epochs needs a quarter of the time
    run = bm.cell_dir("softmax", 16, 2)
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.pt").write_bytes(b"")
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"kind": "epoch", "epoch": e}) + "\n" for e in range(1, 16)))
    assert bm.Rates().seconds("train-softmax-d16-seed2", worst=True) == pytest.approx(worst / 4)
    assert admit("train-softmax-d16-seed2")


def test_a_learning_rate_stage_is_estimated_with_the_extensions_its_grid_takes(tmp_path,
                                                                             monkeypatch):
    """A pilot grid grows past an end that wins: the typical stage runs as many pilots as the
    finished stages' median grid, the worst every extension."""
    monkeypatch.setattr(bm, "OUT", tmp_path)
    (tmp_path / "records").mkdir()
    (tmp_path / "pilots").mkdir()
    (tmp_path / "pilots" / "softmax-d16-lr5.json").write_text(json.dumps(
        {"arm": "softmax", "d": 16, "tokens_per_s": 2240.0, "device": "cpu"}))
    one_pilot = bm.PILOT_STEPS * 1120 / 2240.0
    assert bm.Rates().seconds("lr-softmax-d16") == pytest.approx(
        len(bm.PILOT_LRS) * one_pilot + 60)
    for arm, grid in (("mos", [5, 10, 20, 40, 80]), ("mixtape", [5, 10, 20, 40, 80]),
                      ("softmax", [5, 10, 20, 40])):
        (tmp_path / "records" / f"lr-{arm}-d8.json").write_text(json.dumps({"grid": grid}))
    rates = bm.Rates()
    assert rates.seconds("lr-softmax-d16") == pytest.approx(5 * one_pilot + 60)
    assert rates.seconds("lr-softmax-d16", worst=True) == pytest.approx(
        (len(bm.PILOT_LRS) + bm.MAX_EXTENSIONS) * one_pilot + 60)


def test_an_estimate_that_fails_refuses_its_stage_in_one_line(monkeypatch, capsys):
    def broken():
        raise ValueError("records/x.json is not JSON")

    assert not bm.before(2e9, rates=broken)("train-mos-d16-seed1")
    assert "train-mos-d16-seed1: not started, its estimate failed" in capsys.readouterr().out


def test_until_reads_the_next_time_the_clock_shows_it(capsys):
    import datetime

    noon = datetime.datetime(2026, 12, 7, 12, 0).timestamp()
    assert bm.clock_time("13:30", now=noon) - noon == 90 * 60
    assert bm.clock_time("11:00", now=noon) - noon == 23 * 3600  # passed today: tomorrow's
    with pytest.raises(SystemExit):
        bm.main(["--until", "25:00", "--plan"])
    assert "expected a clock time HH:MM, got '25:00'" in capsys.readouterr().err


def write_cell(out, arm, d, seed, test_ppl, lr=10.0):
    records = out / "records"
    records.mkdir(parents=True, exist_ok=True)
    train = {"arm": arm, "d": d, "seed": seed, "lr": lr, "params": 1000, "output_width": d,
             "curve": [{"epoch": 1, "valid_loss": 6.0}, {"epoch": 2, "valid_loss": 5.5}],
             "epochs": 2, "best_valid_ppl": math.exp(5.5)}
    (records / f"train-{arm}-d{d}-seed{seed}.json").write_text(json.dumps(train))
    (records / f"test-{arm}-d{d}-seed{seed}.json").write_text(json.dumps(
        {"test_ppl": test_ppl, "press_rank": d + 1, "gradient_share": 0.1 * seed}))


def test_the_summary_pairs_seeds_and_tests_the_differences(tmp_path, monkeypatch):
    monkeypatch.setattr(bm, "OUT", tmp_path)
    for seed, (soft, mos, control) in enumerate([(200, 180, 195), (210, 185, 204)], start=1):
        write_cell(tmp_path, "softmax", 8, seed, soft)
        write_cell(tmp_path, "mos", 8, seed, mos)
        write_cell(tmp_path, "mlp_softmax", 8, seed, control)
    rows = bm.summary_rows()
    assert {r["arm"] for r in rows} == {"softmax", "mos", "mlp_softmax"}
    assert next(r for r in rows if r["arm"] == "mlp_softmax")["control"] == "mlp_softmax"
    assert next(r for r in rows if r["arm"] == "mos")["valid_ppl"] == pytest.approx(
        math.exp(5.5))
    gains = {(g["head"], g["against"]): g for g in bm.gain_table(rows)}
    over_softmax = gains[("mos", "softmax")]
    assert over_softmax["gain_percent"] == pytest.approx([100 * (200 / 180 - 1),
                                                          100 * (210 / 185 - 1)])
    assert 0 < over_softmax["paired_p"] < 1
    cells = bm.cell_table(rows)
    mos = next(c for c in cells if c["arm"] == "mos")
    assert mos["test_ppl_mean"] == pytest.approx(182.5) and mos["seeds"] == [1, 2]
    assert mos["gradient_share_mean"] == pytest.approx(0.15) and mos["anisotropy_mean"] is None
    bm.summarize()  # writes the files and the figures without error
    assert json.loads((tmp_path / "summary.json").read_text()) == rows
    assert (tmp_path / "test-ppl-vs-d.png").is_file()


def test_the_gain_figure_puts_three_studies_on_one_axis_in_nats(tmp_path, monkeypatch):
    monkeypatch.setattr(bm, "OUT", tmp_path)
    synthetic = tmp_path / "synthetic.json"
    synthetic.write_text(json.dumps({"rows": [
        {"r": 256, "d": 8, "head": "softmax", "kl_mean": 1.0},
        {"r": 256, "d": 8, "head": "mos", "kl_mean": 0.6},
        {"r": 256, "d": 16, "head": "mos", "kl_mean": 0.3}]}))  # no softmax partner: left out
    smollm2 = tmp_path / "smollm2.json"
    smollm2.write_text(json.dumps({"against_controls": [
        {"head": "mos4", "control": "control3m", "split": "valid", "head_mean": 1.0,
         "control_mean": 9.0},
        {"head": "mos4", "control": "control3m", "split": "test", "head_mean": 20.0,
         "control_mean": 21.0}]}))
    context = tmp_path / "context.json"  # the context heads' summary: MFS and MoS + CPR
    context.write_text(json.dumps({"against_controls": [
        {"head": "mfs", "control": "control7m", "split": "test", "head_mean": 18.0,
         "control_mean": 20.0},
        {"head": "mfs", "control": "mos4", "split": "test", "head_mean": 18.0,
         "control_mean": 30.0},  # not a capacity control: not on the figure
        {"head": "moscpr", "control": "control9m", "split": "valid", "head_mean": 1.0,
         "control_mean": 2.0}]}))  # its test pair missing: no point
    monkeypatch.setattr(bm, "SYNTHETIC", synthetic)
    monkeypatch.setattr(bm, "SMOLLM2", smollm2)
    monkeypatch.setattr(bm, "SMOLLM2_CONTEXT", context)
    rows = []
    for seed, ppl in ((1, {"softmax": 300, "mos": 250, "mlp_softmax": 280, "wide_softmax": 290,
                           "mixtape": 320}),
                      (2, {"softmax": 310, "mos": 240, "mlp_softmax": 290, "wide_softmax": 280,
                           "mixtape": 330})):
        rows += [{"arm": arm, "d": 8, "seed": seed, "test_ppl": value}
                 for arm, value in ppl.items()]
    gains = bm.gain_table(rows)
    series = bm.gain_points(gains)
    # paired by seed: the mean of the per-seed log ratios, not the log of mean perplexities
    mos_softmax = (math.log(300 / 250) + math.log(310 / 240)) / 2
    assert series["PTB map: mos - softmax"] == [(8, pytest.approx(mos_softmax))]
    against = {c: (math.log(a / 250) + math.log(b / 240)) / 2
               for c, (a, b) in (("mlp_softmax", (280, 290)), ("wide_softmax", (290, 280)))}
    # against the stronger control (the smaller gain), not the weaker
    assert series["PTB map: mos - best control"] == [(8, pytest.approx(min(against.values())))]
    assert series["PTB map: mixtape - softmax"][0][1] < 0
    assert series["synthetic r = 256: mos - softmax"] == [(8, pytest.approx(0.4))]
    assert "synthetic r = 64: mos - softmax" not in series  # no rows: no series
    assert series["SmolLM2 frozen: mos4 - control"] == [(576, pytest.approx(math.log(21 / 20)))]
    assert series["SmolLM2 frozen: mfs - control"] == [(576, pytest.approx(math.log(20 / 18)))]
    assert "SmolLM2 frozen: moscpr - control" not in series
    smollm2.write_text("{}")  # a summary of another format is left out, not an error
    assert "SmolLM2 frozen: mos4 - control" not in bm.gain_points(gains)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bm.gain_figure(plt, gains, {})
    assert (tmp_path / "gain-vs-d.png").is_file()


def test_a_third_seed_goes_to_both_arms_of_a_gap_within_two_spreads(tmp_path, monkeypatch):
    monkeypatch.setattr(bm, "OUT", tmp_path)
    monkeypatch.setattr(bm, "LR_CHECKS", ())
    # seeds 1, 2: MoS far below everything (no third seed for its pairs); Mixtape within two
    # spreads of the softmax only; SigSoftmax far above everything
    ppl = {"softmax": (200, 210), "mos": (120, 121), "mixtape": (204, 214),
           "sigsoftmax": (400, 401), "mlp_softmax": (300, 301), "wide_softmax": (350, 351)}
    for arm, (first, second) in ppl.items():
        write_cell(tmp_path, arm, 16, 1, first)
        if arm != "wide_softmax":
            write_cell(tmp_path, arm, 16, 2, second)
    assert bm.third_seed_arms(16) == []  # not before every arm's seeds 1 and 2 are tested
    assert not any(s.name.endswith("seed3") for s in bm.map_stages())
    write_cell(tmp_path, "wide_softmax", 16, 2, ppl["wide_softmax"][1])
    assert bm.third_seed_arms(16) == ["softmax", "mixtape"]
    names = [s.name for s in bm.map_stages()]
    assert names.index("train-softmax-d16-seed3") > names.index("test-wide_softmax-d16-seed2")
    assert names.index("test-mixtape-d16-seed3") < names.index("lr-softmax-d64")
    assert not any(n.startswith(("train-mos-d16-seed3", "train-sigsoftmax-d16-seed3"))
                   for n in names)


def test_a_third_seed_reads_the_adopted_check_not_the_run_it_replaced(tmp_path, monkeypatch):
    """The control's seed 1 trained at its pilot's lr (test 900: its two seeds then spread so
    far that every head would fall within two spreads of it) was replaced by a check (300)."""
    monkeypatch.setattr(bm, "OUT", tmp_path)
    monkeypatch.setattr(bm, "LR_CHECKS", (("mlp_softmax", 16, 5.0, 1),))
    ppl = {"softmax": (200, 210), "mos": (120, 121), "mixtape": (204, 214),
           "sigsoftmax": (400, 401), "mlp_softmax": (900, 301), "wide_softmax": (350, 351)}
    for arm, (first, second) in ppl.items():
        write_cell(tmp_path, arm, 16, 1, first)
        write_cell(tmp_path, arm, 16, 2, second)
    assert bm.third_seed_arms(16) == []  # the check is not done: which run stands is not known
    check = {"arm": "mlp_softmax", "d": 16, "seed": 1, "lr": 5.0, "test_ppl": 300.0,
             "best_valid_ppl": math.exp(5.0)}  # below the pilot's run's exp(5.5): adopted
    (tmp_path / "records" / "check-mlp_softmax-d16-lr5-seed1.json").write_text(json.dumps(check))
    assert bm.adopted_check("mlp_softmax", 16) is not None
    assert bm.third_seed_arms(16) == ["softmax", "mixtape"]


def test_the_width_where_a_head_stops_beating_both_controls():
    def gain(d, against, mean, p, seeds=(1, 2, 3), clear=False):
        return {"d": d, "head": "mos", "against": against, "mean_gain_percent": mean,
                "paired_p": p, "seeds": list(seeds), "beyond_two_spreads": clear}

    gains = [gain(8, "mlp_softmax", 5.0, 0.01), gain(8, "wide_softmax", 6.0, 0.02),
             # two seeds, p above 0.05 (1 degree of freedom) but the gap beyond two spreads:
             # the rule that gave it no third seed calls it a win
             gain(32, "mlp_softmax", 12.0, 0.058, seeds=(1, 2), clear=True),
             gain(32, "wide_softmax", 1.0, 0.04),
             # at 128 one control is not beaten: the gain stops there
             gain(128, "mlp_softmax", 1.0, 0.01), gain(128, "wide_softmax", 0.5, 0.30),
             gain(128, "softmax", 9.0, 0.001)]
    (row,) = bm.beats_both_controls(gains)
    assert row == {"head": "mos", "tested": [8, 32, 128], "beats_both_at": [8, 32],
                   "not_at": [128], "stops_at": 128}
    # not monotone: a loss between two wins is where it stops, not hidden
    gains = [gain(8, c, 5.0, 0.01) for c in bm.CONTROLS] + \
        [gain(32, c, -1.0, 0.5) for c in bm.CONTROLS] + [gain(128, c, 5.0, 0.01)
                                                         for c in bm.CONTROLS]
    (row,) = bm.beats_both_controls(gains)
    assert row["beats_both_at"] == [8, 128] and row["stops_at"] == 32
    # a significant loss is no win, two seeds within two spreads are no win, and a width with
    # one control untested is not judged
    gains = [gain(8, "mlp_softmax", -5.0, 0.01), gain(8, "wide_softmax", -6.0, 0.01),
             gain(16, "mlp_softmax", 3.0, 0.01, seeds=(1, 2)),
             gain(16, "wide_softmax", 3.0, 0.01, seeds=(1, 2)),
             gain(32, "mlp_softmax", 2.0, 0.01)]
    (row,) = bm.beats_both_controls(gains)
    assert row == {"head": "mos", "tested": [8, 16], "beats_both_at": [], "not_at": [8, 16],
                   "stops_at": None}
    assert "| mos | [8, 16] | none | [8, 16] | - |" in bm.summary_markdown(
        [], [], bm.beats_both_controls(gains))


def test_a_summary_that_fails_does_not_stop_the_study(monkeypatch, capsys):
    def broken():
        raise KeyError("a figure's input")

    monkeypatch.setattr(bm, "summarize", broken)
    bm.summarize_after("train-mos-d8-seed1")
    assert "summary not written after train-mos-d8-seed1" in capsys.readouterr().out


def test_a_process_can_take_some_widths_and_leave_the_long_runs():
    names = [s.name for s in bm.stages("map", (32,), long=False)]
    assert names[0] == "lr-softmax-d32" and all("-d32" in n for n in names)
    with_long = [s.name for s in bm.stages("long", (8,))]
    assert with_long[0].startswith("long-") and "lr-softmax-d8" in with_long
    assert "lr-softmax-d32" not in with_long
    assert [s.name for s in bm.stages("map")] == [s.name for s in bm.stages("map", bm.D_VALUES)]


def test_a_training_without_its_checkpoint_is_done_only_once_tested(tmp_path, monkeypatch):
    """The test stage reads the run's best.pt, which stays on the machine that trained: records
    brought from a GPU machine without it train the run again unless its test is recorded."""
    monkeypatch.setattr(bm, "OUT", tmp_path)
    write_cell(tmp_path, "mos", 32, 1, 150.0)
    (tmp_path / "records" / "test-mos-d32-seed1.json").unlink()
    assert not bm.stage_done("train-mos-d32-seed1")
    best = bm.cell_dir("mos", 32, 1) / "checkpoints" / "best.pt"
    best.parent.mkdir(parents=True)
    best.write_bytes(b"")
    assert bm.stage_done("train-mos-d32-seed1")
    best.unlink()
    write_cell(tmp_path, "mos", 32, 1, 150.0)  # its test recorded
    assert bm.stage_done("train-mos-d32-seed1") and bm.stage_done("test-mos-d32-seed1")
    assert not bm.stage_done("lr-mos-d32")  # no record


def test_a_training_made_again_drops_its_old_record_before_it_starts(tmp_path, monkeypatch):
    """Trained on another machine (its record here, its best.pt not): while it trains again here,
    its first best.pt must not make the old record read as done, or another process would test
    a run still training."""
    monkeypatch.setattr(bm, "OUT", tmp_path)
    write_cell(tmp_path, "softmax", 16, 1, 140.0)
    (tmp_path / "records" / "test-softmax-d16-seed1.json").unlink()
    (tmp_path / "records" / "lr-softmax-d16.json").write_text(json.dumps({"lr": 5.0}))
    seen = []

    def training(*words):  # the first epoch's best.pt, then a look at the records
        best = bm.cell_dir("softmax", 16, 1) / "checkpoints" / "best.pt"
        best.parent.mkdir(parents=True, exist_ok=True)
        best.write_bytes(b"")
        seen.append(bm.stage_done("train-softmax-d16-seed1"))
        raise RuntimeError("stopped mid-run")

    monkeypatch.setattr(bm, "run", training)
    with pytest.raises(RuntimeError):
        bm.work("train-softmax-d16-seed1")
    assert seen == [False]


def test_a_learning_rate_check_trains_and_tests_beside_the_map(tmp_path, monkeypatch):
    """LR_CHECKS: beside the cell it checks, one stage trains the cell again at another lr into
    checks/ and tests it; the cell's other seeds wait for it and for the run it is compared
    with. Its run stands for the pilot's run of its seed, and its lr for the cell's, only if its
    validation perplexity is lower; summary.md sets the two side by side either way."""
    monkeypatch.setattr(bm, "OUT", tmp_path)
    monkeypatch.setattr(bm, "LR_CHECKS", (("mlp_softmax", 16, 5.0, 1),))
    stages = {s.name: s for s in bm.map_stages((16,))}
    names = list(stages)
    check = next(s for s in stages.values() if s.name.startswith("check-"))
    assert check.name == "check-mlp_softmax-d16-lr5-seed1"
    assert check.needs == ("lr-mlp_softmax-d16",)  # it trains beside the run it checks
    assert names.index("test-wide_softmax-d16-seed1") < names.index(check.name)
    assert names.index(check.name) < names.index("train-softmax-d16-seed2")
    assert stages["train-mlp_softmax-d16-seed1"].needs == ("lr-mlp_softmax-d16",)
    # the other seeds wait for the decision: the check and the run it is compared with
    assert set(stages["train-mlp_softmax-d16-seed2"].needs) == {
        "lr-mlp_softmax-d16", check.name, "train-mlp_softmax-d16-seed1"}
    assert check.name not in stages["train-mos-d16-seed2"].needs
    assert not [n for n in (s.name for s in bm.map_stages((8,))) if n.startswith("check-")]
    assert bm._check("mlp_softmax-d16-lr1.25-seed3") == ("mlp_softmax", 16, 1.25, 3)

    write_cell(tmp_path, "softmax", 16, 1, 135.0)
    write_cell(tmp_path, "mlp_softmax", 16, 1, 200.0, lr=1.25)  # best valid exp(5.5) = 244.7
    (tmp_path / "records" / "lr-mlp_softmax-d16.json").write_text(json.dumps(
        {"arm": "mlp_softmax", "d": 16, "lr": 1.25, "valid_ppl": {"1.25": 719.0, "5": 738.0}}))
    words = []
    monkeypatch.setattr(bm, "run", lambda *w: words.append(w))

    def training(directory, facts):
        return {**facts, "params": 1000, "output_width": 16, "epochs": 20,
                "curve": [{"epoch": 1, "valid_loss": 5.0}], "best_valid_ppl": valid}

    monkeypatch.setattr(bm, "training_record", training)
    monkeypatch.setattr(bm, "test_record", lambda directory: {"test_ppl": 150.0})
    for valid, adopted in ((250.0, False), (150.0, True)):
        record = bm.work(check.name)
        assert "--train.lr=5" in words[-1]
        assert f"--run.out_dir={tmp_path / 'checks' / 'mlp_softmax-d16-lr5-seed1'}" in words[-1]
        assert record["pilot_lr"] == 1.25 and record["test_ppl"] == 150.0
        (tmp_path / "records" / f"{check.name}.json").write_text(json.dumps(record))
        rows = {r["arm"]: r for r in bm.summary_rows()}
        assert set(rows) == {"softmax", "mlp_softmax"}
        assert rows["mlp_softmax"]["test_ppl"] == (150.0 if adopted else 200.0)
        assert rows["mlp_softmax"]["record"] == (f"{check.name}.json" if adopted
                                                 else "train-mlp_softmax-d16-seed1.json")
        assert bm.cell_lr("mlp_softmax", 16) == (5.0 if adopted else 1.25)
        (row,) = bm.check_rows()
        assert (row["pilot_lr_test_ppl"], row["softmax_test_ppl"]) == (200.0, 135.0)
        assert row["adopted"] is adopted
        markdown = bm.summary_markdown([], [], checks=bm.check_rows())
        assert (f"| 16 | mlp_softmax | 1 | 1.25: 244.69 / 200.00 | 5: {valid:.2f} / 150.00 | 20 "
                f"| 135.00 | +11.1% | {'yes' if adopted else 'no'} |") in markdown
    bm.summarize()  # the curves read the adopted check's record
    assert (tmp_path / "curves.png").is_file()
    bm.work("train-mlp_softmax-d16-seed2")  # the other seeds train at the adopted lr
    assert "--train.lr=5" in words[-1]


def test_checks_of_two_seeds_train_beside_their_runs_and_seed_one_decides(tmp_path, monkeypatch):
    """A cell checked in seeds 1 and 2 (on a GPU, where a width's runs all train at once): no
    run waits, each seed trains at both lrs, seed 1's validation decides which run stands for
    each seed; a seed without a check of its own (the third) waits and takes the decided lr."""
    monkeypatch.setattr(bm, "OUT", tmp_path)
    monkeypatch.setattr(bm, "LR_CHECKS", (("mlp_softmax", 32, 5.0, 1),
                                          ("mlp_softmax", 32, 5.0, 2)))
    stages = {s.name: s for s in bm.map_stages((32,))}
    for seed in (1, 2):
        assert stages[f"train-mlp_softmax-d32-seed{seed}"].needs == ("lr-mlp_softmax-d32",)
        assert stages[f"check-mlp_softmax-d32-lr5-seed{seed}"].needs == ("lr-mlp_softmax-d32",)
    assert set(bm._trained_and_tested("mlp_softmax", 32, 3)[0].needs) == {
        "lr-mlp_softmax-d32", "check-mlp_softmax-d32-lr5-seed1", "train-mlp_softmax-d32-seed1"}
    (tmp_path / "records").mkdir()
    (tmp_path / "records" / "lr-mlp_softmax-d32.json").write_text(json.dumps({"lr": 1.25}))
    assert [bm.seed_lr("mlp_softmax", 32, seed) for seed in (1, 2, 3)] == [1.25, 1.25, 1.25]
    for seed, (pilot_ppl, check_ppl) in {1: (200.0, 150.0), 2: (210.0, 155.0)}.items():
        write_cell(tmp_path, "mlp_softmax", 32, seed, pilot_ppl, lr=1.25)  # valid exp(5.5)
        assert bm.standing_test_ppl("mlp_softmax", 32, seed) is None  # its check not done
        (tmp_path / "records" / f"check-mlp_softmax-d32-lr5-seed{seed}.json").write_text(
            json.dumps({"arm": "mlp_softmax", "d": 32, "seed": seed, "lr": 5.0,
                        "pilot_lr": 1.25, "epochs": 20, "test_ppl": check_ppl,
                        "params": 1000, "output_width": 32,
                        "curve": [{"epoch": 1, "valid_loss": 5.0}],
                        "best_valid_ppl": math.exp(5.0 if seed == 1 else 5.9)}))
    # seed 2's own check validated worse than its pilot-lr run, but seed 1 decides
    assert [bm.standing_test_ppl("mlp_softmax", 32, seed) for seed in (1, 2)] == [150.0, 155.0]
    assert [bm.seed_lr("mlp_softmax", 32, seed) for seed in (1, 2, 3)] == [1.25, 1.25, 5.0]
    rows = {r["seed"]: r for r in bm.summary_rows()}
    assert {seed: rows[seed]["record"] for seed in (1, 2)} == {
        seed: f"check-mlp_softmax-d32-lr5-seed{seed}.json" for seed in (1, 2)}
    assert [row["adopted"] for row in bm.check_rows()] == [True, True]


def write_check(out, arm, d, lr, seed, valid_ppl, test_ppl, pilot_lr=1.25):
    (out / "records" / f"{bm.check_name(arm, d, lr, seed)}.json").write_text(json.dumps(
        {"arm": arm, "d": d, "seed": seed, "lr": lr, "pilot_lr": pilot_lr, "epochs": 20,
         "params": 1000, "output_width": d, "curve": [{"epoch": 1, "valid_loss": 5.0}],
         "best_valid_ppl": valid_ppl, "test_ppl": test_ppl}))


def test_seed_one_decides_against_a_check_and_the_lowest_of_several_lrs_wins(tmp_path,
                                                                              monkeypatch):
    monkeypatch.setattr(bm, "OUT", tmp_path)
    checks = tuple(("mlp_softmax", 32, lr, seed) for lr in (5.0, 10.0) for seed in (1, 2))
    monkeypatch.setattr(bm, "LR_CHECKS", checks)
    valid = math.exp(5.5)  # write_cell's pilot-lr runs
    for seed in (1, 2):
        write_cell(tmp_path, "mlp_softmax", 32, seed, 200.0 + seed, lr=1.25)
    # seed 1's checks both validate worse; seed 2's would win, but seed 1 decides
    for seed, ppl in ((1, valid + 1), (2, valid - 50)):
        write_check(tmp_path, "mlp_softmax", 32, 5.0, seed, ppl, 150.0)
        write_check(tmp_path, "mlp_softmax", 32, 10.0, seed, ppl, 140.0)
    assert bm.adopted_check("mlp_softmax", 32) is None
    assert [bm.standing_test_ppl("mlp_softmax", 32, s) for s in (1, 2)] == [201.0, 202.0]
    assert [r["record"] for r in bm.summary_rows()] == [
        "train-mlp_softmax-d32-seed1.json", "train-mlp_softmax-d32-seed2.json"]
    assert [r["adopted"] for r in bm.check_rows()] == [False] * 4
    # both of seed 1's checks validate better: the lower one (lr 10) is adopted, in each seed
    write_check(tmp_path, "mlp_softmax", 32, 5.0, 1, valid - 20, 150.0)
    write_check(tmp_path, "mlp_softmax", 32, 10.0, 1, valid - 30, 140.0)
    assert bm.adopted_check("mlp_softmax", 32)["lr"] == 10.0
    assert [r["record"] for r in bm.summary_rows()] == [
        "check-mlp_softmax-d32-lr10-seed1.json", "check-mlp_softmax-d32-lr10-seed2.json"]
    assert [r["adopted"] for r in bm.check_rows()] == [True, True, False, False]  # lr10, lr5


def test_a_seed_is_left_out_of_the_tables_until_its_standing_run_is_known(tmp_path,
                                                                           monkeypatch):
    monkeypatch.setattr(bm, "OUT", tmp_path)
    monkeypatch.setattr(bm, "LR_CHECKS", (("mlp_softmax", 32, 5.0, 1),
                                          ("mlp_softmax", 32, 5.0, 2)))
    for seed in (1, 2):
        write_cell(tmp_path, "mlp_softmax", 32, seed, 200.0, lr=1.25)
    assert bm.summary_rows() == []  # seed 1's check not done: neither seed's run is known
    write_check(tmp_path, "mlp_softmax", 32, 5.0, 1, 100.0, 150.0)  # adopted
    assert [r["seed"] for r in bm.summary_rows()] == [1]  # seed 2's own check not done
    assert bm.standing_test_ppl("mlp_softmax", 32, 2) is None
    write_check(tmp_path, "mlp_softmax", 32, 5.0, 2, 400.0, 155.0)  # seed 1 decided: it stands
    (tmp_path / "records" / "train-mlp_softmax-d32-seed2.json").unlink()  # training again
    (tmp_path / "records" / "test-mlp_softmax-d32-seed2.json").unlink()
    rows = bm.summary_rows()
    assert [(r["seed"], r["test_ppl"]) for r in rows] == [(1, 150.0), (2, 155.0)]
    assert bm.standing_test_ppl("mlp_softmax", 32, 2) == 155.0


@pytest.mark.parametrize("checks, message", [
    ((("mlp_softmax", 32, 5.0, 3),), "must be one of SEEDS"),
    ((("mlp_softmax", 32, 5.0, 1), ("mlp_softmax", 32, 10.0, 1), ("mlp_softmax", 32, 5.0, 2)),
     "different lrs"),
])
def test_learning_rate_checks_the_stages_cannot_honour_are_refused(checks, message):
    with pytest.raises(ValueError, match=message):
        bm._valid_lr_checks(checks)
    bm._valid_lr_checks(bm.LR_CHECKS)  # the study's own


def test_a_learning_rate_check_is_estimated_as_a_training_and_its_test(tmp_path, monkeypatch):
    monkeypatch.setattr(bm, "OUT", tmp_path)
    (tmp_path / "records").mkdir()
    rates = bm.Rates()
    assert rates.seconds("check-mlp_softmax-d16-lr5-seed1", worst=True) == pytest.approx(
        rates.seconds("train-mlp_softmax-d16-seed1", worst=True)
        + rates.seconds("test-mlp_softmax-d16-seed1", worst=True))


def test_cells_on_a_gpu_name_their_device_and_data(tmp_path, monkeypatch):
    """--device and --data-dir reach every command; on the CPU the commands are as before."""
    train = bm.train_words("mos", 8, 10.0, 1, tmp_path / "run")
    assert "--run.device=cpu" in train and bm.device_words() == ()
    monkeypatch.setattr(bm, "DEVICE", "cuda")
    monkeypatch.setattr(bm, "DATA_DIR", tmp_path / "data")
    train = bm.train_words("mos", 8, 10.0, 1, tmp_path / "run")
    assert "--run.device=cuda" in train and "--run.device=cpu" not in train
    assert f"--data.dir={tmp_path / 'data' / 'ptb'}" in train
    assert bm.device_words() == ("--device", "cuda")
    assert "--run.device=cuda" in bm.long_words("softmax", 1, tmp_path / "long")


def test_widths_outside_the_map_are_refused_in_one_line(capsys):
    with pytest.raises(SystemExit):
        bm.main(["--widths", "7,8", "--plan"])
    assert "expected widths among 8, 32, 128, 16, 64, 256" in capsys.readouterr().err


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_command_of_a_cell_parses_on_either_device(tmp_path, monkeypatch, device):
    """The commands a pilot, a training and a test stage run are valid highrank command lines
    with --device cuda too (``highrank eval`` has no --device: it must not get one)."""
    from highrank.cli import build_parser

    monkeypatch.setattr(bm, "OUT", tmp_path)
    monkeypatch.setattr(bm, "DEVICE", device)
    commands = []

    def fake_run(*words):
        commands.append(list(words))
        if words[0] == "eval":  # the record the stage reads next
            name = f"eval-{words[words.index('--split') + 1]}-" + (
                words[words.index("--which") + 1] if "--which" in words else "best")
            (Path(words[1]) / f"{name}.json").write_text('{"loss": 5.0, "perplexity": 148.4}')

    monkeypatch.setattr(bm, "run", fake_run)
    monkeypatch.setattr(bm, "_metrics", lambda directory: [])
    run_dir = tmp_path / "runs" / "mos-d8-seed1"
    run_dir.mkdir(parents=True)
    (tmp_path / "pilot-runs" / "mos-d8-lr10").mkdir(parents=True)
    bm.test_record(run_dir)
    monkeypatch.setattr(bm.shutil, "rmtree", lambda *a, **k: None)  # keep the pilot's folder
    bm.pilot("mos", 8, 10.0)
    commands.append(bm.train_words("mos", 8, 10.0, 1, tmp_path / "run"))
    parser = build_parser()
    for words in commands:
        parser.parse_args(words)  # SystemExit on an unknown option
    analyze = [w for w in commands if w[0] == "analyze"]
    assert len(analyze) == 3 and all(("--device" in w) == (device == "cuda") for w in analyze)
    assert not any("--device" in w for w in commands if w[0] == "eval")


def write_long(out, head, seed, test_ppl, valid_loss=4.7):
    records = out / "records"
    records.mkdir(parents=True, exist_ok=True)
    train = {"arm": f"long-{head}", "seed": seed, "params": 4_900_000, "output_width": 200,
             "curve": [{"epoch": 1, "valid_loss": 5.6}, {"epoch": 2, "valid_loss": valid_loss}],
             "epochs": 2}
    (records / f"long-{head}-seed{seed}.json").write_text(json.dumps(train))
    (records / f"test-long-{head}-seed{seed}.json").write_text(json.dumps(
        {"test_ppl": test_ppl, "press_rank": 202 if head == "softmax" else 1957}))


def test_the_long_runs_get_their_own_table_with_mos_paired_against_the_softmax(tmp_path,
                                                                                monkeypatch):
    monkeypatch.setattr(bm, "OUT", tmp_path)
    for seed, (soft, mos) in enumerate([(102.6, 105.4), (100.8, 104.2)], start=1):
        write_long(tmp_path, "softmax", seed, soft)
        write_long(tmp_path, "mos", seed, mos)
    write_cell(tmp_path, "softmax", 8, 1, 170.0)  # a map cell stays out of the long table
    rows = bm.summary_rows()
    long = bm.long_table(rows)
    assert [h["head"] for h in long["heads"]] == ["softmax", "mos"]
    mos = long["heads"][1]
    assert mos["test_ppl_mean"] == pytest.approx(104.8) and mos["seeds"] == [1, 2]
    assert mos["test_ppl_sd"] == pytest.approx(0.8485, abs=1e-4)
    assert mos["valid_ppl"] == pytest.approx([math.exp(4.7)] * 2)
    pair = long["mos_against_softmax"]
    assert pair["gain_percent"] == pytest.approx([100 * (102.6 / 105.4 - 1),
                                                  100 * (100.8 / 104.2 - 1)])
    assert pair["mean_gain_percent"] < 0 and 0 < pair["paired_p"] < 1
    assert all(c["arm"] == "softmax" for c in bm.cell_table(rows))  # and out of the cells
    bm.summarize()
    text = (tmp_path / "summary.md").read_text()
    assert "| mos | [1, 2] | [2, 2] | 109.95, 109.95 | 104.80 ± 0.85 | 1957, 1957 |" in text
    assert json.loads((tmp_path / "cells.json").read_text())["long_runs"] == long


def test_without_a_tested_pair_the_long_table_has_no_comparison(tmp_path, monkeypatch):
    monkeypatch.setattr(bm, "OUT", tmp_path)
    write_long(tmp_path, "softmax", 1, 102.6)
    long = bm.long_table(bm.summary_rows())
    assert [h["head"] for h in long["heads"]] == ["softmax"]
    assert long["heads"][0]["test_ppl_sd"] is None and long["mos_against_softmax"] is None


def test_the_cpu_plan_reads_the_cpu_pilots_rates_only(tmp_path, monkeypatch):
    """A GPU's pilots ran 5-10x the CPU's tokens/s: the CPU plan must not take them (pilots
    before the ``device`` field ran on the CPU)."""
    monkeypatch.setattr(bm, "OUT", tmp_path)
    (tmp_path / "pilots").mkdir()
    for name, rate, device in (("softmax-d8-lr5", 9000.0, None), ("softmax-d8-lr10", 8000.0, "cpu"),
                               ("softmax-d32-lr5", 49000.0, "cuda")):
        arm, d, _ = name.split("-")
        record = {"arm": arm, "d": int(d[1:]), "tokens_per_s": rate,
                  **({} if device is None else {"device": device})}
        (tmp_path / "pilots" / f"{name}.json").write_text(json.dumps(record))
    rates = bm._pilot_rates()
    assert rates == {("softmax", 8): 8500.0}
    # d = 32 from the nearest CPU width, scaled by the output layer's width; not the GPU's 49,000
    assert bm._rate(rates, "softmax", 32) == pytest.approx(8500.0 * (1 + 8 / 256) / (1 + 32 / 256))
    assert [bm._width(s) for s in ("lr-mos-d8", "train-wide_softmax-d128-seed2",
                                   "test-mos-d32-seed3", "long-mos-seed1")] == [8, 128, 32, None]


def test_a_width_whose_pilots_ran_on_another_device_is_left_to_it(tmp_path, monkeypatch):
    """A map process without --widths started a d = 32 cell on the CPU whose pilots ran on the
    H100: a width's arms train on one device, where its pilots ran."""
    monkeypatch.setattr(bm, "OUT", tmp_path)
    (tmp_path / "pilots").mkdir()
    for name, d, device in (("softmax-d8-lr5", 8, None), ("mos-d32-lr5", 32, "cuda"),
                            ("softmax-d32-lr5", 32, "cuda")):
        record = {"arm": name.split("-")[0], "d": d, **({} if device is None else
                                                        {"device": device})}
        (tmp_path / "pilots" / f"{name}.json").write_text(json.dumps(record))
    # the CPU takes CPU_WIDTHS only (the budget): the others wait for a GPU
    assert bm.widths_of_this_device() == ((8, 16), {32: "cuda", 64: bm.BUDGET_DEVICE,
                                                    128: bm.BUDGET_DEVICE,
                                                    256: bm.BUDGET_DEVICE})
    monkeypatch.setattr(bm, "DEVICE", "cuda")
    assert bm.widths_of_this_device() == ((32, 128, 16, 64, 256), {8: "cpu"})


def test_the_plan_names_the_widths_left_to_another_device(tmp_path, monkeypatch, capsys):
    """d = 32's pilots ran on the GPU: the CPU plan leaves it out of its totals and says how
    many of its stages wait there."""
    monkeypatch.setattr(bm, "OUT", tmp_path)
    for name in ("DEVICE", "DATA_DIR"):  # main sets them: restored after the test
        monkeypatch.setattr(bm, name, getattr(bm, name))
    (tmp_path / "pilots").mkdir()
    (tmp_path / "pilots" / "softmax-d32-lr5.json").write_text(json.dumps(
        {"arm": "softmax", "d": 32, "tokens_per_s": 49000.0, "device": "cuda"}))
    (tmp_path / "records").mkdir()
    for arm in bm.ARMS:  # its pilots done: 12 trainings, 12 tests and 2 lr checks wait
        (tmp_path / "records" / f"lr-{arm}-d32.json").write_text(json.dumps({"lr": 5.0}))
    assert bm.main(["--plan"]) == 0
    out = capsys.readouterr().out
    assert "d = 32: 26 stages left to cuda, where its pilots ran" in out
    assert "d = 64: 30 stages left to a GPU, beyond the CPU's budget" in out
    # on the GPU, d = 8's pilots ran on the CPU: left there, not for the CPU's budget
    (tmp_path / "pilots" / "softmax-d8-lr5.json").write_text(json.dumps(
        {"arm": "softmax", "d": 8, "tokens_per_s": 7000.0}))
    assert bm.main(["--plan", "--device", "cuda"]) == 0
    assert "stages left to cpu, where its pilots ran" in capsys.readouterr().out
    by_d = out.split("train and check by d:")[1].split("\n")[0]
    assert "d = 8:" in by_d and "d = 32:" not in by_d
