"""What a high-rank head costs at inference: ``log_prob`` of each warm-startable head at
SmolLM2's shape (d = 576, V = 49,152) against the softmax head's, side by side in one process.

    python -m benchmarks.heads.inference_cost [--rows 1,4,256] [--repeats 9] [--threads 1]
        [--out benchmarks/results/inference-cost] [--profile ROWS | --gemm-columns]

Each repeat times every head once on the same random hidden states (interleaved, so machine noise
hits all alike; eval mode, no gradients), by the wall clock and by this process's CPU time (which
leaves out the time other jobs held the cores); reported: the median time of each head and its ratio
to the softmax's median, per number of rows (1: one generation step; 4: four beams; 256: scoring a
window). Heads built as ``attach_head(init="base")`` builds them (residual contexts for the
mixtures). ``EARLIER`` paths (MoS's log-space chain, ``*_chain``) run on the same head objects,
under ``highrank.heads.kernels.reference_paths()``, so before and after are measured side by
side.

Issue 19's targets: MoS with K components within 1.15 K of the softmax, Mixtape within 1.3.
``--profile ROWS`` profiles every variant instead (``profile-ROWS.md``/``.json``): the time in
matrix products against everything else, and the costliest operators. ``--gemm-columns`` times
the decoder's GEMM at Mixtape's block widths and the next multiples of 16 (``gemm-columns.md``).
Every timing run records the machine's load (``os.getloadavg()``: 1, 5 and 15 minutes) just
before and just after it (``load_average`` in each JSON record, a line in each table), so a
figure said to come from a quiet machine can be checked against its record.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks._common import REPO, machine, write_json, write_text

D_MODEL, VOCAB = 576, 49_152
HEADS = {
    "softmax": ("softmax", {}),
    "mos2": ("mos", {"n_components": 2}),
    "mos4": ("mos", {"n_components": 4}),
    "mixtape": ("mixtape", {}),
}
TARGETS = {"mos2": 1.15 * 2, "mos4": 1.15 * 4, "mixtape": 1.3}
# The reference paths (``highrank.heads.kernels.reference_paths()``), timed beside the default
# on the same head object: label -> head label. MoS's log-space chain is what log_prob computed
# before the in-place mixing (``heads/kernels/in_place.py: mixture_log_prob_``); Mixtape's
# general path what it computed before its in-place assembly; the softmax's general path
# normalises into a new tensor, as it did before its in-place normalisation.
EARLIER = {
    "softmax_general": "softmax",
    "mos2_chain": "mos2",
    "mos4_chain": "mos4",
    "mixtape_general": "mixtape",
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,256")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/inference-cost")
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="ROWS",
        help="instead of timing: profile every variant at ROWS rows",
    )
    parser.add_argument(
        "--gemm-columns",
        action="store_true",
        help="instead: time the decoder GEMM at column counts that are multiples of 16 or not",
    )
    return parser.parse_args(argv)


def load_average() -> list[float] | None:
    """The machine's 1, 5 and 15-minute load averages (``os.getloadavg()``, rounded to 0.01);
    None where the platform keeps none."""
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def timed_load(run, *args) -> tuple:
    """``run(*args)`` and the load averages just before and just after it."""
    before = load_average()
    out = run(*args)
    return out, {"before": before, "after": load_average()}


def load_line(loads: dict) -> str:
    """One line naming the recorded load of every timing run (``loads``: label -> before/after)."""

    def show(values):
        return "not available" if values is None else " / ".join(f"{v:.2f}" for v in values)

    parts = [f"{label}: {show(load['before'])} before, {show(load['after'])} after"
             for label, load in loads.items()]  # fmt: skip
    return "Load average (1 / 5 / 15 min, `os.getloadavg()`): " + "; ".join(parts) + ".\n"


def build_heads():
    import torch

    from highrank.heads import base_init_knobs, build_head

    torch.manual_seed(0)
    heads = {}
    for label, (name, knobs) in HEADS.items():
        head = build_head(name, d_in=D_MODEL, vocab_size=VOCAB, **base_init_knobs(name, knobs))
        heads[label] = head.eval()
    return heads


def variants(heads: dict) -> dict:
    """label -> (head, on its reference path?): every head as built, then EARLIER."""
    out = {label: (head, False) for label, head in heads.items()}
    out.update({label: (heads[of], True) for label, of in EARLIER.items()})
    return out


def log_prob_seconds(head, reference: bool, hidden) -> tuple[float, float]:
    """Wall-clock and CPU seconds (this process's) of one ``head.log_prob(hidden)``, on the
    head's reference path (``reference_paths()``) when ``reference``."""
    from highrank.heads.kernels import reference_paths

    with reference_paths(reference):
        wall, cpu = time.perf_counter(), time.process_time()
        head.log_prob(hidden)
        return time.perf_counter() - wall, time.process_time() - cpu


def time_rows(heads: dict, rows: int, repeats: int) -> dict:
    import torch

    hidden = torch.randn(rows, D_MODEL)
    runs = variants(heads)
    seconds = {label: [] for label in runs}
    with torch.no_grad():
        for head, reference in runs.values():  # warm-up
            log_prob_seconds(head, reference, hidden)
        for _ in range(repeats):
            for label, (head, reference) in runs.items():
                seconds[label].append(log_prob_seconds(head, reference, hidden))
    wall = {label: statistics.median(t[0] for t in times) for label, times in seconds.items()}
    cpu = {label: statistics.median(t[1] for t in times) for label, times in seconds.items()}
    return {
        label: {
            "median_ms": round(1e3 * wall[label], 3),
            "ratio_to_softmax": round(wall[label] / wall["softmax"], 3),
            "median_cpu_ms": round(1e3 * cpu[label], 3),
            "cpu_ratio_to_softmax": round(cpu[label] / cpu["softmax"], 3),
            "target": TARGETS.get(label.split("_")[0]),
        }
        for label in runs
    }


def markdown(result: dict) -> str:
    labels = [*HEADS, *EARLIER]
    lines = [
        "| rows | " + " | ".join(labels) + " |",
        "|---:|" + "---:|" * len(labels),
    ]
    for rows, cells in result["rows"].items():
        for clock, ratio, ms in (("wall", "ratio_to_softmax", "median_ms"),
                                 ("CPU", "cpu_ratio_to_softmax", "median_cpu_ms")):  # fmt: skip
            row = [f"{cells[h][ratio]:.2f}x ({cells[h][ms]:.1f} ms)" for h in labels]
            lines.append(f"| {rows} ({clock}) | " + " | ".join(row) + " |")
    targets = ", ".join(f"{h} <= {t:.2f}x" for h, t in TARGETS.items())
    return "\n".join(lines) + (
        f"\n\nTargets (issue 19): {targets}. Wall: wall-clock medians; CPU: medians of this "
        "process's CPU time, which leaves out the time other jobs held the cores.\n"
    ) + ("\n" + load_line({f"{rows} rows": load for rows, load in result["load_average"].items()})
         if "load_average" in result else "")  # fmt: skip


MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}


