"""The heads' time with another process busy, against a quiet machine (issue 11, item 4).

    python -m benchmarks.heads.heads_under_load [--vocab 10000]
        [--cases softmax,softmax-unchunked,mixtape,mos] [--threads 1,2]
        [--policies default,PASSIVE] [--rounds 1] [--pause PID ...]
        [--out benchmarks/results/heads-under-load]

Each condition runs ``highrank bench heads``' timing (:func:`highrank.bench.heads.time_interleaved`:
every head step alternated with the naive softmax step, medians of ``--repeats``) in a fresh
worker process, because OpenMP reads its settings once, when torch loads it:

* **threads**: torch's intra-op threads (``OMP_NUM_THREADS``), 1 or the machine's 2;
* **policy**: ``OMP_WAIT_POLICY`` of the worker: ``default`` (unset: libgomp's threads spin for a
  while at every barrier before they sleep) or ``PASSIVE`` (they sleep at once);
* **load**: ``quiet``, or ``loaded``: one competing process (a single-threaded loop of 512 x 512
  float32 matmuls, as another training job) busy for the whole condition.

The question it answers: why do the chunked heads lose much more than the naive softmax when
another process is busy? A chunked head makes thousands of aten calls per step where the
naive softmax makes 60 (``ops_per_step``: every ``aten::`` event of torch's profiler, views and
nested calls included, so an upper bound on the parallel regions); an operator large enough to
be split over threads is an OpenMP parallel region that ends in a barrier. When the competing
process holds a core, one of our two threads is off the CPU while the other spins at the
barrier, on the very core the missing thread needs; with ``PASSIVE`` the waiting thread sleeps
and gives it back. Changing only the policy is the test of that explanation.

``--pause PID`` stops a process of your own (and its children) with SIGSTOP for the whole
benchmark, and continues it at the end (also on an error, Ctrl-C, SIGTERM or SIGHUP; after a
``kill -9`` of this script, continue them yourself with ``kill -CONT``): a quiet machine for the
quiet rows. The paused job's own clock keeps running: its logged speeds include the pause.
The results are ``heads-under-load.json`` (every measurement, the machine, the load average
before each condition) and ``heads-under-load.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks._common import REPO, module_name, write_json, write_text

MODULE = module_name(__file__)  # benchmarks.heads.heads_under_load

COMPETITOR = (
    "import torch\n"
    "torch.set_num_threads(1)\n"
    "a = torch.randn(512, 512)\n"
    "while True:\n"
    "    b = torch.tanh(a @ a)\n"
)

# ---- the worker: one condition, in its own process ----------------------------------------


def worker(vocab_size: int, labels: list[str], tokens: int, repeats: int, warmup: int) -> dict:
    """Time every case against the naive softmax under this process's OpenMP settings."""
    import torch

    from highrank.bench.heads import BASELINE, CASES, build_step, time_interleaved

    baseline = build_step(BASELINE, vocab_size, tokens, "cpu")
    rows = {"naive-softmax": {"ops_per_step": count_ops(baseline)}}
    for label in labels:
        step = build_step(CASES[label], vocab_size, tokens, "cpu")
        timing = time_interleaved(step, baseline, repeats=repeats, warmup=warmup, device="cpu")
        rows[label] = {**timing, "ops_per_step": count_ops(step)}
        del step
    policy = os.environ.get("OMP_WAIT_POLICY", "default")  # as this worker's libgomp read it
    return {"torch_threads": torch.get_num_threads(), "policy_seen": policy, "rows": rows}


