"""Speed and memory of every head's output layer, as ratios to a naive softmax.

What is measured, per head and vocabulary size:

* **time**: one forward + backward of the head's loss on ``tokens`` hidden states, the
  median of ``repeats`` runs after ``warmup`` runs, each run *interleaved* with a run of the
  naive softmax baseline (``F.cross_entropy(F.linear(h, E, b))``, the layer written the
  usual way) in the same process, so that machine noise hits both alike. Reported as the
  ratio of medians, and the median of the per-run ratios.
* **peak memory**: the same step, as the growth of peak memory over the memory held before the
  step (parameters and inputs): peak RSS on CPU, in a fresh process per head (the kernel's
  high-water mark, reset just before the step); ``max_memory_allocated`` on CUDA, in this
  process (the allocator's counter, reset just before the step).
  Parameter gradients count, since every training step allocates them.
* **same memory budget** (optional): the most tokens a head can process within a memory
  budget (from the peak memory measured at two token counts, which grows linearly), and its
  time per token at that batch, as the Mixtape paper compares heads.

Shapes follow the papers' PTB models: softmax-family heads read hidden size 400 (AWD-LSTM);
mixtures read 620 and use output embeddings of 280 (AWD-LSTM-MoS), MoS with 15 components.
Multi-Facet Softmax and Softmax-CPR (named, not run by default) read 400 with their papers'
knobs, and what they read besides: the last 3 layers (tanh states, the top one the hidden
states) and the window's token ids (uniform over the vocabulary), time-major windows of 70.
Hidden states are tanh outputs, decoder weights U(-0.1, 0.1): realistic logit scales (huge
synthetic logits would send exp into slow denormal paths on CPU).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import multiprocessing
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from highrank.heads import build_head
from highrank.heads.kernels import reference_paths
from highrank.util.machine import describe_machine

BPTT = 70  # hidden states are laid out (BPTT, tokens / BPTT, d), time-major like AWD-LSTM
BASELINE_D = 400
MAX_BUDGET_FACTOR = 32  # the budget mode never times batches above 32 x the probe batch


@dataclasses.dataclass(frozen=True)
class BenchCase:
    """One output layer configuration to measure."""

    label: str
    head: str  # a name in HEADS, or "naive-softmax" for the baseline
    d_in: int
    knobs: dict = dataclasses.field(default_factory=dict)
    chunk_size: int | None | str = None  # as OutputHead.loss: an int, None or "auto"
    generic_loss: bool = False  # the generic chunked loss (reference_paths()), not the fused one


MIXTURE = {"d_embed": 280, "dropout_time_dim": 0}
HEAD_SHAPES: dict[str, tuple[int, dict]] = {
    "softmax": (400, {}),
    "sigsoftmax": (400, {}),
    "gss": (400, {}),
    "plif": (400, {}),
    "moc": (620, {**MIXTURE, "n_components": 15}),
    "mos": (620, {**MIXTURE, "n_components": 15}),
    "mixtape": (620, dict(MIXTURE)),
}
# The heads that read their context (OutputHead.reads; run when named): layers and ids are
# built for them too (_other_inputs), time-major.
CONTEXT_HEAD_SHAPES: dict[str, tuple[int, dict]] = {
    "mfs": (400, {"time_dim": 0}),
    "cpr": (400, {"time_dim": 0}),
}


def _cases() -> dict[str, BenchCase]:
    """Every head on its default path ("auto" chunking) and whole-batch ("-unchunked")."""
    cases = {}
    for name, (d_in, knobs) in {**HEAD_SHAPES, **CONTEXT_HEAD_SHAPES}.items():
        cases[name] = BenchCase(name, name, d_in, knobs, chunk_size="auto")
        cases[f"{name}-unchunked"] = BenchCase(f"{name}-unchunked", name, d_in, knobs)
    no_sharing = {**HEAD_SHAPES["mixtape"][1], "frequent_fraction": 1.0}
    cases["mixtape-no-sharing"] = BenchCase(
        "mixtape-no-sharing", "mixtape", 620, no_sharing, "auto"
    )
    # Before heads/kernels/mixtape_ce.py: autograd on the mixed logits, chunk by chunk.
    cases["mixtape-generic"] = BenchCase(
        "mixtape-generic", "mixtape", 620, HEAD_SHAPES["mixtape"][1], "auto", generic_loss=True
    )
    return cases


CASES: dict[str, BenchCase] = _cases()
BASELINE = BenchCase("naive-softmax", "naive-softmax", BASELINE_D)
# MoS without chunks needs N x K x V floats several times over (8 GiB at V = 100,000).
DEFAULT_CASES = (*HEAD_SHAPES, "softmax-unchunked", "mixtape-no-sharing")


# ---- building one training step -------------------------------------------------------------


def build_step(case: BenchCase, vocab_size: int, tokens: int, device: str, seed: int = 0):
    """A closure running one forward + backward of ``case``; inputs and parameters built now."""
    generator = torch.Generator().manual_seed(seed)
    shape = (BPTT, _padded_tokens(tokens) // BPTT)
    hidden = torch.tanh(torch.randn(*shape, case.d_in, generator=generator)).to(device)
    hidden.requires_grad_(True)
    target = torch.randint(0, vocab_size, shape, generator=generator).to(device)
    if case.head == "naive-softmax":
        return _naive_softmax_step(hidden, target, vocab_size)
    torch.manual_seed(seed)
    head = build_head(case.head, d_in=case.d_in, vocab_size=vocab_size, **case.knobs).to(device)
    inputs = _other_inputs(head, hidden, vocab_size, generator)

    def step() -> None:
        with reference_paths(case.generic_loss):
            head.loss(hidden, target, chunk_size=case.chunk_size, **inputs).backward()

    return step


def _other_inputs(head, hidden, vocab_size: int, generator) -> dict:
    """What a head reads besides ``hidden (T, B, d)``: the layers below it (tanh states, no
    gradient: the body's share of the step is not the head's) and the window's ids."""
    inputs: dict = {}
    if "layers" in head.reads:
        below = [
            torch.tanh(torch.randn(hidden.shape, generator=generator)).to(hidden.device)
            for _ in range(head.input_layers - 1)
        ]
        inputs["layers"] = (*below, hidden)
    if "context_ids" in head.reads:
        ids = torch.randint(0, vocab_size, hidden.shape[:-1], generator=generator)
        inputs["context_ids"] = ids.to(hidden.device)
    return inputs


