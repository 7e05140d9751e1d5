"""How much denormal floats slow a head's training step on the CPU, and what flushing them
buys (:mod:`highrank.util.denormals`).

    OMP_NUM_THREADS=1 python -m benchmarks.heads.denormals [--vocab 49152] [--d 576]
        [--tokens 512] [--scales 1,8,32] [--repeats 3]
        [--study-work-dir /work/smollm2-context-cpu]
        [--map-runs benchmarks/results/bottleneck-map/runs/softmax-d8-seed2,...]
        [--out benchmarks/results/denormals]

**Synthetic part** (anywhere): the softmax and MoS-4 heads at SmolLM2's shapes (V = 49,152,
d = 576), one step (loss and backward) on ``--tokens`` random hidden states whose scale sets
how sharp the distributions are: at scale s the logits' spread grows with s, and more of the
exponentials inside the log-softmax land in float32's denormal range (exp(x) for x in
(-103.3, -87.3)). For each (head, scale): the share of log-probabilities in that band, and the
median step time with denormals kept and flushed, the two alternated (ABBA) ``--repeats``
times, one torch thread (the flag is per thread: :mod:`highrank.util.denormals`).

**The study's part** (when ``--study-work-dir`` holds the warm-start study's saved states of
MoS + CPR, ``state-moscpr-s<seed>.pt``, and its sequence cache): one training step of the
study's batch (2 windows of 256 tokens) from each seed's saved head, kept and flushed.

**The bottleneck map's part** (``--map-runs``: run folders of the map with their ``best.pt``):
one training step of the map's batch (32 columns of BPTT 35 from the start of PTB's training
split) with each trained model, in training mode (its dropouts on, the same masks both ways).
Penn Treebank's distributions (perplexity 100-200) are far flatter than SmolLM2's (about 16).

Records: ``denormals.json`` (every time, the machine, the load average) and ``denormals.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from benchmarks._common import RESULTS, machine, write_json, write_text

OUT = RESULTS / "denormals"
DENORMAL_EXP = -87.3  # exp(x) < 1.18e-38, float32's smallest normal number, below this
ZERO_EXP = -103.3  # exp(x) < 1.4e-45, float32's smallest denormal: 0, below this


def timed_step(step, flush: bool) -> tuple[float, float]:
    """Seconds of one ``step`` (which returns its loss) and that loss."""
    import torch

    torch.set_flush_denormal(flush)
    torch.manual_seed(0)  # the same dropout masks in every step: only flushing moves the loss
    try:
        began = time.perf_counter()
        loss = step()
        return time.perf_counter() - began, loss
    finally:
        torch.set_flush_denormal(False)


def kept_and_flushed(step, repeats: int) -> dict:
    """Median seconds of ``step`` with denormals kept and flushed, alternated, and the largest
    difference between the two settings' losses (the same step, so only flushing moves it)."""
    step()  # warm-up: allocations, first-call costs
    kept, flushed = [], []
    for repeat in range(repeats):  # ABBA: neither setting always runs first
        order = (False, True) if repeat % 2 == 0 else (True, False)
        for flush in order:
            (flushed if flush else kept).append(timed_step(step, flush))
    return {"kept_s": statistics.median(t for t, _ in kept),
            "flushed_s": statistics.median(t for t, _ in flushed),
            "kept_all": [t for t, _ in kept], "flushed_all": [t for t, _ in flushed],
            "ratio": statistics.median(t for t, _ in kept) / statistics.median(
                t for t, _ in flushed),
            "loss": kept[0][1],
            "loss_difference": max(abs(a - b) for (_, a), (_, b) in zip(kept, flushed,
                                                                          strict=True))}


def synthetic(args) -> list[dict]:
    import torch

    from highrank.heads import build_head

    rows = []
    for name, knobs in (("softmax", {}), ("mos", {"n_components": 4})):
        torch.manual_seed(0)
        head = build_head(name, d_in=args.d, vocab_size=args.vocab, **knobs)
        for scale in args.scales:
            generator = torch.Generator().manual_seed(1)
            hidden = scale * torch.randn(args.tokens, args.d, generator=generator)
            target = torch.randint(args.vocab, (args.tokens,), generator=generator)
            with torch.no_grad():
                log_probs = head.log_prob(hidden)
            # exp(x) is a denormal float32 for x in (-103.3, -87.3), exactly 0 below
            share = ((log_probs < DENORMAL_EXP) & (log_probs > ZERO_EXP)).float().mean().item()

            def step(head=head, hidden=hidden, target=target) -> float:
                head.zero_grad()
                loss = head.loss(hidden, target)
                loss.backward()
                return loss.item()

            row = {"head": name, "scale": scale, "share_in_denormal_band": share,
                   **kept_and_flushed(step, args.repeats), "load_average": os.getloadavg()}
            print(f"{name} scale {scale}: {share:.1%} of log-probs in the denormal band; "
                  f"{row['kept_s']:.2f} s kept, {row['flushed_s']:.2f} s flushed "
                  f"(x{row['ratio']:.2f})", flush=True)
            rows.append(row)
    return rows


