"""Any Hugging Face causal LM on a text: loading it (a folder or a GGUF file), the text's token
ids, and the text cut into windows. What the analyses (:mod:`highrank.analysis.hf_contexts`)
and the retrofit (:mod:`highrank.integrations.retrofit`) both read a model and a text with.

**Loading.** A local model folder (``save_pretrained`` output, with ``config.json``) or a
``.gguf`` file (dequantised to ``dtype``) is loaded offline with ``AutoModelForCausalLM`` and
``AutoTokenizer`` (:func:`load_causal_lm`); a path, a missing extra, a missing tokenizer (also
one that ``transformers`` builds empty from a folder without tokenizer files, which read every
text as 0 tokens), weights that do not fit their config, a pickled or damaged weights file, NaN
weights: each is one :class:`HFInputError` line naming it.

**The text.** :func:`text_token_ids`: the whole UTF-8 file tokenised at once, no special tokens;
:func:`check_token_ids`: every id one the model has (a tokenizer saved beside another model
gives ids beyond its embedding).

**Windows.** The stream ``x_0 .. x_{N-1}`` is cut into non-overlapping windows of ``W`` tokens,
each run as a sequence of its own (positions restart at 0): position ``t`` of window ``k``
predicts ``x_{kW+t+1}`` from the ``t + 1`` tokens of its window, and every token but the first is
predicted exactly once (:func:`window_tokens` gives the inputs and their targets;
:func:`check_window` the window a model can take, :func:`default_window` the default one).

``transformers`` (the ``hf`` extra) is imported by the functions that need it, never when this
module is imported, so ``highrank --help`` works without it.

    model, tokenizer = load_causal_lm("SmolLM2-135M-Instruct.Q4_1.gguf")
    ids = text_token_ids(tokenizer, "wikitext-2/test.txt")
    inputs, targets = window_tokens(ids, default_window(model))   # (W, L) each
"""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from highrank.util.checks import check_positive_int

DEFAULT_MAX_WINDOW = 1024
INSTALL_HINT = "pip install 'highrank[hf]'"


class HFInputError(ValueError):
    """A model path, text file or reading option that cannot be used: one line naming it."""


# ---- loading a model -----------------------------------------------------------------------


def model_source(path: str | os.PathLike) -> tuple[Path, str | None]:
    """``(folder, gguf file name or None)`` of a model path: a folder holding ``config.json``
    (``save_pretrained`` output) or a ``.gguf`` file; anything else is refused, naming it."""
    path = Path(path).expanduser()
    if not path.exists():
        raise HFInputError(
            f"model {path} does not exist; expected a model folder (save_pretrained output, "
            "with config.json) or a .gguf file"
        )
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise HFInputError(
                f"model folder {path} has no config.json; expected the output of "
                "save_pretrained (config.json and the weights) or a .gguf file"
            )
        return path, None
    if path.suffix.lower() != ".gguf":
        raise HFInputError(
            f"model {path} is a file but not a .gguf file; expected a model folder "
            "(save_pretrained output) or a .gguf file"
        )
    return path.parent, path.name


def require_hf(gguf: bool = False) -> None:
    """Raise :class:`HFInputError` naming the missing package when the ``hf`` extra (and,
    for a ``.gguf`` file, the ``gguf`` package) is not installed."""
    needed = ["transformers", *(["gguf"] if gguf else [])]
    for name in needed:
        try:
            __import__(name)
        except ImportError:
            what = "reading a .gguf file" if name == "gguf" else "Hugging Face models"
            raise HFInputError(
                f"{what} needs the '{name}' package, which is not installed: {INSTALL_HINT}"
            ) from None


