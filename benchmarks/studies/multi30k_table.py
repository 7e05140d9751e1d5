"""Multi30k en->de with softmax, MoS-9 and Mixtape: the shape of the Mixtape paper's Table 5.

    python -m benchmarks.studies.multi30k_table [--data ../shared/data]
        [--heads softmax,mos,mixtape] [--epochs N] [--threads 1] [--memory-budget-mb 3072] [--tiny]
        [--runs runs/multi30k-table] [--out benchmarks/results/multi30k-table]

For every head (``configs/multi30k/transformer-<head>.toml``, the same budget for all:
``--epochs``, default the configs'):

1. **train** with ``highrank train`` in a subprocess (``OMP_NUM_THREADS=--threads``); a run that
   stopped is continued with ``highrank train --resume`` (exactly), a finished one is kept;
2. **BLEU** on test2016 with ``highrank translate RUN --split test`` (the config's beam 5,
   length penalty 1.0), sacreBLEU signature recorded;
3. **time per batch at the same batch size**: in one process, one model per head (same sizes,
   the run's subwords), the same ``--timing-batches`` training batches (train.max_tokens tokens
   each) fed to each model in turn, interleaved ``--repeats`` times; a step is forward,
   backward and the AdamW update (label smoothing 0.1). Medians and ratios to softmax; the
   output layer alone (``head.loss`` forward + backward on fixed hidden states) the same way;
4. **per sentence at the same peak-memory budget**: for each head, fresh processes train on
   ``B`` sentences (a fixed random sample of train pairs, padded) for ``--memory-steps`` steps
   and report their peak RSS; ``B`` doubles from 8 until the peak exceeds
   ``--memory-budget-mb``, then is bisected; the largest ``B`` that fits and its median time
   per sentence are recorded.
5. **sentences**: the time per sentence at those batch sizes, side by side: one process
   builds every head's model and its largest batch (the very batch its probe fitted) and
   times their training steps interleaved ``--repeats`` times (medians, ratios to the first
   head); the probes' own step times came from separate processes at other moments.

Each stage writes ``<out>/<stage>-<head>.json`` (or ``timing.json``) when done and is skipped
when that file exists: rerunning continues, never redoes finished work. The stages run on
:class:`benchmarks.study.Study`, each in a fresh process (its record adds the stage's seconds
and peak RSS); several processes may share the study. The table is
``<out>/table.md`` and ``table.json``. ``--tiny`` shrinks everything (d 32, one layer, 1,000
subwords, 30 steps, test sentences decoded greedily) so the whole pipeline runs in minutes; its
numbers are only a check that the script works.

Machine facts (CPU, threads, torch version) are recorded beside every number.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks._common import DATA, REPO, machine, module_name, run_env, write_json, write_text
from benchmarks.study import Stage, Study, module_command

MODULE = module_name(__file__)  # benchmarks.studies.multi30k_table

HEADS = ("softmax", "mos", "mixtape")
STAGES = ("train", "bleu", "timing", "memory", "sentences", "table")
TINY = [
    "--model.d_embed=32",
    "--model.n_heads=2",
    "--model.n_encoder_layers=1",
    "--model.n_decoder_layers=1",
    "--model.d_ff=64",
    "--data.subword_vocab_size=1000",
    "--train.max_tokens=1024",
    "--train.warmup_steps=5",
    "--train.eval_every=15",
    "--train.lr_schedule=inverse-sqrt",
    "--head.gate_dim=8",  # mixtape only (filtered for other heads)
]
TINY_STEPS = 30


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=str(DATA), help="data root")
    p.add_argument("--heads", default=",".join(HEADS))
    p.add_argument("--epochs", type=int, help="train.epochs for every head (default: configs')")
    # 1: on the shared 2-vCPU machine (load ~13) 2 threads ran a first step 5x slower than 1
    # (benchmarks/results/multi30k-step-time).
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--memory-budget-mb", type=float, default=3072.0)
    p.add_argument("--memory-steps", type=int, default=3)
    p.add_argument("--timing-batches", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="a minutes-long check of the pipeline")
    p.add_argument(
        "--stages",
        default=",".join(STAGES),
        help="run only these stages (e.g. train,bleu for the heads done so far)",
    )
    p.add_argument("--runs", default=str(REPO / "runs" / "multi30k-table"))
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "multi30k-table"))
    p.add_argument("--probe-memory", metavar="HEAD", help=argparse.SUPPRESS)
    p.add_argument("--sentences", type=int, help=argparse.SUPPRESS)
    p.add_argument("--stage", help=argparse.SUPPRESS)  # a child's one stage
    return p.parse_args(argv)


def head_overrides(head: str, args) -> list[str]:
    """Command-line overrides of a head's run (the same for every head but head-only knobs)."""
    words = [f"--train.epochs={args.epochs}"] if args.epochs else []
    if args.tiny:
        words += [w for w in TINY if not w.startswith("--head.") or head == "mixtape"]
    return words