def study_states(args) -> list[dict]:
    """One step of the warm-start study's MoS + CPR from each seed's saved state."""
    import torch

    import benchmarks.studies.smollm2_warm_start as study

    work = Path(args.study_work_dir)
    seeds = sorted(int(p.stem.rsplit("-s", 1)[1]) for p in work.glob("state-moscpr-s*.pt"))
    if not seeds:
        print(f"no state-moscpr-s*.pt in {work}: the study's part skipped", flush=True)
        return []
    options = study.parse_args(["--heads", "moscpr", "--work-dir", str(work), "--threads", "1"])
    cache = study.head_cache("moscpr", seeds[0], "train", options)
    windows = torch.tensor([5, 100])  # the study's batch: 2 windows of 256 tokens
    rows = []
    for seed in seeds:
        head = study.build_warm("moscpr", seed, options)
        state = torch.load(work / f"state-moscpr-s{seed}.pt", weights_only=True)
        head.load_state_dict(state["head"])
        head.train()
        hidden, inputs, targets = cache.windows(windows, "cpu", head.reads)

        def step(head=head, hidden=hidden, inputs=inputs, targets=targets) -> float:
            head.zero_grad()
            loss = head.loss(hidden, targets, **inputs)
            loss.backward()
            return loss.item()

        steps_done = len(state["history"])
        row = {"head": "moscpr", "seed": seed, "steps_trained": steps_done,
               **kept_and_flushed(step, args.repeats), "load_average": os.getloadavg()}
        print(f"moscpr seed {seed} after {steps_done} steps: {row['kept_s']:.1f} s kept, "
              f"{row['flushed_s']:.1f} s flushed (x{row['ratio']:.2f})", flush=True)
        rows.append(row)
    return rows


MAP_BATCH, MAP_BPTT = 32, 35  # the small PTB recipe's, which every map cell trains with


def map_runs(args) -> list[dict]:
    """One training step of each trained map run (``--map-runs``), kept and flushed."""

    from highrank.models.load import load_run_corpus

    rows = []
    for run in args.map_runs:
        model, _, corpus = load_run_corpus(run, "best")
        model.train()
        bptt = min(MAP_BPTT, (len(corpus.train) - 1) // MAP_BATCH)  # shorter in a tiny corpus
        ids = corpus.train[: MAP_BATCH * bptt + 1]
        tokens = ids[:-1].view(MAP_BATCH, bptt).t().contiguous()  # (T, B)
        targets = ids[1:].view(MAP_BATCH, bptt).t().contiguous()

        def step(model=model, tokens=tokens, targets=targets) -> float:
            model.zero_grad()
            loss, _, _ = model(tokens, targets)
            loss.backward()
            return loss.item()

        row = {"run": Path(run).name, **kept_and_flushed(step, args.repeats),
               "load_average": os.getloadavg()}
        print(f"{row['run']}: {row['kept_s']:.3f} s kept, {row['flushed_s']:.3f} s flushed "
              f"(x{row['ratio']:.2f})", flush=True)
        rows.append(row)
    return rows


def report(record: dict) -> str:
    lines = ["# Denormals kept and flushed: one training step on the CPU", "",
             f"`python -m benchmarks.heads.denormals` ({record['machine'].get('cpu', '?')}, "
             f"{record['threads']} thread; medians of {record['repeats']}, kept and flushed "
             "alternated; its change: the largest difference of the loss between the two "
             "settings; load: the 1-minute load average after the row).", "",
             "| head | scale | log-probs in (-103.3, -87.3) | kept (s) | flushed (s) "
             "| kept / flushed | loss | its change | load |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in record["synthetic"]:
        lines.append(f"| {r['head']} | {r['scale']:g} | {r['share_in_denormal_band']:.1%} | "
                     f"{r['kept_s']:.2f} | {r['flushed_s']:.2f} | {r['ratio']:.2f} | "
                     f"{r['loss']:.6f} | {r['loss_difference']:.1e} | "
                     f"{r['load_average'][0]:.1f} |")
    if record["study"]:
        lines += ["", "The warm-start study's MoS + CPR, one step of 2 windows of 256 tokens "
                  "from each seed's saved state:", "",
                  "| seed | steps trained | kept (s) | flushed (s) | kept / flushed | loss "
                  "| its change | load |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: "
                  "| ---: |"]
        for r in record["study"]:
            lines.append(f"| {r['seed']} | {r['steps_trained']} | {r['kept_s']:.1f} | "
                         f"{r['flushed_s']:.1f} | {r['ratio']:.2f} | {r['loss']:.6f} | "
                         f"{r['loss_difference']:.1e} | {r['load_average'][0]:.1f} |")
    if record.get("map"):
        lines += ["", "The bottleneck map's trained models, one training step of 32 x 35 tokens "
                  "(best checkpoint, training mode):", "",
                  "| run | kept (s) | flushed (s) | kept / flushed | loss | its change | load |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in record["map"]:
            lines.append(f"| {r['run']} | {r['kept_s']:.3f} | {r['flushed_s']:.3f} | "
                         f"{r['ratio']:.2f} | {r['loss']:.6f} | {r['loss_difference']:.1e} | "
                         f"{r['load_average'][0]:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=49_152)
    parser.add_argument("--d", type=int, default=576)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--scales", type=lambda t: [float(x) for x in t.split(",")],
                        default=[1.0, 8.0, 32.0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--study-work-dir", default=None,
                        help="the warm-start study's --work-dir (its saved MoS + CPR states)")
    parser.add_argument("--map-runs", type=lambda t: [x for x in t.split(",") if x], default=[],
                        help="comma-separated bottleneck-map run folders (their best.pt)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # the flag is the calling thread's: no workers to miss it
    if not torch.set_flush_denormal(False):
        print("this CPU cannot flush denormals (not x86 with SSE3): nothing to measure")
        return 0
    record = {"threads": torch.get_num_threads(), "repeats": args.repeats,
              "vocab": args.vocab, "d": args.d, "tokens": args.tokens,
              "machine": machine(torch.get_num_threads()),
              "synthetic": synthetic(args),
              "study": study_states(args) if args.study_work_dir else [],
              "map": map_runs(args)}
    write_json(args.out / "denormals.json", record)
    write_text(args.out / "denormals.md", report(record))
    print(f"wrote {args.out / 'denormals.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
