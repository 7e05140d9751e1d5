"""Several processes, one run: ``torchrun`` and DistributedDataParallel for every recipe.

``torchrun --nproc-per-node N -m highrank train CONFIG`` starts N copies of ``highrank train``;
each finds RANK / WORLD_SIZE / LOCAL_RANK in its environment (:func:`init_from_env`) and joins
one process group (gloo for CPU tensors, NCCL for CUDA ones; process ``r`` uses GPU
``LOCAL_RANK``). What each piece of a run does then (Li et al., "PyTorch Distributed:
Experiences on Accelerating Data Parallel Training", VLDB 2020, for DDP itself):

    model       wrapped in ``DistributedDataParallel`` for the training forward pass only
                (:func:`distribute`): every parameter's gradient is averaged over the
                processes as backward produces it, so every process takes the same optimizer
                step and the weights (and ASGD's averages) stay identical on every process.
                The heads' chunked losses compute their gradients in the forward pass but hand
                them to autograd in backward (``heads/chunking.py``, ``heads/mixture_ce.py``:
                ``autograd.Function``), so DDP's hooks see them like any other.
    data        stream LMs (AWD-LSTM, Transformer): train.batch_size is the *global* batch;
                process r owns the contiguous columns [r B/N, (r+1) B/N) of the (T, B) batch
                (:func:`shard_columns`) and its own hidden state, so N processes compute the
                one-process step on the same global batch (each averages over its B/N columns
                and DDP averages the N means). Validation likewise splits the
                train.eval_batch_size columns and averages the N losses (every process
                evaluates all columns when they do not divide by N).
    randomness  the variable BPTT length and the window order come from the recipes' own
                generators, seeded alike on every process; dropout draws from each process's
                global generator, which processes 1..N-1 reseed (:func:`distribute`) so their
                masks differ from process 0's (process 0's are those of a one-process run).
    decisions   every process sees the same averaged step loss and validation loss
                (:func:`average`), so the non-finite guard, NT-ASGD's switch and the best
                checkpoint agree; a signal or a checkpoint due by wall time on any process
                stops or saves all of them at the same step (:func:`any_rank`).
    run dir     only process 0 writes it (run lock, config, metrics, checkpoints, command
                line); the others wait at barriers (:func:`on_writer`). A checkpoint holds the
                hidden states of all processes (gathered, so ``hidden`` has the global batch's
                columns as in a one-process run), every process's RNG states under
                ``training["rng"]["ranks"]`` and ``training["world_size"]``: resuming with the
                same N is exact; another N continues with a one-line note.

Outside torchrun (no process group) every function here is the identity or a no-op.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import inspect
import os
import signal
import sys
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from highrank.config import ConfigError
from highrank.runs.run_dir import RunDir
from highrank.train.reporting import RunLog
from highrank.train.startup import seed_everything
from highrank.train.state import Progress

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
PR_SET_PDEATHSIG = 1  # <sys/prctl.h>: the signal a process gets when its parent dies
RESEED_STRIDE = 1_000_003  # process r > 0 reseeds with seed + r * stride (a prime)
T = TypeVar("T")


# ---- the process group ------------------------------------------------------------------------


def active() -> bool:
    """Whether this process is one of several in an initialised process group."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def is_writer() -> bool:
    """Process 0 (or the only process): the one that writes the run directory."""
    return rank() == 0


def launched_rank() -> int | None:
    """The RANK torchrun gave this process (from the environment, with no process group
    joined), or None outside torchrun."""
    if not all(key in os.environ for key in ENV_KEYS):
        return None
    return int(os.environ["RANK"])


def only_process_zero(what: str) -> bool:
    """For work that runs in one process (translation, evaluation): under torchrun, True in
    processes r > 0, which then stop at once and quietly; process 0 says so and does it all,
    without a process group. False outside torchrun."""
    launched = launched_rank()
    if launched is None:
        return False
    if launched == 0:
        print(f"note: {what} runs in one process; under torchrun process 0 does it all and the "
              "others exit", file=sys.stderr, flush=True)
    return launched != 0


def init_from_env() -> bool:
    """Join the process group ``torchrun`` describes in the environment (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR, MASTER_PORT); False when there is none or it is already joined.
    CPU tensors travel by gloo, CUDA tensors by NCCL; a process with a GPU uses GPU
    LOCAL_RANK."""
    if not all(key in os.environ for key in ENV_KEYS) or dist.is_initialized():
        return False
    if not dist.is_available():
        raise ConfigError("torchrun started this process, but this torch has no torch.distributed")
    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        backend = "cpu:gloo,cuda:nccl"
    stop_with_the_launcher()
    dist.init_process_group(backend, init_method="env://")
    atexit.register(_leave)
    return True