def _naive_softmax_step(hidden, target, vocab_size) -> Callable[[], None]:
    weight = torch.empty(vocab_size, hidden.shape[-1], device=hidden.device).uniform_(-0.1, 0.1)
    weight.requires_grad_(True)
    bias = torch.zeros(vocab_size, device=hidden.device, requires_grad=True)

    def step() -> None:
        logits = F.linear(hidden, weight, bias)
        F.cross_entropy(logits.view(-1, vocab_size), target.view(-1)).backward()

    return step


def _synchronise(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---- time -----------------------------------------------------------------------------------


def time_interleaved(
    step: Callable[[], None],
    baseline: Callable[[], None],
    *,
    repeats: int,
    warmup: int,
    device: str,
) -> dict[str, float]:
    """Median seconds of ``step`` and ``baseline``, alternated run by run."""
    for _ in range(warmup):
        step()
        baseline()
    head_times, base_times = [], []
    for _ in range(repeats):
        base_times.append(_timed(baseline, device))
        head_times.append(_timed(step, device))
    ratios = [h / b for h, b in zip(head_times, base_times, strict=True)]
    return {
        "head_ms": 1e3 * statistics.median(head_times),
        "baseline_ms": 1e3 * statistics.median(base_times),
        "time_ratio": statistics.median(head_times) / statistics.median(base_times),
        "median_of_run_ratios": statistics.median(ratios),
    }


def _timed(step: Callable[[], None], device: str) -> float:
    _synchronise(device)
    start = time.perf_counter()
    step()
    _synchronise(device)
    return time.perf_counter() - start


# ---- memory (CPU: in a fresh process) --------------------------------------------------------


def peak_memory_mb(case: BenchCase, vocab_size: int, tokens: int, device: str) -> float:
    """Peak memory growth (MiB) of one step of ``case``: on CUDA in this process (the
    allocator's peak counter resets exactly), on the CPU in a fresh process (the kernel's
    high-water mark of a process that has run nothing else)."""
    if device.startswith("cuda"):
        return _peak_memory_in_this_process(
            dataclasses.asdict(case), vocab_size, tokens, device, torch.get_num_threads()
        )
    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        return pool.apply(
            _peak_memory_in_this_process,
            (dataclasses.asdict(case), vocab_size, tokens, device, torch.get_num_threads()),
        )


def _peak_memory_in_this_process(
    case: dict, vocab_size: int, tokens: int, device: str, threads: int
) -> float:
    torch.set_num_threads(threads)
    step = build_step(BenchCase(**case), vocab_size, tokens, device)
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    before = proc_status_kib("VmRSS")
    reset_peak_rss()
    step()
    return (proc_status_kib("VmHWM") - before) / 1024


def proc_status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM`` = peak RSS); Linux only."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} line; peak RSS needs Linux")


