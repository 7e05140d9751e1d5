"""Damaged or changed files in a retrofit's ``--out`` are one line, never a traceback, and
never used silently (campaign, issue 29 item 3): the training text edited after a run, a
damaged ``plan.json``, a cache's damaged records or changed contents (its checksums), a
``state.pt`` of another budget, shape, or history."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="retrofit needs the hf extra")

from highrank.cli import main  # noqa: E402
from tests.integrations.test_retrofit_command import command, model_and_texts  # noqa: E402
from tests.integrations.test_retrofit_nonfinite import nothing_saved, one_line  # noqa: E402

ERROR = "highrank retrofit: error: "


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    return model_and_texts(tmp_path_factory.mktemp("saved-files"))


@pytest.fixture(scope="module")
def finished(texts, tmp_path_factory):
    """``{mode: folder}``: one finished run per mode, copied by each test (a copied folder
    continues: its ``out`` may change)."""
    model, files = texts
    root = tmp_path_factory.mktemp("finished")
    folders = {}
    for mode in ("frozen", "full"):
        folders[mode] = root / mode
        assert main(argv_of(texts, folders[mode], mode)) == 0
    return folders


def argv_of(texts, out, mode="frozen", files=None):
    model, default = texts
    return command(model, files or default, out, "--head", "mos", "--knob", "n_components=2",
                   "--mode", mode)


def unfinished_copy(finished, mode, tmp_path):
    """A copy of a finished run without its results and model: a rerun reads its files."""
    out = tmp_path / "out"
    shutil.copytree(finished[mode], out)
    (out / "results.json").unlink()
    shutil.rmtree(out / "model")
    return out


def refused(argv, capsys) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    return one_line(capsys.readouterr().err, ERROR)


# ---- the training text edited after a run ------------------------------------------------------


def edited_texts(texts, tmp_path):
    """The run's texts copied, so that editing one leaves the module's texts alone."""
    model, files = texts
    copies = {split: tmp_path / f"{split}.txt" for split in files}
    for split, path in files.items():
        shutil.copy(path, copies[split])
    return copies


def test_an_edited_training_text_is_one_line_saying_how_to_start_again(texts, tmp_path, capsys):
    """Campaign: ``ValueError ... token_ids_sha256 differ`` traceback; --restart cannot help
    since the caches check themselves: delete the cache folder (and --restart), or --out."""
    files = edited_texts(texts, tmp_path)
    out = tmp_path / "out"
    argv = argv_of(texts, out, files=files)
    assert main(argv) == 0
    (out / "results.json").unlink()
    shutil.rmtree(out / "model")
    files["train"].write_text(files["train"].read_text().replace("cat", "dog"))
    line = refused(argv, capsys)
    assert f"--train {files['train']}: its tokens changed since {out / 'cache-train'}" in line
    assert "delete" in line and "--restart" in line and "another --out" in line, line
    assert "token_ids_sha256" not in line
    assert main([*argv, "--restart"]) == 2  # as it says: --restart alone keeps the caches
    assert "its tokens changed" in one_line(capsys.readouterr().err, ERROR)
    assert nothing_saved(out)
    shutil.rmtree(out / "cache-train")  # what it says to do
    assert main([*argv, "--restart"]) == 0


def test_restart_with_a_stale_cache_discards_nothing(finished, texts, tmp_path, capsys):
    """A new user's walk: ``--restart`` with another head on a finished frozen run deleted the
    model and the results, then refused the training cache (its rows are another head's)."""
    out = tmp_path / "out"
    shutil.copytree(finished["frozen"], out)
    before = contents(out)
    model, files = texts
    argv = command(model, files, out, "--head", "cpr", "--knob", "input_layers=2",
                   "--knob", "input_window=1", "--restart")
    line = refused(argv, capsys)
    assert line.startswith(f"{ERROR}3 feature caches do not fit this plan: "), line
    for split in ("train", "valid", "test"):  # every one named at once
        assert f"{out / f'cache-{split}'} was cached with other settings" in line, line
    assert contents(out) == before  # the finished model, its results and the caches: all kept


def contents(folder):
    """Every file's bytes but the run lock's (it names the last process that held it)."""
    return {path.relative_to(folder): path.read_bytes() for path in folder.rglob("*")
            if path.is_file() and path.name != ".lock"}


def test_every_stale_cache_is_named_before_the_first_is_made(texts, tmp_path, capsys):
    """A new user's walk: after deleting the stale training cache as told, the training cache
    was made again (minutes on a real model) before the validation cache refused, then the
    test cache: one at a time."""
    files = edited_texts(texts, tmp_path)
    out = tmp_path / "out"
    argv = argv_of(texts, out, files=files)
    assert main(argv) == 0
    for split in ("train", "valid"):
        files[split].write_text(files[split].read_text().replace("cat", "dog"))
    shutil.rmtree(out / "cache-test")
    line = refused([*argv, "--restart"], capsys)
    assert line.startswith(f"{ERROR}2 feature caches do not fit this plan: "), line
    assert "--train" in line and "--valid" in line and "--test" not in line, line
    assert (out / "model").is_dir() and (out / "results.json").is_file()
    assert not (out / "cache-test").exists()  # nothing made before the refusal


def test_an_edited_training_text_is_refused_by_the_state_in_full_mode(texts, tmp_path, capsys):
    """No cache in lora/full: the state keeps the digest of the windows it trained on (it
    resumed on the new text silently)."""
    files = edited_texts(texts, tmp_path)
    out = tmp_path / "out"
    argv = argv_of(texts, out, "full", files=files)
    assert main(argv) == 0
    (out / "results.json").unlink()
    shutil.rmtree(out / "model")
    files["train"].write_text(files["train"].read_text().replace("cat", "dog"))
    line = refused(argv, capsys)
    assert "state.pt was trained on other tokens than the training text gives now" in line
    assert "--restart" in line
    assert nothing_saved(out)
    assert main([*argv, "--restart"]) == 0


def test_the_same_text_resumes_with_the_digest_kept(finished, texts, tmp_path):
    out = unfinished_copy(finished, "full", tmp_path)
    assert torch.load(out / "state.pt", weights_only=True)["data"]
    assert main(argv_of(texts, out, "full")) == 0


# ---- plan.json -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("content", "message"), [
    ("garbage{", r"plan.json is not JSON \(JSONDecodeError"),
    ("[1, 2]", r"plan.json holds a JSON list, not a plan"),
])
def test_a_damaged_plan_is_one_line_and_restart_goes_on(finished, texts, tmp_path, capsys,
                                                         content, message):
    import re

    out = unfinished_copy(finished, "frozen", tmp_path)
    (out / "plan.json").write_text(content)
    argv = argv_of(texts, out)
    line = refused(argv, capsys)
    assert re.search(message, line) and "--restart" in line, line
    assert nothing_saved(out)
    assert main([*argv, "--restart"]) == 0