def stop_with_the_launcher() -> None:
    """Ask Linux for a SIGTERM when the parent (the torchrun launcher) dies: a kill -9 of the
    launcher left both processes training on as orphans; now each stops at the next step
    boundary like after any SIGTERM (process 0 saves last.pt). Elsewhere nothing happens."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: no prctl
        return
    if os.getppid() == 1:  # the launcher died before the request: stop as it would have
        os.kill(os.getpid(), signal.SIGTERM)


def _leave() -> None:
    """At exit under torchrun: the process group destroyed while the interpreter is whole.
    Cyclic garbage first (a DDP wrapper and its reducer, kept alive by hook cycles, hold the
    gloo group and its threads): left to interpreter finalization, their teardown aborted a
    finished process once (SIGABRT, "terminate called without an active exception", LoRA in
    2 processes on a loaded machine)."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


# ---- the model --------------------------------------------------------------------------------


def distribute(model: nn.Module, seed: int, *, wrap: bool = True) -> nn.Module:
    """The module to call for training forward passes: ``model`` itself in one process; else
    ``model`` in DistributedDataParallel (which makes every process start from process 0's
    weights; ``wrap=False``: not wrapped, for a model FSDP2 sharded), and processes r > 0
    reseed their global RNGs (dropout masks of their own)."""
    if not active():
        return model
    wrapped = model
    if wrap:
        device = next(model.parameters()).device
        ids = None  # CPU: DDP takes no device ids
        if device.type == "cuda":
            ids = [device.index if device.index is not None else torch.cuda.current_device()]
        wrapped = Distributed(model, device_ids=ids, **_NO_BUFFER_SYNC)
    if rank() > 0:
        seed_everything(seed + rank() * RESEED_STRIDE)
    return wrapped


# Buffers (position tables) are constants, alike on every process: not re-sent every forward.
# torch >= 2.13 names the switch forward_sync_buffers (broadcast_buffers is deprecated).
_NO_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(nn.parallel.DistributedDataParallel).parameters
    else {"broadcast_buffers": False}
)


class Distributed(nn.parallel.DistributedDataParallel):
    """DistributedDataParallel that also answers the wrapped model's attributes
    (``wrapped.backbone``), so a recipe's step code takes either."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)


def no_sync(module: nn.Module, skip: bool = True) -> AbstractContextManager:
    """Around a forward and its backward: with ``skip``, DDP does not average the gradients
    (micro-batches before the last one of an accumulated update: the last one's backward
    averages the sums)."""
    ddp = isinstance(module, nn.parallel.DistributedDataParallel)
    return module.no_sync() if ddp and skip else nullcontext()


# ---- data -------------------------------------------------------------------------------------


def shard_columns(batch: torch.Tensor, what: str, *, strict: bool = True, dim: int = 1):
    """This process's contiguous share of the columns (``dim``) of ``batch``: process r of N
    gets columns [r B/N, (r+1) B/N). When B does not divide by N: a ConfigError naming
    ``what`` (``strict``), else the whole batch (every process computes all of it)."""
    n, columns = world_size(), batch.size(dim)
    if n == 1:
        return batch
    if columns % n:
        if not strict:
            return batch
        raise ConfigError(
            f"{what} = {columns} is the global batch, split among {n} processes: it must "
            f"divide by {n}; start as many processes as divide it (torchrun --nproc-per-node), "
            f"or a new run with a multiple of {n} (e.g. --{what}={max(n, columns // n * n)})"
        )
    share = columns // n
    return batch.narrow(dim, rank() * share, share).contiguous()


def gather_columns(part: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard_columns`: every process's ``part`` side by side along ``dim``,
    on every process."""
    if not active():
        return part
    parts = [torch.empty_like(part) for _ in range(world_size())]
    dist.all_gather(parts, part.contiguous())
    return torch.cat(parts, dim=dim)


# ---- agreeing -----------------------------------------------------------------------------------


def average(value: float | torch.Tensor) -> float:
    """The mean of ``value`` over the processes, the same float on every one (gathered and
    summed in rank order, float64); a NaN anywhere makes it NaN everywhere."""
    local = torch.as_tensor(value, dtype=torch.float64).detach().reshape(1)
    if not active():
        return float(local)
    local = local.to(_collective_device())
    values = [torch.empty_like(local) for _ in range(world_size())]
    dist.all_gather(values, local)
    return float(torch.cat(values).sum().cpu()) / len(values)


def gathered(values: list[float]) -> list[list[float]]:
    """Every process's ``values`` (as float64), in rank order, on every process (``[values]``
    outside torchrun): sums and maxima taken from them are the same float everywhere."""
    local = torch.tensor(values, dtype=torch.float64)
    if not active():
        return [local.tolist()]
    local = local.to(_collective_device())
    parts = [torch.empty_like(local) for _ in range(world_size())]
    dist.all_gather(parts, local)
    return [part.cpu().tolist() for part in parts]


