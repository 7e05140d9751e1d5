"""What a retrofit run depends on, checked before any work: :class:`RetrofitPlan`, kept in
``OUT/plan.json``; a rerun with another plan is refused (:func:`check_out`)."""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

import torch

from highrank.config import ConfigError
from highrank.heads import HEADS, check_init
from highrank.train.startup import resolve_device as _resolve_run_device
from highrank.util.checks import check_finite, check_positive_int
from highrank.util.paths import out_folder_problem

# ``highrank.cli.retrofit`` spells these out (its --help imports no torch); a test holds them equal.
MODES = ("frozen", "lora", "full")
DEFAULT_LR = {"frozen": 3e-4, "lora": 2e-4, "full": 1e-5}
# A run may resume on another device, and from a folder that was moved or copied; after the
# non-finite guard stopped it, with another --lr.
MAY_CHANGE = ("device", "out")
# What a retrofit writes in its folder after plan.json, and ``--restart`` deletes (results.json
# first: a folder is finished while it and the model are there).
OUTPUTS = ("results.json", "history.json", "state.pt", "model")
RESTART_DAMAGED_PLAN = (
    "the run's plan is damaged; add --restart to train again with this command's plan (the "
    "feature caches are kept: they check what they were made from), or delete the folder"
)


class RetrofitError(ValueError):
    """Input that the retrofit cannot use: one line naming it and what was expected."""


@dataclass(frozen=True)
class RetrofitPlan:
    """Everything a retrofit run depends on (kept in ``OUT/plan.json``)."""

    model: str
    head: str
    train: str
    valid: str
    out: str
    test: str | None = None
    mode: str = "frozen"
    knobs: dict = field(default_factory=dict)
    init: str = "base"
    window: int = 256
    max_train_tokens: int | None = None
    max_eval_tokens: int | None = None
    steps: int | None = None  # None: one pass over the training windows
    batch_tokens: int = 512
    lr: float | None = None  # None: DEFAULT_LR[mode]
    warmup_steps: int = 20
    seed: int = 0
    lora_rank: int = 8
    cache_dtype: str = "float32"
    device: str = "auto"
    fsdp: bool = False  # full mode under torchrun: the model sharded by FSDP2

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise RetrofitError(f"--mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        if self.head not in HEADS:
            raise RetrofitError(f"unknown head {self.head!r}; choose one of: {', '.join(HEADS)}")
        check_init(self.init)
        if self.fsdp and self.mode != "full":
            raise RetrofitError(
                f"--fsdp shards the whole model, which only --mode full trains; got --mode "
                f"{self.mode} (lora and frozen train data-parallel under torchrun as they are)"
            )
        for name in ("window", "batch_tokens", "lora_rank"):
            _positive(name, getattr(self, name))
        for name in ("max_train_tokens", "max_eval_tokens", "steps"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        # here, before the folder and its caches are written (the optimizer checked it later)
        if self.lr is not None and not (_finite(self.lr) and self.lr > 0):
            raise RetrofitError(f"--lr must be a positive finite number; got {self.lr!r}")
        resolve_device(self.device)

    @property
    def learning_rate(self) -> float:
        return DEFAULT_LR[self.mode] if self.lr is None else self.lr

    @property
    def reads_context(self) -> bool:
        """Does the head read its context (MFS, CPR)? Then frozen mode caches the layers it
        reads and trains on whole windows."""
        return HEADS[self.head].reads != ("hidden",)

    @property
    def splits(self) -> list[str]:
        """The texts this plan reads: train, valid and (when given) test."""
        return ["train", "valid"] + (["test"] if self.test else [])


def resolve_device(name: str) -> torch.device:
    """``--device`` as training resolves ``run.device`` (``auto``: CUDA when available); a
    device that is not there, or no device at all, is one :class:`RetrofitError`."""
    try:
        return _resolve_run_device(name, option="--device")
    except ConfigError as error:  # torch.device("toaster") too
        raise RetrofitError(str(error)) from None


def check_out(out: Path, plan: RetrofitPlan, *, restart: bool = False) -> None:
    """``out`` is a new folder or one of this plan (:data:`MAY_CHANGE` aside; ``lr`` too when
    the non-finite guard stopped it; any plan with ``restart``). A folder without a
    ``plan.json`` (written before anything else) that holds one of :data:`OUTPUTS` is not a
    retrofit's: it is refused, since the run would replace them (a base model in ``out/model``
    was deleted at the end of a run)."""
    problem = out_folder_problem(out, "a retrofit")
    if problem:
        raise RetrofitError(f"--out: {problem}")
    saved = out / "plan.json"
    foreign = [name for name in OUTPUTS if (out / name).exists()]
    if foreign and not saved.exists():
        raise RetrofitError(
            f"--out {out} holds {', '.join(foreign)} but no plan.json: it is not a retrofit's "
            "folder, and a retrofit would replace them; give a new or empty folder"
        )
    if saved.exists() and not restart:
        old = read_plan(saved)
        may_change = MAY_CHANGE + (("lr",) if "stopped" in old else ())
        # a setting added since a folder was written is there at its default
        defaults = {f.name: f.default for f in fields(RetrofitPlan) if f.default is not MISSING}
        changed = sorted(k for k, v in asdict(plan).items()
                         if k not in may_change and old.get(k, defaults.get(k)) != v)
        if changed:
            raise RetrofitError(
                f"{out} holds a retrofit with other settings ({', '.join(changed)}); give "
                "another --out, add --restart to train again with these (the caches are "
                "kept), or delete it"
            )


def read_plan(path: Path) -> dict:
    """The plan kept in ``path`` (``OUT/plan.json``); not JSON, or not a JSON object, is one
    :class:`RetrofitError` saying how to go on (``--restart`` writes it again)."""
    try:
        plan = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise RetrofitError(
            f"{path} is not JSON ({type(error).__name__}: {reason}): {RESTART_DAMAGED_PLAN}"
        ) from None
    if not isinstance(plan, dict):
        raise RetrofitError(
            f"{path} holds a JSON {type(plan).__name__}, not a plan: {RESTART_DAMAGED_PLAN}"
        )
    return plan


def _positive(name: str, value) -> None:
    try:
        check_positive_int(f"--{name.replace('_', '-')}", value)
    except ValueError as error:
        raise RetrofitError(str(error)) from None


def _finite(value) -> bool:
    try:
        check_finite("lr", value)
    except ValueError:
        return False
    return True


__all__ = ["DEFAULT_LR", "MAY_CHANGE", "MODES", "OUTPUTS", "RetrofitError", "RetrofitPlan",
           "check_out", "read_plan", "resolve_device"]
