"""The fault campaign on every surface (issue 22): translation, Transformer LM, memory-mapped
corpora, torchrun, Hugging Face (analyses and retrofit), malicious pickles, `highrank data get`.

Each case runs the command line as a user would and prints one line with its verdict:
``held`` (a refusal in one clear line, or a success where one is due) or ``FOUND`` with what
went wrong (a traceback, a hang, silent acceptance of bad input, a run that cannot be resumed,
a command silent for longer than SILENT seconds, a killed run not resumed bit-identical).

    OMP_NUM_THREADS=1 python -m benchmarks.checks.fault_campaign_surfaces WORK_DIR [--only SURFACE ...]

Nothing is downloaded: the corpora are generated, the Hugging Face models are tiny random ones
saved from configs, and `data get` reads a file:// mirror built from ../shared/data.
"""

# ruff: noqa: E501  (a script of long report lines)
from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks._common import REPO

MARKER = ".highrank-fault-campaign-surfaces"  # a folder the campaign made, so it may delete it
# Seconds without output, once torch and highrank are imported, that count as "silent".
SILENT = 10.0
SHARED = REPO.parent / "shared" / "data"
SURFACES = ("translation", "transformer", "memmap", "torchrun", "hf", "security", "data-get")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
# `highrank ARGS` after writing, to the file its first argument names, the moment torch and the
# command line are imported: silence is counted from there, so that a loaded machine's slow
# import (5-25 s here) is not taken for a silent command. HR and TR are set in main().
TIMED = """import runpy, sys, time
import torch, highrank.cli  # noqa: F401 (the start-up)
with open(sys.argv.pop(1), "w") as handle:
    handle.write(repr(time.monotonic()))
sys.argv[0] = "highrank"
runpy.run_module("highrank", run_name="__main__", alter_sys=True)
"""
HR: list[str] = []
TR: list[str] = []
TRAJECTORY = ("kind", "epoch", "step", "train_loss", "val_loss", "phase", "lr")
SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT}


@dataclass
class Result:
    rc: int | None  # None: still running when the timeout came (a hang)
    out: str
    err: str
    secs: float
    silence: float  # the longest stretch without a byte on stdout or stderr
    torchrun: bool = False

    @property
    def lines(self) -> list[str]:
        """stderr's lines less notes and warnings (what the user reads as the outcome)."""
        return [
            x
            for x in self.err.replace("\r", "\n").splitlines()
            if x.strip() and not x.startswith("note:") and "Warning" not in x
        ]

    @property
    def last(self) -> str:
        lines = self.lines or self.out.replace("\r", "\n").splitlines() or [""]
        return lines[-1].strip()[:220]


def _reader(stream, chunks: list, stamps: list) -> None:
    # os.read sees progress bars' \r updates too: a bar that moves is not silence
    while data := os.read(stream.fileno(), 4096):
        chunks.append(data)
        stamps.append(time.monotonic())


def start(args: list[str], env: dict | None = None, cwd: Path | None = None):
    stamp = Path(os.environ["CAMPAIGN_STAMPS"]) / f"{time.monotonic_ns()}.t"
    args = [str(stamp) if a == "{stamp}" else a for a in args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    p = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=full_env,
        cwd=cwd,
        start_new_session=True,  # a kill reaches torchrun's children too
    )
    p.t0, p.stamp = time.monotonic(), stamp
    p.logs = ([], [], [], [])
    p.threads = [
        threading.Thread(target=_reader, args=(p.stdout, p.logs[0], p.logs[2]), daemon=True),
        threading.Thread(target=_reader, args=(p.stderr, p.logs[1], p.logs[3]), daemon=True),
    ]
    for t in p.threads:
        t.start()
    return p


def finish(p, timeout: float = 240) -> Result:
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        p.returncode = None
    end = time.monotonic()
    for t in p.threads:
        t.join(timeout=5)
    try:  # when the timed wrapper finished importing torch and highrank
        ready = max(p.t0, float(p.stamp.read_text()))
    except (OSError, ValueError):
        ready = p.t0
    stamps = sorted([ready, *[t for t in p.logs[2] + p.logs[3] if t > ready], end])
    silence = max(b - a for a, b in zip(stamps, stamps[1:], strict=False))
    text = [b"".join(x).decode("utf-8", "replace") for x in p.logs[:2]]
    torchrun = "torch.distributed.run" in p.args
    return Result(p.returncode, text[0], text[1], end - p.t0, silence, torchrun)


def run(args: list[str], timeout: float = 240, **kw) -> Result:
    return finish(start(args, **kw), timeout)


class Campaign:
    def __init__(self, root: Path):
        self.root = root
        self.counts: dict[str, list[int]] = {}
        self.found: list[str] = []

    def record(self, surface: str, name: str, ok: bool, why: str, r: Result | None = None):
        held, total = self.counts.setdefault(surface, [0, 0])
        self.counts[surface] = [held + ok, total + 1]
        verdict = "held" if ok else f"FOUND ({why})"
        timing = f"rc {r.rc}, {r.secs:.0f}s, silent <= {r.silence:.0f}s: " if r else ""
        line = f"[{surface}] {name}: {verdict}; {timing}{r.last if r else why}"
        if not ok:
            self.found.append(line)
        print(line, flush=True)

    def _common(self, r: Result) -> str | None:
        if r.rc is None:
            return "hang"
        if "Traceback (most recent call last)" in r.err:
            return "traceback"
        if r.silence > SILENT:
            return f"silent for {r.silence:.0f}s"
        return None

    def refuse(self, surface: str, name: str, args: list[str], must: str = "", **kw) -> Result:
        """Bad input: a non-zero exit with one clear line (that names ``must`` when given)."""
        r = run(args, **kw)
        why = self._common(r)
        if why is None and r.rc == 0:
            why = "accepted silently"
        if why is None and r.rc < 0:
            why = f"died of signal {-r.rc}"
        if why is None and must and must not in r.last:
            why = f"the last line does not name {must!r}"
        self.record(surface, name, why is None, why or "", r)
        return r

    def succeed(self, surface: str, name: str, args: list[str], check=None, **kw) -> Result:
        """Good input: exit 0, and ``check(result)`` (a problem's text, or None) holds."""
        r = run(args, **kw)
        why = self._common(r) or (f"exit {r.rc}" if r.rc != 0 else None)
        if why is None and check is not None:
            why = check(r)
        self.record(surface, name, why is None, why or "", r)
        return r

    def check(self, surface: str, name: str, problem: str | None, r: Result | None = None):
        self.record(surface, name, problem is None, problem or "", r)