def load_causal_lm(
    path: str | os.PathLike,
    *,
    device: str | torch.device = "cpu",
    dtype=torch.float32,
    progress: bool = True,
) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of a local causal LM: ``AutoModelForCausalLM`` and
    ``AutoTokenizer`` from a model folder, or from a ``.gguf`` file (``gguf_file=``,
    dequantised to ``dtype``). Only local files are read (``local_files_only``), whatever
    ``HF_HUB_OFFLINE`` says. The model is in eval mode on ``device``. ``progress=False``
    hides transformers' loading bars."""
    folder, gguf_file = model_source(path)
    require_hf(gguf=gguf_file is not None)
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        return _load(path, folder, gguf_file, device, dtype)
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def _load(path, folder: Path, gguf_file: str | None, device, dtype) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    options: dict[str, Any] = {"local_files_only": True}
    if gguf_file is not None:
        options["gguf_file"] = gguf_file
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, **options)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise HFInputError(
            f"no tokenizer could be loaded from {path} ({first_line(error)}); save one beside "
            "the model with tokenizer.save_pretrained(folder)"
        ) from None
    if getattr(tokenizer, "vocab_size", None) == 0:  # GPT-2's class built without its files
        raise HFInputError(
            f"{path} holds no tokenizer ({type(tokenizer).__name__} was built with an empty "
            "vocabulary: no tokenizer.json, vocab.json or tokenizer.model beside the model); "
            "save one beside the model with tokenizer.save_pretrained(folder)"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **options)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise HFInputError(
            f"{path} could not be loaded as a causal LM: {first_line(error)}"
        ) from None
    except RuntimeError as error:  # transformers' size check: the weights do not fit the config
        if "mismatched_sizes" not in str(error):
            raise
        raise HFInputError(
            f"{path} could not be loaded: its weights do not have the sizes its config.json "
            "gives (a hidden size, a vocabulary or a layer count differs); restore the "
            "config.json that was saved with them"
        ) from None
    except pickle.UnpicklingError as error:  # torch's weights-only load refused a pickle
        raise HFInputError(
            f"{path} could not be loaded: its PyTorch weights file holds Python objects "
            f"beyond tensors{_unpickled_global(error)}, which could run code, so it was "
            "refused; convert the model to safetensors where you trust its source"
        ) from None
    except Exception as error:  # safetensors' own errors: a truncated or damaged weights file
        if type(error).__name__ != "SafetensorError":
            raise
        raise HFInputError(
            f"{path} could not be loaded: its weights file is truncated or damaged "
            f"({first_line(error)}); save or copy the model again"
        ) from None
    check_finite_weights(model, path)
    return model.to(device).eval(), tokenizer


def _unpickled_global(error: Exception) -> str:
    """`` (posix.system)``: the global torch's weights-only unpickler refused, when it says."""
    found = re.search(r"GLOBAL ([\w.]+)", str(error))
    return f" ({found.group(1)})" if found else ""


def check_finite_weights(model: Any, path: str | os.PathLike) -> None:
    """One line naming the first parameter with a NaN or infinite entry (such a model's
    log-probabilities are undefined, and every instrument would fail later, further away)."""
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            bad = int((~torch.isfinite(tensor)).sum())
            raise HFInputError(
                f"{path}: the weight {name} {tuple(tensor.shape)} holds {bad} NaN or infinite "
                "entries; the model's log-probabilities are undefined (a diverged or damaged "
                "checkpoint): load an earlier or intact copy"
            )


# ---- a text ----------------------------------------------------------------------------------


def text_token_ids(tokenizer: Any, path: str | os.PathLike) -> torch.Tensor:
    """``(N,)`` int64 ids of the whole UTF-8 text file at ``path``, tokenised at once by
    ``tokenizer`` without special tokens (no BOS/EOS added)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise HFInputError(f"text file {path} does not exist") from None
    except IsADirectoryError:
        raise HFInputError(f"text file {path} is a folder; expected a text file") from None
    except UnicodeDecodeError as error:
        raise HFInputError(
            f"text file {path} is not UTF-8 (byte {error.start}: {error.reason})"
        ) from None
    try:
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    except Exception as error:  # the tokenizer's own failure, whatever its library raises
        raise HFInputError(
            f"the model's tokenizer could not tokenise {path}: {type(error).__name__}: "
            f"{first_line(error)}"
        ) from None
    return torch.tensor(ids, dtype=torch.int64)


def check_token_ids(model: Any, ids: torch.Tensor, *, model_path: str | os.PathLike,
                    source: str = "the text") -> None:
    """Every id in ``ids`` is one the model has (a row of its input embedding and of its
    output layer): a tokenizer that does not match its model (a token added or duplicated)
    gives an id beyond them, which the embedding refused as an ``IndexError`` traceback."""
    sizes = [layer.weight.shape[0] for layer in (model.get_input_embeddings(),
                                                 model.get_output_embeddings())
             if layer is not None and getattr(layer, "weight", None) is not None]
    if not sizes or not ids.numel():
        return
    size, top = min(sizes), int(ids.max())
    if top >= size:
        raise HFInputError(
            f"the tokenizer of {model_path} gives the id {top} in {source}, but the model has "
            f"{size} token ids (0..{size - 1}): the tokenizer does not match the model (a "
            "token added or duplicated?); save the model's own tokenizer beside it"
        )


# ---- windows -------------------------------------------------------------------------------


def max_positions(model: Any) -> int | None:
    """The model's maximum sequence length from its config, or ``None`` when it says none."""
    config = model.config
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def vocab_width(model: Any) -> int | None:
    """The width of the model's output (its config's ``vocab_size``), or ``None``."""
    config = model.config
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    value = getattr(config, "vocab_size", None)
    return value if isinstance(value, int) else None


