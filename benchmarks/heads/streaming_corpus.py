"""The memory-mapped corpus at scale: build time, peak memory, disk, batches/s vs a training step.

    python -m benchmarks.heads.streaming_corpus --tokens 10000000 --tokens 100000000

For each size: writes (once, reused when its zipf.json matches) a seeded Zipfian corpus
(:mod:`highrank.data.zipf`: 200,000 word types, exponent 1, train in 100 shards as One
Billion Word's, valid/test 1% of train each) under --work, then measures, each in a fresh
Python subprocess (one torch thread) so that ``resource.getrusage`` peak RSS is its own:

* ``baseline``: the peak RSS of importing highrank.data.streaming (Python, numpy, torch) alone;
* ``build``: :func:`highrank.data.streaming.load_stream_corpus` with ``max_vocab = 100,000`` on an
  empty cache (hash, one-pass vocabulary with ids to disk, in-place remap, valid/test): wall
  and CPU seconds, peak RSS, the cache's bytes on disk;
* ``cached``: the same call again (the cache hit: hashing the text and opening the maps);
* ``batches``: ``get_batch`` windows of (bptt 35, batch 64) read from the memory map in
  order (stream batching) and sentence-shuffled (the first read of an epoch builds its
  order, timed apart), tokens/s over --windows windows;
* ``step``: one training step (forward, backward, clip, SGD) of a small AWD-LSTM with a full
  softmax over the 100,000 words (d_embed 64, d_hidden 128, 2 layers, chunked head loss), on
  windows of the same shape: tokens/s, median of --steps steps after one warm-up.

Results: benchmarks/results/streaming-corpus/tokens-<N>.json (a finished size is skipped on a
rerun; --force redoes it) and README.md, a table of every size measured.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks._common import REPO, module_name, write_json, write_text

MODULE = module_name(__file__)  # benchmarks.heads.streaming_corpus

RESULTS = REPO / "benchmarks" / "results" / "streaming-corpus"
TYPES, MAX_VOCAB, SHARDS, SEED = 200_000, 100_000, 100, 0
BATCH, BPTT = 64, 35


def peak_rss_mib() -> float:
    """This process's peak resident set size (Linux ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_now_mib() -> dict:
    """The resident set now, split (Linux /proc/self/status) into the process's own memory
    (RssAnon) and pages of mapped files (RssFile: the corpus map's pages, which the kernel
    drops under memory pressure, and the shared libraries)."""
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("RssAnon:", "RssFile:")):
                name, value = line.split(":")
                fields[f"{name.removeprefix('Rss').lower()}_mib"] = int(value.split()[0]) / 1024
    return fields


# ---- the measurements, each run in its own subprocess --------------------------------------


def child_baseline(corpus: Path, cache: Path, args) -> dict:
    import highrank.data.streaming  # noqa: F401  (what every other child imports)

    return {"peak_rss_mib": peak_rss_mib()}


def child_build(corpus: Path, cache: Path, args) -> dict:
    from highrank.data.streaming import load_stream_corpus

    shutil.rmtree(cache, ignore_errors=True)
    wall, cpu = time.perf_counter(), time.process_time()
    loaded = load_stream_corpus(corpus, max_vocab=MAX_VOCAB, cache_dir=cache)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {
        "seconds": wall,
        "cpu_seconds": cpu,
        "peak_rss_mib": peak_rss_mib(),
        "vocab_size": len(loaded.vocab),
        "tokens": {s: int(v.size) for s, v in loaded.ids.items()},
        "oov": loaded.oov,
        "cache_bytes": sum(p.stat().st_size for p in loaded.cache.iterdir()),
        "rss_at_end": rss_now_mib(),
    }


def child_cached(corpus: Path, cache: Path, args) -> dict:
    from highrank.data.streaming import load_stream_corpus

    wall = time.perf_counter()
    load_stream_corpus(corpus, max_vocab=MAX_VOCAB, cache_dir=cache)
    return {"seconds": time.perf_counter() - wall, "peak_rss_mib": peak_rss_mib()}


