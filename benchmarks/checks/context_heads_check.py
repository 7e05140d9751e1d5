"""The context heads (MFS, CPR) on SmolLM2-135M before the warm-start study runs them (issue 34):
what their inputs look like, whether their first steps are stable, and what a step costs.

    python -m benchmarks.checks.context_heads_check --work-dir DIR [--out FILE]

``DIR`` holds the study's sequence caches (``cache3-train``, ``cache3-valid``: ``python -m
benchmarks.studies.smollm2_warm_start --work-dir DIR --only cache --heads mfs``; a smoke-sized
one with ``--train-tokens 1024 --valid-tokens 512 --test-tokens 512``) and ``lm_head.pt``.

1. **Inputs**: the largest |value| and the RMS of each of the last 3 layers over the first two
   valid windows (the top one is after SmolLM2's final norm).
2. **First steps**: CPR and MFS warm-started as the study builds them, 6 steps (warm-up 2) at
   each lr of ``--lrs`` on the cached training windows, with Mi's inputs raw (the paper) and
   RMS-normalised (``normalize_inputs``, the heads' default): each step's loss and the valid
   perplexity after, beside the untouched model's.
3. **Step cost**: the median seconds of one training step (forward, backward, Adam) of each
   head on random inputs of the study's shapes (2 windows of 256 tokens, d = 576, V = 49,152,
   3 layers), 4 steps, the first dropped; one thread.

The record (``--out``) holds the three, the machine and the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._common import REPO, machine, write_json

OUT = REPO / "benchmarks/results/smollm2-warm-start/context-heads-check.json"


def inputs_report(cache) -> list[dict]:
    import torch

    _, inputs, _ = cache.windows(torch.arange(min(2, cache.n_windows)))
    return [{"layer_from_top": len(inputs["layers"]) - 1 - i,
             "abs_max": float(layer.abs().max()), "rms": float(layer.pow(2).mean().sqrt())}
            for i, layer in enumerate(inputs["layers"])]


def first_steps(study, args, caches, lrs) -> list[dict]:
    from highrank.integrations.retrofit import evaluate_head, train_head

    found = []
    for name in ("cpr", "mfs"):
        for normalize in (False, True):
            for lr in lrs:
                kind, knobs = study.HEADS[name]
                study.HEADS[name] = (kind, {**knobs, "normalize_inputs": normalize})
                try:
                    head = study.build_warm(name, 1, args)
                finally:
                    study.HEADS[name] = (kind, knobs)
                budget = study.budget_for(name, 1, args, lr=lr, steps=6, warmup=2)
                with tempfile.TemporaryDirectory() as folder:
                    summary = train_head(head, caches["train"], budget, Path(folder) / "s.pt")
                valid = evaluate_head(head.eval(), caches["valid"])["perplexity"]
                losses = [h["loss"] for h in summary["history"]]
                found.append({"head": name, "normalize_inputs": normalize, "lr": lr,
                              "losses": losses, "valid_ppl": valid})
                print(f"{name} normalize_inputs={normalize} lr {lr:g}: losses "
                      f"{[round(v, 3) for v in losses]}, valid {valid:.3f}", flush=True)
    return found


def step_seconds(heads: list[tuple[str, dict]], d: int = 576, vocab: int = 49_152) -> list[dict]:
    import torch

    from highrank.heads import base_init_knobs, build_head

    hidden = torch.randn(2, 256, d)
    layers = tuple(torch.randn(2, 256, d) for _ in range(3))
    ids = torch.randint(0, vocab, (2, 256))
    targets = torch.randint(0, vocab, (2, 256))
    found = []
    for name, knobs in heads:
        knobs = base_init_knobs(name, knobs)
        if name in ("mfs", "cpr"):
            knobs["time_dim"] = 1
        head = build_head(name, d_in=d, vocab_size=vocab, **knobs)
        given = {"layers": layers, "context_ids": ids}
        given = {k: v for k, v in given.items() if k in head.reads}
        optimizer = torch.optim.Adam(head.parameters(), lr=1e-4)
        times = []
        for _ in range(4):
            began = time.perf_counter()
            head.loss(hidden, targets, **given).backward()
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - began)
        found.append({"head": name, "knobs": knobs, "median_step_seconds":
                      statistics.median(times[1:]), "steps_timed": 3})
        print(f"{name} {knobs}: {found[-1]['median_step_seconds']:.2f} s/step", flush=True)
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--lrs", default="1e-4,3e-4")
    args = parser.parse_args(argv)
    import torch

    from benchmarks.studies import smollm2_warm_start as study
    from highrank.integrations.retrofit import evaluate_head, load_cache

    torch.set_num_threads(1)
    load_before = os.getloadavg()
    study_args = study.parse_args(["--work-dir", str(args.work_dir)])
    caches = {split: load_cache(args.work_dir / f"cache3-{split}") for split in ("train", "valid")}
    base = evaluate_head(study.build_warm("own", 1, study_args).eval(), caches["valid"])
    record = {
        "command": "python -m benchmarks.checks.context_heads_check " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        "cached_tokens": {split: len(cache) for split, cache in caches.items()},
        "inputs": inputs_report(caches["valid"]),
        "base_valid_ppl": base["perplexity"],
        "first_steps": first_steps(study, study_args, caches,
                                   [float(v) for v in args.lrs.split(",")]),
        "step_seconds": step_seconds([("softmax", {}), ("mfs", {}), ("cpr", {}),
                                      ("cpr", {"n_components": 4}),
                                      ("mlp_softmax", {"mlp_width": 6050})]),
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "machine": machine(1),
    }
    write_json(args.out, record)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
