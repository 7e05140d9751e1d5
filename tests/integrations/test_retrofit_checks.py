"""``highrank retrofit`` checks before work (campaign, issue 29 item 4): what needs no model
before it is loaded (an empty text, a bad knob), the head sized before it is built (a huge
knob), a model folder without a tokenizer, a tokenizer that gives ids the model does not
have, and ``results.json`` saying what ran (a warm-up longer than the steps)."""

from __future__ import annotations

import json
import re

import pytest

transformers = pytest.importorskip("transformers", reason="retrofit needs the hf extra")

from highrank.cli import main  # noqa: E402
from tests.analysis.test_hf_contexts import (  # noqa: E402
    SPECIALS,
    WORDS,
    save_tiny_model,
)
from tests.integrations.test_retrofit_command import command, model_and_texts  # noqa: E402
from tests.integrations.test_retrofit_nonfinite import one_line  # noqa: E402

ERROR = "highrank retrofit: error: "


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    root = tmp_path_factory.mktemp("checks")
    (root / "empty.txt").write_text("")
    return model_and_texts(root)


def with_option(argv, option, value):
    if option in argv:
        argv[argv.index(option) + 1] = value
        return argv
    return [*argv, option, value]


@pytest.fixture
def no_model_loading(monkeypatch):
    import highrank.causal_lm as causal_lm  # where the retrofit loads a model from

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before a check that needs none")

    monkeypatch.setattr(causal_lm, "load_causal_lm", no_loading)


@pytest.mark.parametrize(("option", "value", "message"), [
    ("--train", "{empty}", r"--train: text file .*empty.txt is empty"),
    ("--valid", "{empty}", r"--valid: text file .*empty.txt is empty"),
    ("--test", "/no/such.txt", r"--test: text file /no/such.txt does not exist"),
    ("--train", "{folder}", r"--train: text file .* is a folder"),
    ("--knob", "n_components=0", r"--head mos: n_components must be a positive integer"),
    ("--knob", "colour=2", r"--head mos: head 'mos' has no knob\(s\) colour"),
    ("--knob", "time_dim=0", r"--head mos: time_dim is set by attach_head .*; valid knobs of "
                             r"'mos': (?!.*time_dim)"),
    ("--head", "sigsoftmax", r"cannot start at the base model"),
    ("--hf", "/no/such/model", r"model /no/such/model does not exist"),
])
def test_what_needs_no_model_is_checked_before_loading_it(
    texts, tmp_path, capsys, no_model_loading, option, value, message
):
    """Campaign: an empty --train or n_components=0 was refused only after loading the model
    (4-5 minutes for SmolLM2 on a loaded machine)."""
    model, files = texts
    out = tmp_path / "out"
    argv = command(model, files, out, "--head", "mos")
    value = value.format(empty=model.parent / "empty.txt", folder=tmp_path)
    argv = with_option(argv, option, value)
    assert main(argv) == 2
    line = one_line(capsys.readouterr().err, ERROR)
    assert re.search(message, line), line
    assert not out.exists()  # nothing written


@pytest.mark.parametrize("mode", ["frozen", "lora"])
def test_more_layers_than_the_model_gives_is_refused_before_caching(texts, tmp_path, capsys, mode):
    """A new user's walk: CPR's default 3 layers on a 1-block model failed inside the cache
    (a traceback, a partial cache left behind) or, with LoRA, named PEFT's wrapper."""
    model, files = texts
    blocks = transformers.AutoConfig.from_pretrained(model).num_hidden_layers
    out = tmp_path / "out"
    argv = command(model, files, out, "--head", "cpr", "--mode", mode,
                   "--knob", f"input_layers={blocks + 2}")
    assert main(argv) == 2
    line = one_line(capsys.readouterr().err, ERROR)
    assert line.endswith(f"--head cpr: SoftmaxCPR reads the last {blocks + 2} layers but this "
                         f"model gives {blocks + 1} (its embeddings' output and each of its "
                         f"{blocks} blocks'): --knob input_layers={blocks + 1} or fewer"), line
    assert not (out / "cache-train").exists()


@pytest.mark.parametrize(("text", "value"), [
    ("pointer=true", True), ("pointer=True", True), ("pointer=False", False),
    ("d_embed=None", None), ("d_embed=null", None), ("n_components=2", 2), ("name=mos", "mos"),
])
def test_a_knob_reads_json_and_the_python_spellings_the_knob_lists_show(text, value):
    from highrank.cli.retrofit import knob

    assert knob(text) == (text.partition("=")[0], value)