def highrank(words: list[str], threads: int) -> None:
    command = [sys.executable, "-m", "highrank", *words]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True, env=run_env(threads), cwd=REPO)


# ---- 1. training and 2. BLEU -------------------------------------------------------------------


def train_head(head: str, args, run: Path, data_dir: Path) -> dict:
    from highrank.runs.checkpoint import load_checkpoint
    from highrank.runs.run_dir import read_metrics

    config = REPO / "configs" / "multi30k" / f"transformer-{head}.toml"
    steps = ["--max-steps", str(TINY_STEPS)] if args.tiny else []
    last = run / "checkpoints" / "last.pt"
    if last.is_file():
        progress = load_checkpoint(last)["training"]["progress"]
        if not progress["done"] and not (args.tiny and progress["step"] >= TINY_STEPS):
            highrank(["train", "--resume", str(run), *steps, "--no-progress"], args.threads)
    else:
        words = [str(config), f"--run.out_dir={run}", f"--data.dir={data_dir}"]
        highrank(["train", *words, *head_overrides(head, args), *steps, "--no-progress"],
                 args.threads)  # fmt: skip
    records = read_metrics(run / "metrics.jsonl")
    evals = [r for r in records if r["kind"] in ("epoch", "eval")]
    return {
        "head": head,
        "run": str(run),
        "steps": max(r["step"] for r in records),
        "train_seconds": round(train_seconds(evals), 1),
        "best_val_loss": min(r["val_loss"] for r in evals),
        "best_val_ppl": min(r["val_ppl"] for r in evals),
        "overrides": head_overrides(head, args),
    }


def train_seconds(evals: list[dict]) -> float:
    """Seconds in training steps up to the last validation: each validation record holds its
    epoch's cumulative step time, so the sum over epochs of the largest."""
    per_epoch: dict[int, float] = {}
    for record in evals:
        per_epoch[record["epoch"]] = max(per_epoch.get(record["epoch"], 0.0), record["seconds"])
    return sum(per_epoch.values())


def bleu_head(head: str, args, run: Path) -> dict:
    search = ["--greedy"] if args.tiny else []
    out = run / "test-hypotheses.de"
    highrank(["translate", str(run), "--split", "test", "--out", str(out), *search], args.threads)
    records = sorted(run.glob("translate-test-best-*.json"), key=lambda p: p.stat().st_mtime)
    return json.loads(records[-1].read_text())


# ---- 3. time per batch at the same batch size ------------------------------------------------


def load_models(heads, args, runs: Path):
    """One model per head (its run's config), the run's subwords, the train pairs."""
    from highrank.models import build_seq2seq
    from highrank.mt.translation_data import saved_translation_data
    from highrank.runs.run_dir import RunDir

    models, data = {}, None
    for head in heads:
        run = RunDir.open(runs / head)
        config = run.load_config()
        data = data or saved_translation_data(run.path, config, ("train",))
        models[head] = (build_seq2seq(config, data.vocab_sizes), config)
    return models, data


def training_step(model, optimizer, batch, label_smoothing=0.1) -> float:
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss = model.loss(batch.src, batch.tgt_in, batch.tgt_out, label_smoothing=label_smoothing)
    loss.backward()
    optimizer.step()
    return time.perf_counter() - start