# ---- the feature cache ------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "content", "message"), [
    ("meta.json", "garbage", r"cache-train/meta.json is not JSON"),
    ("meta.json", "[]", r"cache-train/meta.json holds a JSON list, not an object"),
    ("progress.json", "garbage", r"cache-train/progress.json is not JSON"),
    ("progress.json", "{}", r"progress.json does not say how many of the \d+ windows"),
    ("progress.json", '{"windows_done": 99999, "complete": false}',
     r"progress.json does not say how many"),
    ("progress.json", None, r"cache-train/progress.json is missing"),
    ("features.npy", None, r"cache-train holds a feature cache that cannot be read"),
])
def test_damaged_cache_records_are_one_line(finished, texts, tmp_path, capsys, name, content,
                                            message):
    import re

    out = unfinished_copy(finished, "frozen", tmp_path)
    path = out / "cache-train" / name
    if content is None:
        path.unlink()
    else:
        path.write_text(content)
    line = refused(argv_of(texts, out), capsys)
    assert re.search(message, line) and "delete" in line, line
    assert nothing_saved(out)


def damage_targets_out_of_range(cache):
    targets = np.load(cache / "targets.npy")
    targets[3] = 999
    np.save(cache / "targets.npy", targets)


def damage_targets_in_range(cache):
    targets = np.load(cache / "targets.npy")
    targets[3] = (targets[3] + 1) % 20  # another word of the vocabulary: results differed
    np.save(cache / "targets.npy", targets)


def zero_features(cache):
    features = np.load(cache / "features.npy", mmap_mode="r+")
    features[:] = 0  # finite: the finite check alone passed it, and results differed
    features.flush()


def features_of_another_shape(cache):
    np.save(cache / "features.npy", np.zeros((5, 3), dtype=np.float32))


@pytest.mark.parametrize(("damage", "message"), [
    (damage_targets_out_of_range, r"targets.npy does not match the checksum written when its "
                                  r"cache was finished"),
    (damage_targets_in_range, r"targets.npy does not match the checksum"),
    (zero_features, r"features.npy does not match the checksum"),
    (features_of_another_shape, r"features.npy holds float32 \(5, 3\), not the float32"),
])
def test_changed_cache_contents_are_refused(finished, texts, tmp_path, capsys, damage, message):
    import re

    out = unfinished_copy(finished, "frozen", tmp_path)
    damage(out / "cache-train")
    line = refused(argv_of(texts, out), capsys)
    assert re.search(message, line) and f"delete {out / 'cache-train'}" in line, line
    assert nothing_saved(out)


