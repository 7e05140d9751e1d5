"""``highrank retrofit``: a warm-started highrank head on a local causal LM, trained in one
command (frozen body on cached features, LoRA, or full fine-tuning); see
:mod:`highrank.integrations.retrofit`."""

from __future__ import annotations

import argparse
import json
import signal
import sys

from highrank.cli.common import AFTER_INTERRUPT, guarded, non_negative_int, positive_int

# highrank.integrations.retrofit.plan's MODES, spelt out so that --help imports no torch
# (tests/integrations/test_retrofit_command.py holds the two equal).
MODES = ("frozen", "lora", "full")


# Python's spellings, as a head's knobs are listed (``pointer=True``), read as JSON's.
PYTHON_LITERALS = {"True": True, "False": False, "None": None}


def knob(text: str) -> tuple[str, object]:
    """``KEY=VALUE``; VALUE read as JSON (numbers, true/false; Python's True/False/None too),
    else kept as a string."""
    key, equals, value = text.partition("=")
    if not equals or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. n_components=2); got {text!r}")
    if value.strip() in PYTHON_LITERALS:
        return key.strip(), PYTHON_LITERALS[value.strip()]
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--hf",
        required=True,
        metavar="MODEL",
        help="a local causal LM: a save_pretrained folder or a .gguf file",
    )
    parser.add_argument("--head", required=True, help="the highrank head (mos, mixtape, ...)")
    parser.add_argument(
        "--knob",
        type=knob,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a head knob, repeatable (e.g. --knob n_components=2)",
    )
    parser.add_argument("--train", required=True, metavar="FILE", help="training text (UTF-8)")
    parser.add_argument("--valid", required=True, metavar="FILE", help="validation text")
    parser.add_argument("--test", metavar="FILE", help="test text (optional)")
    parser.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="run folder: plan, caches, state, results.json, model/",
    )
    parser.add_argument(
        "--mode",
        choices=MODES,
        default="frozen",
        help="frozen: train the head on cached features of the frozen body "
        "(default); lora: LoRA on the body + the head; full: everything, small lr",
    )
    parser.add_argument(
        "--init",
        choices=("base", "paper"),
        default="base",
        help="base: start exactly at the model's distribution (default)",
    )
    parser.add_argument(
        "--window",
        type=positive_int,
        default=256,
        help="tokens per window of text (default %(default)s)",
    )
    parser.add_argument(
        "--max-train-tokens",
        type=positive_int,
        default=None,
        help="use only the first N training tokens",
    )
    parser.add_argument(
        "--max-eval-tokens",
        type=positive_int,
        default=None,
        help="score only the first N valid/test tokens",
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help="Adam steps (default: one pass over the training tokens)",
    )
    parser.add_argument(
        "--batch-tokens",
        type=positive_int,
        default=512,
        help="tokens per step (default %(default)s)",
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=None,
        help="learning rate (default: 3e-4 frozen, 2e-4 lora, 1e-5 full)",
    )
    parser.add_argument("--warmup-steps", type=non_negative_int, default=20)
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--lora-rank", type=positive_int, default=8)
    parser.add_argument(
        "--cache-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype of the cached features in frozen mode (default float32)",
    )
    parser.add_argument(
        "--device",
        default="auto",
        help="where the body and head run: auto (CUDA when available), cpu, cuda, cuda:1, ...",
    )
    parser.add_argument(
        "--fsdp",
        action="store_true",
        help="--mode full under torchrun: shard the model across the processes with FSDP2 "
        "(each holds 1/N of the weights, gradients and Adam moments) instead of DDP",
    )
    parser.add_argument(
        "--threads", type=positive_int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="load the model and texts, run every check, print the head's new parameters "
        "(what a capacity control must reach), tokens, windows and steps; train and write "
        "nothing",
    )
    parser.add_argument(
        "--restart",
        action="store_true",
        help="train again from the warm start in an existing --out (settings may change), "
        "keeping its feature caches; caches that do not fit the new settings are all named "
        "before anything is discarded",
    )


def run(args: argparse.Namespace) -> int:
    def job() -> int:
        from highrank.cli.analyze import register_highrank_models
        from highrank.integrations.retrofit import (
            RetrofitError,
            RetrofitPlan,
            SavedFileError,
            dry_run,
            retrofit,
        )
        from highrank.train.state import Interrupted

        # a folder saved with a highrank head loads (then is refused in one line) instead of
        # transformers asking on stdin whether to run its code
        register_highrank_models()
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        try:
            plan = RetrofitPlan(
                model=args.hf,
                head=args.head,
                knobs=dict(args.knob),
                train=args.train,
                valid=args.valid,
                test=args.test,
                out=args.out,
                mode=args.mode,
                init=args.init,
                window=args.window,
                max_train_tokens=args.max_train_tokens,
                max_eval_tokens=args.max_eval_tokens,
                steps=args.steps,
                batch_tokens=args.batch_tokens,
                lr=args.lr,
                warmup_steps=args.warmup_steps,
                seed=args.seed,
                lora_rank=args.lora_rank,
                cache_dtype=args.cache_dtype,
                device=args.device,
                fsdp=args.fsdp,
            )
            with _sigterm_raises():
                if args.dry_run:
                    dry_run(plan, restart=args.restart)
                else:
                    retrofit(plan, restart=args.restart)
        except (RetrofitError, SavedFileError) as error:
            if _speaks():
                print(f"highrank retrofit: error: {error}", file=sys.stderr)
            return 2
        except Terminated:  # outside the training steps (loading a model takes minutes)
            return _stopped_by("SIGTERM")
        except Interrupted as stop:  # the training loop saved its state between two steps
            return _stopped_by(stop.signal_name)
        return 0

    return guarded("retrofit", job)


def _stopped_by(name: str) -> int:
    """The last line after a signal, and the shell's status for it (143, 130)."""
    if name == "SIGTERM":
        if _speaks():
            print(f"highrank retrofit: stopped by SIGTERM; {AFTER_INTERRUPT['retrofit']}",
                  file=sys.stderr)
        return 128 + signal.SIGTERM
    if _speaks():
        print(f"highrank retrofit: interrupted; {AFTER_INTERRUPT['retrofit']}", file=sys.stderr)
    return 128 + signal.SIGINT


def _speaks() -> bool:
    """Whether this process prints the verb's last line: under torchrun process 0 only."""
    from highrank.train.distributed import launched_rank

    return launched_rank() in (None, 0)


class Terminated(BaseException):
    """SIGTERM (a scheduler, ``kill``) arrived: what was saved stays; the same command goes on.
    A BaseException, as KeyboardInterrupt: the library's ``except Exception`` (reading a
    damaged state.pt, a tokenizer's failure) must not turn it into an input error (a SIGTERM
    while state.pt was read said "delete it", status 2)."""


class _sigterm_raises:
    """Within the block SIGTERM raises :class:`Terminated` (it killed the process silently);
    the previous handler is restored after. The training loop catches it for itself
    (:class:`highrank.train.interrupts.SignalCatcher`: the state saved between two steps);
    this covers what has no step to stop at: loading the model, tokenising, caching, scoring."""

    def __enter__(self):
        def stop(signum, frame):
            raise Terminated

        self.previous = signal.signal(signal.SIGTERM, stop)
        return self

    def __exit__(self, *exc):
        signal.signal(signal.SIGTERM, self.previous)
        return False