def head_step(model, hidden, target, pad) -> float:
    """The output layer alone: loss forward + backward on fixed hidden states."""
    start = time.perf_counter()
    hidden = hidden.detach().requires_grad_(True)
    loss = model.head.loss(hidden, target, ignore_index=pad, label_smoothing=0.1)
    loss.backward()
    return time.perf_counter() - start


def timing(heads, args, runs: Path) -> dict:
    import torch

    from highrank.mt.bitext import TokenBatches
    from highrank.train.schedule import build_adamw

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    models, data = load_models(heads, args, runs)
    config = next(iter(models.values()))[1]
    batches = TokenBatches(
        data.pairs("train"), max_tokens=config.train.max_tokens, special=data.special,
        shuffle=True, seed=0, epoch=1, max_len=config.model.max_len,
    )[: args.timing_batches]  # fmt: skip
    optimizers = {h: build_adamw(m, 1e-4, 0.0, (0.9, 0.98), 1e-9) for h, (m, _) in models.items()}
    step = {h: [] for h in heads}
    head_only = {h: [] for h in heads}
    hidden = {}
    for h, (model, _) in models.items():
        model.train()
        for i, batch in enumerate(batches):
            with torch.no_grad():
                hidden[h, i] = model(batch.src, batch.tgt_in)
        training_step(model, optimizers[h], batches[0])  # warm-up, not timed
    for _ in range(args.repeats):
        for i, batch in enumerate(batches):
            for h, (model, _) in models.items():  # interleaved: the machine's load hits all
                step[h].append(training_step(model, optimizers[h], batch))
                head_only[h].append(head_step(model, hidden[h, i], batch.tgt_out, data.special.pad))
    result = {"batch_tokens": config.train.max_tokens, "batches": len(batches),
              "sentences_per_batch": [len(b) for b in batches], "repeats": args.repeats,
              "machine": machine(args.threads), "heads": {}}  # fmt: skip
    for h in heads:
        result["heads"][h] = {
            "step_ms_median": 1000 * statistics.median(step[h]),
            "head_ms_median": 1000 * statistics.median(head_only[h]),
            "step_ratio": statistics.median(step[h]) / statistics.median(step[heads[0]]),
            "head_ratio": statistics.median(head_only[h]) / statistics.median(head_only[heads[0]]),
            "parameters": sum(p.numel() for p in models[h][0].parameters()),
        }
    return result


# ---- 4. per sentence at the same peak-memory budget -------------------------------------------


def sentence_batch(data, config, sentences: int):
    """``sentences`` train pairs drawn from a fixed generator (those that fit model.max_len),
    padded into one batch: the indices and the batch."""
    import numpy as np

    from highrank.mt.bitext import collate

    pairs = data.pairs("train")
    lengths = np.maximum(pairs.src_lengths, pairs.tgt_lengths) + 1
    keep = np.flatnonzero(lengths <= config.model.max_len)
    chosen = np.random.default_rng(0).choice(keep, size=min(sentences, keep.size), replace=False)
    return chosen, collate(pairs, chosen, data.special)


def probe_memory(head: str, sentences: int, args, runs: Path) -> None:
    """(A fresh process.) Train ``sentences`` fixed pairs for a few steps; print peak RSS and
    the median step time as JSON."""
    import torch

    from highrank.train.schedule import build_adamw

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    models, data = load_models([head], args, runs)
    model, config = models[head]
    chosen, batch = sentence_batch(data, config, sentences)
    optimizer = build_adamw(model, 1e-4, 0.0, (0.9, 0.98), 1e-9)
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    times = [training_step(model, optimizer, batch) for _ in range(args.memory_steps)]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"sentences": len(chosen), "padded_tokens": int(batch.tgt_out.numel()),
                      "peak_rss_mb": peak, "before_steps_rss_mb": baseline,
                      "step_s_median": statistics.median(times[1:] or times)}))  # fmt: skip