# ---- inputs -------------------------------------------------------------------------------------

WORDS = "the a red blue dog cat runs sits on big small house tree bird sang far near".split()


def word_corpus(folder: Path, lines=(("train", 1500), ("valid", 120), ("test", 120))) -> Path:
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in lines:
        text = "\n".join(" ".join(rng.choices(WORDS, k=rng.randint(4, 12))) for _ in range(n))
        (folder / f"{split}.txt").write_text(text + "\n", encoding="utf-8")
    return folder


def bitext(folder: Path, sizes=(("train", 240), ("valid", 16), ("test", 12))) -> Path:
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in sizes:
        src, tgt = [], []
        for _ in range(n):
            words = rng.choices(WORDS, k=rng.randint(2, 6))
            src.append(" ".join(words))
            tgt.append(" ".join(w[::-1] + "x" for w in reversed(words)))
        (folder / f"{split}.en").write_text("\n".join(src) + "\n", encoding="utf-8")
        (folder / f"{split}.de").write_text("\n".join(tgt) + "\n", encoding="utf-8")
    return folder


SEQ2SEQ = """[data]
dir = "{data}"
src_lang = "en"
tgt_lang = "de"
subword_vocab_size = 48
[model]
backbone = "seq2seq"
d_embed = 16
n_heads = 2
n_encoder_layers = 1
n_decoder_layers = 1
d_ff = 32
max_len = 40
[head]
name = "{head}"
[train]
lr = 0.01
warmup_steps = 4
max_tokens = 192
epochs = {epochs}
eval_every = 10
checkpoint_every = 4
log_every = 1
seed = 3
[decode]
beam_size = 2
max_len_b = 5
[run]
device = "cpu"
"""

TRANSFORMER = """[data]
dir = "{data}"
{data_extra}
[model]
backbone = "transformer"
d_embed = 8
n_layers = 2
n_heads = 2
d_ff = 16
positions = "learned"
max_len = 8
[head]
name = "{head}"
[train]
batch_size = 4
bptt = 8
eval_batch_size = 4
lr = 0.01
warmup_steps = 3
lr_schedule = "cosine"
accumulate = 2
eval_every = 40
checkpoint_every = 15
epochs = {epochs}
log_every = 1
[run]
device = "cpu"
"""


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def trajectory(run_dir: Path) -> list[tuple]:
    rows = []
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        row = json.loads(line)
        rows.append(tuple(row.get(k) for k in TRAJECTORY))
    return rows


def checkpoint_bytes_valid(run_dir: Path) -> bool:
    return not list(run_dir.rglob("*.tmp")) and not list(run_dir.rglob(".*tmp*"))


