"""Training throughput: highrank's AWD-LSTM (every AWD regulariser off) against a plain PyTorch
LSTM language model of the same size, on the same Penn Treebank batches, interleaved in one
process. The logic lives in ``benchmarks/studies/plain_lstm.py`` beside this script (read its
docstring for what is compared and how).

    python -m benchmarks.studies.plain_lstm_vs_awd [--data-dir ../shared/data/ptb] [--steps 20]
        [--repeats 10] [--warmup 10] [--threads 2]
        [--out benchmarks/results/plain-lstm-vs-awd.json]

Writes the JSON record (machine, settings, parameter counts, tokens/s per round, medians and
ratios) and prints a Markdown table. The default run is 210 steps of each model (10 warm-up,
then 10 rounds of 20): about 2.5 minutes at 1 thread on a 2-core Xeon (0.33 and 0.39 s per
step), less at the default 2 threads. ``--set KEY=VALUE`` changes the recipe further (e.g.
``--set train.chunk_size=100000`` times our head with its loss unchunked).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks._common import DATA, REPO, module_name, write_json
from benchmarks.studies.plain_lstm import (
    Settings,
    benchmark_config,
    markdown_table,
    run_benchmark,
)

MODULE = module_name(__file__)  # benchmarks.studies.plain_lstm_vs_awd

DEFAULT_RECIPE = REPO / "configs" / "ptb" / "small-softmax.toml"
DEFAULT_DATA = DATA / "ptb"
DEFAULT_OUT = REPO / "benchmarks" / "results" / "plain-lstm-vs-awd.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=str(DEFAULT_DATA), help="PTB folder (%(default)s)")
    parser.add_argument("--steps", type=int, default=Settings.steps, help="timed steps per round")
    parser.add_argument("--repeats", type=int, default=Settings.repeats, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=Settings.warmup, help="untimed steps each")
    parser.add_argument("--threads", type=int, default=Settings.threads, help="torch threads")
    parser.add_argument("--config", default=str(DEFAULT_RECIPE), help="recipe (%(default)s)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override applied after the regularisers are switched off (repeatable)",
    )
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="JSON file (%(default)s)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    data_dir = Path(args.data_dir)
    if not (data_dir / "train.txt").is_file():
        print(
            f"plain_lstm_vs_awd: no corpus at {data_dir} (expected train.txt there); "
            "pass --data-dir DIR",
            file=sys.stderr,
        )
        return 2
    try:
        settings = Settings(args.steps, args.repeats, args.warmup, args.threads)
        config = benchmark_config(args.config, data_dir, args.set)
    except ValueError as error:  # ConfigError is a ValueError
        print(f"plain_lstm_vs_awd: error: {error}", file=sys.stderr)
        return 2
    result = run_benchmark(config, settings, progress=lambda m: print(m, file=sys.stderr))
    result["command"] = " ".join(
        ["python", "-m", MODULE, *(sys.argv[1:] if argv is None else argv)]
    )
    out = Path(args.out)
    write_json(out, result)
    print(markdown_table(result))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
