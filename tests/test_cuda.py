"""highrank on a GPU: every head, training and resume, analysis and Hugging Face models on CUDA
agree with the CPU.

Skipped where torch sees no CUDA device (CI has none). ``HIGHRANK_TEST_DEVICE`` names another
device to check (``cuda:1``, ``mps``, or ``cpu`` to try these tests' logic on a machine without
a GPU). Recorded runs on a lent GPU: benchmarks/results/cuda-check/.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from highrank.heads import HEADS, base_init_knobs, build_head
from tests.conftest import SMALL_KNOBS, head_inputs

DEVICE = os.environ.get("HIGHRANK_TEST_DEVICE", "cuda")
if DEVICE.startswith("cuda") and not torch.cuda.is_available():
    pytest.skip("no CUDA device: torch.cuda.is_available() is False", allow_module_level=True)

HEAD_NAMES = list(HEADS)


def _on(device, *tensors):
    return [t.to(device) for t in tensors]


@pytest.mark.parametrize("name", HEAD_NAMES)
def test_every_head_computes_the_same_function_on_the_device_in_float64(make_head, name):
    """log_prob, loss and every gradient equal the CPU's to float64 rounding (chunked loss)."""
    cpu_head = make_head(name, vocab_size=300).double().eval()
    device_head = copy.deepcopy(cpu_head).to(DEVICE)
    hidden = 3 * torch.randn(4, 10, 12, dtype=torch.float64)
    target = torch.randint(0, 300, (4, 10))
    results = []
    for head, (h, t) in ((cpu_head, (hidden, target)), (device_head, _on(DEVICE, hidden, target))):
        h = h.clone().requires_grad_(True)
        inputs = head_inputs(head, h)  # MFS, CPR: layers and ids made from h, alike on both
        log_p = head.log_prob(h, **inputs)
        loss = head.loss(h, t, chunk_size=7, **inputs)
        loss.backward()
        grads = [p.grad.cpu() for p in head.parameters() if p.grad is not None]
        results.append((log_p.detach().cpu(), loss.detach().cpu(), h.grad.cpu(), grads))
    (lp_cpu, loss_cpu, gh_cpu, g_cpu), (lp_dev, loss_dev, gh_dev, g_dev) = results
    torch.testing.assert_close(lp_dev, lp_cpu, rtol=0, atol=1e-10)
    torch.testing.assert_close(loss_dev, loss_cpu, rtol=1e-12, atol=0)
    torch.testing.assert_close(gh_dev, gh_cpu, rtol=0, atol=1e-10)
    assert len(g_dev) == len(g_cpu) > 0
    for got, want in zip(g_dev, g_cpu, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", HEAD_NAMES)
def test_every_head_trains_on_the_device_in_float32_with_its_noise(make_head, name):
    head = make_head(name, vocab_size=300, stochastic=True).to(DEVICE).train()
    hidden = torch.randn(3, 8, 12, device=DEVICE)
    inputs = head_inputs(head, hidden)
    log_p = head.log_prob(hidden, **inputs)
    assert log_p.device.type == torch.device(DEVICE).type and log_p.dtype == torch.float32
    torch.testing.assert_close(
        log_p.logsumexp(-1), torch.zeros(3, 8, device=DEVICE), atol=1e-5, rtol=0
    )
    loss = head.loss(hidden, torch.randint(0, 300, (3, 8), device=DEVICE), **inputs)
    loss.backward()
    assert torch.isfinite(loss) and all(
        torch.isfinite(p.grad).all() for p in head.parameters() if p.grad is not None
    )


@pytest.mark.skipif(not DEVICE.startswith("cuda"), reason="bfloat16 autocast is checked on CUDA")
@pytest.mark.parametrize("name", HEAD_NAMES)
def test_under_bfloat16_autocast_every_head_returns_normalised_float32(make_head, name):
    head = make_head(name, vocab_size=300).to(DEVICE).eval()
    hidden = torch.randn(64, 12, device=DEVICE)
    inputs = head_inputs(head, hidden)
    exact = head.log_prob(hidden, **inputs)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        log_p = head.log_prob(hidden, **inputs)
        loss = head.loss(hidden, torch.randint(0, 300, (64,), device=DEVICE), **inputs)
    assert log_p.dtype == loss.dtype == torch.float32
    torch.testing.assert_close(
        log_p.logsumexp(-1), torch.zeros(64, device=DEVICE), atol=1e-5, rtol=0
    )
    # bfloat16 keeps 8 significant bits: log-probs of size ~6 move by a few hundredths at most
    assert (log_p - exact).abs().max().item() < 0.1


@pytest.mark.parametrize("name", [n for n in HEAD_NAMES if HEADS[n].BASE_INIT_KNOBS is not None])
def test_a_warm_started_head_equals_its_softmax_on_the_device(name):
    softmax = build_head("softmax", d_in=12, vocab_size=300)
    torch.nn.init.normal_(softmax.bias)
    head = build_head(name, d_in=12, vocab_size=300, **base_init_knobs(name, SMALL_KNOBS[name]))
    with torch.no_grad():
        head.weight.copy_(softmax.weight)
        head.bias.copy_(softmax.bias)
    head.start_at_base(softmax.projection)
    softmax, head = softmax.to(DEVICE), head.to(DEVICE)
    hidden = 3 * torch.randn(40, 12, device=DEVICE)
    torch.testing.assert_close(
        head.eval().log_prob(hidden, **head_inputs(head, hidden)), softmax.log_prob(hidden),
        atol=1e-5, rtol=0
    )


# ---- training runs ------------------------------------------------------------------------

AWD = ("train.epochs=2", "train.optimizer=et-asgd", "train.switch_epoch=1")
HEAD_OVERRIDES = {
    "softmax": [],
    "mos": ["head.name=mos", "head.n_components=2", "head.latent_dropout=0.2"],
    "mixtape": ["head.name=mixtape", "head.gate_dim=3", "head.gate_noise=0.1"],
}


def _deterministic():
    """CUDA kernels that add with atomics (embedding and index backward, some reductions) sum
    in a different order on each call; bit-identical comparisons ask torch for the others."""
    torch.use_deterministic_algorithms(True)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@pytest.fixture
def deterministic():
    _deterministic()
    yield
    torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("head", list(HEAD_OVERRIDES))
def test_an_awd_lstm_run_on_the_device_resumes_bit_identical(tmp_path, head, deterministic):
    from highrank.runs.checkpoint import load_checkpoint
    from highrank.train import resume, train
    from tests.conftest import write_train_corpus
    from tests.train.test_train import options, tiny_config, trajectory

    corpus = write_train_corpus(tmp_path / "corpus")
    overrides = (*AWD, f"run.device={DEVICE}", *HEAD_OVERRIDES[head])
    straight = train(tiny_config(corpus, tmp_path / "straight", *overrides), options=options())
    assert straight.stop_reason == "epochs"
    out = tmp_path / "interrupted"
    first = train(tiny_config(corpus, out, *overrides), options=options(max_steps=40))
    assert first.stop_reason == "max_steps"
    resume(out, options=options())
    assert trajectory(out) == trajectory(tmp_path / "straight")
    # a checkpoint written on the device loads on a machine without one
    payload = load_checkpoint(out / "checkpoints" / "best.pt")
    assert all(t.device.type == "cpu" for t in payload["model"].values())


def test_a_run_trained_on_the_device_evaluates_the_same_on_the_cpu(tmp_path):
    from highrank.evaluate import evaluate_perplexity
    from highrank.models import load_run_corpus
    from highrank.train import train
    from tests.conftest import write_train_corpus
    from tests.train.test_train import options, tiny_config

    corpus = write_train_corpus(tmp_path / "corpus")
    out = tmp_path / "run"
    train(tiny_config(corpus, out, "train.epochs=1", f"run.device={DEVICE}"), options=options())
    losses = {}
    for device in (DEVICE, "cpu"):
        model, _, words = load_run_corpus(out, device=device)
        result = evaluate_perplexity(model, words.test.to(device), batch_size=2, bptt=6)
        losses[device] = result.loss
    assert losses[DEVICE] == pytest.approx(losses["cpu"], rel=1e-5)


def test_a_transformer_run_trains_on_the_device(tmp_path):
    from highrank.config import load_config
    from highrank.train import train
    from tests.conftest import TINY_TRANSFORMER, write_train_corpus
    from tests.train.test_train import options

    corpus = write_train_corpus(tmp_path / "corpus")
    config = load_config(
        None,
        [f"data.dir={corpus}", f"run.out_dir={tmp_path / 'run'}", *TINY_TRANSFORMER,
         "train.epochs=2", f"run.device={DEVICE}", "head.name=mos", "head.n_components=2"],
    )  # fmt: skip
    result = train(config, options=options())
    assert result.stop_reason == "epochs" and result.best_val_loss < 10


# ---- analysis and Hugging Face models -------------------------------------------------------


def test_the_rank_of_a_run_is_the_same_on_the_device(tiny_run, tmp_path):
    import shutil

    from highrank.analysis.rank import analyze_run

    records = {}
    for i, device in enumerate(("cpu", DEVICE)):
        run = shutil.copytree(tiny_run, tmp_path / f"copy-{i}")
        backend = "torch" if device != "cpu" else "auto"
        records[device] = analyze_run(run, max_contexts=30, device=device, backend=backend)
    assert records[DEVICE]["press_rank"] == records["cpu"]["press_rank"]
    assert records[DEVICE]["s_max"] == pytest.approx(records["cpu"]["s_max"], rel=1e-5)


@pytest.mark.parametrize("head", ["softmax", "mos", "mixtape", "gss"])
def test_a_hugging_face_model_with_a_warm_head_generates_on_the_device(head):
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    from highrank.integrations.hf import attach_head
    from tests.integrations.conftest import VOCAB, tiny_llama

    base = tiny_llama().eval()
    model = attach_head(copy.deepcopy(base), head, **SMALL_KNOBS[head]).to(DEVICE).eval()
    base = base.to(DEVICE)
    ids = torch.randint(0, VOCAB, (2, 7), device=DEVICE)
    with torch.no_grad():
        expected = base(ids).logits.log_softmax(-1)
        got = model(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    mask = torch.ones_like(ids)
    greedy = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    base_greedy = base.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(greedy, base_greedy)  # warm start: the same distribution, the same text
    assert greedy.device.type == torch.device(DEVICE).type


@pytest.mark.parametrize("mode", ["frozen", "lora", "full"])
def test_a_retrofit_on_the_device_scores_as_on_the_cpu(tmp_path, mode):
    """``highrank retrofit --device``: caching, training and evaluation on the device give the
    CPU's perplexities (the same batches; float32 rounding apart), and the state resumes."""
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    if mode == "lora":
        pytest.importorskip("peft", reason="--mode lora needs peft")
    from highrank.integrations.retrofit_run import RetrofitPlan, retrofit
    from tests.analysis.test_hf_contexts import save_tiny_model, write_text

    model = save_tiny_model(tmp_path / "model")
    files = {split: str(write_text(tmp_path / f"{split}.txt", n_words=n, seed=i))
             for i, (split, n) in enumerate((("train", 200), ("valid", 60), ("test", 60)))}
    results = {}
    for where, device in (("here", "cpu"), ("there", DEVICE)):
        plan = RetrofitPlan(model=str(model), head="mos", knobs={"n_components": 2}, mode=mode,
                            out=str(tmp_path / f"out-{where}"), window=8, batch_tokens=16,
                            steps=6, warmup_steps=2, lr=1e-2, device=device, **files)
        results[device] = retrofit(plan, progress=False)
    for split in ("valid", "test"):
        for kind in ("base", "trained"):
            assert results[DEVICE][kind][split]["perplexity"] == pytest.approx(
                results["cpu"][kind][split]["perplexity"], rel=1e-3)
    assert results[DEVICE]["trained"]["valid"]["perplexity"] != pytest.approx(
        results[DEVICE]["base"]["valid"]["perplexity"], rel=1e-3)  # it trained
