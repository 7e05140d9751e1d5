"""Seconds per training batch of the Multi30k translation configs, softmax vs MoS-9 vs Mixtape.

    OMP_NUM_THREADS=1 python -m benchmarks.heads.multi30k_step_time THREADS [section.key=value ...]

Learns the configs' subwords on Multi30k train (../shared/data/multi30k), builds one model per
head from ``configs/multi30k/transformer-{softmax,mos,mixtape}.toml`` (with the overrides), and
feeds the same four shuffled training batches (train.max_tokens each) to the three models in
turn: a step is forward, backward (label smoothing 0.1) and an AdamW update. Prints each step's
time and the median of batches 2-4 (the first is a warm-up). Used to size the configs' budget;
``benchmarks/studies/multi30k_table.py`` measures the same with more repeats. Recorded output:
benchmarks/results/multi30k-step-time/.
"""

import statistics
import sys
import time

import torch

from benchmarks._common import REPO
from highrank.config import load_config
from highrank.models import build_seq2seq
from highrank.mt.bitext import TokenBatches
from highrank.mt.translation_data import learn_translation_data
from highrank.train.schedule import build_adamw

HEADS = ("softmax", "mos", "mixtape")


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help") or not sys.argv[1].isdigit():
        print(__doc__)
        raise SystemExit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
    torch.set_num_threads(int(sys.argv[1]))
    overrides = sys.argv[2:]
    configs = {
        h: load_config(REPO / f"configs/multi30k/transformer-{h}.toml", overrides) for h in HEADS
    }
    start = time.time()
    data = learn_translation_data(configs["softmax"])
    print("subwords s", round(time.time() - start, 1), flush=True)
    c = configs["softmax"]
    batches = TokenBatches(
        data.pairs("train"), max_tokens=c.train.max_tokens, special=data.special,
        shuffle=True, seed=1, epoch=1, max_len=c.model.max_len,
    )  # fmt: skip
    print("batches/epoch", len(batches), flush=True)
    models = {h: build_seq2seq(cfg, data.vocab_sizes) for h, cfg in configs.items()}
    optimizers = {h: build_adamw(m, 1e-4, 0.0, (0.9, 0.98), 1e-9) for h, m in models.items()}
    times = {h: [] for h in models}
    for i in range(4):
        b = batches[i]
        for h, m in models.items():
            s = time.perf_counter()
            optimizers[h].zero_grad()
            m.loss(b.src, b.tgt_in, b.tgt_out, label_smoothing=0.1).backward()
            optimizers[h].step()
            times[h].append(time.perf_counter() - s)
        print(i, {h: round(t[-1], 2) for h, t in times.items()}, flush=True)
    for h, t in times.items():
        print(h, "median s/step (batches 2-4)", round(statistics.median(t[1:]), 2), flush=True)


if __name__ == "__main__":
    main()
