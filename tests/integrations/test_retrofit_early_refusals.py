"""``highrank retrofit`` refuses early and loses nothing: an --out folder holding someone
else's files, a SIGTERM while the state is read, and the plan errors that once came only after
the long work (and left a plan.json that refused the corrected command)."""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="retrofit needs the hf extra")

from highrank.cli import main  # noqa: E402
from tests.analysis.test_hf_contexts import _tokenizer  # noqa: E402
from tests.integrations.test_retrofit_command import command, model_and_texts  # noqa: E402


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    return model_and_texts(tmp_path_factory.mktemp("refusals"))


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("highrank retrofit: error: ") and len(err.strip().splitlines()) == 1, err
    return err


def tree(folder) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None
            for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("restart", [False, True])
def test_a_folder_of_other_files_is_refused_and_kept(texts, tmp_path, capsys, restart):
    """--out a folder holding a model/ (e.g. the base model itself) and a results.json: the run
    replaced both, silently, status 0 (--restart deleted them first)."""
    import shutil

    model, files = texts
    out = tmp_path / "work"
    shutil.copytree(model, out / "model")
    (out / "results.json").write_text("my own results")
    before = tree(out)
    argv = command(out / "model", files, out, "--head", "mos", "--knob", "n_components=2")
    assert main(argv + (["--restart"] if restart else [])) == 2
    err = one_line(capsys)
    assert "holds results.json, model but no plan.json" in err, err
    assert tree(out) == before


@pytest.mark.parametrize("restart", [False, True])
def test_an_out_that_is_or_lies_under_a_file_is_one_line(texts, tmp_path, capsys, restart):
    model, files = texts
    (tmp_path / "file").write_text("x")
    extra = ["--restart"] if restart else []
    for out in (tmp_path / "file", tmp_path / "file" / "sub"):
        assert main(command(model, files, out, "--head", "mos", *extra)) == 2
        assert f"--out: {tmp_path / 'file'} is a file; expected a folder" in one_line(capsys)
    assert (tmp_path / "file").read_text() == "x"


def test_sigterm_while_the_state_is_read_stops_and_keeps_it(texts, tmp_path, capsys,
                                                           monkeypatch):
    """A SIGTERM while state.pt was read became "state.pt cannot be read ...; delete it to
    train again" (status 2): the library's catch-all for a damaged file took it."""
    model, files = texts
    out = tmp_path / "out"
    argv = command(model, files, out, "--head", "softmax", "--mode", "full")
    assert main(argv) == 0
    (out / "results.json").unlink()  # so that running again reads state.pt
    state = (out / "state.pt").read_bytes()
    real_load = torch.load

    def load(path, *args, **kwargs):
        if str(path).endswith("state.pt"):
            os.kill(os.getpid(), signal.SIGTERM)  # a scheduler stops the job meanwhile
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(torch, "load", load)
    capsys.readouterr()
    assert main(argv) == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert "stopped by SIGTERM" in err and "delete" not in err, err
    assert (out / "state.pt").read_bytes() == state


@pytest.mark.parametrize("mode", ["frozen", "full"])
def test_a_batch_beyond_the_training_text_is_refused_before_any_work(texts, tmp_path, capsys,
                                                                     mode):
    """It came after the feature caches were made (frozen) or the base model scored (full),
    with plan.json written: the corrected command was then refused as another plan."""
    model, files = texts
    out = tmp_path / "out"
    argv = command(model, files, out, "--head", "mos", "--mode", mode)
    argv[argv.index("--batch-tokens") + 1] = "100000"
    assert main(argv) == 2
    assert "--batch-tokens 100000 exceeds the" in one_line(capsys)
    assert not (out / "plan.json").exists() and not (out / "cache-train").exists()
    assert main(command(model, files, out, "--head", "mos", "--mode", mode)) == 0


def test_d_embed_with_the_base_init_is_one_line_before_any_work(texts, tmp_path, capsys):
    """attach_head's ValueError was a traceback after loading, with plan.json written."""
    model, files = texts
    out = tmp_path / "out"
    assert main(command(model, files, out, "--head", "mos", "--knob", "d_embed=8")) == 2
    assert "--knob d_embed=8: --init base starts the head at the model's lm_head" in one_line(
        capsys)
    assert not (out / "plan.json").exists()
    assert main(command(model, files, out, "--head", "mos", "--knob", "d_embed=8",
                        "--init", "paper")) == 0
    capsys.readouterr()
    # a dry run checks it too (it said the plan was fine)
    assert main(command(model, files, tmp_path / "dry", "--head", "mos", "--knob", "d_embed=8",
                        "--dry-run")) == 2
    one_line(capsys)


def test_lora_without_peft_is_one_line_before_loading(texts, tmp_path, capsys, monkeypatch):
    """It came after the model was loaded and the base model scored, with plan.json written:
    the same folder then refused --mode full as another plan."""
    model, files = texts
    out = tmp_path / "out"
    monkeypatch.setitem(sys.modules, "peft", None)  # not installed
    assert main(command(model, files, out, "--head", "mos", "--mode", "lora")) == 2
    assert "--mode lora needs the peft package" in one_line(capsys)
    assert not out.exists()
    assert main(command(model, files, out, "--head", "mos", "--mode", "full")) == 0


def test_lora_on_a_body_without_projections_is_one_line_before_any_work(texts, tmp_path,
                                                                        capsys):
    pytest.importorskip("peft", reason="--mode lora needs peft")
    _, files = texts
    torch.manual_seed(0)
    config = transformers.RwkvConfig(vocab_size=20, hidden_size=16, num_hidden_layers=2,
                                     attention_hidden_size=16, intermediate_size=32,
                                     context_length=64)
    rwkv = tmp_path / "rwkv"
    transformers.RwkvForCausalLM(config).save_pretrained(rwkv)
    _tokenizer().save_pretrained(rwkv)
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(command(rwkv, files, out, "--head", "mos", "--mode", "lora")) == 2
    err = one_line(capsys)
    assert "found no attention or MLP projection in the body (RwkvModel)" in err, err
    assert "--mode full or frozen" in err
    assert not (out / "plan.json").exists()


def test_a_model_that_has_a_highrank_head_is_one_line(texts, tmp_path, capsys):
    """A retrofit's own saved model as --hf: an AttributeError traceback (no lm_head)."""
    from highrank.integrations.hf import attach_head

    model, files = texts
    saved = tmp_path / "highrank-model"
    base = transformers.AutoModelForCausalLM.from_pretrained(model)
    attach_head(base, "mos", n_components=2).save_pretrained(saved)
    transformers.AutoTokenizer.from_pretrained(model).save_pretrained(saved)
    out = tmp_path / "out"
    capsys.readouterr()
    for extra in ([], ["--dry-run"]):
        assert main(command(saved, files, out, "--head", "mos", *extra)) == 2
        err = one_line(capsys)
        assert f"--hf {saved} already has the highrank head 'mos'" in err, err
        assert "give the base model it was made from" in err
    assert not (out / "plan.json").exists()
    assert json.loads((saved / "config.json").read_text())["head_name"] == "mos"