def profile_rows(heads: dict, rows: int, calls: int = 3, top: int = 8) -> dict:
    """torch.profiler over ``calls`` log_prob calls of every variant at ``rows`` rows: per
    variant the milliseconds per call in matrix products and in everything else, and the
    ``top`` operators by self time (ms per call)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    hidden = torch.randn(rows, D_MODEL)
    out = {}
    with torch.no_grad():
        for label, (head, reference) in variants(heads).items():
            log_prob_seconds(head, reference, hidden)  # warm-up
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(calls):
                    log_prob_seconds(head, reference, hidden)
            events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
            ms = {e.key: e.self_cpu_time_total / 1e3 / calls for e in events}
            matmul = sum(v for k, v in ms.items() if k in MATMULS)
            out[label] = {
                "matmul_ms": round(matmul, 1),
                "other_ms": round(sum(ms.values()) - matmul, 1),
                "top_ops_ms": {e.key: round(ms[e.key], 1) for e in events[:top]},
            }
    return out


def profile_markdown(profiles: dict, rows: int) -> str:
    lines = [
        f"Profile of one `log_prob` of {rows} rows (torch.profiler, self time per operator, "
        "ms per call; matrix products = aten::mm/addmm/bmm/baddbmm).",
        "",
        "| variant | matrix products | everything else | top operators |",
        "|---|---:|---:|---|",
    ]
    for label, p in profiles.items():
        top = ", ".join(f"{k.removeprefix('aten::')} {v:.0f}" for k, v in p["top_ops_ms"].items())
        lines.append(f"| {label} | {p['matmul_ms']:.0f} | {p['other_ms']:.0f} | {top} |")
    return "\n".join(lines) + "\n"


# (rows, output columns) of the GEMMs timed by --gemm-columns: Mixtape's rare block (V - S
# ids, 256 rows) and frequent block (S ids, 4 x 256 rows) at SmolLM2's shape, each beside the
# next multiple of 16, and the softmax's full V.
GEMM_SHAPES = [(256, 49_152), (256, 44_237), (256, 44_240), (1024, 4_915), (1024, 4_928)]


def gemm_columns(repeats: int) -> dict:
    """CPU seconds (medians, interleaved) of ``x (rows, d) @ W[:columns]^T`` per shape, and
    the seconds per output value relative to the softmax's (256, V) product."""
    import torch

    weight = torch.randn(VOCAB, D_MODEL)
    inputs = {rows: torch.randn(rows, D_MODEL) for rows, _ in GEMM_SHAPES}
    seconds = {shape: [] for shape in GEMM_SHAPES}
    for _ in range(repeats + 1):  # the first round warms up
        for rows, columns in GEMM_SHAPES:
            began = time.process_time()
            torch.mm(inputs[rows], weight[:columns].t())
            seconds[(rows, columns)].append(time.process_time() - began)
    medians = {shape: statistics.median(times[1:]) for shape, times in seconds.items()}
    per_value = {shape: medians[shape] / (shape[0] * shape[1]) for shape in GEMM_SHAPES}
    reference = per_value[GEMM_SHAPES[0]]
    return {
        f"{rows}x{columns}": {
            "median_cpu_ms": round(1e3 * medians[(rows, columns)], 1),
            "per_value_vs_softmax": round(per_value[(rows, columns)] / reference, 3),
        }
        for rows, columns in GEMM_SHAPES
    }


