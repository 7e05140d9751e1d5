"""``highrank analyze KIND``: rank, KL, top-k, word similarity, hidden size, unargmaxable
tokens, LM-head saturation and the gradient bottleneck of trained runs (or Hugging Face
causal LMs); plus the glue of ``highrank compare`` and ``highrank report``.

Each KIND is one module of this package holding its command-line code, two functions
``add_arguments(parser)`` and ``run(args) -> exit status``, over the library functions of
:mod:`highrank.analysis` (which neither parse arguments nor print); adding an analysis is
adding one module here and one entry to :data:`ANALYSES`.

    highrank analyze rank runs/ptb-softmax runs/ptb-mos --split test
"""

from __future__ import annotations

import argparse
import importlib

from highrank.cli.analyze.common import check_paths
from highrank.cli.common import Parser, guarded, refuse

# kind -> (module under highrank.cli.analyze, one-line help)
ANALYSES: dict[str, tuple[str, str]] = {
    "rank": ("rank", "log-prob matrix, Press and epsilon-effective rank, singular values"),
    "similarity": ("similarity", "word similarity of the input and output embeddings (Spearman)"),
    "kl": ("kl", "expected pairwise KL divergence between next-token distributions"),
    "topk": ("topk", "top-k next tokens of several models side by side, with the reference"),
    "hidden-size": ("hidden_size", "output layer's hidden size from the knee of the spectrum"),
    "unargmaxable": ("unargmaxable", "tokens no hidden state can make the argmax (LP, HiGHS)"),
    "saturation": ("saturation", "output-matrix spectrum, hidden-state anisotropy, per checkpoint"),
    "gradient-bottleneck": (
        "gradient_bottleneck",
        "share of the logit gradient the output layer passes back to the hidden state",
    ),
}


def _module(name: str):
    return importlib.import_module(f"highrank.cli.analyze.{name}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``highrank analyze KIND ...``: one sub-subcommand per entry of :data:`ANALYSES`, whose
    options are declared when that KIND is used (its module imports no torch either way)."""
    kinds = parser.add_subparsers(dest="kind", metavar="KIND", required=True)
    for kind, (module, help_text) in ANALYSES.items():
        sub = kinds.add_parser(kind, help=help_text, description=help_text, allow_abbrev=False)
        declare = _declaration(module)
        if isinstance(sub, Parser):
            sub.declare_later(declare)
        else:
            declare(sub)
        sub.set_defaults(analysis_module=module)


def _declaration(module: str):
    return lambda parser: _module(module).add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    kind = next(k for k, (module, _) in ANALYSES.items() if module == args.analysis_module)
    status = refuse(f"analyze {kind}", check_paths(args))  # a path typo: before torch
    if status:
        return status
    if getattr(args, "hf", None):
        if not getattr(args, "no_progress", False):  # transformers' import alone takes seconds
            print(f"loading {', '.join(map(str, args.hf))} (transformers)", flush=True)
        register_highrank_models()

    def job() -> int:
        _check_before_the_analysis(args)
        return _module(args.analysis_module).run(args)

    return guarded("analyze", job)


def _check_before_the_analysis(args: argparse.Namespace) -> None:
    """What the analyses' own code would find only deep inside: a ``--device`` this torch
    cannot use (a one-line error, not torch's traceback); ``auto`` resolved."""
    if getattr(args, "device", None) is not None:
        from highrank.train.startup import resolve_device

        args.device = str(resolve_device(args.device, option="--device"))
    _refuse_one_name_for_two_models(getattr(args, "hf", None) or [])


def _refuse_one_name_for_two_models(models: list[str]) -> None:
    """Records in --out are named by the model's short name: two models of one name would
    write one file, the second over the first."""
    from pathlib import Path

    from highrank.analysis.hf_contexts import model_name
    from highrank.causal_lm import HFInputError

    seen: dict[str, tuple[str, Path]] = {}
    for model in models:
        name, path = model_name(model), Path(model).resolve()
        if name in seen and seen[name][1] != path:
            raise HFInputError(
                f"--hf {seen[name][0]} and --hf {model} are both named {name!r}, which names "
                "their records in --out: one would overwrite the other; copy one to a folder "
                "of another name, or analyse them with two --out folders"
            )
        seen[name] = (model, path)


def register_highrank_models() -> None:
    """Make ``--hf`` read highrank's own saved models (config.json ``model_type =
    "highrank"``): importing the integration registers that type with the Auto classes.
    Without transformers nothing happens here; loading then names the missing extra."""
    try:
        import highrank.integrations.hf  # noqa: F401
    except ImportError:
        pass
