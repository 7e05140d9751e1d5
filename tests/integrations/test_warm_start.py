"""attach_head(init="base"): a high-rank head that starts exactly at a pretrained model's
distribution and leaves the softmax bottleneck after one optimiser step (tiny random GPT-2
and Llama models built from configs)."""

from __future__ import annotations

import pytest
import torch

from highrank.analysis.rank import press_rank
from highrank.heads import HEADS
from tests.conftest import SMALL_KNOBS
from tests.integrations.conftest import BASES, HIDDEN, VOCAB

CAN_START = [name for name in HEADS if HEADS[name].BASE_INIT_KNOBS is not None]


def base_log_probs(base, ids):
    with torch.no_grad():
        return torch.log_softmax(base(ids).logits.float(), dim=-1)


@pytest.mark.parametrize("name", CAN_START)
@pytest.mark.parametrize("base_name", sorted(BASES))
def test_the_attached_head_starts_at_the_base_models_distribution(base_name, name):
    from highrank.integrations.hf import attach_head

    base = BASES[base_name]().eval()
    ids = torch.randint(0, VOCAB, (3, 12))
    expected = base_log_probs(base, ids)
    model = attach_head(base, name, **SMALL_KNOBS[name]).eval()  # init="base" is the default
    with torch.no_grad():
        got = model(ids).logits
    assert (got - expected).abs().max() <= 1e-5


def test_sigsoftmax_is_refused_in_one_line_and_attaches_with_the_paper_init():
    from highrank.integrations.hf import attach_head

    with pytest.raises(ValueError, match=r"cannot start at the base model: .*init='paper'"):
        attach_head(BASES["gpt2"](), "sigsoftmax")
    assert attach_head(BASES["gpt2"](), "sigsoftmax", init="paper").config.head_name == (
        "sigsoftmax"
    )
    with pytest.raises(ValueError, match=r"init must be one of 'paper', 'base'; got 'zero'"):
        attach_head(BASES["gpt2"](), "mos", init="zero")


def log_prob_matrix(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.reshape(-1, VOCAB)


@pytest.mark.parametrize("name", ["mos", "moc", "mixtape", "gss", "plif"])
def test_one_step_leaves_the_softmax_bottleneck(name):
    """The base's log-prob matrix has rank <= d + 1 (no lm_head bias); after one Adam step of
    the head on a batch, the mixtures and the learned pointwise functions exceed it (MoC, a
    mixture of contexts inside one softmax, must not)."""
    from highrank.integrations.hf import attach_head

    torch.manual_seed(0)
    base = BASES["llama"]().eval()
    with torch.no_grad():  # logits of a trained model's size (a random init's are ~0.1)
        base.lm_head.weight.mul_(50.0)
    ids = torch.randint(0, VOCAB, (4, 40))  # 160 contexts > d + 1 = 33
    assert press_rank(base_log_probs(base, ids).reshape(-1, VOCAB)) <= HIDDEN + 1
    model = attach_head(base, name, **SMALL_KNOBS[name])
    for parameter in model.model.parameters():
        parameter.requires_grad_(False)
    optimizer = torch.optim.Adam([p for p in model.head.parameters() if p.requires_grad], 1e-2)
    model.train()
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    rank = press_rank(log_prob_matrix(model.eval(), ids))
    if name == "moc":
        assert rank <= HIDDEN + 2
    else:
        assert rank > HIDDEN + 1, f"{name}: rank {rank} after one step"


def test_a_warm_model_saves_and_reloads(tmp_path):
    from transformers import AutoModelForCausalLM

    from highrank.integrations.hf import attach_head

    base = BASES["gpt2"]().eval()
    ids = torch.randint(0, VOCAB, (2, 10))
    model = attach_head(base, "mixtape", **SMALL_KNOBS["mixtape"]).eval()
    model.save_pretrained(tmp_path / "m")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert again.config.head_knobs["residual_contexts"] is True
    torch.testing.assert_close(log_prob_matrix(again, ids), log_prob_matrix(model, ids))
    torch.testing.assert_close(log_prob_matrix(again, ids), base_log_probs(base, ids).reshape(
        -1, VOCAB), atol=1e-5, rtol=0)


def test_a_saved_model_naming_an_unknown_head_is_one_clear_error(tmp_path):
    """Issue: from_pretrained raised a bare KeyError."""
    import json

    from transformers import AutoModelForCausalLM

    from highrank.integrations.hf import attach_head

    attach_head(BASES["gpt2"](), "softmax").save_pretrained(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "head_name": "nope"}))
    with pytest.raises(ValueError, match=r"names the head 'nope', which this highrank does not"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "m")


@pytest.mark.parametrize("base_name", sorted(BASES))
def test_the_config_states_the_base_models_context_length(base_name, tmp_path):
    """Issue 21: tools (lm-eval's HFLM) read max_position_embeddings / n_positions from
    model.config; they lived only inside base_config."""
    from transformers import AutoModelForCausalLM

    from highrank.integrations.hf import attach_head

    model = attach_head(BASES[base_name](), "mos", n_components=2)
    assert model.config.max_position_embeddings == 64
    model.save_pretrained(tmp_path / "m")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert again.config.max_position_embeddings == 64


def test_analyze_hf_reads_a_saved_highrank_model(tmp_path, capsys):
    """Issue 21: `highrank analyze rank --hf FOLDER` of an attach_head(...).save_pretrained
    folder said Transformers does not recognise the model type `highrank`."""
    import subprocess
    import sys

    from tests.analysis.test_hf_contexts import save_tiny_model, write_text

    base = save_tiny_model(tmp_path / "base")
    folder = tmp_path / "mos"
    script = (  # a fresh process: nothing of highrank.integrations imported beforehand
        "import sys; from transformers import AutoModelForCausalLM, AutoTokenizer;"
        "from highrank.integrations.hf import attach_head;"
        f"m = attach_head(AutoModelForCausalLM.from_pretrained({str(base)!r}), 'mos', "
        f"n_components=2); m.save_pretrained({str(folder)!r});"
        f"AutoTokenizer.from_pretrained({str(base)!r}).save_pretrained({str(folder)!r})"
    )
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True)
    text = write_text(tmp_path / "t.txt", n_words=200)
    probe = (
        "import sys; from highrank.cli import main; sys.exit(main(['analyze', 'rank', '--hf', "
        f"{str(folder)!r}, '--text', {str(text)!r}, '--out', {str(tmp_path / 'out')!r}, "
        "'--window', '16']))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-500:]
