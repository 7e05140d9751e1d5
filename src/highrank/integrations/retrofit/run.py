"""``highrank retrofit``: a warm-started high-rank head on a user's own causal LM, one command.

    highrank retrofit --hf MODEL --head mos --train FILE --valid FILE [--test FILE] --out DIR
        [--mode frozen|lora|full] [--knob n_components=2] ...

Three modes, one budget and one training loop (:mod:`~highrank.integrations.retrofit.train`:
Adam, linear warm-up then cosine decay, gradient-norm clip 1; every parameter at ``--lr`` but
those a head trains at a rate of its own, ``parameter_groups``: PLIF's slopes at 0.02):

* ``frozen``: the body is frozen; its final hidden states are cached once
  (:func:`~highrank.integrations.retrofit.cache.cache_hidden_states`, ``OUT/cache-<split>``)
  and only the head is trained on them. The cheapest protocol: every head sees the same
  features.
* ``lora``: PEFT LoRA adapters on the body's attention and MLP projections (``nn.Linear``, and
  ``transformers``' ``Conv1D`` of GPT-2), plus the whole head, trained on the text's windows
  end to end; merged into the body when saved.
* ``full``: every parameter, at a small learning rate: the protocol of Softmax-CPR (Chang &
  McCallum; iesl/Softmax-CPR fine-tunes the whole GPT-2, lr 1e-5).

The head starts at the base model's distribution (``attach_head(init="base")``), untied from
the input embedding in frozen mode (the body must keep reading the embedding it was cached
with). Before any long work the inputs are checked and a bad one is one line: before the
model is loaded, what needs no model (its path, ``--out`` a new folder or a retrofit's, each
text a non-empty file, the head and its knobs, built on the meta device at a placeholder
size; peft for lora); after, the rest (the model ends in an lm_head, each text holds at
least one window of ids the model has, the window fits its positions, a batch fits the
training text, the head's width the lm_head's under ``--init base``, LoRA finds projections
to adapt, memory and disk suffice for the head sized from the knobs, never built for the
check). Then: valid/test perplexity of the base model and of the trained one on the model's
own tokens (``results.json``; :mod:`~highrank.integrations.retrofit.score`), and
``OUT/model``, a ``HighrankForCausalLM`` with its tokenizer that
``AutoModelForCausalLM.from_pretrained`` reloads (after ``import highrank.integrations.hf``)
and ``generate()`` uses.

``device`` (``--device``; ``auto``: CUDA when available) runs the body and the head there
(caching, training, evaluation); caches and states are stored on the CPU side, so a run may
resume on another device.

Several processes: ``torchrun --nproc-per-node N -m highrank retrofit ...`` runs every mode
data-parallel (:mod:`highrank.train.distributed`: gloo on the CPU, NCCL on GPUs, process r on
GPU ``LOCAL_RANK``). ``--batch-tokens`` is the global batch, split evenly (frozen: its cached
rows; lora / full: its windows, ``batch_tokens // window``, must divide by N). Frozen mode
caches each round of N batches of windows in N processes (process r runs the r-th batch, the
one a single process would run, so the cache is the same bytes), process 0 gathers and writes
them; the head, and in lora / full mode the model, trains in DistributedDataParallel; the
valid/test scores are summed over each process's share of the rows. Only process 0 writes
``OUT`` (plan, caches, ``state.pt`` with every process's random generators, results, model)
and prints; a signal to any process stops all at the same step, saved; a process killed makes
the others stop in one line at their next exchange (torchrun stops the rest), and the same
command resumes from what was saved, ending bit-identical to an uninterrupted run of N
processes (``tests/integrations/test_retrofit_distributed.py``).

Resumable: the plan is kept in ``OUT/plan.json`` (a rerun with another plan is refused;
the device and the folder's place may change), caches continue from their last batch of
windows, training from its last checkpoint (``OUT/state.pt``, weights-only), and finished
steps are skipped; a finished run is reported at once, without loading the model. A SIGINT or
SIGTERM during training saves the state between two steps
(:class:`~highrank.train.state.Interrupted`). What a rerun reads from ``OUT`` is checked: a
damaged ``plan.json``, cache or ``state.pt``, a cache of changed contents (its checksums) or
of another text, a state of another run: each one line naming the file and how to go on.
``results.json`` keeps the plan as given and, under ``effective``, what ran: the steps, the
warm-up, the lr and the tokens a step (``tokens_per_step``; ``windows_per_step`` where a step
trains on whole windows), with a note where that differs from the plan (the steps of one
pass; a warm-up longer than the steps takes them all; ``--batch-tokens`` rounded to whole
windows), printed as it starts.

Nothing non-finite is saved: the training loop skips a step whose loss or gradient norm is
not finite and stops after :data:`~highrank.integrations.retrofit.train.MAX_NONFINITE_STEPS`
in a row (the last finite state kept); a trained model whose weights or valid/test perplexity
are not finite is not saved, nor its results. Either stop is recorded in ``plan.json``
(``stopped``): the same command with another ``--lr`` then continues, and ``--restart`` trains
again from the warm start with the caches kept. What a rerun loads is checked (a NaN cached
row or saved weight is one line).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path

import torch
from torch import nn

from highrank import causal_lm
from highrank.heads import base_init_knobs, build_head
from highrank.integrations.attach_knobs import check_attach_knobs
from highrank.integrations.hf_context import check_layers_given
from highrank.integrations.hf_parallel import full_state_dict, fully_shard_highrank
from highrank.integrations.retrofit.cache import (
    CacheSettingsError,
    cache_hidden_states,
    check_cache_settings,
    head_from_lm_head,
    output_layer,
)
from highrank.integrations.retrofit.plan import (
    OUTPUTS,
    RetrofitError,
    RetrofitPlan,
    check_out,
    resolve_device,
)
from highrank.integrations.retrofit.score import evaluate_head, score_windows
from highrank.integrations.retrofit.train import (
    RESTART_ADVICE,
    TrainBudget,
    all_finite_parameters,
    train_head,
    train_windows,
)
from highrank.runs.locks import run_lock
from highrank.train import distributed
from highrank.train.state import TrainingError
from highrank.util.atomic import write_json
from highrank.util.denormals import flush_denormals
from highrank.util.machine import available_memory

# The body's projections that LoRA adapts, by the names transformers' architectures use.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                "c_attn", "c_proj", "c_fc", "query_key_value", "dense", "fc1", "fc2", "Wqkv",
                "out_proj", "dense_h_to_4h", "dense_4h_to_h", "fc_in", "fc_out")
# The sizes a head is built at (on the meta device: nothing allocated) to check its knobs
# before the model, and so its real sizes, is loaded.
PLACEHOLDER_WIDTH, PLACEHOLDER_VOCAB = 64, 1024


@flush_denormals()
def retrofit(plan: RetrofitPlan, *, progress: bool = True, restart: bool = False) -> dict:
    """Check, (cache,) train, evaluate and save: ``results.json``'s contents. One process at
    a time writes ``plan.out``: a second is refused naming the first (they raced before).

    A finished run is reported at once. ``restart`` trains again from the warm start with this
    plan (its settings may differ), keeping the feature caches, which check their own settings.
    """
    distributed.init_from_env()  # under torchrun: join the other processes
    progress = progress and distributed.is_writer()  # process 0 speaks for all
    out = Path(plan.out)
    say = print if progress else (lambda *a, **k: None)
    check_out(out, plan, restart=restart)
    if not restart:
        finished = _finished_results(out)
        if finished is not None:
            say(f"{out} holds a finished retrofit ({out / 'model'}); nothing to do", flush=True)
            return finished
    check_before_loading(plan)
    with distributed.writer_lock(lambda: run_lock(out)), _peers_kept():
        return _retrofit(plan, out, progress, say, restart)


# What torch.distributed's gloo and NCCL say when another process of the group is gone.
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "gloo/transport",
             "NCCL communicator was aborted", "Broken pipe")


@contextmanager
def _peers_kept() -> Iterator[None]:
    """Under torchrun a process killed (or stopped by an error) makes the others' next
    collective fail with a transport error and a traceback: it becomes one line (status 1)
    saying what is kept; torchrun then stops the rest."""
    try:
        yield
    except RuntimeError as error:
        if not (distributed.active() and any(text in str(error) for text in PEER_LOST)):
            raise
        raise TrainingError(
            "another process of this torchrun stopped (its connection is gone); what was saved "
            "is kept (caches to their last batch of windows, training to its last checkpoint): "
            "run the same command again to continue"
        ) from None


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
    for name in OUTPUTS:
        if (out / name).is_dir():
            shutil.rmtree(out / name, ignore_errors=True)
        else:
            (out / name).unlink(missing_ok=True)


def dry_run(plan: RetrofitPlan, *, progress: bool = True, restart: bool = False) -> dict:
    """Every check of a retrofit (the model loaded, the texts tokenised, memory, disk and the
    caches in ``--out``), then what it would train, without training or writing anything: the
    head's parameters (new ones beside the decoder E, b: what a capacity control must reach),
    each text's tokens and windows, the steps. Printed and returned."""
    say = print if progress else (lambda *a, **k: None)
    if distributed.launched_rank() is not None:
        raise RetrofitError("--dry-run is one process: run it without torchrun (it checks how "
                            "a batch shares among N processes only when they run)")
    check_out(Path(plan.out), plan, restart=restart)
    check_before_loading(plan)
    model, _, ids, _ = _prepared(plan, say, restart)
    vocab, width = model.get_output_embeddings().weight.shape
    head = _head_on_meta(plan, width, vocab)
    total = sum(p.numel() for p in head.parameters())
    decoder = head.weight.numel() + head.bias.numel()
    windows = {split: (len(split_ids) - 1) // plan.window for split, split_ids in ids.items()}
    budget = _train_budget(plan, windows["train"])
    found = {"head": plan.head, "knobs": plan.knobs, "parameters": total,
             "decoder_parameters": decoder, "new_parameters": total - decoder,
             "tokens": {split: len(split_ids) for split, split_ids in ids.items()},
             "windows": windows, **effective_budget(plan, asdict(budget))}
    body = ("" if plan.mode == "frozen" else
            f" (the head's; the {'LoRA adapters' if plan.mode == 'lora' else 'body'} train too)")
    say(f"dry run: checked, nothing trained or written. --head {plan.head}: "
        f"{total - decoder:,} new parameters beside the decoder E, b ({decoder:,}); "
        f"{total:,} in all{body}")
    for note in found.get("notes", []):
        say(f"note: {note}")
    for split, count in found["tokens"].items():
        say(f"--{split}: {count:,} tokens, {windows[split]:,} windows of {plan.window}")
    say(f"{found['steps']} steps ({plan.mode} mode), warm-up {found['warmup_steps']}, "
        f"lr {found['lr']:g}")
    return found


def _prepared(plan: RetrofitPlan, say, restart: bool):
    """The model (on its device), its tokenizer, each text's token ids and the tokens after
    its last whole window, every check of the plan against them passed."""
    say(f"loading {plan.model}", flush=True)  # a GGUF file takes minutes to dequantise
    model, tokenizer = _load(plan)
    _check_output_layer(plan, model)
    device = resolve_device(plan.device)
    if device.type != "cpu":
        say(f"running on {device}", flush=True)
    model.to(device)
    positions = causal_lm.max_positions(model)  # before the texts are tokenised (minutes)
    if positions is not None and plan.window > positions:
        raise RetrofitError(f"--window {plan.window} exceeds the model's {positions} positions: "
                            f"give --window {positions} or less")
    ids = {}
    for split in plan.splits:
        say(f"tokenising --{split} {getattr(plan, split)}", flush=True)
        ids[split] = _token_ids(plan, tokenizer, split)
    tails = _unread_tails(plan, ids)
    for split, left in tails.items():
        limited = (plan.max_train_tokens if split == "train" else plan.max_eval_tokens) is not None
        option = "--max-train-tokens" if split == "train" else "--max-eval-tokens"
        read = f"tokens read ({option})" if limited else "tokens"
        say(f"note: --{split}: the last {left} of its {len(ids[split]):,} {read} fill no window "
            f"of {plan.window} and are not read", flush=True)
    _check_plan_fits(plan, model, ids, restart)  # the caches too: nothing is discarded before
    return model, tokenizer, ids, tails


def _retrofit(plan: RetrofitPlan, out: Path, progress: bool, say, restart: bool) -> dict:
    model, tokenizer, ids, tails = _prepared(plan, say, restart)
    if restart:  # process 0 writes
        distributed.from_writer(lambda: _forget_training(out))

    def start() -> dict:
        out.mkdir(parents=True, exist_ok=True)
        # kept until the run finishes (its state's lr may differ from the plan's); not after
        # --restart, which trains from the warm start: its plan binds like any other
        stopped = {} if restart else _stopped(out)
        write_json(out / "plan.json", {**asdict(plan), **stopped})
        return stopped

    stopped = distributed.from_writer(start)
    run = _run_frozen if plan.mode == "frozen" else _run_end_to_end
    hf_model, summary, scores, base_scores = run(plan, model, ids, out, progress, bool(stopped))
    _refuse_non_finite(out, plan, hf_model, scores, summary)
    effective = {**effective_budget(plan, summary["budget"]), "unread_tokens": tails}
    results = {"plan": asdict(plan), "effective": effective,
               "base": base_scores, "trained": scores,
               "training": {k: v for k, v in summary.items() if k != "history"},
               **({"processes": distributed.world_size()} if distributed.active() else {})}

    # FSDP2 shards gathered whole to process 0 (every process takes part); None: as it is
    whole = full_state_dict(hf_model) if plan.fsdp else None

    def save() -> None:
        _save_model(hf_model, tokenizer, out / "model", whole)
        write_json(out / "plan.json", asdict(plan))
        write_json(out / "results.json", results)
        write_json(out / "history.json", {"history": summary["history"]})

    distributed.from_writer(save)
    for split in ("valid", "test"):
        if split in scores:
            say(f"{split} perplexity: base {base_scores[split]['perplexity']:.3f}, "
                f"{plan.head} {scores[split]['perplexity']:.3f}", flush=True)
    say(f"saved {out / 'model'} (reload with AutoModelForCausalLM after "
        "import highrank.integrations.hf)", flush=True)
    return results


def _unread_tails(plan: RetrofitPlan, ids: dict) -> dict[str, int]:
    """Per text, the last tokens that fill no whole window (``window_tokens``): neither
    trained on nor scored (texts read to their end left out)."""
    tails = {split: (len(split_ids) - 1) % plan.window for split, split_ids in ids.items()}
    return {split: left for split, left in tails.items() if left}


def _stopped(out: Path) -> dict:
    """``{"stopped": ...}`` when the non-finite guard stopped this run (plan.json says so)."""
    try:
        old = json.loads((out / "plan.json").read_text())
    except (OSError, ValueError):
        return {}
    return {"stopped": old["stopped"]} if isinstance(old, dict) and "stopped" in old else {}


def _mark_stopped(out: Path, error: TrainingError) -> None:
    if not distributed.is_writer():  # every process stops; process 0 records it
        return
    plan = json.loads((out / "plan.json").read_text())
    write_json(out / "plan.json", {**plan, "stopped": str(error)})


@contextmanager
def _stop_recorded(out: Path) -> Iterator[None]:
    """Training stopped by the non-finite guard is recorded in ``plan.json`` (the same
    command may then continue with another ``--lr``)."""
    try:
        yield
    except TrainingError as error:
        _mark_stopped(out, error)
        raise


def _refuse_non_finite(out: Path, plan: RetrofitPlan, hf_model, scores: dict,
                       summary: dict) -> None:
    """Nothing non-finite is saved as a model or a result: a diverged run stops here, in one
    line, with what to change (its finite losses reached 1e20 before the scores overflowed)."""
    bad = [f"{split} perplexity {score['perplexity']}" for split, score in scores.items()
           if not math.isfinite(score["perplexity"])]
    # every process answers (an FSDP2 shard holds 1/N of the weights): all raise, or none
    if distributed.average(float(all_finite_parameters(hf_model))) != 1.0:
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


# ---- checks before any long work ---------------------------------------------------------------


def check_before_loading(plan: RetrofitPlan) -> None:
    """What can be checked before the model is loaded (minutes for a large one): the model's
    path, each text an existing, non-empty file, and the head with its knobs."""
    try:
        causal_lm.model_source(plan.model)
    except causal_lm.HFInputError as error:
        raise RetrofitError(str(error)) from None
    for split in plan.splits:
        path = Path(getattr(plan, split))
        if not path.exists():
            raise RetrofitError(f"--{split}: text file {path} does not exist")
        if not path.is_file():
            raise RetrofitError(f"--{split}: text file {path} is a folder; expected a text file")
        if path.stat().st_size == 0:
            raise RetrofitError(
                f"--{split}: text file {path} is empty; give a text of at least one window "
                f"(--window {plan.window}) of tokens plus the one after it"
            )
    _head_on_meta(plan, PLACEHOLDER_WIDTH, PLACEHOLDER_VOCAB)
    if plan.mode == "lora":
        _peft()
    if plan.fsdp and not distributed.active():
        raise RetrofitError(
            "--fsdp shards the model across the processes of a torchrun: start it with "
            "`torchrun --nproc-per-node N -m highrank retrofit ... --fsdp`"
        )


def _head_on_meta(plan: RetrofitPlan, width: int, vocab: int):
    """The plan's head built on the meta device (its knobs checked, its parameters counted,
    nothing allocated: ``n_components=1000000000`` is sized, not built)."""
    knobs = _head_knobs(plan)
    try:
        check_attach_knobs(plan.head, plan.knobs)
        with torch.device("meta"):
            return build_head(plan.head, d_in=width, vocab_size=vocab, **knobs)
    except (TypeError, ValueError) as error:
        raise RetrofitError(f"--head {plan.head}: {error}") from None


def _load(plan: RetrofitPlan):
    try:
        return causal_lm.load_causal_lm(plan.model, progress=False)
    except causal_lm.HFInputError as error:
        raise RetrofitError(str(error)) from None


def _check_output_layer(plan: RetrofitPlan, model) -> None:
    """The model ends in a linear lm_head for the head to replace (a model saved by a retrofit
    has a highrank head instead, and was an AttributeError traceback)."""
    try:
        output_layer(model)
    except TypeError as error:
        head = getattr(model.config, "head_name", None)  # HighrankConfig's
        if head is not None:
            raise RetrofitError(
                f"--hf {plan.model} already has the highrank head {head!r} (a model saved by "
                "retrofit or attach_head), not an lm_head to replace; give the base model it "
                "was made from"
            ) from None
        raise RetrofitError(f"--hf {plan.model}: {error}") from None


def _token_ids(plan: RetrofitPlan, tokenizer, split: str) -> torch.Tensor:
    try:
        ids = causal_lm.text_token_ids(tokenizer, getattr(plan, split))
    except causal_lm.HFInputError as error:
        raise RetrofitError(f"--{split}: {error}") from None
    limit = plan.max_train_tokens if split == "train" else plan.max_eval_tokens
    ids = ids if limit is None else ids[: limit + 1]
    if ids.numel() < plan.window + 1:
        raise RetrofitError(
            f"--{split} {getattr(plan, split)} holds {ids.numel()} tokens, fewer than one window "
            f"of {plan.window} plus its next token; give a longer text or a smaller --window"
        )
    return ids


def _check_plan_fits(plan: RetrofitPlan, model, ids: dict, restart: bool = False) -> None:
    """Head and knobs valid, window within the model's positions, the batch shared evenly
    among the processes under torchrun, memory and disk enough."""
    if not _by_windows(plan):
        _check_share(plan, "--batch-tokens", plan.batch_tokens)
    else:  # whole windows per step
        _check_share(plan, f"--batch-tokens {plan.batch_tokens} // --window {plan.window}",
                     max(1, plan.batch_tokens // plan.window))
    lm_head = model.get_output_embeddings()
    vocab, width = lm_head.weight.shape
    _train_budget(plan, (len(ids["train"]) - 1) // plan.window)  # --batch-tokens fits the text
    d_embed = plan.knobs.get("d_embed")
    if plan.init == "base" and d_embed not in (None, width):  # attach_head's ValueError, later
        raise RetrofitError(
            f"--knob d_embed={d_embed}: --init base starts the head at the model's lm_head, "
            f"a ({vocab}, {width}) matrix, which d_embed={d_embed} would change; drop the knob "
            "or give --init paper"
        )
    if plan.mode == "lora":
        _lora_layers(model.base_model)
    for split, split_ids in ids.items():
        try:
            causal_lm.check_token_ids(model, split_ids, model_path=plan.model,
                                      source=f"--{split} {getattr(plan, split)}")
        except causal_lm.HFInputError as error:
            raise RetrofitError(str(error)) from None
    probe = _head_on_meta(plan, width, vocab)
    try:
        check_layers_given(probe, model.config, fix="--knob input_layers=")
    except ValueError as error:
        raise RetrofitError(f"--head {plan.head}: {error}") from None
    head_bytes = sum(p.numel() for p in probe.parameters()) * 4 * 4  # weights, grads, Adam
    probe_layers = probe.input_layers
    del probe
    need = head_bytes + _activation_bytes(plan, vocab)
    if plan.mode == "frozen":
        layers = _cache_layers(plan, probe_layers)
        made = _check_caches(plan, model, ids, layers, restart)  # their disk space is taken
        tokens = sum(t.numel() for split, t in ids.items() if split not in made)
        cache_bytes = tokens * width * (layers or 1) * _dtype_bytes(plan)
        free_disk = shutil.disk_usage(_existing_parent(Path(plan.out))).free
        if cache_bytes > free_disk:
            raise RetrofitError(
                f"the feature caches need {cache_bytes / 2**30:.1f} GiB but "
                f"{_existing_parent(Path(plan.out))} has {free_disk / 2**30:.1f} GiB free; "
                "free space, lower --max-train-tokens or use --cache-dtype bfloat16"
            )
    else:  # weights (and for full: gradients, Adam's moments), 1/N each under --fsdp
        shards = distributed.world_size() if plan.fsdp else 1
        need += (sum(p.numel() for p in model.parameters()) * 4
                 * (4 if plan.mode == "full" else 1) // shards)
    available = available_memory(resolve_device(plan.device))
    if available is not None and need > available:
        raise RetrofitError(
            f"this plan needs about {need / 2**30:.1f} GiB of memory but {available / 2**30:.1f}"
            f" GiB are available; lower --batch-tokens"
            f"{'' if plan.mode == 'frozen' else ', use --mode frozen'}, or a smaller head"
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


def _head_knobs(plan: RetrofitPlan) -> dict:
    try:
        return base_init_knobs(plan.head, plan.knobs) if plan.init == "base" else plan.knobs
    except ValueError as error:
        raise RetrofitError(str(error)) from None


def _budget(plan: RetrofitPlan, train_tokens: int) -> TrainBudget:
    if plan.batch_tokens > train_tokens:
        raise RetrofitError(
            f"--batch-tokens {plan.batch_tokens} exceeds the {train_tokens} training tokens"
        )
    steps = plan.steps or max(1, train_tokens // plan.batch_tokens)
    return TrainBudget(steps=steps, batch_tokens=plan.batch_tokens, lr=plan.learning_rate,
                       warmup_steps=min(plan.warmup_steps, steps), clip=1.0, seed=plan.seed)


def _window_budget(plan: RetrofitPlan, n_windows: int) -> TrainBudget:
    """The budget over whole windows (lora / full mode, and a head that reads its context in
    frozen mode): ``--batch-tokens // --window`` windows a step (at least one), one pass over
    the windows unless ``--steps`` says."""
    per_batch = max(1, plan.batch_tokens // plan.window)
    steps = plan.steps or max(1, n_windows // per_batch)
    return replace(_budget(plan, n_windows * plan.window), batch_tokens=per_batch,
                   steps=steps, warmup_steps=min(plan.warmup_steps, steps))


def _train_budget(plan: RetrofitPlan, n_windows: int) -> TrainBudget:
    """The budget over a training text of ``n_windows`` whole windows, as the mode trains."""
    if _by_windows(plan):
        return _window_budget(plan, n_windows)
    return _budget(plan, n_windows * plan.window)


def _check_share(plan: RetrofitPlan, what: str, rows: int) -> None:
    """Under torchrun the batch is the global one, split evenly among the processes."""
    n = distributed.world_size()
    if rows % n:
        unit = "windows" if _by_windows(plan) else "tokens"
        raise RetrofitError(
            f"{what} = {rows} {unit} per step is the global batch, split among {n} "
            f"processes: it must divide by {n}; start as many processes as divide it "
            "(torchrun --nproc-per-node), or give another --batch-tokens"
        )


# ---- frozen: cached features, the head alone ----------------------------------------------------


def _run_frozen(plan, model, ids, out: Path, progress: bool, lr_may_change: bool):
    from highrank.integrations.hf import attach_head  # the hf extra (transformers)

    torch.manual_seed(plan.seed)
    hf_model = attach_head(model, plan.head, init=plan.init, untie=True, **plan.knobs)
    layers = _cache_layers(plan, hf_model.head.input_layers)
    caches = {split: _cache(plan, model, ids[split], out, split, progress, layers)
              for split in ids}
    base_head = head_from_lm_head(model, "softmax").to(model.get_output_embeddings().weight.device)
    base_head.eval()  # the base model's own output layer: its exact distribution
    budget = _budget(plan, len(caches["train"]))
    if plan.reads_context:  # whole windows per step, as in lora / full mode
        budget = _window_budget(plan, caches["train"].n_windows)
    _say_effective(plan, asdict(budget), progress)
    # Cached rows of a token cache are single tokens, shuffled: dropout per token, not locked
    # over a sequence (a head that reads its context trains on whole windows: kept locked).
    locked = hf_model.head.dropout_time_dim
    if not plan.reads_context:
        hf_model.head.dropout_time_dim = None
    with _stop_recorded(out):
        summary = train_head(hf_model.head, caches["train"], budget, out / "state.pt",
                             checkpoint_every=10, progress=progress,
                             lr_may_change=lr_may_change, catch_signals=True)
    summary["trainable_parameters"] = sum(p.numel() for p in hf_model.head.parameters())
    hf_model.head.dropout_time_dim = locked
    scores, base_scores = {}, {}
    for split in [s for s in ("valid", "test") if s in caches]:
        base_scores[split] = evaluate_head(base_head, caches[split])
        scores[split] = evaluate_head(hf_model.head, caches[split], reference=base_head)
    return hf_model, summary, scores, base_scores


# ---- lora / full: the body trained too, on windows ---------------------------------------------


def _run_end_to_end(plan, model, ids, out: Path, progress: bool, lr_may_change: bool):
    from highrank.integrations.hf import attach_head  # the hf extra (transformers)

    windows = {split: causal_lm.window_tokens(ids[split], plan.window) for split in ids}
    base_scores = {split: score_windows(model, *windows[split], base=True,
                                        label=f"{split} (base)", progress=progress)
                   for split in ("valid", "test") if split in windows}
    torch.manual_seed(plan.seed)
    width = model.get_output_embeddings().weight.shape[1]
    # an output embedding of another width (--knob d_embed) cannot be the input embedding
    untie = plan.knobs.get("d_embed") not in (None, width)
    hf_model = attach_head(model, plan.head, init=plan.init, untie=untie, **plan.knobs)
    trainable = make_trainable(hf_model, plan)
    if plan.fsdp:  # in place: every process keeps 1/N of each group's weights
        fully_shard_highrank(trainable)
    inputs, targets = windows["train"]
    budget = _window_budget(plan, inputs.shape[0])
    _say_effective(plan, asdict(budget), progress)
    with _stop_recorded(out):
        summary = train_windows(trainable, inputs, targets, budget, out / "state.pt",
                                progress=progress, lr_may_change=lr_may_change,
                                catch_signals=True)
    summary["trainable_parameters"] = sum(p.numel() for p in trainable.parameters()
                                          if p.requires_grad)
    trained = trainable.merge_and_unload() if plan.mode == "lora" else trainable
    scores = {split: score_windows(trained, *windows[split], label=split, progress=progress)
              for split in ("valid", "test") if split in windows}
    return trained, summary, scores, base_scores


def _cache(plan: RetrofitPlan, model, ids: torch.Tensor, out: Path, split: str,
           progress: bool, layers: int | None = None):
    """The feature cache of ``split`` (made, continued or loaded; with ``layers``, a sequence
    cache of that many layers); one made from other tokens or with other settings is one line
    saying how to go on (:func:`_check_caches` names them all before the first is made)."""
    folder = out / f"cache-{split}"
    try:
        return cache_hidden_states(model, ids, folder, window=plan.window, dtype=plan.cache_dtype,
                                   source=str(plan.model), progress=progress, layers=layers)
    except CacheSettingsError as error:
        raise RetrofitError(_stale_message(plan, [(split, folder, error)], False)) from None


def _cache_layers(plan: RetrofitPlan, input_layers: int) -> int | None:
    """The layers a sequence cache keeps for a head that reads its context, None for the
    token cache of the others."""
    return max(input_layers, 1) if plan.reads_context else None


def _check_caches(plan: RetrofitPlan, model, ids: dict, layers: int | None,
                  restart: bool) -> set[str]:
    """The splits whose feature cache in ``--out`` this plan can use; every one it could not
    use named in one line before any is made or anything is discarded (``--restart`` keeps the
    caches: a stale one refused only after the caches before it were made, and the run's model
    already gone)."""
    usable, stale = set(), []
    for split, split_ids in ids.items():
        folder = Path(plan.out) / f"cache-{split}"
        try:
            if check_cache_settings(model, split_ids, folder, window=plan.window,
                                    dtype=plan.cache_dtype, source=str(plan.model),
                                    layers=layers):
                usable.add(split)
        except CacheSettingsError as error:
            stale.append((split, folder, error))
    if stale:
        raise RetrofitError(_stale_message(plan, stale, restart))
    return usable


TOKENS = {"token_ids_sha256", "n_tokens", "n_windows"}  # a cache's settings that are its tokens


def _stale_message(plan: RetrofitPlan, stale: list[tuple], restart: bool) -> str:
    """Why each ``(split, folder, CacheSettingsError)`` cannot be used, and what to do."""
    reasons = []
    for split, folder, error in stale:
        if set(error.changed) <= TOKENS:
            limit = "--max-train-tokens" if split == "train" else "--max-eval-tokens"
            reasons.append(f"--{split} {getattr(plan, split)}: its tokens changed since {folder} "
                           f"was cached from them (the text was edited, or {limit} changed)")
        else:
            differ = ", ".join(f"{k} {old!r}, now {new!r}"
                               for k, (old, new) in error.changed.items() if k not in TOKENS)
            reasons.append(f"{folder} was cached with other settings ({differ})")
    folders = " and ".join(str(folder) for _, folder, _ in stale)
    train = any(split == "train" for split, _, _ in stale)
    again = " and add --restart (to train again on them)" if train and not restart else ""
    lead = reasons[0] if len(reasons) == 1 else (
        f"{len(reasons)} feature caches do not fit this plan: " + "; ".join(reasons))
    return (f"{lead}; delete {folders}{again}, or give another --out (--restart alone keeps the "
            "caches, and they refuse what they were not made from)")


def effective_budget(plan: RetrofitPlan, budget: dict) -> dict:
    """What ran, beside the plan as given: the steps, warm-up, lr and tokens a step, and a note
    where they differ from the plan (``--steps`` left to one pass; a warm-up longer than the
    steps; ``--batch-tokens`` rounded to whole windows)."""
    record = {k: budget[k] for k in ("steps", "warmup_steps", "lr")}
    notes = _changed_notes(plan, budget)
    if plan.steps is None:
        notes.insert(0, f"--steps not given: one pass over the training text, "
                        f"{budget['steps']} steps")
    if _by_windows(plan):  # the budget's rows are windows
        windows = budget["batch_tokens"]
        record.update(windows_per_step=windows, tokens_per_step=windows * plan.window)
    else:
        record["tokens_per_step"] = budget["batch_tokens"]
    return {**record, **({"notes": notes} if notes else {})}


def _changed_notes(plan: RetrofitPlan, budget: dict) -> list[str]:
    """The notes on what a step trains on that differs from the plan as given."""
    notes = []
    if _by_windows(plan) and budget["batch_tokens"] * plan.window != plan.batch_tokens:
        notes.append(_window_rounding(plan, budget["batch_tokens"]))
    if budget["warmup_steps"] < plan.warmup_steps:
        notes.append(f"--warmup-steps {plan.warmup_steps} exceeds the {budget['steps']} steps: "
                     f"the warm-up took all {budget['warmup_steps']}")
    return notes


def _by_windows(plan: RetrofitPlan) -> bool:
    """Whether a step trains on whole windows (lora / full, or a head reading its context)."""
    return plan.mode != "frozen" or plan.reads_context


def _window_rounding(plan: RetrofitPlan, windows: int) -> str:
    return (
        f"--batch-tokens {plan.batch_tokens} is not a whole number of --window {plan.window} "
        f"windows: each step trains on {windows} whole window{'s' * (windows > 1)} "
        f"({windows * plan.window} tokens)"
    )


def _say_effective(plan: RetrofitPlan, budget: dict, progress: bool) -> None:
    """Print the notes of ``effective_budget`` that change what a step trains on."""
    if progress:
        for note in _changed_notes(plan, budget):
            print(f"note: {note}", flush=True)


def make_trainable(hf_model, plan: RetrofitPlan):
    """``full``: every parameter of ``hf_model``; ``lora``: PEFT LoRA adapters of rank
    ``plan.lora_rank`` on the body's projections named in :data:`LORA_TARGETS` that PEFT can
    adapt (``nn.Linear``, and ``transformers``' ``Conv1D``: GPT-2's ``c_attn``, ``c_proj``,
    ``c_fc``), plus the whole head."""
    if plan.mode == "full":
        return hf_model.train().requires_grad_(True)
    LoraConfig, get_peft_model = _peft()
    found = _lora_layers(hf_model.model)
    targets = sorted(found)
    config = LoraConfig(r=plan.lora_rank, lora_alpha=2 * plan.lora_rank, lora_dropout=0.0,
                        target_modules=rf"^model\..*\.({'|'.join(targets)})$",
                        modules_to_save=["head"],
                        # Conv1D keeps its weight as (in, out): PEFT's fan_in_fan_out says so
                        fan_in_fan_out=all(kind is not nn.Linear for kind in found.values()))
    return get_peft_model(hf_model, config).train()


def _peft():
    """PEFT's ``LoraConfig`` and ``get_peft_model``; its absence is one line (before loading)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise RetrofitError("--mode lora needs the peft package: pip install peft") from None
    return LoraConfig, get_peft_model


def _lora_layers(body: nn.Module) -> dict[str, type]:
    """The names (last part) of the body's projections LoRA adapts, with their types; none is
    one line, checked before any long work (it came after the base model's scores)."""
    adaptable = _adaptable_layers()
    found = {name.rsplit(".", 1)[-1]: type(module) for name, module in body.named_modules()
             if isinstance(module, adaptable) and name.rsplit(".", 1)[-1] in LORA_TARGETS}
    if not found:
        raise RetrofitError(
            f"found no attention or MLP projection in the body ({type(body).__name__}) to "
            f"adapt with LoRA (it adapts {', '.join(LORA_TARGETS)}); use --mode full or frozen"
        )
    return found


def _adaptable_layers() -> tuple[type, ...]:
    """The layer types LoRA adapts here: ``nn.Linear`` and ``transformers``' ``Conv1D``."""
    from transformers.pytorch_utils import Conv1D  # the hf extra

    return nn.Linear, Conv1D


# ---- saving ------------------------------------------------------------------------------------


def _save_model(hf_model, tokenizer, folder: Path, state: dict | None = None) -> None:
    """``save_pretrained`` into ``folder``, replacing it whole (``state``: the weights to
    write, gathered from FSDP2's shards)."""
    partial = folder.with_name(f".{folder.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    hf_model.save_pretrained(partial, **({} if state is None else {"state_dict": state}))
    tokenizer.save_pretrained(partial)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(partial, folder)


__all__ = ["LORA_TARGETS", "check_before_loading", "effective_budget", "make_trainable",
           "retrofit"]