def child_batches(corpus: Path, cache: Path, args) -> dict:
    from highrank.data import get_batch
    from highrank.data.streaming import load_stream_corpus

    out = {}
    for batching in ("stream", "sentences"):
        loaded = load_stream_corpus(
            corpus, max_vocab=MAX_VOCAB, batching=batching, seed=SEED, cache_dir=cache
        )
        view = loaded.batchify("train", BATCH)  # finds the sentence ends for "sentences"
        wall = time.perf_counter()
        view = view.for_epoch(1)
        get_batch(view, 0, BPTT)  # the epoch's order is built on its first read
        setup = time.perf_counter() - wall
        windows = min(args.windows, (view.size(0) - 1) // BPTT)
        wall, tokens = time.perf_counter(), 0
        for w in range(windows):
            _, target = get_batch(view, w * BPTT, BPTT)
            tokens += target.numel()
        wall = time.perf_counter() - wall
        out[batching] = {
            "tokens_per_second": tokens / wall,
            "windows": windows,
            "epoch_setup_seconds": setup,
        }
    out["peak_rss_mib"] = peak_rss_mib()
    out["rss_at_end"] = rss_now_mib()  # the mapped corpus pages read are RssFile
    return out


def child_step(corpus: Path, cache: Path, args) -> dict:
    import torch

    from highrank.config import load_config
    from highrank.models import build_model
    from highrank.train.awd_lstm import build_optimizer, optimization_step

    torch.manual_seed(0)
    config = load_config(
        None,
        [
            "model.d_embed=64",
            "model.d_hidden=128",
            "model.n_layers=2",
            f"train.batch_size={BATCH}",
            f"train.bptt={BPTT}",
        ],
    )
    model = build_model(config, MAX_VOCAB).train()
    optimizer = build_optimizer(model, 1.0, 1.2e-6)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = model.init_state(BATCH)
    ids = torch.randint(0, MAX_VOCAB, (BPTT + 1, BATCH))
    times = []
    for _ in range(args.steps + 1):
        wall = time.perf_counter()
        outcome = optimization_step(
            model,
            optimizer,
            params,
            ids[:-1],
            ids[1:],
            state,
            chunk_size="auto",
            clip=0.25,
            lr_scale=1.0,
        )
        times.append(time.perf_counter() - wall)
        state = outcome.state
    median = statistics.median(times[1:])
    return {
        "seconds_per_step": median,
        "tokens_per_second": BPTT * BATCH / median,
        "steps": args.steps,
        "peak_rss_mib": peak_rss_mib(),
    }


CHILDREN = {
    "baseline": child_baseline,
    "build": child_build,
    "cached": child_cached,
    "batches": child_batches,
    "step": child_step,
}


def run_child(name: str, corpus: Path, cache: Path, args) -> dict:
    """``name``'s measurement in a fresh interpreter on one thread; its JSON result."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    command = [
        sys.executable,
        "-m",
        MODULE,
        "--child",
        name,
        "--corpus",
        str(corpus),
        "--cache",
        str(cache),
        "--windows",
        str(args.windows),
        "--steps",
        str(args.steps),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"child {name} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- the driver ---------------------------------------------------------------------------


def corpus_for(tokens: int, work: Path) -> tuple[Path, dict]:
    """The Zipf corpus of ``tokens`` train tokens under ``work`` (written once)."""
    from highrank.data.zipf import write_zipf_corpus

    folder = work / f"zipf-{tokens}"
    marker = folder / "zipf.json"
    if marker.is_file():
        info = json.loads(marker.read_text())
        if info["tokens"]["train"] == tokens and info["types"] == TYPES and info["seed"] == SEED:
            return folder, {**info, "generated_seconds": None}
    shutil.rmtree(folder, ignore_errors=True)
    wall = time.perf_counter()
    info = write_zipf_corpus(folder, train_tokens=tokens, types=TYPES, shards=SHARDS, seed=SEED)
    return folder, {**info, "generated_seconds": time.perf_counter() - wall}


def measure(tokens: int, args) -> dict:
    from highrank.data.streaming import BLOCK_BYTES
    from highrank.util.machine import describe_machine

    corpus, info = corpus_for(tokens, args.work)
    cache = args.work / f"cache-{tokens}"
    result = {
        "machine": describe_machine(threads=1, note="shared with other jobs"),
        "threads": 1,
        "command": " ".join(["python", "-m", MODULE, *sys.argv[1:]]),
        "corpus": {k: info[k] for k in ("types", "exponent", "tokens", "bytes", "seed")},
        "corpus_generated_seconds": info["generated_seconds"],
        "shards": SHARDS,
        "max_vocab": MAX_VOCAB,
        "block_bytes": BLOCK_BYTES,
        "batch": {"batch_size": BATCH, "bptt": BPTT},
    }
    for name in CHILDREN:
        print(f"[{tokens:,} tokens] {name} ...", flush=True)
        result[name] = run_child(name, corpus, cache, args)
    if not args.keep:
        shutil.rmtree(cache, ignore_errors=True)
    return result


def table(results: list[dict]) -> str:
    rows = [
        "| train tokens | text on disk | ids on disk | build: wall / CPU s | build peak RSS "
        "| import-only RSS | cached load s | batches tok/s (stream / sentences) "
        "| training step tok/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        b, s = r["batches"], r["step"]
        rows.append(
            f"| {r['corpus']['tokens']['train']:,} | {r['corpus']['bytes'] / 2**20:,.0f} MiB "
            f"| {r['build']['cache_bytes'] / 2**20:,.0f} MiB "
            f"| {r['build']['seconds']:.1f} / {r['build']['cpu_seconds']:.1f} "
            f"| {r['build']['peak_rss_mib']:,.0f} MiB | {r['baseline']['peak_rss_mib']:,.0f} MiB "
            f"| {r['cached']['seconds']:.1f} "
            f"| {b['stream']['tokens_per_second']:,.0f} "
            f"/ {b['sentences']['tokens_per_second']:,.0f} "
            f"| {s['tokens_per_second']:,.0f} |"
        )
    return "\n".join(rows)


def machine_text(results: list[dict]) -> str:
    """The machine line of the first result (records before util.machine hold a string)."""
    from highrank.util.machine import machine_line

    machine = results[0]["machine"]
    return machine if isinstance(machine, str) else machine_line(machine)


def write_readme(results: list[dict]) -> None:
    commands = sorted({r["command"] for r in results})
    text = [
        "# Memory-mapped corpora at scale (`benchmarks/heads/streaming_corpus.py`)",
        "",
        f"Machine: {machine_text(results)}; every figure from a fresh subprocess on 1 thread, "
        "measured once per size (the machine was shared with other jobs, so times are "
        "indicative).",
        "",
        "Commands: " + "; ".join(f"`{c}`" for c in commands),
        "",
        f"Corpus: seeded Zipf (exponent 1) over {TYPES:,} word types, train in {SHARDS} shards, "
        f"valid/test 1% of train each; `data.max_vocab = {MAX_VOCAB:,}` (the 1B-Word recipe's "
        f"100K). Batches: bptt {BPTT} x batch {BATCH}. Training step: AWD-LSTM d_embed 64, "
        f"d_hidden 128, 2 layers, full softmax over V = {MAX_VOCAB:,}, median of the steps.",
        "",
        table(results),
        "",
        "Peak RSS is `resource.getrusage(RUSAGE_SELF).ru_maxrss` of the subprocess, its imports "
        "(Python, numpy, torch: the import-only column) included. Text on disk: the corpus's "
        "UTF-8 bytes; ids on disk: the int32 cache (ids of all three splits, vocabulary, meta).",
        "",
        "Reading batches maps the id file: the pages read count in RSS as mapped-file pages "
        "(RssFile, which the kernel drops under memory pressure), not as the process's own "
        "memory (RssAnon). After the batch reads (both batchings):",
        "",
        "| train tokens | batches peak RSS | RssAnon at end | RssFile at end |",
        "|---:|---:|---:|---:|",
        *[
            f"| {r['corpus']['tokens']['train']:,} | {r['batches']['peak_rss_mib']:,.0f} MiB "
            f"| {r['batches']['rss_at_end']['anon_mib']:,.0f} MiB "
            f"| {r['batches']['rss_at_end']['file_mib']:,.0f} MiB |"
            for r in results
        ],
        "",
    ]
    write_text(RESULTS / "README.md", "\n".join(text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, action="append", help="train tokens (repeatable)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/highrank-streaming-bench"))
    parser.add_argument("--windows", type=int, default=2000, help="windows read per batching")
    parser.add_argument("--steps", type=int, default=5, help="timed training steps")
    parser.add_argument("--force", action="store_true", help="redo sizes already recorded")
    parser.add_argument("--keep", action="store_true", help="keep the id cache afterwards")
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import torch

        torch.set_num_threads(1)
        print(json.dumps(CHILDREN[args.child](args.corpus, args.cache, args)))
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    for tokens in args.tokens or [10_000_000]:
        path = RESULTS / f"tokens-{tokens}.json"
        if path.is_file() and not args.force:
            print(f"{path} exists; skipping (--force redoes it)")
            continue
        result = measure(tokens, args)
        write_json(path, result)
        print(json.dumps(result, indent=2))
    results = [json.loads(p.read_text()) for p in sorted(RESULTS.glob("tokens-*.json"))]
    write_readme(sorted(results, key=lambda r: r["corpus"]["tokens"]["train"]))


if __name__ == "__main__":
    main()