def reset_peak_rss() -> None:
    """Reset this process's peak RSS (VmHWM) to its current RSS."""
    # Writing 5 to clear_refs resets the high-water mark VmHWM to the current RSS (Linux).
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


# ---- same memory budget ---------------------------------------------------------------------


def budget_tokens(
    case: BenchCase, vocab_size: int, budget_mb: float, probe_tokens: int, device: str
) -> int:
    """Most tokens (a multiple of BPTT, at most ``MAX_BUDGET_FACTOR x probe_tokens``) whose
    step fits ``budget_mb``, from a linear fit of the peak memory at two token counts."""
    small = _padded_tokens(max(BPTT, probe_tokens // 2))
    large = max(_padded_tokens(probe_tokens), small + BPTT)
    peak_small = peak_memory_mb(case, vocab_size, small, device)
    peak_large = peak_memory_mb(case, vocab_size, large, device)
    per_token = max((peak_large - peak_small) / (large - small), 1e-9)
    fixed = peak_large - per_token * large
    fitting = int((budget_mb - fixed) / per_token) // BPTT * BPTT
    return min(max(0, fitting), MAX_BUDGET_FACTOR * _padded_tokens(probe_tokens))


def _padded_tokens(tokens: int) -> int:
    return BPTT * max(1, tokens // BPTT)


# ---- the whole benchmark --------------------------------------------------------------------


def run_benchmark(
    *,
    vocab_sizes: Sequence[int],
    labels: Sequence[str] = DEFAULT_CASES,
    tokens: int = 1400,
    repeats: int = 5,
    warmup: int = 2,
    device: str = "cpu",
    budget_mb: float | None = None,
    progress: Callable[[str], None] = print,
) -> dict:
    """Measure every case at every vocabulary size; returns a JSON-ready dict."""
    _check_labels(labels)
    rows = []
    for vocab_size in vocab_sizes:
        baseline = build_step(BASELINE, vocab_size, tokens, device)
        base_peak = peak_memory_mb(BASELINE, vocab_size, tokens, device)
        for label in labels:
            progress(f"V={vocab_size:,} {label}")
            row = _measure_case(
                CASES[label], vocab_size, tokens, device, baseline, base_peak, repeats, warmup
            )
            rows.append(row)
            gc.collect()
        if budget_mb is not None:
            _add_budget_mode(rows, vocab_size, labels, tokens, device, budget_mb, repeats, warmup)
    return {"machine": describe_machine(), "settings": _settings(locals()), "rows": rows}


def _measure_case(case, vocab_size, tokens, device, baseline, base_peak, repeats, warmup):
    step = build_step(case, vocab_size, tokens, device)
    timing = time_interleaved(step, baseline, repeats=repeats, warmup=warmup, device=device)
    del step
    peak = peak_memory_mb(case, vocab_size, tokens, device)
    return {
        "vocab_size": vocab_size,
        "case": case.label,
        "head": case.head,
        "d_in": case.d_in,
        "knobs": case.knobs,
        "chunk_size": case.chunk_size,
        **timing,
        "peak_mb": peak,
        "baseline_peak_mb": base_peak,
        # Tiny shapes can grow RSS by less than a page: no ratio rather than a division by 0.
        "memory_ratio": peak / base_peak if base_peak > 0 else None,
    }


def _add_budget_mode(rows, vocab_size, labels, tokens, device, budget_mb, repeats, warmup):
    """Time per token of each head at the largest batch its budget allows, interleaved with
    the baseline at *its* largest batch."""
    base_tokens = budget_tokens(BASELINE, vocab_size, budget_mb, tokens, device)
    baseline = build_step(BASELINE, vocab_size, base_tokens, device)
    for row in rows:
        if row["vocab_size"] != vocab_size or row["case"] not in labels:
            continue
        case = CASES[row["case"]]
        fitting = budget_tokens(case, vocab_size, budget_mb, tokens, device)
        row["budget"] = {"budget_mb": budget_mb, "tokens": fitting, "baseline_tokens": base_tokens}
        if fitting == 0:
            row["budget"]["time_per_token_ratio"] = None  # not even BPTT tokens fit
            continue
        step = build_step(case, vocab_size, fitting, device)
        timing = time_interleaved(step, baseline, repeats=repeats, warmup=warmup, device=device)
        head_us = 1e3 * timing["head_ms"] / _padded_tokens(fitting)
        base_us = 1e3 * timing["baseline_ms"] / _padded_tokens(base_tokens)
        row["budget"].update(
            us_per_token=head_us,
            baseline_us_per_token=base_us,
            time_per_token_ratio=head_us / base_us,
        )


def _check_labels(labels: Sequence[str]) -> None:
    unknown = [label for label in labels if label not in CASES]
    if unknown:
        raise ValueError(f"unknown bench case(s) {unknown}; choose from: {', '.join(CASES)}")


def _settings(arguments: dict) -> dict:
    keys = ("vocab_sizes", "labels", "tokens", "repeats", "warmup", "device", "budget_mb")
    settings = {key: arguments[key] for key in keys}
    settings["vocab_sizes"], settings["labels"] = (
        list(settings["vocab_sizes"]),
        list(settings["labels"]),
    )
    settings["bptt"], settings["baseline"] = BPTT, dataclasses.asdict(BASELINE)
    return settings


# ---- reporting ------------------------------------------------------------------------------


def markdown_table(result: dict) -> str:
    """The benchmark as a Markdown table, with the machine and settings above it."""
    machine, settings = result["machine"], result["settings"]
    lines = [
        f"Machine: {machine['cpu']}, {machine['cpu_count']} cores, torch {machine['torch']} "
        f"({machine['torch_threads']} threads), device {settings['device']}"
        + _gpu_name(machine, settings["device"]),
        f"Tokens per step: {settings['tokens']} (BPTT {settings['bptt']}); median of "
        f"{settings['repeats']} runs after {settings['warmup']} warm-up runs; ratios are to a "
        f"naive softmax (d = {BASELINE_D}) measured in the same process (time) or the same way "
        "(memory).",
        "",
        "| V | head | chunk | time ratio | head ms | baseline ms | peak MiB | memory ratio |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['vocab_size']:,} | {row['case']} | {row['chunk_size'] or '-'} | "
            f"{row['time_ratio']:.2f} | {row['head_ms']:.0f} | {row['baseline_ms']:.0f} | "
            f"{row['peak_mb']:.0f} | {_format_ratio(row['memory_ratio'])} |"
        )
    budget_rows = [row for row in result["rows"] if "budget" in row]
    if budget_rows:
        lines += _budget_table(budget_rows)
    return "\n".join(lines) + "\n"


def _gpu_name(machine: dict, device: str) -> str:
    """`` (<name>)`` of the GPU ``device`` (``cuda``, ``cuda:N``); ``""`` for the CPU."""
    if not device.startswith("cuda") or not machine.get("gpus"):
        return ""
    index = int(device.split(":")[1]) if ":" in device else 0
    return f" ({machine['gpus'][min(index, len(machine['gpus']) - 1)]})"


def _budget_table(rows: list[dict]) -> list[str]:
    lines = [
        "",
        f"Same memory budget ({rows[0]['budget']['budget_mb']:.0f} MiB of peak growth):",
        "",
        "| V | head | tokens that fit | us / token | baseline tokens | time per token ratio |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        b = row["budget"]
        us = f"{b['us_per_token']:.1f}" if "us_per_token" in b else "-"
        ratio = _format_ratio(b["time_per_token_ratio"])
        lines.append(
            f"| {row['vocab_size']:,} | {row['case']} | {b['tokens']:,} | {us} | "
            f"{b['baseline_tokens']:,} | {ratio} |"
        )
    return lines


def _format_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def write_results(result: dict, out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "heads.json", out_dir / "heads.md"
    json_path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    md_path.write_text(markdown_table(result), encoding="utf-8")
    return json_path, md_path