def all_finite(value: torch.Tensor) -> bool:
    """Whether ``value`` is finite on every process (so all skip a step, or none does)."""
    return average(torch.isfinite(value.detach()).all()) == 1.0


def any_rank(value: int | None) -> int | None:
    """The largest ``value`` over the processes (None counts as 0; 0 gives None): e.g. a
    signal number caught by any one of them."""
    if not active():
        return value or None
    flag = torch.tensor([value or 0], dtype=torch.int64, device=_collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag) or None


def barrier() -> None:
    if active():
        dist.barrier()


def _collective_device() -> torch.device:
    """Where small tensors for collectives live: the GPU when NCCL carries them."""
    nccl = torch.cuda.is_available() and "nccl" in str(dist.get_backend()).lower()
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


# ---- the run directory ------------------------------------------------------------------------


def on_writer(write: Callable[[], T], otherwise: Callable[[], T]) -> T:
    """``write()`` on process 0, ``otherwise()`` on the others once process 0 is done (a
    barrier: e.g. the run directory exists before anyone reads it)."""
    result = write() if is_writer() else None
    barrier()
    return result if is_writer() else otherwise()


def from_writer(compute: Callable[[], T]) -> T:
    """``compute()`` on process 0 (where it may write), its result sent to every process; an
    exception it raises is raised on every process (so none waits for a result that never
    comes). ``compute()`` itself outside torchrun."""
    if not active():
        return compute()
    box: list[Any] = [None]
    if is_writer():
        try:
            box[0] = ("value", compute())
        except Exception as error:  # sent on, and raised here too
            box[0] = ("error", error)
    dist.broadcast_object_list(box, src=0)
    kind, payload = box[0]
    if kind == "error":
        raise payload
    return payload


def writer_lock(lock: Callable[[], AbstractContextManager]) -> AbstractContextManager:
    """The run lock, taken by process 0 only (the others write nothing)."""
    return lock() if is_writer() else nullcontext()


class FollowerLog(RunLog):
    """A :class:`RunLog` that writes nothing and shows nothing (processes 1..N-1)."""

    def __init__(self, run: RunDir, stage: str, progress: Progress, show_bar: bool) -> None:
        self.stage, self.progress, self.show_bar = stage, progress, False
        self.metrics = _NoMetrics()

    def write(self, record: Mapping[str, Any]) -> None:
        pass

    def validation(self, record, val_loss, improved, seconds, verdict) -> None:
        pass

    def close(self) -> None:
        pass


class _NoMetrics:
    """What a checkpoint asks of metrics.jsonl, on a process that does not write it."""

    def offset(self) -> int:
        return 0

    def lines(self, stage: str) -> int:
        return 0

    def rewind(self, offset: int, stage: str | None, lines: int | None) -> None:
        pass


def run_log(run: RunDir, stage: str, progress: Progress, show_bar: bool) -> RunLog:
    """The stage's :class:`RunLog` on process 0, a :class:`FollowerLog` on the others."""
    kind = RunLog if is_writer() else FollowerLog
    return kind(run, stage, progress, show_bar)


def gather_rng(state: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's ``rng``: process 0's ``state`` as before and, with several processes,
    every process's under ``"ranks"`` (a list in rank order)."""
    if not active():
        return state
    states: list[Any] = [None] * world_size()
    dist.all_gather_object(states, state)
    return {**state, "ranks": states}


def rank_rng(rng: Mapping[str, Any], saved_world: int) -> Mapping[str, Any]:
    """The RNG states this process restores from a checkpoint's ``rng``: its own when the
    checkpoint was written by as many processes; else process 0's (on process 0) and
    nothing (None: keep the fresh reseeded streams) on the others."""
    if saved_world == world_size() and "ranks" in rng:
        return rng["ranks"][rank()]
    return rng if is_writer() else None


def note_world_size(saved_world: int, where: str) -> None:
    """One line (process 0, stderr) when a checkpoint written by another number of
    processes is resumed: training goes on, but not bit-identically."""
    if saved_world != world_size() and is_writer():
        print(
            f"note: {where} was written by {saved_world} process(es) and resumes in "
            f"{world_size()}: training continues from it, but dropout masks (and the order of "
            f"sums) differ from an uninterrupted run; resume with torchrun --nproc-per-node "
            f"{saved_world} for an exact continuation",
            file=sys.stderr,
        )


__all__ = [
    "active",
    "all_finite",
    "any_rank",
    "Distributed",
    "FollowerLog",
    "average",
    "barrier",
    "distribute",
    "from_writer",
    "gather_columns",
    "gather_rng",
    "gathered",
    "init_from_env",
    "is_writer",
    "no_sync",
    "note_world_size",
    "on_writer",
    "rank",
    "rank_rng",
    "run_log",
    "shard_columns",
    "world_size",
    "writer_lock",
]