def test_a_huge_knob_is_sized_not_built(texts, tmp_path, capsys, monkeypatch):
    """Campaign: --knob n_components=1000000000 tried to allocate 128 GB before the memory
    check; the head is counted on the meta device, and the check refuses it."""
    import torch

    model, files = texts
    built = []
    real_empty = torch.empty

    def watched_empty(*args, **kwargs):  # nn.Linear's parameters: refused, not allocated
        size = args[0] if len(args) == 1 and not isinstance(args[0], int) else args
        device = torch.device(kwargs.get("device") or torch.get_default_device())
        if device.type != "meta" and torch.Size(size).numel() > 10**9:
            built.append(torch.Size(size).numel())
            raise AssertionError("a head of 1e9 components was built, not sized")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", watched_empty)
    out = tmp_path / "out"
    argv = command(model, files, out, "--head", "mos", "--knob", "n_components=1000000000")
    assert main(argv) == 2
    line = one_line(capsys.readouterr().err, ERROR)
    assert re.search(r"this plan needs about [\d.]+ GiB of memory but [\d.]+ GiB are available; "
                     r"lower --batch-tokens, or a smaller head$", line), line
    assert built == []
    assert not (out / "cache-train").exists()


def save_without_tokenizer(folder):
    torch = pytest.importorskip("torch")
    from tests.analysis.test_hf_contexts import _config

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(_config("gpt2", 0)).save_pretrained(folder)
    return folder


def test_a_model_folder_without_a_tokenizer_is_named(texts, tmp_path, capsys):
    """Campaign: a GPT-2 folder without tokenizer files loaded an empty GPT2Tokenizer, and
    the text was blamed ("holds 0 tokens")."""
    _, files = texts
    folder = save_without_tokenizer(tmp_path / "no-tokenizer")
    out = tmp_path / "out"
    assert main(command(folder, files, out, "--head", "mos")) == 2
    line = one_line(capsys.readouterr().err, ERROR)
    assert f"{folder} holds no tokenizer" in line and "tokenizer.save_pretrained" in line, line
    assert "0 tokens" not in line
    assert not out.exists()


