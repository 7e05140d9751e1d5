"""``highrank retrofit``: a warm-started high-rank head on a user's own causal LM, one command.

    highrank retrofit --hf MODEL --head mos --train FILE --valid FILE [--test FILE] --out DIR
        [--mode frozen|lora|full] [--knob n_components=2] ...

Three modes, one budget (Adam, linear warm-up then cosine decay, gradient-norm clip 1):

* ``frozen``: the body is frozen; its final hidden states are cached once
  (:func:`highrank.integrations.retrofit.cache_hidden_states`, ``OUT/cache-<split>``) and only
  the head is trained on them. The cheapest protocol: every head sees the same features.
* ``lora``: PEFT LoRA adapters on the body's attention and MLP projections, plus the whole
  head, trained on the text's windows end to end; merged into the body when saved.
* ``full``: every parameter, at a small learning rate: the protocol of Softmax-CPR (Chang &
  McCallum; iesl/Softmax-CPR fine-tunes the whole GPT-2, lr 1e-5).

The head starts at the base model's distribution (``attach_head(init="base")``), untied from
the input embedding in frozen mode (the body must keep reading the embedding it was cached
with). Before any long work the inputs are checked (the model loads, the head and knobs
exist and are in range, each text holds at least one window, memory and disk suffice) and a
bad one is one line. Then: valid/test perplexity of the base model and of the trained one on
the model's own tokens (``results.json``), and ``OUT/model``, a ``HighrankForCausalLM`` with its
tokenizer that ``AutoModelForCausalLM.from_pretrained`` reloads (after ``import
highrank.integrations.hf``) and ``generate()`` uses.

``device`` (``--device``; ``auto``: CUDA when available) runs the body and the head there
(caching, training, evaluation); caches and states are stored on the CPU side, so a run may
resume on another device.

Resumable: the plan is kept in ``OUT/plan.json`` (a rerun with another plan is refused;
the device and the folder's place may change),
caches continue from their last batch of windows, training from its last checkpoint
(``OUT/state.pt``, weights-only), and finished steps are skipped; a finished run is reported at
once, without loading the model.

Nothing non-finite is saved: both training loops skip a step whose loss or gradient norm is not
finite and stop after :data:`~highrank.integrations.retrofit.MAX_NONFINITE_STEPS` in a row
(the last finite state kept); a trained model whose weights or valid/test perplexity are not
finite is not saved, nor its results. Either stop is recorded in ``plan.json`` (``stopped``):
the same command with another ``--lr`` then continues, and ``--restart`` trains again from the
warm start with the caches kept. What a rerun loads is checked (a NaN cached row or saved
weight is one line).
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from highrank.heads import HEADS, base_init_knobs, build_head, check_init
from highrank.integrations.retrofit import (
    RESTART_ADVICE,
    NonFiniteSteps,
    TrainBudget,
    all_finite_parameters,
    batch_indices,
    cache_hidden_states,
    check_finite_tensors,
    check_saved_budget,
    evaluate_head,
    finite_perplexity,
    load_cache,
    step_record,
    train_head,
    training_summary,
    window_tokens,
)
from highrank.runs.locks import run_lock
from highrank.train.state import TrainingError

MODES = ("frozen", "lora", "full")
DEFAULT_LR = {"frozen": 3e-4, "lora": 2e-4, "full": 1e-5}
# The body's projections that LoRA adapts, by the names transformers' architectures use.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                "c_attn", "c_proj", "c_fc", "query_key_value", "dense", "fc1", "fc2", "Wqkv")


class RetrofitError(ValueError):
    """Input that the retrofit cannot use: one line naming it and what was expected."""


@dataclass(frozen=True)
class RetrofitPlan:
    """Everything a retrofit run depends on (kept in ``OUT/plan.json``)."""

    model: str
    head: str
    train: str
    valid: str
    out: str
    test: str | None = None
    mode: str = "frozen"
    knobs: dict = field(default_factory=dict)
    init: str = "base"
    window: int = 256
    max_train_tokens: int | None = None
    max_eval_tokens: int | None = None
    steps: int | None = None  # None: one pass over the training windows
    batch_tokens: int = 512
    lr: float | None = None  # None: DEFAULT_LR[mode]
    warmup_steps: int = 20
    seed: int = 0
    lora_rank: int = 8
    cache_dtype: str = "float32"
    device: str = "auto"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise RetrofitError(f"--mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        if self.head not in HEADS:
            raise RetrofitError(f"unknown head {self.head!r}; choose one of: {', '.join(HEADS)}")
        check_init(self.init)
        for name in ("window", "batch_tokens", "lora_rank"):
            _positive(name, getattr(self, name))
        for name in ("max_train_tokens", "max_eval_tokens", "steps"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        # here, before the folder and its caches are written (the optimizer checked it later)
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise RetrofitError(f"--lr must be a positive finite number; got {self.lr!r}")
        _resolve_device(self.device)

    @property
    def learning_rate(self) -> float:
        return DEFAULT_LR[self.mode] if self.lr is None else self.lr


def _resolve_device(name: str) -> torch.device:
    from highrank.config import ConfigError
    from highrank.train.startup import resolve_device

    try:
        return resolve_device(name)
    except ConfigError as error:
        message = str(error).replace("--run.device", "--device").replace("run.device", "--device")
        raise RetrofitError(message) from None
    except RuntimeError:  # torch.device("toaster")
        raise RetrofitError(f"--device {name!r} is not a device: give auto, cpu, cuda or "
                            "cuda:N") from None


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise RetrofitError(f"--{name.replace('_', '-')} must be a positive integer; got {value!r}")


# ---- the whole run ---------------------------------------------------------------------------


def retrofit(plan: RetrofitPlan, *, progress: bool = True, restart: bool = False) -> dict:
    """Check, (cache,) train, evaluate and save: ``results.json``'s contents. One process at
    a time writes ``plan.out``: a second is refused naming the first (they raced before).

    A finished run is reported at once. ``restart`` trains again from the warm start with this
    plan (its settings may differ), keeping the feature caches, which check their own settings.
    """
    out = Path(plan.out)
    say = print if progress else (lambda *a, **k: None)
    if not restart:
        _check_out(out, plan)
        finished = _finished_results(out)
        if finished is not None:
            say(f"{out} holds a finished retrofit ({out / 'model'}); nothing to do", flush=True)
            return finished
    with run_lock(out):
        if restart:
            _forget_training(out)
        return _retrofit(plan, out, progress, say)


def _finished_results(out: Path) -> dict | None:
    """``results.json`` of a finished run (written last, after the model), else None."""
    results = out / "results.json"
    if not (results.is_file() and (out / "model").is_dir()):
        return None
    try:
        return json.loads(results.read_text())
    except (OSError, ValueError):
        return None  # damaged: the run's saved state decides what happens


def _forget_training(out: Path) -> None:
    """What ``--restart`` discards: the training state and what was made from it."""
    for name in ("results.json", "history.json", "state.pt"):
        (out / name).unlink(missing_ok=True)
    shutil.rmtree(out / "model", ignore_errors=True)


def _retrofit(plan: RetrofitPlan, out: Path, progress: bool, say) -> dict:
    say(f"loading {plan.model}", flush=True)  # a GGUF file takes minutes to dequantise
    model, tokenizer = _load(plan)
    device = _resolve_device(plan.device)
    if device.type != "cpu":
        say(f"running on {device}", flush=True)
    model.to(device)
    ids = {}
    for split in _splits(plan):
        say(f"tokenising --{split} {getattr(plan, split)}", flush=True)
        ids[split] = _token_ids(plan, tokenizer, split)
    _check_plan_fits(plan, model, ids)
    out.mkdir(parents=True, exist_ok=True)
    stopped = _stopped(out)  # kept until the run finishes: lr may differ from the state's
    _write_json(out / "plan.json", {**asdict(plan), **stopped})
    run = _run_frozen if plan.mode == "frozen" else _run_end_to_end
    hf_model, summary, scores, base_scores = run(plan, model, ids, out, progress, bool(stopped))
    _refuse_non_finite(out, plan, hf_model, scores, summary)
    results = {"plan": asdict(plan), "base": base_scores, "trained": scores,
               "training": {k: v for k, v in summary.items() if k != "history"}}
    _save_model(hf_model, tokenizer, out / "model", plan)
    _write_json(out / "plan.json", asdict(plan))
    _write_json(out / "results.json", results)
    _write_json(out / "history.json", {"history": summary["history"]})
    for split in ("valid", "test"):
        if split in scores:
            say(f"{split} perplexity: base {base_scores[split]['perplexity']:.3f}, "
                f"{plan.head} {scores[split]['perplexity']:.3f}", flush=True)
    say(f"saved {out / 'model'} (reload with AutoModelForCausalLM after "
        "import highrank.integrations.hf)", flush=True)
    return results


def _stopped(out: Path) -> dict:
    """``{"stopped": ...}`` when the non-finite guard stopped this run (plan.json says so)."""
    try:
        old = json.loads((out / "plan.json").read_text())
    except (OSError, ValueError):
        return {}
    return {"stopped": old["stopped"]} if isinstance(old, dict) and "stopped" in old else {}


def _mark_stopped(out: Path, error: TrainingError) -> None:
    plan = json.loads((out / "plan.json").read_text())
    _write_json(out / "plan.json", {**plan, "stopped": str(error)})


def _refuse_non_finite(out: Path, plan: RetrofitPlan, hf_model, scores: dict,
                       summary: dict) -> None:
    """Nothing non-finite is saved as a model or a result: a diverged run stops here, in one
    line, with what to change (its finite losses reached 1e20 before the scores overflowed)."""
    bad = [f"{split} perplexity {score['perplexity']}" for split, score in scores.items()
           if not math.isfinite(score["perplexity"])]
    if not all_finite_parameters(hf_model):
        bad.append("non-finite weights")
    if not bad:
        return
    losses = [h["loss"] for h in summary["history"] if h["loss"] is not None]
    last = f"; the last training loss was {losses[-1]:.3g}" if losses else ""
    error = TrainingError(
        f"the trained model has {', '.join(bad)}: training diverged{last}. No model and no "
        f"results were saved. {RESTART_ADVICE.format(lr=plan.learning_rate)}"
        .replace("run the same command again to continue, or add --restart to train again",
                 "add --restart to train again")
    )
    _mark_stopped(out, error)
    raise error


def _splits(plan: RetrofitPlan) -> list[str]:
    return ["train", "valid"] + (["test"] if plan.test else [])


# ---- checks before any long work ---------------------------------------------------------------


def _check_out(out: Path, plan: RetrofitPlan) -> None:
    if out.exists() and not out.is_dir():
        raise RetrofitError(f"--out {out} is a file; expected a folder (new or of this run)")
    saved = out / "plan.json"
    if saved.exists():
        old = json.loads(saved.read_text())
        may_change = _MAY_CHANGE + (("lr",) if "stopped" in old else ())
        changed = sorted(k for k, v in asdict(plan).items()
                         if k not in may_change and old.get(k) != v)
        if changed:
            raise RetrofitError(
                f"{out} holds a retrofit with other settings ({', '.join(changed)}); give "
                "another --out, add --restart to train again with these (the caches are "
                "kept), or delete it"
            )


# A run may resume on another device, and from a folder that was moved or copied; after the
# non-finite guard stopped it, with another --lr.
_MAY_CHANGE = ("device", "out")


def _load(plan: RetrofitPlan):
    from highrank.analysis.hf_contexts import HFInputError, load_causal_lm

    try:
        return load_causal_lm(plan.model, progress=False)
    except HFInputError as error:
        raise RetrofitError(str(error)) from None


def _token_ids(plan: RetrofitPlan, tokenizer, split: str) -> torch.Tensor:
    from highrank.analysis.hf_contexts import HFInputError, text_token_ids

    try:
        ids = text_token_ids(tokenizer, getattr(plan, split))
    except HFInputError as error:
        raise RetrofitError(f"--{split}: {error}") from None
    limit = plan.max_train_tokens if split == "train" else plan.max_eval_tokens
    ids = ids if limit is None else ids[: limit + 1]
    if ids.numel() < plan.window + 1:
        raise RetrofitError(
            f"--{split} {getattr(plan, split)} holds {ids.numel()} tokens, fewer than one window "
            f"of {plan.window} plus its next token; give a longer text or a smaller --window"
        )
    return ids


def _check_plan_fits(plan: RetrofitPlan, model, ids: dict) -> None:
    """Head and knobs valid, window within the model's positions, memory and disk enough."""
    from highrank.analysis.hf_contexts import max_positions

    lm_head = model.get_output_embeddings()
    vocab, width = lm_head.weight.shape
    knobs = _head_knobs(plan)
    try:
        probe = build_head(plan.head, d_in=width, vocab_size=vocab, **knobs)
    except (TypeError, ValueError) as error:
        raise RetrofitError(f"--head {plan.head}: {error}") from None
    positions = max_positions(model)
    if positions is not None and plan.window > positions:
        raise RetrofitError(f"--window {plan.window} exceeds the model's {positions} positions")
    head_bytes = sum(p.numel() for p in probe.parameters()) * 4 * 4  # weights, grads, Adam
    del probe
    need = head_bytes + _activation_bytes(plan, vocab)
    if plan.mode == "frozen":
        cache_bytes = sum(t.numel() for t in ids.values()) * width * _dtype_bytes(plan)
        free_disk = shutil.disk_usage(_existing_parent(Path(plan.out))).free
        if cache_bytes > free_disk:
            raise RetrofitError(
                f"the feature caches need {cache_bytes / 2**30:.1f} GiB but "
                f"{_existing_parent(Path(plan.out))} has {free_disk / 2**30:.1f} GiB free; "
                "free space, lower --max-train-tokens or use --cache-dtype bfloat16"
            )
    else:
        need += sum(p.numel() for p in model.parameters()) * 4 * (4 if plan.mode == "full" else 1)
    available = _available_memory(_resolve_device(plan.device))
    if available is not None and need > available:
        raise RetrofitError(
            f"this plan needs about {need / 2**30:.1f} GiB of memory but {available / 2**30:.1f}"
            " GiB are available; lower --batch-tokens, use --mode frozen, or a smaller head"
        )