def memory_head(head: str, args, runs: Path) -> dict:
    def probe(b: int) -> dict:
        words = [sys.executable, "-m", MODULE, "--probe-memory", head,
                 "--sentences", str(b), "--runs", str(runs), "--threads", str(args.threads),
                 "--memory-steps", str(args.memory_steps)]  # fmt: skip
        done = subprocess.run(words, capture_output=True, text=True, env=run_env(args.threads))
        if done.returncode != 0:  # e.g. killed for memory: does not fit
            return {"sentences": b, "peak_rss_mb": float("inf"), "error": done.stderr[-300:]}
        return json.loads(done.stdout.strip().splitlines()[-1])

    budget, probes = args.memory_budget_mb, []
    fits, fails, b = None, None, 8
    while fails is None and b <= 65536:
        result = probe(b)
        probes.append(result)
        if result["peak_rss_mb"] <= budget and result["sentences"] == b:
            fits, b = result, b * 2
        else:
            fails = result
    while (
        fits is not None
        and fails is not None
        and fails["sentences"] - fits["sentences"] > max(4, fits["sentences"] // 8)
    ):
        middle = (fits["sentences"] + fails["sentences"]) // 2
        result = probe(middle)
        probes.append(result)
        fits, fails = (result, fails) if result["peak_rss_mb"] <= budget else (fits, result)
    best = fits or {}
    return {
        "head": head,
        "budget_mb": budget,
        "largest_batch_sentences": best.get("sentences"),
        "peak_rss_mb": best.get("peak_rss_mb"),
        "ms_per_sentence": 1000 * best["step_s_median"] / best["sentences"] if best else None,
        "probes": probes,
        "machine": machine(args.threads),
    }


def sentence_timing(heads, out: Path, args, runs: Path) -> dict:
    """Stage 5: each head at its largest batch in the memory budget, timed side by side."""
    import torch

    from highrank.train.schedule import build_adamw

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    models, data = load_models(heads, args, runs)
    sizes = {h: json.loads((out / f"memory-{h}.json").read_text())["largest_batch_sentences"]
             for h in heads}  # fmt: skip
    batches = {h: sentence_batch(data, models[h][1], sizes[h])[1] for h in heads}
    optimizers = {h: build_adamw(m, 1e-4, 0.0, (0.9, 0.98), 1e-9) for h, (m, _) in models.items()}
    times = {h: [] for h in heads}
    for h, (model, _) in models.items():
        model.train()
        training_step(model, optimizers[h], batches[h])  # warm-up, not timed
    for _ in range(args.repeats):
        for h, (model, _) in models.items():  # interleaved: the machine's load hits all
            times[h].append(training_step(model, optimizers[h], batches[h]))
    per = {h: statistics.median(times[h]) / sizes[h] for h in heads}
    return {"repeats": args.repeats, "machine": machine(args.threads),
            "heads": {h: {"sentences": sizes[h], "step_s": times[h],
                          "ms_per_sentence": 1000 * per[h], "ratio": per[h] / per[heads[0]]}
                      for h in heads}}  # fmt: skip


# ---- the table ---------------------------------------------------------------------------------


def table(heads, out: Path, args) -> None:
    rows = []
    timing_record = json.loads((out / "timing.json").read_text())
    side_by_side = out / "sentences.json"  # stage 5; without it the column is left empty
    per_sentence = json.loads(side_by_side.read_text())["heads"] if side_by_side.is_file() else {}
    for head in heads:
        train = json.loads((out / f"train-{head}.json").read_text())
        bleu = json.loads((out / f"bleu-{head}.json").read_text())
        memory = json.loads((out / f"memory-{head}.json").read_text())
        t = timing_record["heads"][head]
        rows.append({"head": head, "bleu": bleu["bleu"], "signature": bleu["signature"],
                     "steps": train["steps"], "train_seconds": train["train_seconds"],
                     "best_val_ppl": train["best_val_ppl"], **t,
                     "largest_batch_sentences": memory["largest_batch_sentences"],
                     "ms_per_sentence": per_sentence.get(head, {}).get("ms_per_sentence"),
                     })  # fmt: skip
    base = rows[0]["ms_per_sentence"]
    m = timing_record["machine"]
    cpu, threads = m.get("cpu", m.get("processor")), m.get("torch_threads", m.get("threads"))
    lines = [
        f"Multi30k en->de test2016; {cpu}, {m['cpu_count']} CPUs, {threads} "
        f"thread(s), torch {m['torch']} ({m['note']}); memory budget {args.memory_budget_mb:g} "
        f"MB peak RSS; time per batch at {timing_record['batch_tokens']} tokens"
        + (" (--tiny: a check of the pipeline, not a result)" if args.tiny else ""),
        "",
        "| head | test BLEU | steps | train s | valid ppl | ms/batch (ratio) | head ms/batch "
        "(ratio) | largest batch in budget | ms/sentence (ratio) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        per = r["ms_per_sentence"]
        ratio = f"{per / base:.2f}" if per and base else "-"
        lines.append(
            f"| {r['head']} | {r['bleu']:.2f} | {r['steps']} | {r['train_seconds']:.0f} | "
            f"{r['best_val_ppl']:.2f} | {r['step_ms_median']:.0f} ({r['step_ratio']:.2f}) | "
            f"{r['head_ms_median']:.0f} ({r['head_ratio']:.2f}) | {r['largest_batch_sentences']} "
            f"| {per if per is None else f'{per:.1f}'} ({ratio}) |"
        )
    lines += ["", f"sacreBLEU signature: {rows[0]['signature']}"]
    write_text(out / "table.md", "\n".join(lines) + "\n")
    write_json(out / "table.json", {"rows": rows, "tiny": args.tiny})
    print("\n".join(lines))


def main(argv=None) -> int:
    args = parse_args(argv)
    runs, out = Path(args.runs), Path(args.out)
    heads = tuple(h.strip() for h in args.heads.split(",") if h.strip())
    if args.probe_memory:
        probe_memory(args.probe_memory, args.sentences, args, runs)
        return 0
    data_dir = Path(args.data) / "multi30k"
    if not (data_dir / "train.en").is_file():
        print(f"skipped: no Multi30k at {data_dir} (expected train.en, train.de, ...); "
              "pass --data", file=sys.stderr)  # fmt: skip
        return 0
    runner = study(heads, args, data_dir, argv if argv is not None else sys.argv[1:])

    def summary() -> None:
        if "table" in {s.strip() for s in args.stages.split(",")}:
            table(heads, out, args)

    return runner.main(args.stage, summarize=summary)


def study(heads, args, data_dir: Path, argv) -> Study:
    """The chosen ``--stages`` as a :class:`benchmarks.study.Study`: records ``<out>/<stage>.json``
    (``train-<head>``, ``bleu-<head>``, ``timing``, ``memory-<head>``, ``sentences``), each stage
    in a fresh process, lock files in ``--runs``."""
    runs, out = Path(args.runs), Path(args.out)
    chosen = {s.strip() for s in args.stages.split(",")}
    trained = tuple(f"train-{h}" for h in heads)
    plan = []
    for head in heads:
        plan += [Stage(f"train-{head}")] if "train" in chosen else []
        plan += [Stage(f"bleu-{head}", (f"train-{head}",))] if "bleu" in chosen else []
    plan += [Stage("timing", trained)] if "timing" in chosen else []
    plan += [Stage(f"memory-{h}", (f"train-{h}",)) for h in heads if "memory" in chosen]
    if "sentences" in chosen:
        plan.append(Stage("sentences", tuple(f"memory-{h}" for h in heads)))

    def work(stage: str) -> dict:
        kind, _, head = stage.partition("-")
        if kind == "train":
            return train_head(head, args, runs / head, data_dir)
        if kind == "bleu":
            return bleu_head(head, args, runs / head)
        if kind == "memory":
            return memory_head(head, args, runs)
        return {"timing": lambda: timing(heads, args, runs),
                "sentences": lambda: sentence_timing(heads, out, args, runs)}[kind]()

    return Study(plan, work, records=out, locks=runs, indent=2, end="\n",
                 child=module_command(MODULE, argv))

if __name__ == "__main__":
    raise SystemExit(main())
