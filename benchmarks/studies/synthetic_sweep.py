"""The heads on a synthetic language of known rank, over a sweep of true rank r and dimension d.

    python -m benchmarks.studies.synthetic_sweep [--ranks 16,64,256] [--dims 8,16,32]
        [--seeds 0,1,2] [--heads softmax,moc,mos,mixtape,sigsoftmax,gss,plif] [--steps 2000]
        [--out benchmarks/results/synthetic-sweep]

Where the rank story is exact: ``highrank demo``'s setting (:mod:`highrank.demo`) — a true
N x V log-probability matrix of rank exactly r (N = V = 256, logits N(0, 3^2) through a rank-r
factorisation), and every head fitted to it by full-batch Adam on the exact KL with free
d-dimensional context vectors, the same steps, learning rate and seed-tied initialisation for
all heads — repeated for every (r, d, seed) of the sweep. Per head it records the final mean
KL(P* || P_theta) (nats, float64) and the Press rank of the learned log-prob matrix. A softmax
head's matrix has rank at most d + 2, so with d < r - 1 it cannot reach KL 0; the mixtures can.

Each cell (r, d, seed) is a stage of :class:`benchmarks.study.Study`: written to
``<out>/cells/r<r>-d<d>-seed<s>.json`` when done (with its seconds and peak RSS) and skipped
when that file exists (rerunning continues; processes sharing the sweep split its cells).
Then ``summary.json``/``summary.md`` (per r, d and head: mean and sd of KL over seeds, mean
learned rank) and ``sweep.png`` (KL against r, one panel per d). One thread, deterministic
kernels (as the demo): the numbers do not depend on the machine's load; the seconds do.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict
from pathlib import Path

from benchmarks._common import REPO, machine, save_figure, write_json, write_text
from benchmarks.study import Stage, Study


def int_list(text: str) -> list[int]:
    return [int(word) for word in text.split(",")]


def parse_args(argv=None) -> argparse.Namespace:
    from highrank.heads import HEADS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--ranks", type=int_list, default=[16, 64, 256])
    p.add_argument("--dims", type=int_list, default=[8, 16, 32])
    p.add_argument("--seeds", type=int_list, default=[0, 1, 2])
    p.add_argument("--heads", default=",".join(HEADS))
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "synthetic-sweep"))
    args = p.parse_args(argv)
    args.heads = tuple(args.heads.split(","))
    return args


def cell_path(args, rank: int, dim: int, seed: int) -> Path:
    return Path(args.out) / "cells" / f"r{rank}-d{dim}-seed{seed}.json"


def run_cell(args, rank: int, dim: int, seed: int) -> dict:
    """Fit every head to one true matrix; the cell's record."""
    from highrank.demo import DemoSettings, fit_head, true_log_probs

    settings = DemoSettings(rank=rank, dim=dim, seed=seed, steps=args.steps, heads=args.heads)
    target = true_log_probs(settings)  # (N, V) float64
    heads = {}
    for name in settings.heads:
        result = fit_head(name, settings, target)
        heads[name] = {
            "kl": result.kl,
            "rank": result.rank,
            "params": result.params,
            "seconds": round(result.seconds, 2),
        }
    return {"settings": asdict(settings), "softmax_rank_bound": dim + 2, "heads": heads}


def summarize(args, cells: dict[tuple[int, int, int], dict]) -> dict:
    rows = []
    for rank in args.ranks:
        for dim in args.dims:
            group = [cells[(rank, dim, s)] for s in args.seeds if (rank, dim, s) in cells]
            for head in args.heads:
                kls = [c["heads"][head]["kl"] for c in group]
                ranks = [c["heads"][head]["rank"] for c in group]
                rows.append({
                    "r": rank, "d": dim, "head": head, "seeds": len(group),
                    "kl_mean": statistics.mean(kls),
                    "kl_sd": statistics.stdev(kls) if len(kls) > 1 else 0.0,
                    "rank_mean": statistics.mean(ranks),
                    "params": group[0]["heads"][head]["params"],
                })  # fmt: skip
    return {"steps": args.steps, "seeds": args.seeds, "machine": machine(1), "rows": rows}


def summary_markdown(args, summary: dict) -> str:
    lines = [
        f"KL(P* || P_theta) in nats, mean +- sd over seeds {args.seeds}; learned Press rank "
        f"(mean); N = V = 256, {args.steps} full-batch Adam steps per head.",
        "",
        "| r | d | " + " | ".join(args.heads) + " |",
        "| ---: | ---: | " + " | ".join("---" for _ in args.heads) + " |",
    ]
    by_cell: dict[tuple[int, int], dict[str, dict]] = {}
    for row in summary["rows"]:
        by_cell.setdefault((row["r"], row["d"]), {})[row["head"]] = row
    for (rank, dim), heads in by_cell.items():
        cells = [
            f"{row['kl_mean']:.4f} +- {row['kl_sd']:.4f} (rank {row['rank_mean']:.0f})"
            for row in (heads[h] for h in args.heads)
        ]
        lines.append(f"| {rank} | {dim} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(args, summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(args.dims), figsize=(4 * len(args.dims), 3.6), sharey=True)
    axes = axes if len(args.dims) > 1 else [axes]
    for axis, dim in zip(axes, args.dims, strict=True):
        for head in args.heads:
            rows = [r for r in summary["rows"] if r["d"] == dim and r["head"] == head]
            x, y, sd = ([r[k] for r in rows] for k in ("r", "kl_mean", "kl_sd"))
            axis.errorbar(x, y, yerr=sd, marker="o", capsize=2, label=head)
        axis.set_xscale("log", base=2)
        axis.set_yscale("symlog", linthresh=1e-3)
        axis.set_title(f"d = {dim} (softmax rank <= {dim + 2})")
        axis.set_xlabel("true rank r")
    axes[0].set_ylabel("KL(P* || P_theta), nats")
    axes[-1].legend(fontsize=7)
    figure.tight_layout()
    save_figure(figure, path, dpi=120)
    plt.close(figure)


def main(argv=None) -> int:
    args = parse_args(argv)
    grid = {cell_path(args, *cell).stem: cell
            for cell in [(r, d, s) for r in args.ranks for d in args.dims for s in args.seeds]}
    out = Path(args.out)
    study = Study([Stage(name) for name in grid], lambda name: run_cell(args, *grid[name]),
                  records=out / "cells", locks=out / ".locks", indent=2, end="\n")
    status = study.run()
    if status:
        return status
    cells = {cell: json.loads(study.record_path(name).read_text()) for name, cell in grid.items()}
    summary = summarize(args, cells)
    write_json(out / "summary.json", summary)
    write_text(out / "summary.md", summary_markdown(args, summary))
    plot(args, summary, out / "sweep.png")
    print(summary_markdown(args, summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