def _activation_bytes(plan: RetrofitPlan, vocab: int) -> int:
    """The (tokens x components x V) logits of one batch, with their gradients, in float32."""
    components = int(plan.knobs.get("n_components", 4 if plan.head == "mixtape" else 1))
    return plan.batch_tokens * components * vocab * 4 * 3


def _dtype_bytes(plan: RetrofitPlan) -> int:
    return 2 if plan.cache_dtype == "bfloat16" else 4


def _existing_parent(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def _available_memory(device: torch.device) -> int | None:
    from highrank.analysis.rank import available_memory_bytes

    return available_memory_bytes(device)


def _head_knobs(plan: RetrofitPlan) -> dict:
    try:
        return base_init_knobs(plan.head, plan.knobs) if plan.init == "base" else plan.knobs
    except ValueError as error:
        raise RetrofitError(str(error)) from None


# ---- frozen: cached features, the head alone ----------------------------------------------------


def _run_frozen(plan, model, ids, out: Path, progress: bool, lr_may_change: bool):
    from highrank.integrations.hf import attach_head

    caches = {
        split: cache_hidden_states(model, ids[split], out / f"cache-{split}", window=plan.window,
                                   dtype=plan.cache_dtype, source=str(plan.model),
                                   progress=progress)
        for split in ids
    }
    base_head = _base_softmax(model)
    torch.manual_seed(plan.seed)
    hf_model = attach_head(model, plan.head, init=plan.init, untie=True, **plan.knobs)
    budget = _budget(plan, len(caches["train"]))
    # Cached rows are single tokens, shuffled: dropout per token, not locked over a sequence.
    locked, hf_model.head.dropout_time_dim = hf_model.head.dropout_time_dim, None
    try:
        summary = train_head(hf_model.head, caches["train"], budget, out / "state.pt",
                             checkpoint_every=10, progress=progress, lr_may_change=lr_may_change)
    except TrainingError as error:
        _mark_stopped(out, error)
        raise
    summary["trainable_parameters"] = sum(p.numel() for p in hf_model.head.parameters())
    hf_model.head.dropout_time_dim = locked
    scores, base_scores = {}, {}
    for split in [s for s in ("valid", "test") if s in caches]:
        base_scores[split] = evaluate_head(base_head, caches[split])
        scores[split] = evaluate_head(hf_model.head, caches[split], reference=base_head)
    return hf_model, summary, scores, base_scores


def _base_softmax(model) -> nn.Module:
    """The base model's own output layer as a highrank softmax (its exact distribution)."""
    lm_head = model.get_output_embeddings()
    head = build_head("softmax", d_in=lm_head.in_features, vocab_size=lm_head.out_features)
    head.to(lm_head.weight.device)
    with torch.no_grad():
        head.weight.copy_(lm_head.weight)
        head.bias.copy_(lm_head.bias if lm_head.bias is not None else 0.0)
    return head.eval()


def _budget(plan: RetrofitPlan, train_tokens: int) -> TrainBudget:
    if plan.batch_tokens > train_tokens:
        raise RetrofitError(
            f"--batch-tokens {plan.batch_tokens} exceeds the {train_tokens} training tokens"
        )
    steps = plan.steps or max(1, train_tokens // plan.batch_tokens)
    return TrainBudget(steps=steps, batch_tokens=plan.batch_tokens, lr=plan.learning_rate,
                       warmup_steps=min(plan.warmup_steps, steps), clip=1.0, seed=plan.seed)


# ---- lora / full: the body trained too, on windows ---------------------------------------------


def _run_end_to_end(plan, model, ids, out: Path, progress: bool, lr_may_change: bool):
    from highrank.integrations.hf import attach_head

    windows = {split: window_tokens(ids[split], plan.window) for split in ids}
    base_scores = {split: _window_perplexity(model, *windows[split], base=True,
                                             label=f"{split} (base)", progress=progress)
                   for split in ("valid", "test") if split in windows}
    torch.manual_seed(plan.seed)
    hf_model = attach_head(model, plan.head, init=plan.init, **plan.knobs)
    trainable = _make_trainable(hf_model, plan)
    inputs, targets = windows["train"]
    per_batch = max(1, plan.batch_tokens // plan.window)
    budget = _budget(plan, inputs.shape[0] * plan.window)
    budget = TrainBudget(**{**asdict(budget), "batch_tokens": per_batch,
                            "steps": plan.steps or max(1, inputs.shape[0] // per_batch)})
    try:
        summary = _train_windows(trainable, inputs, targets, budget, out / "state.pt", progress,
                                 lr_may_change)
    except TrainingError as error:
        _mark_stopped(out, error)
        raise
    summary["trainable_parameters"] = sum(p.numel() for p in trainable.parameters()
                                          if p.requires_grad)
    trained = trainable.merge_and_unload() if plan.mode == "lora" else trainable
    scores = {split: _window_perplexity(trained, *windows[split], label=split,
                                        progress=progress)
              for split in ("valid", "test") if split in windows}
    return trained, summary, scores, base_scores


def _make_trainable(hf_model, plan: RetrofitPlan):
    if plan.mode == "full":
        return hf_model.train().requires_grad_(True)
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise RetrofitError("--mode lora needs the peft package: pip install peft") from None
    targets = sorted({name.rsplit(".", 1)[-1] for name, module in hf_model.model.named_modules()
                      if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in LORA_TARGETS})
    if not targets:
        raise RetrofitError("found no attention or MLP projection in the body to adapt with LoRA")
    config = LoraConfig(r=plan.lora_rank, lora_alpha=2 * plan.lora_rank, lora_dropout=0.0,
                        target_modules=rf"^model\..*\.({'|'.join(targets)})$",
                        modules_to_save=["head"])
    return get_peft_model(hf_model, config).train()


def _train_windows(model, inputs, targets, budget: TrainBudget, state_path: Path, progress,
                   lr_may_change: bool = False):
    """Adam over batches of whole windows (``budget.batch_tokens`` counts windows here), with
    the non-finite guard of the frozen loop."""
    from highrank.util.progress import progress_bar

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=budget.lr)
    history: list[dict] = []
    start = _load_state(state_path, model, optimizer, budget, history, lr_may_change)
    guard = NonFiniteSteps(state_path, budget.lr)
    save = functools.partial(_save_state, state_path, model, optimizer, budget, history)
    with progress_bar(total=budget.steps, initial=start, desc="retrofit", unit="step",
                      disable=not progress) as bar:
        for step in range(start, budget.steps):
            began = time.perf_counter()
            lr = budget.lr * budget.lr_factor(step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            rows = batch_indices(budget, inputs.shape[0], step)
            optimizer.zero_grad(set_to_none=True)
            device = _device_of(model)
            loss = model(input_ids=inputs[rows].to(device),
                         shift_labels=targets[rows].to(device)).loss
            skipped = guard.backward_and_step(loss, optimizer, params, budget.clip)
            history.append(step_record(step, loss, lr, began, skipped))
            bar.update(1)
            bar.set_postfix(loss="skipped" if skipped else f"{history[-1]['loss']:.3f}")
            if guard.exhausted:
                guard.stop(step + 1, model, save)
            if (step + 1) % 10 == 0 or step + 1 == budget.steps:
                save()
    model.eval()
    return training_summary(history, budget)


def _save_state(path: Path, model, optimizer, budget, history) -> None:
    trainable = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    state = {"budget": asdict(budget), "trainable": trainable,
             "optimizer": optimizer.state_dict(), "history": history,
             "rng": torch.get_rng_state(), "python_rng": random.getstate()}
    temporary = path.with_name(f".{path.name}.partial")
    torch.save(state, temporary)
    os.replace(temporary, path)


def _load_state(path: Path, model, optimizer, budget, history: list,
                lr_may_change: bool = False) -> int:
    if not path.exists():
        return 0
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # unpickling refused, truncated, ...
        raise RetrofitError(f"{path} cannot be read ({type(error).__name__}); delete it to "
                            "train again") from None
    check_saved_budget(path, state.get("budget"), budget, lr_may_change)
    check_finite_tensors(path, state["trainable"])
    parameters = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in state["trainable"].items():
            parameters[name].copy_(value)
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    random.setstate(state["python_rng"])
    history.extend(state["history"])
    return len(history)


@torch.no_grad()
def _window_perplexity(model, inputs, targets, *, base: bool = False, batch: int = 4,
                       label: str = "", progress: bool = False) -> dict:
    """Perplexity over every token of the windows: a base model's logits, or a highrank
    model's normalised log-probabilities."""
    from highrank.util.progress import progress_bar

    model.eval()
    nll, began, device = 0.0, time.perf_counter(), _device_of(model)
    bar = progress_bar(total=inputs.shape[0], desc=f"score {label}", unit="window",
                       disable=not progress)
    for first in range(0, inputs.shape[0], batch):
        bar.update(min(batch, inputs.shape[0] - first))
        logits = model(input_ids=inputs[first:first + batch].to(device)).logits.float()
        log_probs = torch.log_softmax(logits, dim=-1) if base else logits
        picked = log_probs.gather(-1, targets[first:first + batch].to(device).unsqueeze(-1))
        nll -= float(picked.double().sum())
    bar.close()
    n = targets.numel()
    return {"tokens": n, "nll_per_token": nll / n, "perplexity": finite_perplexity(nll / n),
            "seconds": time.perf_counter() - began}


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


# ---- saving ------------------------------------------------------------------------------------


def _save_model(hf_model, tokenizer, folder: Path, plan: RetrofitPlan) -> None:
    partial = folder.with_name(f".{folder.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    hf_model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(partial, folder)


def _write_json(path: Path, payload: dict) -> None:
    temporary = path.with_name(f".{path.name}.partial")
    temporary.write_text(json.dumps(payload, indent=1, default=str))
    os.replace(temporary, path)


__all__ = ["MODES", "RetrofitError", "RetrofitPlan", "load_cache", "retrofit"]