def test_a_finished_cache_records_its_checksums(finished):
    progress = json.loads((finished["frozen"] / "cache-valid" / "progress.json").read_text())
    assert set(progress) == {"windows_done", "complete", "features_crc32", "targets_crc32"}


def test_a_cache_finished_before_checksums_still_loads(finished, texts, tmp_path):
    out = unfinished_copy(finished, "frozen", tmp_path)
    path = out / "cache-train" / "progress.json"
    progress = json.loads(path.read_text())
    path.write_text(json.dumps({k: progress[k] for k in ("windows_done", "complete")}))
    assert main(argv_of(texts, out)) == 0


# ---- state.pt ------------------------------------------------------------------------------------


def weights_key(mode):
    return "head" if mode == "frozen" else "trainable"


def first_weight(state, mode):
    return next(iter(state[weights_key(mode)]))


def other_budget(state, mode):
    state["budget"] = {**state["budget"], "steps": 99}


def other_shape(state, mode):
    state[weights_key(mode)][first_weight(state, mode)] = torch.zeros(1)  # broadcast silently


def missing_weight(state, mode):
    del state[weights_key(mode)][first_weight(state, mode)]


def weights_not_a_dict(state, mode):
    state[weights_key(mode)] = [1, 2]


def history_not_a_list(state, mode):
    state["history"] = {"a": 1}


def history_of_numbers(state, mode):
    state["history"] = [1, 2]


def history_three_times_the_budget(state, mode):
    state["history"] = state["history"] * 3  # was taken as finished


def bad_rng(state, mode):
    state["rng"] = torch.zeros(3)


def bad_python_rng(state, mode):
    state["python_rng"] = 5


def optimizer_without_groups(state, mode):
    state["optimizer"] = {}


def optimizer_moments_of_another_shape(state, mode):
    for moments in state["optimizer"]["state"].values():
        moments["exp_avg"] = torch.zeros(2)


@pytest.mark.parametrize("mode", ["frozen", "full"])
@pytest.mark.parametrize(("damage", "message"), [
    (other_budget, r"state.pt was trained with budget .* \(steps 99, not 6\)"),
    (other_shape, r"state.pt does not fit this (head|model) \(RuntimeError: .* is \(1,\), not"),
    (missing_weight, r"state.pt does not fit this (head|model) \(RuntimeError: lacks "),
    (weights_not_a_dict, r"state.pt holds no weights under '(head|trainable)'"),
    (history_not_a_list, r"state.pt holds a history of type dict, not a list of steps"),
    (history_of_numbers, r"state.pt holds a damaged history: step record 0"),
    (history_three_times_the_budget, r"state.pt holds 18 steps of history, more than the "
                                     r"budget's 6"),
    (bad_rng, r"state.pt holds no random generator state"),
    (bad_python_rng, r"state.pt holds a random generator state that cannot be restored"),
    (optimizer_without_groups, r"state.pt holds an optimizer state that does not fit"),
    (optimizer_moments_of_another_shape, r"state.pt holds an optimizer state that does not fit "
                                         r"\(ValueError: its exp_avg is \(2,\)"),
])
def test_a_damaged_state_is_one_line(finished, texts, tmp_path, capsys, mode, damage, message):
    import re

    out = unfinished_copy(finished, mode, tmp_path)
    state = torch.load(out / "state.pt", weights_only=True)
    damage(state, mode)
    torch.save(state, out / "state.pt")
    argv = argv_of(texts, out, mode)
    line = refused(argv, capsys)
    assert re.search(message, line) and "--restart" in line, line
    assert nothing_saved(out)
    if damage is history_three_times_the_budget:
        assert main([*argv, "--restart"]) == 0  # and --restart trains again


def test_compare_reads_a_real_retrofit_output(finished):
    """The layout test_significance.py's fake retrofits copy is the one retrofit writes."""
    from highrank.analysis.significance import read_eval

    results = json.loads((finished["frozen"] / "results.json").read_text())
    record = read_eval(finished["frozen"], "test", "auto")
    assert record["perplexity"] == results["trained"]["test"]["perplexity"]
    assert record["base_perplexity"] == results["base"]["test"]["perplexity"]
    assert record["source"].startswith("retrofit mos (frozen, seed ")