def count_ops(step) -> int:
    """Operators (aten calls, forward and backward) one step runs: each is a parallel region."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        step()
    return sum(1 for event in profiler.events() if event.name.startswith("aten::"))


# ---- the driver -----------------------------------------------------------------------------


def run_condition(args, policy: str, threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    env.pop("OMP_WAIT_POLICY", None)
    if policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    command = [
        sys.executable,
        "-m",
        MODULE,
        "--worker",
        "--vocab",
        str(args.vocab),
        "--cases",
        ",".join(args.cases),
        "--tokens",
        str(args.tokens),
        "--repeats",
        str(args.repeats),
        "--warmup",
        str(args.warmup),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def start_competitor() -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    competitor = subprocess.Popen([sys.executable, "-c", COMPETITOR], env=env)
    time.sleep(3.0)  # torch imported, the loop running
    return competitor


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except OSError:  # gone since, or not ours: the others still get the signal
            pass


def processes_to_pause(roots: list[int]) -> list[int]:
    """Every process below ``roots``, never this script or its parents (stopping those would
    hang the benchmark); an error naming a PID that does not exist."""
    protected, current = set(), os.getpid()
    while current > 1:  # this process and its ancestors
        protected.add(current)
        stat = Path(f"/proc/{current}/stat").read_text()
        current = int(stat.rsplit(")", 1)[1].split()[1])
    for root in roots:
        if not Path(f"/proc/{root}").exists():
            raise SystemExit(f"--pause {root}: no such process")
        if root in protected:
            raise SystemExit(f"--pause {root}: that is this benchmark or one of its parents")
    return [pid for root in roots for pid in descendants(root) if pid not in protected]


def _exit_on_termination(signum, frame) -> None:
    raise SystemExit(128 + signum)  # runs the finally that continues the paused processes


def measure(args) -> list[dict]:
    conditions = []
    for round_index in range(args.rounds):
        for load in ("quiet", "loaded"):
            competitor = start_competitor() if load == "loaded" else None
            try:
                for policy in args.policies:
                    for threads in args.threads:
                        load_average = os.getloadavg()
                        print(
                            f"round {round_index + 1}: {load}, {policy}, {threads} threads",
                            flush=True,
                        )
                        result = run_condition(args, policy, threads)
                        conditions.append(
                            {
                                "round": round_index,
                                "load": load,
                                "policy": policy,
                                "threads": threads,
                                "load_average_before": load_average,
                                **result,
                            }
                        )
            finally:
                if competitor is not None:
                    competitor.kill()
                    competitor.wait()
    return conditions


# ---- the report -----------------------------------------------------------------------------


def summarize(conditions: list[dict], labels: list[str]) -> list[dict]:
    """Per case, policy and threads: ratio to the naive softmax quiet and loaded (medians over
    rounds), and how much slower loaded than quiet, the head and the naive softmax each."""
    table = []
    keys = sorted({(c["policy"], c["threads"]) for c in conditions}, key=str)
    for label in labels:
        for policy, threads in keys:
            row = {"case": label, "policy": policy, "threads": threads}
            for load in ("quiet", "loaded"):
                chosen = [
                    c["rows"][label]
                    for c in conditions
                    if (c["policy"], c["threads"], c["load"]) == (policy, threads, load)
                ]
                row[f"{load}_ratio"] = statistics.median(r["time_ratio"] for r in chosen)
                row[f"{load}_head_ms"] = statistics.median(r["head_ms"] for r in chosen)
                row[f"{load}_naive_ms"] = statistics.median(r["baseline_ms"] for r in chosen)
                row["ops_per_step"] = chosen[0]["ops_per_step"]
            row["head_slowdown"] = row["loaded_head_ms"] / row["quiet_head_ms"]
            row["naive_slowdown"] = row["loaded_naive_ms"] / row["quiet_naive_ms"]
            table.append(row)
    return table


def markdown(result: dict) -> str:
    naive_ops = result["conditions"][0]["rows"]["naive-softmax"]["ops_per_step"]
    lines = [
        f"Machine: {result['machine']}; V = {result['settings']['vocab']:,}, "
        f"{result['settings']['tokens']:,} tokens per step, medians of "
        f"{result['settings']['repeats']} interleaved runs, {result['settings']['rounds']} "
        f"round(s); loaded = one competing single-threaded matmul process. The naive softmax "
        f"runs {naive_ops} operators per step.",
        "",
        "| case | ops/step | OMP_WAIT_POLICY | threads | x naive, quiet | x naive, loaded "
        "| head loaded/quiet | naive loaded/quiet |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in result["table"]:
        lines.append(
            f"| {row['case']} | {row['ops_per_step']} | {row['policy']} | {row['threads']} "
            f"| {row['quiet_ratio']:.2f} | {row['loaded_ratio']:.2f} "
            f"| {row['head_slowdown']:.2f} | {row['naive_slowdown']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def machine() -> str:
    from highrank.util.machine import describe_machine

    info = describe_machine()
    return f"{info['cpu']}, {info['cpu_count']} CPUs, torch {info['torch']}"


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--vocab", type=int, default=10_000)
    parser.add_argument(
        "--cases",
        type=lambda s: s.split(","),
        default=["softmax", "softmax-unchunked", "mixtape", "mos"],
    )
    parser.add_argument("--tokens", type=int, default=1400, help="as highrank bench heads")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=lambda s: [int(t) for t in s.split(",")], default=[1, 2])
    parser.add_argument("--policies", type=lambda s: s.split(","), default=["default", "PASSIVE"])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--pause",
        type=int,
        action="append",
        default=[],
        metavar="PID",
        help="SIGSTOP this process and its children while measuring (repeatable)",
    )
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/heads-under-load"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_arguments(argv)
    if args.worker:
        result = worker(args.vocab, args.cases, args.tokens, args.repeats, args.warmup)
        print(json.dumps(result))
        return 0
    paused = processes_to_pause(args.pause)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _exit_on_termination)
    try:
        signal_all(paused, signal.SIGSTOP)
        time.sleep(2.0 if paused else 0.0)
        conditions = measure(args)
    finally:
        signal_all(paused, signal.SIGCONT)
    settings = {k: v for k, v in vars(args).items() if k not in ("worker", "pause", "out")}
    result = {
        "machine": machine(),
        "settings": settings,
        "paused_pids": paused,
        "conditions": conditions,
        "table": summarize(conditions, args.cases),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "heads-under-load.json", result, indent=1)
    write_text(out / "heads-under-load.md", markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
