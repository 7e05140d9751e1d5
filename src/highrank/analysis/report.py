"""``highrank report RUN_DIR... --out DIR``: one self-contained HTML page per set of runs.

The page assembles what the other verbs kept in each run directory, recomputing nothing:

* overview: head, parameters, epochs, best validation perplexity (``metrics.jsonl``), test
  perplexity (``eval-test-*.json`` of ``highrank eval``, ``dynamic-eval-test-*.json``);
* training curves: validation perplexity per epoch (PNG);
* rank: Press and epsilon-effective ranks (``analysis/rank-*.json``) and the singular-value
  spectrum (PNG, from the saved singular values);
* pairwise KL (``analysis/kl-*.json``) and word similarity (``analysis/similarity-*.json``);
* LM-head saturation (``analysis/saturation-*.json``: one row per checkpoint) and the gradient
  bottleneck (``analysis/gradient-bottleneck-*.json``).

Every table names the record file a row comes from, so that two records of one run (another
reading, another sample) are told apart.

A section with nothing to show says which command fills it. Plots are embedded as base64
PNGs, so ``DIR/report.html`` is a single file to keep in a lab notebook; the PNGs and a JSON
of everything shown are written beside it.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from highrank.analysis.output import ANALYSIS_DIR, format_cell, is_number, read_json, write_json
from highrank.analysis.rank import EFFECTIVE_RANK_EPSILONS, write_spectrum
from highrank.analysis.topk import format_report, report_title
from highrank.config import load_config
from highrank.data import Vocab
from highrank.evaluate.records import describe, stale_checkpoint
from highrank.models import build_model, count_parameters
from highrank.runs.run_dir import RunDirError, read_metrics
from highrank.util.atomic import write_text_atomic
from highrank.util.paths import is_retrofit_output, retrofit_output_note

_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 62rem; margin: 2rem auto; color: #222; }
h1 { font-size: 1.5rem; }
h2 { font-size: 1.15rem; margin-top: 2rem; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; font-size: 0.9rem; margin: 0.5rem 0; }
th, td { border: 1px solid #ddd; padding: 0.25rem 0.6rem; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
th { background: #f4f4f4; } .note { color: #666; font-size: 0.85rem; }
code { background: #f4f4f4; padding: 0 0.2rem; } img { max-width: 100%; }
"""


# ---- collecting what a run directory holds -------------------------------------------------


def collect_run(run_dir: str | Path) -> dict[str, Any]:
    """Everything :func:`write_report` shows about one run, read from its directory."""
    run_dir = Path(run_dir)
    if is_retrofit_output(run_dir):
        raise RunDirError(retrofit_output_note(run_dir))
    if not (run_dir / "config.toml").is_file():
        raise RunDirError(f"{run_dir} is not a run directory of `highrank train` (no config.toml)")
    config = load_config(run_dir / "config.toml")
    metrics = (
        read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
    )
    epochs = [m for m in metrics if m.get("kind") == "epoch"]
    folder = run_dir / ANALYSIS_DIR
    return {
        "run_dir": str(run_dir),
        "name": run_dir.name,
        "head": config.head.name,
        "parameters": _parameter_count(run_dir, config),
        "epochs": [(m.get("stage"), m.get("epoch"), m.get("val_ppl")) for m in epochs],
        "best_val_ppl": min((m["val_ppl"] for m in epochs if m.get("val_ppl")), default=None),
        "evals": {p.stem: read_json(p) for p in sorted(run_dir.glob("*eval-*.json"))},
        "rank": {
            p.stem: _found_in(read_json(p), run_dir) for p in sorted(folder.glob("rank-*.json"))
        },
        "kl": {p.stem: read_json(p) for p in sorted(folder.glob("kl-*.json"))},
        "similarity": {p.stem: read_json(p) for p in sorted(folder.glob("similarity-*.json"))},
        "saturation": {p.stem: read_json(p) for p in sorted(folder.glob("saturation-*.json"))},
        "gradient": {
            p.stem: read_json(p) for p in sorted(folder.glob("gradient-bottleneck-*.json"))
        },
        "hidden_size": {p.stem: read_json(p) for p in sorted(folder.glob("hidden-size-*.json"))},
        "unargmaxable": {
            p.stem: read_json(p) for p in sorted(folder.glob("unargmaxable-*.json"))
        },
        "topk": {p.stem: read_json(p) for p in sorted(folder.glob("topk-*.json"))},
    }