def default_window(model: Any) -> int:
    """``min(the model's maximum positions, 1024)`` (1024 when the config gives none)."""
    limit = max_positions(model)
    return DEFAULT_MAX_WINDOW if limit is None else min(limit, DEFAULT_MAX_WINDOW)


def check_window(
    model: Any,
    n_tokens: int,
    window: int | None = None,
    *,
    bos_token_id: int | None = None,
    source: str = "the text",
) -> int:
    """The window length to read ``n_tokens`` tokens with: ``window``, or the default one
    (the whole text when it is shorter); refused when the model cannot take it or the text is
    shorter than the window asked for."""
    if window is None:
        window = default_window(model)
        if bos_token_id is not None and window == max_positions(model):
            window -= 1  # room for the BOS token
        if 2 <= n_tokens < window:  # a short text: one window of all of it
            window = n_tokens
    if not isinstance(window, int) or window < 1:
        raise HFInputError(f"window must be a positive number of tokens; got {window!r}")
    limit = max_positions(model)
    needed = window + (bos_token_id is not None)
    if limit is not None and needed > limit:
        raise HFInputError(
            f"a window of {window} tokens{' plus BOS' if bos_token_id is not None else ''} "
            f"exceeds the model's {limit} positions; use --window {limit - (needed - window)}"
        )
    if n_tokens < window:
        raise HFInputError(
            f"{source} has {n_tokens} tokens, fewer than one window of {window}; give a "
            "longer text or a smaller --window"
        )
    return window


def window_tokens(token_ids: Sequence[int] | torch.Tensor, window: int) -> tuple[torch.Tensor,
                                                                                torch.Tensor]:
    """Non-overlapping windows of a token stream: ``(inputs, targets)``, both ``(W, window)``
    with ``W = (len(ids) - 1) // window``; ``targets`` are ``inputs`` shifted by one token."""
    ids = as_token_tensor(token_ids)
    check_positive_int("window", window)
    n_windows = (ids.numel() - 1) // window
    if n_windows == 0:
        raise ValueError(
            f"a stream of {ids.numel()} tokens holds no window of {window} tokens plus the "
            "target after it; give more tokens or a smaller window"
        )
    span = n_windows * window
    return ids[:span].view(n_windows, window), ids[1 : span + 1].view(n_windows, window)


def as_token_tensor(token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """``token_ids`` as a 1-D int64 tensor; floats, booleans, other shapes and negative ids
    are refused in one line."""
    ids = torch.as_tensor(token_ids)
    if ids.ndim != 1 or ids.dtype in (torch.float16, torch.bfloat16, torch.float32,
                                      torch.float64, torch.bool):
        raise ValueError(
            f"token_ids must be a 1-D sequence of integer ids; got {ids.dtype} of shape "
            f"{tuple(ids.shape)}"
        )
    if ids.numel() and int(ids.min()) < 0:
        raise ValueError(f"token_ids hold a negative id ({int(ids.min())})")
    return ids.long()


def first_line(error: BaseException) -> str:
    """The first line of an error's message (its class name when it has none)."""
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


__all__ = [
    "DEFAULT_MAX_WINDOW",
    "INSTALL_HINT",
    "HFInputError",
    "as_token_tensor",
    "check_finite_weights",
    "check_token_ids",
    "check_window",
    "default_window",
    "first_line",
    "load_causal_lm",
    "max_positions",
    "model_source",
    "require_hf",
    "text_token_ids",
    "vocab_width",
    "window_tokens",
]