def main(argv=None) -> int:
    import torch

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    heads = build_heads()
    if args.gemm_columns:
        timings, load = timed_load(gemm_columns, args.repeats)
        write_json(args.out / "gemm-columns.json",
                   {"d": D_MODEL, "repeats": args.repeats, "timings": timings,
                    "machine": machine(args.threads, note="shared with other jobs"),
                    "load_average": load})  # fmt: skip
        table = "| rows x columns | CPU ms (median) | time per value vs 256 x 49,152 |\n"
        table += "|---|---:|---:|\n" + "".join(
            f"| {shape} | {t['median_cpu_ms']:.1f} | {t['per_value_vs_softmax']:.2f} |\n"
            for shape, t in timings.items()
        )
        table += "\n" + load_line({"GEMMs": load})
        write_text(args.out / "gemm-columns.md", table)
        print(table)
        return 0
    if args.profile:
        profiles, load = timed_load(profile_rows, heads, args.profile)
        write_json(args.out / f"profile-{args.profile}.json",
                   {"rows": args.profile, "machine": machine(args.threads, note="shared with "
                    "other jobs while it ran"), "load_average": load,
                    "variants": profiles})  # fmt: skip
        table = profile_markdown(profiles, args.profile) + "\n" + load_line({"profile": load})
        write_text(args.out / f"profile-{args.profile}.md", table)
        print(table)
        return 0
    result = {
        "settings": {"d": D_MODEL, "vocab": VOCAB, "repeats": args.repeats,
                     "heads": {k: [n, kn] for k, (n, kn) in HEADS.items()},
                     "earlier_paths": {k: [of, {"reference_paths": True}]
                                       for k, of in EARLIER.items()}},
        "machine": machine(args.threads, note="shared with other jobs while it ran"),
        "rows": {},
        "load_average": {},
    }  # fmt: skip
    for rows in (int(r) for r in args.rows.split(",")):
        result["rows"][str(rows)], result["load_average"][str(rows)] = timed_load(
            time_rows, heads, rows, args.repeats
        )
        print(f"rows {rows}: " + ", ".join(
            f"{h} {c['ratio_to_softmax']:.2f}x (CPU {c['cpu_ratio_to_softmax']:.2f}x)"
            for h, c in result["rows"][str(rows)].items()
        ), flush=True)  # fmt: skip
    write_json(args.out / "log_prob.json", result)
    write_text(args.out / "log_prob.md", markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