def _found_in(record: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """The record with ``run_dir`` where it was found (a run may have moved since)."""
    return {**record, "run_dir": str(run_dir)}


def _parameter_count(run_dir: Path, config) -> int | None:
    """Trainable parameters of the model the run's config and vocabulary describe."""
    import torch

    vocab_file = run_dir / "vocab.json"
    if not vocab_file.is_file():
        return None
    with torch.random.fork_rng(devices=[]):  # building draws initial weights
        return count_parameters(build_model(config, len(Vocab.load(vocab_file))))


# ---- the page ---------------------------------------------------------------------------


def write_report(run_dirs: Sequence[str | Path], out: str | Path) -> Path:
    """Write ``out/report.html`` (plus its PNGs and ``report.json``); returns the HTML path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [collect_run(run_dir) for run_dir in run_dirs]
    sections = [
        _overview(runs),
        _training_curves(runs, out),
        _rank_section(runs, out),
        _kl_section(runs),
        _similarity_section(runs),
        _saturation_section(runs),
        _gradient_section(runs),
        _hidden_size_section(runs),
        _unargmaxable_section(runs),
        _topk_section(runs),
    ]
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    page = (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>highrank report</title>"
        f"<style>{_STYLE}</style></head><body>\n<h1>highrank report</h1>\n"
        f"<p class='note'>{len(runs)} run(s), written {stamp} by <code>highrank report</code>. "
        "Every number below is read from the files in the run directories named in the first "
        "table.</p>\n" + "\n".join(sections) + "\n</body></html>\n"
    )
    write_json(out / "report.json", {"runs": runs})
    return write_text_atomic(out / "report.html", page)


def _overview(runs: list[dict[str, Any]]) -> str:
    headers = [
        "run",
        "head",
        "parameters",
        "epochs",
        "best valid ppl",
        "test ppl",
        "dynamic-eval test ppl",
        "directory",
    ]
    rows = [
        [
            r["name"],
            r["head"],
            r["parameters"],
            len(r["epochs"]),
            r["best_val_ppl"],
            _eval_value(r, "eval-test"),
            _eval_value(r, "dynamic-eval-test"),
            r["run_dir"],
        ]
        for r in runs
    ]
    missing = [r["name"] for r in runs if _eval_value(r, "eval-test") is None]
    note = _hint(missing, "highrank eval RUN_DIR --split test") if missing else ""
    return "<h2>Runs</h2>\n" + _html_table(headers, rows) + _sources(runs) + note


# The checkpoint whose figure a report shows: the finetuned one when it was evaluated.
PREFERRED_CHECKPOINTS = ("finetuned", "best", "last")


def preferred_eval(run: dict[str, Any], prefix: str) -> tuple[str, dict[str, Any]] | None:
    """``(name, record)`` of the figure to show for ``prefix`` (``eval-test``): a record of
    the full split of the run's own corpus (``<prefix>-<which>.json``; records of other data
    or of ``--max-tokens`` carry a suffix and are never the figure), finetuned first."""
    for which in PREFERRED_CHECKPOINTS:
        name = f"{prefix}-{which}"
        record = run["evals"].get(name)
        if record is not None and record.get("default_data", True):
            return name, record
    return None


def _eval_value(run: dict[str, Any], prefix: str) -> float | None:
    found = preferred_eval(run, prefix)
    return found[1].get("perplexity") if found else None


def _sources(runs: list[dict[str, Any]]) -> str:
    """One line per figure shown: which checkpoint and data it came from."""
    lines = []
    for run in runs:
        for prefix, label in (("eval-test", "test"), ("dynamic-eval-test", "dynamic-eval test")):
            found = preferred_eval(run, prefix)
            if found:
                line = f"{run['name']} {label} ppl: {describe(found[1])}"
                if stale_checkpoint(run["run_dir"], found[1]) is not None:
                    line += (f" (STALE: {found[1]['checkpoint']} has changed since; rerun "
                             f"`highrank {prefix.removesuffix('-test')} {run['run_dir']}`)")
                lines.append(line)
    return "<p class='note'>" + "<br>".join(map(html.escape, lines)) + "</p>\n" if lines else ""


def _training_curves(runs: list[dict[str, Any]], out: Path) -> str:
    curves = {
        r["name"]: [(i + 1, ppl) for i, (_, _, ppl) in enumerate(r["epochs"]) if ppl] for r in runs
    }
    curves = {name: points for name, points in curves.items() if points}
    if not curves:
        return "<h2>Training</h2>\n<p class='note'>No epoch has been logged in metrics.jsonl.</p>"
    path = _plot_curves(curves, out / "training.png")
    return "<h2>Training</h2>\n" + _image(path, "validation perplexity per epoch")


def _plot_curves(curves: dict[str, list[tuple[int, float]]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 3.6), dpi=120)
    for name, points in curves.items():
        axes.plot(*zip(*points, strict=True), marker="o", markersize=3, label=name)
    axes.set_xlabel("epoch (training, then finetuning)")
    axes.set_ylabel("validation perplexity")
    axes.set_yscale("log")
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def _rank_section(runs: list[dict[str, Any]], out: Path) -> str:
    # each with the name of its record file: two records of one run must not look alike
    records = [{**record, "_record": stem} for r in runs for stem, record in r["rank"].items()]
    if not records:
        return "<h2>Rank</h2>\n" + _hint([r["name"] for r in runs], "highrank analyze rank RUN_DIR")
    epsilons = [str(e) for e in EFFECTIVE_RANK_EPSILONS]
    headers = ["run", "record", "split", "matrix", "Press rank",
               *[f"eff. rank {e}" for e in epsilons]]
    rows = [
        [
            Path(r["run_dir"]).name,
            r["_record"],
            r["split"] + ("" if r["kind"] == "log_prob" else f" ({r['kind']})"),
            f"{r['shape'][0]:,} x {r['shape'][1]:,}",
            r["press_rank"],
            *[r["effective_rank"][e] for e in epsilons],
        ]
        for r in records
    ]
    plot = write_spectrum(records, out / "spectrum.png")
    note = (
        "<p class='note'>Press rank: singular values above 0.5 sqrt(m + n + 1) s_max eps "
        "(float32 eps); epsilon-effective rank: the fewest singular values holding a "
        "1 - epsilon share of the squared Frobenius norm. Dotted lines: each model's Press "
        "threshold.</p>"
    )
    return "<h2>Rank</h2>\n" + _html_table(headers, rows) + note + _image(plot, "spectrum")


def _kl_section(runs: list[dict[str, Any]]) -> str:
    records = [(r["name"], stem, record) for r in runs for stem, record in r["kl"].items()]
    if not records:
        return "<h2>Pairwise KL</h2>\n" + _hint(
            [r["name"] for r in runs], "highrank analyze kl RUN_DIR"
        )
    keys = ["split", "pairs", "mean", "std", "stderr"]
    headers = ["run", "record", *keys]
    rows = [[name, stem, *[_find(record, key) for key in keys]] for name, stem, record in records]
    return "<h2>Pairwise KL</h2>\n" + _html_table(headers, rows)


def _similarity_section(runs: list[dict[str, Any]]) -> str:
    records = [(r["name"], record) for r in runs for record in r["similarity"].values()]
    if not records:
        return "<h2>Word similarity</h2>\n" + _hint(
            [r["name"] for r in runs], "highrank analyze similarity RUN_DIR"
        )
    names = sorted({b for _, record in records for b in record.get("benchmarks", {})})
    headers = ["benchmark", *[f"{run} {side}" for run, _ in records for side in ("in", "out")]]
    rows = []
    for benchmark in names:
        row: list[Any] = [benchmark]
        for _, record in records:
            scores = record["benchmarks"].get(benchmark, {}).get("spearman", {})
            row += [scores.get("input"), scores.get("output")]
        rows.append(row)
    note = (
        "<p class='note'>Spearman correlation of cosine similarity with human scores; pairs "
        "with an out-of-vocabulary word skipped (counts in the JSON records).</p>"
    )
    return "<h2>Word similarity</h2>\n" + _html_table(headers, rows) + note


def _saturation_section(runs: list[dict[str, Any]]) -> str:
    """One row per checkpoint of every saturation record (``highrank analyze saturation``)."""
    rows = [
        [r["name"], stem, point["checkpoint"], point.get("step"), point["press_rank"],
         point["entropy_effective_rank"], point["top_mass"].get("10"),
         point["anisotropy"]["mean_cosine"],
         (point.get("tanh_contexts") or {}).get("share_saturated")]
        for r in runs for stem, record in r["saturation"].items()
        for point in record.get("checkpoints", [])
    ]  # fmt: skip
    headers = ["run", "record", "checkpoint", "step", "decoder Press rank", "entropy rank",
               "top-10 energy", "anisotropy", "tanh units saturated"]
    note = ("The decoder E's spectrum (top-10 energy: the share of sum s_i^2 in "
            "the top 10 directions), the mean cosine of the head's inputs, and the share of the "
            "tanh units forming a head's contexts with |tanh| > 0.95 (mixtures only).")
    return _table_section("LM-head saturation", runs, "highrank analyze saturation RUN_DIR",
                          headers, rows, note)


def _gradient_section(runs: list[dict[str, Any]]) -> str:
    """One row per gradient-bottleneck record (``highrank analyze gradient-bottleneck``)."""
    rows = [
        [r["name"], stem, record.get("split"), record.get("n_tokens"), record["share"]["mean"],
         record["share"]["median"], record["share"]["energy_weighted"], record.get("mean_nll")]
        for r in runs for stem, record in r["gradient"].items()
    ]  # fmt: skip
    headers = ["run", "record", "split", "tokens", "mean share", "median share",
               "energy-weighted share", "NLL"]
    note = ("The share of the logit gradient's squared norm that reaches the "
            "hidden state, per token.")
    return _table_section("Gradient bottleneck", runs,
                          "highrank analyze gradient-bottleneck RUN_DIR", headers, rows, note)


def _hidden_size_section(runs: list[dict[str, Any]]) -> str:
    """One row per hidden-size record (``highrank analyze hidden-size``)."""
    rows = [
        [r["name"], stem, " x ".join(f"{n:,}" for n in record["shape"]), record["knee"],
         record["gap"], "yes" if record["low_rank_knee"] else "no",
         (record.get("hidden_size") or {}).get("with_bias"),
         (record.get("hidden_size") or {}).get("without_bias"), record["press_rank"],
         record["verdict"]]
        for r in runs for stem, record in r["hidden_size"].items()
    ]  # fmt: skip
    headers = ["run", "record", "matrix", "knee", "gap", "low-rank", "d (bias)", "d (no bias)",
               "Press rank", "verdict"]
    note = ("The largest gap s_k / s_(k+1) of the raw log-prob spectrum; a "
            "knee (a gap of 100x or more, the rest below the Press threshold) at k reads as a "
            "softmax layer of hidden size k - 2 with a bias, k - 1 without.")
    return _table_section("Hidden size from the outputs", runs,
                          "highrank analyze hidden-size RUN_DIR", headers, rows, note)


def _unargmaxable_section(runs: list[dict[str, Any]]) -> str:
    """One row per unargmaxable record (``highrank analyze unargmaxable``)."""
    rows = [
        [r["name"], stem, record["head"], record["vocab_size"], record["domain"],
         record["unargmaxable"], record["undecided"],
         ", ".join((record.get("unargmaxable_tokens") or [])[:10])]
        for r in runs for stem, record in r["unargmaxable"].items()
    ]  # fmt: skip
    headers = ["run", "record", "head", "V", "domain", "unargmaxable", "undecided",
               "first unargmaxable tokens"]
    note = ("Tokens that no hidden state in the domain makes the strict argmax "
            "of the output layer (all of them in the JSON records).")
    return _table_section("Unargmaxable tokens", runs, "highrank analyze unargmaxable RUN_DIR",
                          headers, rows, note)


def _topk_section(runs: list[dict[str, Any]]) -> str:
    """Each top-k record (``highrank analyze topk`` of one run) as its text block."""
    blocks = [
        f"<h3>{html.escape(r['name'])}: {html.escape(stem)}</h3>\n<pre>"
        + html.escape(format_report(record["contexts"], report_title(record)))
        + "</pre>"
        for r in runs for stem, record in r["topk"].items()
    ]  # fmt: skip
    if not blocks:
        return "<h2>Top-k next tokens</h2>\n" + _hint(
            [r["name"] for r in runs], "highrank analyze topk RUN_DIR --random"
        )
    return "<h2>Top-k next tokens</h2>\n" + "\n".join(blocks)


def _table_section(title: str, runs: list[dict[str, Any]], command: str,
                   headers: Sequence[str], rows: list[list[Any]], note: str) -> str:
    """A section of one table (``note`` under it), or the command to run when no run has a
    record for it."""
    if not rows:
        return f"<h2>{title}</h2>\n" + _hint([r["name"] for r in runs], command)
    return f"<h2>{title}</h2>\n" + _html_table(headers, rows) + f"<p class='note'>{note}</p>"


def _find(record: dict[str, Any], key: str) -> Any:
    """``record[key]``, or the same key one level down (records nest their results)."""
    if key in record:
        return record[key]
    for value in record.values():
        if isinstance(value, dict) and key in value:
            return value[key]
    return None


def _hint(names: list[str], command: str) -> str:
    return (
        f"<p class='note'>Nothing recorded for {html.escape(', '.join(names))}: run "
        f"<code>{html.escape(command)}</code> first.</p>"
    )


def _image(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f"<img alt='{html.escape(alt)}' src='data:image/png;base64,{data}'>"


def _html_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """An HTML table, cells formatted as the text tables format them, numbers right-aligned."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(_html_cell(value) for value in row) + "</tr>\n" for row in rows)
    return f"<table><tr>{head}</tr>\n{body}</table>\n"


def _html_cell(value: Any) -> str:
    kind = " class='num'" if is_number(value) else ""
    return f"<td{kind}>{html.escape(format_cell(value))}</td>"
