"""A small fault campaign on the command line (issue 12): kill -9 at random moments of a
training run (checkpoints every 3 steps) then resume, two concurrent resumes, a corrupted
last.pt, a torn metrics.jsonl, and each bad input of the issue. Prints what each did.

    .venv/bin/python -m benchmarks.checks.fault_campaign [WORK_DIR]

Its sibling benchmarks/checks/fault_campaign_surfaces.py attacks the other surfaces (issue 22).

About 15-20 minutes on the shared 2-vCPU machine (each command pays torch's import).
"""

# ruff: noqa: E501  (a script of long report lines)
import argparse
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

MARKER = ".highrank-fault-campaign"  # a folder the campaign made, so it may delete it again

def main() -> None:
    """The whole campaign (only when run as a script: importing this module runs nothing)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("work_dir", nargs="?", default="/tmp/highrank-fault-campaign")
    R = Path(parser.parse_args().work_dir)
    if R.exists() and any(R.iterdir()) and not (R / MARKER).is_file():
        parser.error(f"{R} holds files of something else (no {MARKER}): name a new or empty folder")
    shutil.rmtree(R, ignore_errors=True)
    R.mkdir(parents=True)
    (R / MARKER).write_text("")
    HR = [sys.executable, "-m", "highrank"]
    rng = random.Random(0)
    corpus = R / "corpus"
    corpus.mkdir()
    words = [f"w{i}" for i in range(200)]
    for split, n in (("train", 3000), ("valid", 200), ("test", 200)):
        (corpus / f"{split}.txt").write_text(
            "\n".join(" ".join(rng.choices(words, k=rng.randint(5, 15))) for _ in range(n)) + "\n"
        )
    cfg = R / "tiny.toml"
    cfg.write_text(
        f'[data]\ndir = "{corpus}"\n[model]\nd_embed = 16\nd_hidden = 24\nn_layers = 2\n[train]\nbatch_size = 8\nbptt = 10\nepochs = 2\nlog_every = 5\ncheckpoint_every = 3\neval_batch_size = 4\n'
    )


    def run(args, **kw):
        p = subprocess.run(HR + args, capture_output=True, text=True, **kw)
        err = [x for x in p.stderr.splitlines() if not x.startswith("note:") and "Warning" not in x]
        return p.returncode, err


    def whole_lines(path):
        b = Path(path).read_bytes()
        return b.endswith(b"\n") or not b


    out = R / "run"
    print("== 1. kill -9 at random moments (checkpoints every 3 steps), then resume")
    rc, err = run(["train", str(cfg), f"--run.out_dir={out}", "--no-progress", "--max-steps", "3"])
    print(" first 3 steps rc", rc)
    kills = 0
    for i in range(12):
        p = subprocess.Popen(
            HR + ["train", "--resume", str(out), "--no-progress"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(rng.uniform(2.0, 5.0))
        if p.poll() is None:
            p.kill()
            kills += 1
        p.wait()
        tmps = list((out / "checkpoints").glob(".*tmp")) + list(out.glob(".*.tmp"))
        print(
            f"  kill {i}: rc {p.returncode}, temporaries left {len(tmps)}, metrics whole lines {whole_lines(out / 'metrics.jsonl')}"
        )
    rc, err = run(["train", "--resume", str(out), "--no-progress"])
    tmps = list((out / "checkpoints").glob(".*tmp"))
    steps = [
        json.loads(x)["step"]
        for x in (out / "metrics.jsonl").read_text().splitlines()
        if '"kind": "step"' in x
    ]
    print(
        f" after {kills} kills: final resume rc {rc} ({err[-1] if err else ''}); temporaries {len(tmps)}; step lines strictly increasing: {steps == sorted(set(steps))}"
    )
    print("== 2. two concurrent resumes")
    ref = R / "ref"
    run(["train", str(cfg), f"--run.out_dir={ref}", "--no-progress", "--max-steps", "3"])
    a = subprocess.Popen(
        HR + ["train", "--resume", str(ref), "--no-progress", "--train.epochs=3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(2.5)
    rc, err = run(["train", "--resume", str(ref), "--no-progress", "--train.epochs=3"])
    print(" second:", rc, err)
    a.wait()
    print(" first rc", a.returncode)
    steps = [
        json.loads(x)["step"]
        for x in (ref / "metrics.jsonl").read_text().splitlines()
        if '"kind": "step"' in x
    ]
    print(" duplicated step lines:", len(steps) - len(set(steps)))
    print("== 3. corrupted last.pt")
    last = ref / "checkpoints" / "last.pt"
    data = bytearray(last.read_bytes())
    data[len(data) // 2] ^= 0xFF
    last.write_bytes(bytes(data))
    p = subprocess.run(
        HR + ["train", "--resume", str(ref), "--no-progress", "--train.epochs=3"],
        capture_output=True,
        text=True,
    )
    print(
        " rc",
        p.returncode,
        [x[:200] for x in p.stderr.splitlines() if "instead" in x or "error" in x][:2],
    )
    print("== 4. torn metrics.jsonl")
    with open(ref / "metrics.jsonl", "ab") as h:
        h.write(b'{"kind": "step", "st')
    rc, err = run(["report", str(ref), "--out", str(R / "report")])
    print(" report rc", rc, err[:2])
    rc, err = run(
        ["train", "--resume", str(ref), "--no-progress", "--train.epochs=4", "--max-steps", "2000"]
    )
    print(" resume rc", rc, "whole lines", whole_lines(ref / "metrics.jsonl"))
    print("== 5. bad inputs")
    f = R / "afile"
    f.write_text("x")
    bad = R / "bad"
    shutil.copytree(ref, bad)
    (bad / "checkpoints" / "last.pt").unlink()
    (bad / "checkpoints" / "last.pt").mkdir()
    ro = R / "rocorpus"
    shutil.copytree(corpus, ro)
    (ro / "valid.txt").chmod(0)
    cases = {
        "n_components=0": [
            "train",
            str(cfg),
            "--head.name=mos",
            "--head.n_components=0",
            f"--run.out_dir={R / 'x1'}",
        ],
        "latent_dropout=1.5": [
            "train",
            str(cfg),
            "--head.name=mos",
            "--head.latent_dropout=1.5",
            f"--run.out_dir={R / 'x2'}",
        ],
        "frequent_fraction=2": [
            "train",
            str(cfg),
            "--head.name=mixtape",
            "--head.frequent_fraction=2",
            f"--run.out_dir={R / 'x3'}",
        ],
        "gate_dim=0": [
            "train",
            str(cfg),
            "--head.name=mixtape",
            "--head.gate_dim=0",
            f"--run.out_dir={R / 'x4'}",
        ],
        "slope=-1": [
            "train",
            str(cfg),
            "--head.name=gss",
            "--head.slope=-1",
            f"--run.out_dir={R / 'x5'}",
        ],
        "plif low>high": [
            "train",
            str(cfg),
            "--head.name=plif",
            "--head.low=5",
            "--head.high=1",
            f"--run.out_dir={R / 'x6'}",
        ],
        "abbreviated --head.n_component": [
            "train",
            str(cfg),
            "--head.name=mos",
            "--head.n_component=3",
            f"--run.out_dir={R / 'x7'}",
        ],
        "abbreviated analyze --whic": ["analyze", "rank", str(ref), "--whic", "last"],
        "train without arguments": ["train"],
        "out_dir is a file": ["train", str(cfg), f"--run.out_dir={f}"],
        "last.pt a directory": ["train", "--resume", str(bad)],
        "unreadable split (root reads it anyway)": [
            "train",
            str(cfg),
            f"--data.dir={ro}",
            f"--run.out_dir={R / 'x8'}",
        ],
        "cuda on CPU build": ["train", str(cfg), "--run.device=cuda", f"--run.out_dir={R / 'x9'}"],
        "eval --max-tokens (own record)": ["eval", str(ref), "--max-tokens", "500"],
        "absurd model": ["train", str(cfg), "--model.d_hidden=3000000", f"--run.out_dir={R / 'x10'}"],
    }
    for name, args in cases.items():
        t = time.time()
        rc, err = run(
            args + ["--no-progress"] if args[0] in ("train", "eval") and len(args) > 1 else args
        )
        print(
            f" {name}: rc {rc}, {len(err)} line(s), {time.time() - t:.1f}s: {err[-1][:230] if err else ''}"
        )
    print(" eval records:", sorted(p.name for p in ref.glob("eval-*.json")))
    print(
        " nothing written:",
        [d for d in ("x1", "x2", "x3", "x4", "x5", "x6", "x7", "x9", "x10") if (R / d).exists()],
    )
    shutil.rmtree(R / "x8", ignore_errors=True)


if __name__ == "__main__":
    main()