def save_with_a_duplicated_unk(folder):
    """The tiny model (20 ids) beside a word-level tokenizer of 21: ``<unk>`` a word of its
    own beside ``[UNK]`` (PTB's texts hold ``<unk>``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    save_tiny_model(folder)
    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS + ["<unk>"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]",
                                        bos_token="<s>")
    tokenizer.save_pretrained(folder)
    return folder


def test_a_tokenizer_id_beyond_the_vocabulary_is_one_line(texts, tmp_path, capsys):
    """Campaign: an IndexError traceback from the embedding; now the id and the size."""
    _, files = texts
    folder = save_with_a_duplicated_unk(tmp_path / "model")
    train = tmp_path / "train.txt"
    train.write_text(files["train"].read_text().replace("cat", "<unk>"))
    out = tmp_path / "out"
    for mode in ("frozen", "full"):
        assert main(command(folder, {**files, "train": train}, out, "--head", "mos", "--mode",
                            mode)) == 2
        line = one_line(capsys.readouterr().err, ERROR)
        assert (f"the tokenizer of {folder} gives the id 20 in --train {train}, but the model "
                "has 20 token ids (0..19)") in line, line
        assert not out.exists()


def test_results_record_the_warm_up_that_ran(texts, tmp_path, capsys):
    """Campaign: results.json said warm-up 20 in the plan and 4 in the budget, unexplained."""
    model, files = texts
    out = tmp_path / "out"
    argv = with_option(command(model, files, out, "--head", "softmax"), "--warmup-steps", "20")
    assert main(argv) == 0
    assert "note: --warmup-steps 20 exceeds the 6 steps: the warm-up took all 6" in (
        capsys.readouterr().out)
    results = json.loads((out / "results.json").read_text())
    assert results["plan"]["warmup_steps"] == 20  # the plan as given
    assert results["effective"]["warmup_steps"] == 6 and results["effective"]["steps"] == 6
    assert results["effective"]["notes"] == [
        "--warmup-steps 20 exceeds the 6 steps: the warm-up took all 6"]


@pytest.mark.parametrize(("mode", "batch_tokens", "windows"), [("lora", "20", 2), ("full", "5", 1)])
def test_results_say_the_whole_windows_a_step_trained_on(texts, tmp_path, capsys, mode,
                                                         batch_tokens, windows):
    """A new user's walk: a step over whole windows recorded --batch-tokens 20 as
    batch_tokens 2 (windows) and rounded it silently."""
    model, files = texts
    out = tmp_path / "out"
    argv = with_option(command(model, files, out, "--head", "softmax", "--mode", mode),
                       "--batch-tokens", batch_tokens)
    assert main(argv) == 0
    note = (f"--batch-tokens {batch_tokens} is not a whole number of --window 8 windows: each "
            f"step trains on {windows} whole window{'s' * (windows > 1)} ({8 * windows} tokens)")
    assert f"note: {note}" in capsys.readouterr().out
    effective = json.loads((out / "results.json").read_text())["effective"]
    assert effective["windows_per_step"] == windows
    assert effective["tokens_per_step"] == 8 * windows and effective["notes"] == [note]


def test_results_say_how_many_steps_one_pass_took(texts, tmp_path):
    model, files = texts
    out = tmp_path / "out"
    argv = command(model, files, out, "--head", "softmax", "--mode", "full")
    del argv[argv.index("--steps"):argv.index("--steps") + 2]
    assert main(argv) == 0
    effective = json.loads((out / "results.json").read_text())["effective"]
    assert effective["notes"][0] == (
        f"--steps not given: one pass over the training text, {effective['steps']} steps")
    assert effective["warmup_steps"] == min(2, effective["steps"])


@pytest.mark.parametrize(("d_embed", "tied"), [("None", True), ("8", False)])
def test_full_mode_on_a_tied_model_unties_only_for_another_output_width(
    texts, tmp_path, d_embed, tied
):
    """``--knob d_embed=None`` is the model's width: the head stays tied to the embedding (in
    full mode; LoRA trains a copy of a tied head, saved untied: test_hf_tie.py); another width
    cannot be tied, so the head gets its own (attach_head refuses a tie)."""
    _, files = texts
    model = save_tiny_model(tmp_path / "gpt2", "gpt2")  # GPT-2 ties lm_head to its embedding
    out = tmp_path / "out"
    assert main(command(model, files, out, "--head", "mos", "--knob", "n_components=2",
                        "--knob", f"d_embed={d_embed}", "--init", "paper",
                        "--mode", "full")) == 0
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied


def test_a_window_beyond_the_model_s_positions_is_refused_before_the_texts_are_read(
    texts, tmp_path, capsys, monkeypatch
):
    """A new user's walk: retrofit's default --window 256 on a 128-position model was refused
    only after all three texts were tokenised."""
    import highrank.integrations.retrofit.run as run

    model, files = texts
    positions = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    monkeypatch.setattr(run, "_token_ids", lambda *a, **k: pytest.fail("the texts were read"))
    argv = command(model, files, tmp_path / "out", "--head", "mos")
    assert main(with_option(argv, "--window", str(positions + 1))) == 2
    line = one_line(capsys.readouterr().err, ERROR)
    assert line.endswith(f"--window {positions + 1} exceeds the model's {positions} positions: "
                         f"give --window {positions} or less"), line


def test_the_tokens_after_the_last_whole_window_are_said_to_be_unread(texts, tmp_path, capsys):
    """A new user's walk: 889 valid tokens were scored as 768, and nothing said why."""
    from highrank.analysis.hf_contexts import text_token_ids

    model, files = texts
    out = tmp_path / "out"
    assert main(command(model, files, out, "--head", "softmax")) == 0
    printed = capsys.readouterr().out
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    unread = json.loads((out / "results.json").read_text())["effective"]["unread_tokens"]
    for split, path in files.items():
        n = len(text_token_ids(tokenizer, path))
        left = (n - 1) % 8  # command()'s --window 8
        assert unread.get(split, 0) == left
        if left:
            assert (f"note: --{split}: the last {left} of its {n:,} tokens fill no window of 8 "
                    "and are not read") in printed
    assert unread  # these texts leave some


def test_a_dry_run_checks_counts_and_writes_nothing(texts, tmp_path, capsys):
    """A new user's walk: finding the control's width took a whole retrofit per guess (the
    parameter count was in results.json only)."""
    model, files = texts
    out = tmp_path / "out"
    argv = command(model, files, out, "--head", "mos", "--knob", "n_components=2")
    assert main([*argv, "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert not out.exists()  # nothing written, not even the folder
    config = json.loads((model / "config.json").read_text())
    decoder = config["vocab_size"] * (config["hidden_size"] + 1)  # E and b
    found = re.search(r"dry run: checked, nothing trained or written\. --head mos: ([\d,]+) new "
                      rf"parameters beside the decoder E, b \({decoder:,}\); ([\d,]+) in all",
                      printed)
    assert found, printed
    new, total = (int(group.replace(",", "")) for group in found.groups())
    assert new + decoder == total and new > 0
    assert "6 steps (frozen mode), warm-up 2" in printed
    assert main([*argv, "--knob", "n_components=0", "--dry-run"]) == 2  # the checks ran
    (tmp_path / "file").write_text("")
    assert main([*with_option(list(argv), "--out", str(tmp_path / "file")), "--dry-run"]) == 2
    assert main(argv) == 0  # the real run trains the head counted
    results = json.loads((out / "results.json").read_text())
    assert results["training"]["trainable_parameters"] == total