def kill_and_resume(
    c: Campaign, surface: str, first: list[str], resume: list[str], out: Path, ref: Path, n: int, window: tuple[float, float], rng: random.Random
) -> None:
    """Start ``first``, then ``n`` times: a random signal at a random moment, then ``resume``;
    finally resume to the end and compare the trajectory with the uninterrupted ``ref``."""
    args = first
    # every signal at least once (kill -9 first among them when n allows), in a seeded order
    names = [*SIGNALS] * (n // len(SIGNALS) + 1)
    names = ["SIGKILL", *rng.sample(names[1:], len(names) - 1)][:n]
    for i, name in enumerate(names):
        metrics = out / "metrics.jsonl"
        size = metrics.stat().st_size if metrics.is_file() else -1
        p = start(args)
        # a random moment once training moves (metrics.jsonl grows), not during the import
        while p.poll() is None and (metrics.stat().st_size if metrics.is_file() else -1) == size:
            time.sleep(0.1)
        time.sleep(rng.uniform(*window))
        if p.poll() is None:
            os.killpg(p.pid, SIGNALS[name]) if args[:3] == TORCHRUN[:3] else p.send_signal(SIGNALS[name])
        r = finish(p, timeout=90)
        # processes of the run still alive 30 s after the one killed (torchrun's workers)
        deadline = time.monotonic() + 30
        while (stray := subprocess.run(["pgrep", "-f", "--", str(out)], capture_output=True, text=True).stdout.split()) and time.monotonic() < deadline:
            time.sleep(0.5)
        problem, launcher = None, False
        if r.rc is None:
            problem = f"no exit within 90 s of {name}"
        elif "Traceback (most recent call last)" in r.err and name != "SIGKILL":
            problem = f"traceback after {name}"
            if r.torchrun and "/highrank/" not in r.err.split("Traceback (most recent call last)", 1)[1]:
                launcher = True  # torch.distributed.run's own SignalException: not ours
                problem = None
        elif stray:
            problem = f"stray processes {stray}"
        elif (out / "metrics.jsonl").is_file() and not (out / "metrics.jsonl").read_bytes().endswith(b"\n"):
            problem = "metrics.jsonl ends in a torn line"
        said = " (torchrun's launcher then printed its SignalException traceback)" if launcher else ""
        c.check(surface, f"{name} at {r.secs:.1f}s (kill {i + 1}/{n}){said}", problem, r)
        args = resume
    r = run(resume, timeout=400)
    got, want = trajectory(out), trajectory(ref)
    problem = c._common(r) or (f"exit {r.rc}" if r.rc != 0 else None)
    if problem is None and got != want:
        diff = next((k for k, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
        problem = f"not bit-identical to the uninterrupted run: {len(got)} vs {len(want)} metric lines, first difference at line {diff}"
    c.check(surface, "final resume equals the uninterrupted run", problem, r)


def corrupt_cases(c: Campaign, surface: str, run_dir: Path, verbs: list[list[str]], work: Path) -> None:
    """A copy of a finished run with a truncated last.pt / best.pt, a torn and a shortened
    metrics.jsonl: each verb either recovers (exit 0, saying so) or refuses in one line."""
    for damage in ("truncated last.pt", "truncated both", "torn metrics.jsonl", "metrics.jsonl emptied"):
        bad = work / f"{surface}-{damage.replace(' ', '-')}"
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(run_dir, bad)
        ckpt = bad / "checkpoints"
        if damage.startswith("truncated"):
            for name in ("last.pt", "best.pt") if damage == "truncated both" else ("last.pt",):
                if (ckpt / name).is_file():
                    (ckpt / name).write_bytes((ckpt / name).read_bytes()[:2000])
            for prev in ckpt.glob("*.prev.pt") if damage == "truncated both" else ():
                prev.write_bytes(prev.read_bytes()[:100])
        elif damage == "torn metrics.jsonl":
            with open(bad / "metrics.jsonl", "ab") as h:
                h.write(b'{"kind": "step", "st')
        else:
            (bad / "metrics.jsonl").write_text("")
        for verb in verbs:
            args = [*HR, *[str(bad) if a == "RUN" else a for a in verb]]
            r = run(args)
            why = c._common(r)
            if why is None and r.rc not in (0, 1, 2):
                why = f"exit {r.rc}"
            c.check(surface, f"{damage}: {verb[0]}", why, r)


# ---- surfaces -------------------------------------------------------------------------------


def translation(c: Campaign, w: Path, rng: random.Random) -> None:
    s = "translation"
    data = bitext(w / "bitext")
    cfg = write(w / "mt.toml", SEQ2SEQ.format(data=data, head="softmax", epochs=30))
    ref = w / "mt-ref"
    c.succeed(s, "uninterrupted reference run", [*HR, "train", str(cfg), f"--run.out_dir={ref}"], timeout=400)
    out = w / "mt-killed"
    kill_and_resume(c, s, [*HR, "train", str(cfg), f"--run.out_dir={out}"], [*HR, "train", "--resume", str(out)], out, ref, 5, (0.5, 6.0), rng)
    # killed before its first checkpoint (during the subword training), then restarted both ways
    early = w / "mt-early"
    p = start([*HR, "train", str(cfg), f"--run.out_dir={early}"])
    while not (early / "config.toml").exists() and p.poll() is None:
        time.sleep(0.05)
    p.kill()
    finish(p)
    c.succeed(s, "killed before its first checkpoint: train --resume", [*HR, "train", "--resume", str(early), "--max-steps", "2"])
    shutil.rmtree(early / "checkpoints", ignore_errors=True)
    (early / "checkpoints").mkdir()
    c.succeed(s, "killed before its first checkpoint: the original command again", [*HR, "train", str(cfg), f"--run.out_dir={early}", "--max-steps", "2"])
    # bad inputs
    for name, damage in (
        ("missing train.de", lambda d: (d / "train.de").unlink()),
        ("empty valid.en", lambda d: (d / "valid.en").write_text("")),
        ("non-UTF-8 train.en", lambda d: (d / "train.en").write_bytes(b"the dog \xff\xfe sits\n" * 240)),
        ("line counts differ", lambda d: (d / "train.de").write_text("a\n" * 10)),
        ("empty line in train.en", lambda d: (d / "train.en").write_text((d / "train.en").read_text().replace("\n", "\n\n", 1))),
        ("train.en is a folder", lambda d: ((d / "train.en").unlink(), (d / "train.en").mkdir())),
    ):
        d = w / f"bitext-{name.replace(' ', '-')}"
        shutil.copytree(data, d)
        damage(d)
        c.refuse(s, name, [*HR, "train", str(cfg), f"--data.dir={d}", f"--run.out_dir={w / 'x'}"])
    for name, override in (
        ("d_embed not divisible by n_heads", "--model.n_heads=3"),
        ("subword_vocab_size=0", "--data.subword_vocab_size=0"),
        ("max_tokens=-1", "--train.max_tokens=-1"),
        ("label_smoothing=1.5", "--train.label_smoothing=1.5"),
        ("beam_size=0 in config", "--decode.beam_size=0"),
        ("unknown key", "--model.n_encoder_layer=2"),
        ("huge model", "--model.d_ff=100000000000"),
    ):
        c.refuse(s, name, [*HR, "train", str(cfg), override, f"--run.out_dir={w / 'x'}"])
    afile = write(w / "afile", "x")
    c.refuse(s, "out_dir is a file", [*HR, "train", str(cfg), f"--run.out_dir={afile}"])
    ro = w / "readonly"
    ro.mkdir(exist_ok=True)
    ro.chmod(0o555)
    if os.geteuid() != 0:
        c.refuse(s, "read-only parent of out_dir", [*HR, "train", str(cfg), f"--run.out_dir={ro / 'run'}"])
    c.refuse(s, "translate --beam 0", [*HR, "translate", str(ref), "--beam", "0"])
    c.refuse(s, "translate --out an existing folder", [*HR, "translate", str(ref), "--out", str(w)])
    c.refuse(s, "eval --max-tokens 10 of a translation run", [*HR, "eval", str(ref), "--max-tokens", "10"])
    for verb in (["dynamic-eval"], ["analyze", "rank"], ["finetune"]):
        c.refuse(s, f"{verb[-1]} of a translation run", [*HR, *verb, str(ref)], must="translation")
    c.succeed(s, "translate the test split", [*HR, "translate", str(ref), "--split", "test", "--out", str(w / "hyp.txt")], check=lambda r: None if (w / "hyp.txt").is_file() else "no hypotheses file")
    c.refuse(s, "translate a missing split", [*HR, "translate", str(ref), "--split", "dev"])
    # two resumes at once on one folder
    conc = w / "mt-conc"
    shutil.copytree(ref, conc)
    a = start([*HR, "train", "--resume", str(conc), "--train.epochs=60"])
    time.sleep(9)
    r = run([*HR, "train", "--resume", str(conc), "--train.epochs=60"])
    ra = finish(a, 400)
    lines = trajectory(conc)
    steps = [x[2] for x in lines if x[0] == "step"]
    problem = c._common(r) or (None if r.rc not in (0, None) and "in use" in r.last else "second resume not refused") or (None if ra.rc == 0 and steps == sorted(set(steps)) else "first run damaged")
    c.check(s, "two resumes of one run at once", problem, r)
    corrupt_cases(c, s, ref, [["train", "--resume", "RUN"], ["translate", "RUN", "--split", "test"]], w)


def lm_config(w: Path, name: str, data: Path, epochs: int, head="softmax", data_extra="") -> Path:
    return write(w / f"{name}.toml", TRANSFORMER.format(data=data, head=head, epochs=epochs, data_extra=data_extra))


def transformer(c: Campaign, w: Path, rng: random.Random) -> None:
    s = "transformer"
    data = word_corpus(w / "words")
    cfg = lm_config(w, "tf", data, epochs=6)
    ref = w / "tf-ref"
    c.succeed(s, "uninterrupted reference run", [*HR, "train", str(cfg), f"--run.out_dir={ref}", "--no-progress"], timeout=400)
    out = w / "tf-killed"
    kill_and_resume(c, s, [*HR, "train", str(cfg), f"--run.out_dir={out}"], [*HR, "train", "--resume", str(out)], out, ref, 5, (0.5, 6.0), rng)
    for name, override in (
        ("n_heads=0", "--model.n_heads=0"),
        ("d_embed not divisible by n_heads", "--model.n_heads=3"),
        ("max_len=0", "--model.max_len=0"),
        ("bptt beyond learned positions", "--train.bptt=50"),
        ("dropout_input=1.5", "--model.dropout_input=1.5"),
        ("accumulate=0", "--train.accumulate=0"),
        ("lr=nan", "--train.lr=nan"),
        ("epochs=-1", "--train.epochs=-1"),
        ("positions=foo", "--model.positions=foo"),
        ("huge d_ff", "--model.d_ff=1000000000000"),
    ):
        c.refuse(s, name, [*HR, "train", str(cfg), override, f"--run.out_dir={w / 'x'}"])
    c.refuse(s, "eval --bptt beyond the position table", [*HR, "eval", str(ref), "--bptt", "50"])
    c.refuse(s, "analyze rank --bptt beyond the position table", [*HR, "analyze", "rank", str(ref), "--bptt", "50", "--max-contexts", "50"])
    for name, damage in (
        ("missing valid.txt", lambda d: (d / "valid.txt").unlink()),
        ("empty train.txt", lambda d: (d / "train.txt").write_text("")),
        ("non-UTF-8 train.txt", lambda d: (d / "train.txt").write_bytes(b"a \xff b\n" * 100)),
    ):
        d = w / f"words-{name.replace(' ', '-')}"
        shutil.copytree(data, d)
        damage(d)
        c.refuse(s, name, [*HR, "train", str(cfg), f"--data.dir={d}", f"--run.out_dir={w / 'x'}"])
    c.refuse(s, "dynamic-eval of a transformer run", [*HR, "dynamic-eval", str(ref)])
    # another run's checkpoint (other size, same corpus) copied in
    other = w / "tf-other"
    c.succeed(s, "a second run of another size", [*HR, "train", str(cfg), "--model.d_embed=12", f"--run.out_dir={other}", "--max-steps", "3", "--no-progress"])
    alien = w / "tf-alien"
    shutil.copytree(ref, alien)
    for name in ("last.pt", "best.pt"):
        shutil.copy(other / "checkpoints" / "last.pt", alien / "checkpoints" / name)
    c.refuse(s, "eval of another run's checkpoint", [*HR, "eval", str(alien)])
    c.refuse(s, "train --resume of another run's checkpoint", [*HR, "train", "--resume", str(alien)])
    # a new run started twice at once in one folder
    twin = w / "tf-twin"
    a = start([*HR, "train", str(cfg), f"--run.out_dir={twin}", "--no-progress"])
    b = start([*HR, "train", str(cfg), f"--run.out_dir={twin}", "--no-progress"])
    ra, rb = finish(a, 400), finish(b, 400)
    rcs = sorted([ra.rc, rb.rc], key=str)
    problem = c._common(ra) or c._common(rb) or (None if rcs[0] == 0 and rcs[1] != 0 else f"exits {ra.rc}, {rb.rc}")
    if problem is None and trajectory(twin) != trajectory(ref):
        problem = "the surviving run differs from the uninterrupted one"
    c.check(s, "one new run started twice at once in one folder", problem, rb if rb.rc else ra)
    # metrics.jsonl shorter than the checkpoint's offset, then resume
    short = w / "tf-short"
    shutil.copytree(ref, short)
    lines = (short / "metrics.jsonl").read_text().splitlines(keepends=True)
    (short / "metrics.jsonl").write_text("".join(lines[: len(lines) // 2]))
    c.succeed(s, "resume with metrics.jsonl shorter than the checkpoint: says so", [*HR, "train", "--resume", str(short), "--train.epochs=8", "--max-steps", "2", "--no-progress"], check=lambda r: None if "lacks" in r.err else "no word about the lost lines")
    best_dir = w / "tf-bestdir"
    shutil.copytree(ref, best_dir)
    (best_dir / "checkpoints" / "best.pt").unlink()
    (best_dir / "checkpoints" / "best.pt").mkdir()
    c.refuse(s, "best.pt a folder, last.pt intact: resume refused naming it", [*HR, "train", "--resume", str(best_dir), "--train.epochs=8", "--max-steps", "2", "--no-progress"], must="best.pt")
    corrupt_cases(c, s, ref, [["train", "--resume", "RUN", "--train.epochs=8"], ["eval", "RUN"], ["report", "RUN", "--out", str(w / "rep")]], w)


def memmap(c: Campaign, w: Path, rng: random.Random) -> None:
    s = "memmap"
    cache = w / "cache"
    env = {"HIGHRANK_CACHE_DIR": str(cache)}
    data = w / "zipf"
    c.succeed(s, "data zipf (3 shards)", [*HR, "data", "zipf", str(data), "--tokens", "25000", "--shards", "3"], timeout=300)
    extra = 'memmap = true\nbatching = "sentences"'
    cfg = lm_config(w, "mm", data, epochs=1, data_extra=extra)
    ref = w / "mm-ref"
    c.succeed(s, "train on the zipf corpus as written", [*HR, "train", str(cfg), f"--run.out_dir={ref}", "--no-progress"], env=env, timeout=400)
    out = w / "mm-killed"
    kill_and_resume(c, s, [*HR, "train", str(cfg), f"--run.out_dir={out}"], [*HR, "train", "--resume", str(out)], out, ref, 3, (0.5, 6.0), rng)
    c.succeed(s, "data stats of a shard folder", [*HR, "data", "stats", str(data)])

    def variant(name, damage):
        d = w / f"zipf-{name.replace(' ', '-')}"
        shutil.copytree(data, d, symlinks=True)
        damage(d)
        return d

    shards = sorted((data / "train").iterdir()) if (data / "train").is_dir() else []
    for name, damage in (
        ("dangling symlink shard", lambda d: (d / "train" / "part-99999.txt").symlink_to(w / "nowhere.txt")),
        ("sub-folder among the shards", lambda d: (d / "train" / "sub").mkdir()),
        ("empty shard folder", lambda d: [x.unlink() for x in (d / "train").iterdir()]),
        ("non-UTF-8 shard", lambda d: (d / "train" / shards[0].name).write_bytes(b"w1 \xff w2\n" * 50)),
        ("train is a file, valid missing", lambda d: (d / "valid.txt").unlink()),
    ):
        if not shards:
            c.check(s, name, "zipf wrote no train/ folder of shards")
            continue
        c.refuse(s, name, [*HR, "train", str(cfg), f"--data.dir={variant(name, damage)}", f"--run.out_dir={w / 'x'}"], env=env)
    c.refuse(s, "HIGHRANK_CACHE_DIR is a file", [*HR, "train", str(cfg), f"--run.out_dir={w / 'x'}"], env={"HIGHRANK_CACHE_DIR": str(write(w / "cachefile", "x"))})
    ids = sorted(cache.rglob("*.ids"))
    if ids:
        # a cached ids file changed behind highrank's back: a different, in-range id
        for f in ids:
            raw = bytearray(f.read_bytes())
            raw[8:12] = (1).to_bytes(4, "little") if raw[8:12] != (1).to_bytes(4, "little") else (2).to_bytes(4, "little")
            f.write_bytes(bytes(raw))
        c.refuse(s, "cached ids altered (in range)", [*HR, "train", str(cfg), f"--run.out_dir={w / 'x2'}", "--max-steps", "2"], env=env)
        sizes = {f: f.stat().st_size for f in ids}
        for f in ids:
            f.write_bytes(f.read_bytes()[:-3])
        # a cache of the wrong size is stale: rebuilt from the text (the text is the truth)
        rebuilt = lambda r: None if all(f.stat().st_size == n for f, n in sizes.items()) else "cache not rebuilt"  # noqa: E731
        c.succeed(s, "cached ids truncated: rebuilt", [*HR, "train", str(cfg), f"--run.out_dir={w / 'x3'}", "--max-steps", "2"], env=env, check=rebuilt)
    else:
        c.check(s, "cached ids exist", f"no *.ids under {cache}")
    # the corpus changed under a run (the vocabulary did not), then resume
    # (two shards swapped: the same words, so the same vocabulary, in another order)
    moved = variant("changed", lambda d: ((d / "train" / shards[0].name).write_text(shards[1].read_text()), (d / "train" / shards[1].name).write_text(shards[0].read_text())))
    c.refuse(s, "resume after the corpus changed", [*HR, "train", "--resume", str(ref), f"--data.dir={moved}", "--train.epochs=2"], env=env)


def torchrun(c: Campaign, w: Path, rng: random.Random) -> None:
    s = "torchrun"
    data = word_corpus(w / "words-ddp", lines=(("train", 800), ("valid", 60), ("test", 60)))
    cfg = lm_config(w, "ddp", data, epochs=4)
    ref = w / "ddp-ref"
    c.succeed(s, "uninterrupted 2-process reference", [*TR, "train", str(cfg), f"--run.out_dir={ref}", "--no-progress"], timeout=400)
    out = w / "ddp-killed"
    kill_and_resume(c, s, [*TR, "train", str(cfg), f"--run.out_dir={out}"], [*TR, "train", "--resume", str(out)], out, ref, 2, (0.5, 8.0), rng)
    # one worker killed -9: the other must stop, no stray process
    one = w / "ddp-one"
    p = start([*TR, "train", str(cfg), f"--run.out_dir={one}"])
    deadline = time.time() + 120
    while time.time() < deadline and not (one / "metrics.jsonl").is_file():
        time.sleep(0.5)
    time.sleep(2)
    kids = subprocess.run(["pgrep", "-f", "--", f"--run.out_dir={one}"], capture_output=True, text=True).stdout.split()
    workers = [k for k in kids if int(k) != p.pid and "torch.distributed.run" not in Path(f"/proc/{k}/cmdline").read_text(errors="replace")] if kids else []
    if workers:
        os.kill(int(workers[-1]), signal.SIGKILL)
    t = time.time()
    r = finish(p, 120)
    stray = subprocess.run(["pgrep", "-f", "--", f"--run.out_dir={one}"], capture_output=True, text=True).stdout.split()
    problem = "no worker found" if not workers else ("hang" if r.rc is None else (f"stray {stray}" if stray else None))
    c.check(s, f"one worker killed -9: the rest stop in {time.time() - t:.1f}s", problem, r)
    c.succeed(s, "resume after a worker was killed", [*TR, "train", "--resume", str(one), "--max-steps", "40", "--no-progress"], timeout=300)
    mt = bitext(w / "bitext-ddp")
    mtcfg = write(w / "ddp-mt.toml", SEQ2SEQ.format(data=mt, head="softmax", epochs=1))
    r = run([*TR, "train", str(mtcfg), f"--run.out_dir={w / 'ddp-mt'}", "--max-steps", "3"], timeout=300)
    problem = c._common(r) or (f"exit {r.rc}" if r.rc != 0 else None) or (None if "one process" in (r.out + r.err) else "does not say it runs in one process")
    c.check(s, "translation config under torchrun: one process, said so", problem, r)
    r = run([*TR, "eval", str(ref)], timeout=300)
    n_results = (r.out + r.err).count("perplexity")
    problem = c._common(r) or (f"exit {r.rc}" if r.rc else None) or (None if n_results == 1 else f"{n_results} perplexity lines")
    c.check(s, "eval under torchrun: one evaluation", problem, r)
    c.succeed(s, "resume in 1 process of a 2-process run: a note", [*HR, "train", "--resume", str(ref), "--train.epochs=5", "--max-steps", "3", "--no-progress"], check=lambda r: None if "written by 2 process(es)" in r.err else "no note")


HF_SETUP = """
import sys, torch, transformers
from pathlib import Path
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
words = "the a of cat dog sat on mat ran far near house tree bird sang loud quiet red".split()
vocab = {t: i for i, t in enumerate(["[UNK]", "<s>"] + words)}
backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", bos_token="<s>")
torch.manual_seed(0)
cfg = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1)
folder = Path(sys.argv[1])
transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
tok.save_pretrained(folder)
import random
rng = random.Random(0)
for name, n in (("train", 3000), ("valid", 400), ("test", 400)):
    text = [" ".join(rng.choice(words) for _ in range(9)) for _ in range(n // 9)]
    (folder.parent / f"{name}.txt").write_text("\\n".join(text) + "\\n")
"""


def hf(c: Campaign, w: Path, rng: random.Random) -> None:
    s = "hf"
    model = w / "hf" / "model"
    r = run([sys.executable, "-c", HF_SETUP, str(model)], timeout=200)
    if r.rc != 0:
        c.check(s, "tiny model saved", f"setup failed: {r.last}", r)
        return
    text = w / "hf" / "test.txt"
    rank = ["analyze", "rank", "--hf"]
    c.succeed(s, "analyze rank of the tiny model", [*HR, *rank, str(model), "--text", str(text), "--out", str(w / "hf-rank"), "--max-contexts", "64"])

    def variant(name, damage):
        d = w / f"hf-{name.replace(' ', '-')}"
        shutil.copytree(model, d)
        damage(d)
        return d

    def set_config(d, **kv):
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(kv)
        (d / "config.json").write_text(json.dumps(cfg))

    def nan_weights(d):
        from safetensors.torch import load_file, save_file

        t = load_file(d / "model.safetensors")
        for v in t.values():
            v.fill_(float("nan"))
        save_file(t, d / "model.safetensors", metadata={"format": "pt"})

    for name, damage in (
        ("truncated model.safetensors", lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:500])),
        ("empty model.safetensors", lambda d: (d / "model.safetensors").write_bytes(b"")),
        ("config sizes mismatch the weights", lambda d: set_config(d, hidden_size=32, intermediate_size=64)),
        ("no tokenizer", lambda d: [f.unlink() for f in d.iterdir() if "token" in f.name]),
        ("broken tokenizer.json", lambda d: (d / "tokenizer.json").write_text("{not json")),
        ("config.json not JSON", lambda d: (d / "config.json").write_text("{")),
        ("unknown model_type", lambda d: set_config(d, model_type="nonesuch")),
        ("NaN weights", lambda d: nan_weights(d)),
    ):
        try:
            folder = variant(name, damage)
        except Exception as error:  # noqa: BLE001 (a setup step of the campaign, reported)
            c.check(s, name, f"setup: {error}")
            continue
        c.refuse(s, f"analyze rank: {name}", [*HR, *rank, str(folder), "--text", str(text), "--out", str(w / "hf-x"), "--max-contexts", "64"])
    c.refuse(s, "analyze rank: --out is a file", [*HR, *rank, str(model), "--text", str(text), "--out", str(write(w / "hf-outfile", "x"))])
    c.refuse(s, "analyze rank: missing --text", [*HR, *rank, str(model), "--text", str(w / "nope.txt"), "--out", str(w / "hf-x")])
    c.refuse(s, "analyze rank: empty --text", [*HR, *rank, str(model), "--text", str(write(w / "empty.txt", "")), "--out", str(w / "hf-x")])
    nonutf = w / "nonutf.txt"
    nonutf.write_bytes(b"the cat \xff\xfe sat\n" * 20)
    c.refuse(s, "analyze rank: non-UTF-8 --text", [*HR, *rank, str(model), "--text", str(nonutf), "--out", str(w / "hf-x")])
    c.refuse(s, "analyze rank: a model folder that does not exist", [*HR, *rank, str(w / "nomodel"), "--text", str(text), "--out", str(w / "hf-x")])
    c.refuse(s, "analyze rank: --max-contexts 0", [*HR, *rank, str(model), "--text", str(text), "--out", str(w / "hf-x"), "--max-contexts", "0"])
    # retrofit: a run, killed and run again, bad inputs
    train, valid = w / "hf" / "train.txt", w / "hf" / "valid.txt"
    base = [*HR, "retrofit", "--hf", str(model), "--head", "mos", "--knob", "n_components=2", "--train", str(train), "--valid", str(valid), "--window", "16", "--batch-tokens", "64"]
    ref = w / "rf-ref"
    c.succeed(s, "retrofit (frozen, mos-2)", [*base, "--out", str(ref), "--steps", "300"], timeout=400, check=lambda r: None if (ref / "results.json").is_file() else "no results.json")
    out = w / "rf-killed"
    for name in SIGNALS:
        p = start([*base, "--out", str(out), "--steps", "300"])
        time.sleep(rng.uniform(6, 18))
        if p.poll() is None:
            p.send_signal(SIGNALS[name])
        r = finish(p, 90)
        problem = "no exit within 90 s" if r.rc is None else ("traceback" if "Traceback (most recent" in r.err and name != "SIGKILL" else None)
        c.check(s, f"retrofit {name} at {r.secs:.1f}s", problem, r)
    r = run([*base, "--out", str(out), "--steps", "300"], timeout=400)
    got = json.loads((out / "results.json").read_text()) if (out / "results.json").is_file() else None
    want = json.loads((ref / "results.json").read_text()) if (ref / "results.json").is_file() else None
    def keep(d):  # the results less timings and the folder's own name
        if isinstance(d, dict):
            return {k: keep(v) for k, v in d.items() if "second" not in k and k != "out"}
        return d

    problem = c._common(r) or (f"exit {r.rc}" if r.rc else None) or (None if got and keep(got) == keep(want) else "results differ from the uninterrupted retrofit")
    c.check(s, "retrofit run again after the kills equals the uninterrupted one", problem, r)
    for name, extra in (
        ("unknown head", ["--head", "nonesuch"]),
        ("knob out of range", ["--knob", "n_components=0"]),
        ("knob not KEY=VALUE", ["--knob", "n_components"]),
        ("--steps 0", ["--steps", "0"]),
        ("--lr -1", ["--lr", "-1"]),
        ("--window 0", ["--window", "0"]),
        ("--window beyond the model's positions", ["--window", "100000"]),
    ):
        c.refuse(s, f"retrofit {name}", [*base, *extra, "--out", str(w / f"rf-x-{name.replace(' ', '-')}")])
    # a refused start (its --lr) leaves nothing that blocks the corrected command
    c.refuse(s, "retrofit --lr nan", [*base, "--lr", "nan", "--out", str(w / "rf-fixed")])
    c.succeed(s, "the corrected command into the same folder", [*base, "--out", str(w / "rf-fixed"), "--steps", "5"])
    c.refuse(s, "retrofit --out is a file", [*base, "--out", str(w / "hf-outfile")])
    c.refuse(s, "retrofit missing --valid file", [*base[:-6], "--valid", str(w / "nope.txt"), *base[-4:], "--out", str(w / "rf-x-valid")])
    c.refuse(s, "retrofit with other settings into a finished folder", [*base, "--out", str(ref), "--steps", "301"])
    conc = w / "rf-conc"
    a = start([*base, "--out", str(conc), "--steps", "300"])
    b = start([*base, "--out", str(conc), "--steps", "300"])
    ra, rb = finish(a, 400), finish(b, 400)
    r = rb if rb.rc else ra
    ok = sorted([ra.rc, rb.rc], key=str) == [0, 2] and "in use" in r.last
    problem = c._common(ra) or c._common(rb) or (None if ok else f"exits {ra.rc}, {rb.rc}: {r.last}")
    c.check(s, "two retrofits into one folder at once: one refused", problem, r)


PAYLOAD = """
import sys, torch, numpy as np
from pathlib import Path
class P:
    def __reduce__(self):
        return (Path.touch, (Path(sys.argv[2]),))
kind, path = sys.argv[1], Path(sys.argv[3])
if kind == "npy":
    np.save(path, np.array([P()], dtype=object))  # an object array: pickled
else:
    torch.save({"format": "highrank-checkpoint", "model": {}, "payload": P()}, path)
"""


def security(c: Campaign, w: Path, rng: random.Random) -> None:
    s = "security"
    data = word_corpus(w / "words-sec", lines=(("train", 300), ("valid", 40), ("test", 40)))
    cfg = lm_config(w, "sec", data, epochs=1)
    good = w / "sec-run"
    r = run([*HR, "train", str(cfg), f"--run.out_dir={good}", "--max-steps", "3", "--no-progress"])
    if r.rc != 0:
        c.check(s, "a run to attack", f"setup failed: {r.last}", r)
        return
    mt = bitext(w / "bitext-sec")
    mtrun = w / "sec-mt"
    run([*HR, "train", str(write(w / "sec-mt.toml", SEQ2SEQ.format(data=mt, head="softmax", epochs=1))), f"--run.out_dir={mtrun}", "--max-steps", "4"], timeout=300)
    hfm = w / "sec-hf" / "model"
    run([sys.executable, "-c", HF_SETUP, str(hfm)], timeout=200)
    marker = w / "PWNED"

    def poison(kind: str, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_dir():
            shutil.rmtree(path)
        subprocess.run([sys.executable, "-c", PAYLOAD, kind, str(marker), str(path)], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})

    cases = []
    for verb in (["train", "--resume", "R"], ["eval", "R", "--which", "last"], ["dynamic-eval", "R", "--which", "last"], ["finetune", "R"], ["analyze", "rank", "R", "--which", "last"], ["analyze", "saturation", "R"], ["report", "R", "--out", str(w / "sec-rep")]):
        cases.append((f"pickled last.pt + best.pt to {' '.join(verb[:2]).replace(' R', '')}" + (" (reads none: runs, payload inert)" if verb[0] == "report" else ""), good, ["checkpoints/last.pt", "checkpoints/best.pt"], "pt", verb))
    cases.append(("pickled last.pt to translate", mtrun, ["checkpoints/last.pt", "checkpoints/best.pt"], "pt", ["translate", "R", "--which", "last"]))
    cases.append(("pickled last.prev.pt behind a truncated last.pt", good, ["checkpoints/last.prev.pt"], "pt", ["train", "--resume", "R"]))
    cases.append(("pickled pytorch_model.bin (no safetensors)", hfm, ["pytorch_model.bin"], "pt", ["analyze", "rank", "--hf", "R", "--text", str(data / "test.txt"), "--out", str(w / "sec-x")]))
    for name, run_dir, files, kind, verb in cases:
        target = w / f"sec-{abs(hash(name)) % 10**8}"
        shutil.copytree(run_dir, target)
        for f in files:
            poison(kind, target / f)
        if "behind" in name:
            (target / "checkpoints" / "last.pt").write_bytes(b"PK\x03\x04trunc")
        if "pytorch_model.bin" in name:
            (target / "model.safetensors").unlink()
        marker.unlink(missing_ok=True)
        r = run([*HR, *[str(target) if a == "R" else a for a in verb]])
        reads = verb[0] != "report"  # report reads metrics.jsonl and records, no checkpoint
        problem = "PAYLOAD RAN" if marker.exists() else (c._common(r) or ("accepted" if r.rc == 0 and reads else None))
        c.check(s, name, problem, r)
    # analysis outputs and retrofit state
    rep = w / "sec-rank"
    r = run([*HR, "analyze", "rank", str(good), "--which", "last", "--out", str(rep), "--max-contexts", "40"])
    for npy in sorted(rep.rglob("*.npy"))[:3]:
        poison("npy", npy)
        marker.unlink(missing_ok=True)
        r = run([*HR, "report", str(rep), "--out", str(w / "sec-rep2")])
        problem = "PAYLOAD RAN" if marker.exists() else c._common(r)
        c.check(s, f"pickled {npy.name} to report", problem, r)
        marker.unlink(missing_ok=True)
        r = run([*HR, "analyze", "rank", str(good), "--which", "last", "--out", str(rep), "--max-contexts", "40"])
        problem = "PAYLOAD RAN" if marker.exists() else c._common(r)
        c.check(s, f"pickled {npy.name} to analyze rank resuming into its folder", problem, r)
    rf = w / "sec-rf"
    base = [*HR, "retrofit", "--hf", str(hfm), "--head", "mos", "--knob", "n_components=2", "--train", str(hfm.parent / "train.txt"), "--valid", str(hfm.parent / "valid.txt"), "--window", "16", "--batch-tokens", "64", "--steps", "20", "--out", str(rf)]
    run(base, timeout=300)
    states = sorted(rf.rglob("*.pt")) + sorted(rf.rglob("*.npy"))[:2]
    clean = w / "sec-rf-clean"
    shutil.copytree(rf, clean)
    for state in states[:4]:
        shutil.rmtree(rf)
        shutil.copytree(clean, rf)  # one poisoned file at a time
        poison("npy" if state.suffix == ".npy" else "pt", state)
        (rf / "results.json").unlink(missing_ok=True)  # so that the same command reads it again
        shutil.rmtree(rf / "model", ignore_errors=True)
        marker.unlink(missing_ok=True)
        r = run(base, timeout=300)
        problem = "PAYLOAD RAN" if marker.exists() else c._common(r)
        c.check(s, f"pickled retrofit {state.relative_to(rf)} to retrofit", problem, r)
    if not states:
        c.check(s, "retrofit state files found", None)


def data_get(c: Campaign, w: Path, rng: random.Random) -> None:
    s = "data-get"
    sys.path.insert(0, str(REPO / "src"))
    from highrank.data.sources import DATASETS, GITHUB_RAW

    mirror = w / "mirror"
    for dataset in DATASETS.values():
        for file in dataset.files:
            where = mirror / file.url.removeprefix(GITHUB_RAW)
            where.parent.mkdir(parents=True, exist_ok=True)
            raw = (SHARED / dataset.folder / file.name).read_bytes()
            where.write_bytes(gzip.compress(raw, mtime=0) if file.gunzip else raw)
    uri = mirror.as_uri()
    to = w / "got"
    offline = {"https_proxy": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9"}

    def same(name):
        ds = DATASETS[name]
        bad = [f.name for f in ds.files if (to / ds.folder / f.name).read_bytes() != (SHARED / ds.folder / f.name).read_bytes()]
        return f"differs: {bad}" if bad else None

    c.succeed(s, "get all from the mirror", [*HR, "data", "get", "all", "--to", str(to), "--mirror", uri], check=lambda r: same("ptb") or same("multi30k"), timeout=300)
    c.succeed(s, "get ptb again: nothing downloaded", [*HR, "data", "get", "ptb", "--to", str(to), "--mirror", "file:///nonexistent"], check=lambda r: None if "already" in r.out else "did not say the files are there")
    c.refuse(s, "offline, no mirror", [*HR, "data", "get", "ptb", "--to", str(w / "off")], env=offline)
    c.refuse(s, "a mirror folder that does not exist", [*HR, "data", "get", "ptb", "--to", str(w / "off2"), "--mirror", "file:///nonexistent"])
    c.refuse(s, "unknown dataset", [*HR, "data", "get", "ptbb", "--to", str(w / "off3"), "--mirror", uri])
    c.refuse(s, "--to is a file", [*HR, "data", "get", "ptb", "--to", str(write(w / "tofile", "x")), "--mirror", uri])
    c.refuse(s, "bad mirror scheme", [*HR, "data", "get", "ptb", "--to", str(w / "off4"), "--mirror", "ftp://x"])
    # a mirror serving a wrong file: sha256 refused, nothing wrong kept
    bad_mirror = w / "bad-mirror"
    shutil.copytree(mirror, bad_mirror)
    victim = next(iter(DATASETS["ptb"].files))
    vpath = bad_mirror / victim.url.removeprefix(GITHUB_RAW)
    vpath.write_bytes(vpath.read_bytes()[:-10] + b"0123456789")
    dest = w / "got-bad"
    c.refuse(s, "a mirror file with wrong bytes", [*HR, "data", "get", "ptb", "--to", str(dest), "--mirror", bad_mirror.as_uri()], must="sha256")
    kept = dest / DATASETS["ptb"].folder / victim.name
    c.check(s, "the wrong file is not kept under its name", "kept" if kept.is_file() else None)
    # a local file damaged after the download: the next get notices
    f = to / DATASETS["ptb"].folder / victim.name
    f.write_bytes(f.read_bytes()[:-1] + b"!")
    c.refuse(s, "a damaged local file: refused, never overwritten", [*HR, "data", "get", "ptb", "--to", str(to), "--mirror", uri], must="move it away")
    damaged = f.read_bytes()
    c.check(s, "the damaged file is left as it was", None if damaged.endswith(b"!") else "overwritten")
    f.rename(w / "moved-away.txt")
    c.succeed(s, "moved away: fetched again", [*HR, "data", "get", "ptb", "--to", str(to), "--mirror", uri], check=lambda r: same("ptb"))
    # a partial download left behind: resumed
    part = to / DATASETS["ptb"].folder / (victim.name + ".part")
    full = f.read_bytes()
    f.unlink()
    part.write_bytes(full[: len(full) // 2])
    c.succeed(s, "a .part left behind is resumed", [*HR, "data", "get", "ptb", "--to", str(to), "--mirror", uri], check=lambda r: same("ptb"))
    part.write_bytes(b"garbage" * 1000)
    f.unlink()
    c.succeed(s, "a .part of wrong bytes is started again", [*HR, "data", "get", "ptb", "--to", str(to), "--mirror", uri], check=lambda r: same("ptb"))
    ro = w / "ro-to"
    ro.mkdir()
    ro.chmod(0o555)
    if os.geteuid() != 0:
        c.refuse(s, "--to read-only", [*HR, "data", "get", "ptb", "--to", str(ro), "--mirror", uri])
    # killed during the download, then run again
    dest = w / "got-kill"
    for _ in range(2):
        p = start([*HR, "data", "get", "all", "--to", str(dest), "--mirror", uri])
        time.sleep(rng.uniform(7.0, 10.0))
        p.kill()
        finish(p)
    c.succeed(s, "get all after two kills -9", [*HR, "data", "get", "all", "--to", str(dest), "--mirror", uri], timeout=300)
    bad = [f.name for ds in DATASETS.values() for f in ds.files if (dest / ds.folder / f.name).read_bytes() != (SHARED / ds.folder / f.name).read_bytes()]
    c.check(s, "every file byte-identical after the kills", f"differ: {bad}" if bad else None)
    a = start([*HR, "data", "get", "all", "--to", str(w / "got-conc"), "--mirror", uri])
    b = start([*HR, "data", "get", "all", "--to", str(w / "got-conc"), "--mirror", uri])
    ra, rb = finish(a, 300), finish(b, 300)
    problem = c._common(ra) or c._common(rb)
    if problem is None:
        bad = [f.name for ds in DATASETS.values() for f in ds.files if not (w / "got-conc" / ds.folder / f.name).is_file() or (w / "got-conc" / ds.folder / f.name).read_bytes() != (SHARED / ds.folder / f.name).read_bytes()]
        problem = f"differ after two at once: {bad}" if bad and 0 in (ra.rc, rb.rc) else (None if 0 in (ra.rc, rb.rc) else f"both failed: {ra.last} / {rb.last}")
    c.check(s, "two gets into one folder at once", problem, rb)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("work_dir", nargs="?", default="/tmp/highrank-fault-campaign-surfaces")
    parser.add_argument("--only", nargs="+", choices=SURFACES, default=list(SURFACES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    root = Path(args.work_dir).resolve()
    if root.exists() and any(root.iterdir()) and not (root / MARKER).is_file():
        parser.error(f"{root} holds files of something else (no {MARKER}): name a new or empty folder")
    for surface in args.only:  # a surface starts from a clean folder, the others' stay
        if (root / surface).exists():
            for p in (root / surface).rglob("*"):
                if p.is_dir() and not p.is_symlink():
                    p.chmod(0o755)
            shutil.rmtree(root / surface)
    root.mkdir(parents=True, exist_ok=True)
    (root / MARKER).write_text("")
    (root / "stamps").mkdir(exist_ok=True)
    os.environ["CAMPAIGN_STAMPS"] = str(root / "stamps")
    timed = root / "highrank_timed.py"
    timed.write_text(TIMED)
    HR[:] = [sys.executable, str(timed), "{stamp}"]
    TR[:] = [*TORCHRUN, str(timed), "{stamp}"]
    c = Campaign(root)
    t0 = time.time()
    for surface in args.only:
        w = root / surface
        w.mkdir()
        t = time.time()
        globals()[surface.replace("-", "_")](c, w, random.Random(args.seed))
        held, total = c.counts.get(surface, [0, 0])
        print(f"== {surface}: {held}/{total} held, {time.time() - t:.0f} s", flush=True)
    print(f"== all: {sum(h for h, _ in c.counts.values())}/{sum(t for _, t in c.counts.values())} held in {time.time() - t0:.0f} s")
    for line in c.found:
        print("FOUND", line)


if __name__ == "__main__":
    main()
