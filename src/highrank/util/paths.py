"""What is wrong with a path a user named, in one line, without importing anything numerical.

The command line runs these before it imports the library (torch takes seconds, a minute on a
busy machine), and the library raises the same lines in its own errors, so a missing folder,
a file given for a folder or a file in the way of an output folder reads the same whichever
catches it. Each function returns the problem, or None when there is none.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

CORPUS_FILES = "train.txt, valid.txt and test.txt"


def corpus_dir_problem(directory: str | os.PathLike) -> str | None:
    """A corpus folder: it must exist and be a folder (of train/valid/test.txt)."""
    directory = Path(directory).expanduser()
    if directory.is_dir():
        return None
    if directory.exists():
        return (
            f"corpus directory {directory} is a file, not a folder; expected a folder holding "
            f"{CORPUS_FILES}"
        )
    return f"corpus directory {directory} does not exist; expected a folder holding {CORPUS_FILES}"


def run_dir_problem(run_dir: str | os.PathLike) -> str | None:
    """A run directory of ``highrank train``: it must exist and be a folder."""
    run_dir = Path(run_dir)
    if run_dir.is_dir():
        return None
    if run_dir.exists():
        return (
            f"run directory {run_dir} is a file, not a folder; expected the folder `highrank "
            "train` wrote (config.toml, checkpoints/, vocab.txt)"
        )
    return f"run directory {run_dir} does not exist"


def is_retrofit_output(run_dir: str | os.PathLike) -> bool:
    """Whether ``run_dir`` is the ``--out`` folder of ``highrank retrofit`` (its ``plan.json``,
    no ``config.toml`` of a training run)."""
    run_dir = Path(run_dir)
    return (run_dir / "plan.json").is_file() and not (run_dir / "config.toml").is_file()


def retrofit_output_note(run_dir: str | os.PathLike) -> str:
    """What a verb of training runs says of a retrofit's ``--out`` folder: where its scores
    and its model are, and which verbs read them."""
    run_dir = Path(run_dir)
    return (
        f"{run_dir} is the output of `highrank retrofit`, not a run of `highrank train`: its "
        f"valid and test scores are in {run_dir / 'results.json'} (`highrank compare` reads "
        f"them) and its model is {run_dir / 'model'} (`highrank analyze VERB --hf "
        f"{run_dir / 'model'}`)"
    )


def out_folder_problem(out: str | os.PathLike, purpose: str = "the records") -> str | None:
    """An output folder for ``purpose``, new or existing: neither it nor a folder above it may
    be a file."""
    for place in (Path(out), *Path(out).parents):
        if place.exists() and not place.is_dir():
            return f"{place} is a file; expected a folder for {purpose} (new or existing)"
    return None


def made_out_folder_problem(out: str | os.PathLike, purpose: str = "the records") -> str | None:
    """:func:`out_folder_problem`, then the folder made (it would be at the first record):
    a place where no folder can be made says so now, not after the work."""
    problem = out_folder_problem(out, purpose)
    if problem:
        return problem
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return f"cannot make the folder for {purpose} here: {error.strerror or error}"
    return None


def file_problem(path: str | os.PathLike, what: str) -> str | None:
    """An input file (``what`` names it: "--text"): it must exist and not be a folder."""
    path = Path(path)
    if path.is_file():
        return None
    if path.is_dir():
        return f"{what} {path} is a folder; expected a file"
    return f"{what} {path} does not exist"


def config_file_problem(path: str | os.PathLike) -> str | None:
    """A TOML config file: it must exist (else the closest ``.toml`` files are named, as a
    mistyped key is) and be a file."""
    path = Path(path)
    if path.is_file():
        return None
    if path.is_dir():
        return f"config file {str(path)!r} is a folder; expected a TOML file"
    close = close_files(path, suffix=".toml")
    hint = f"; did you mean {', '.join(map(str, close))}?" if close else ""
    return f"config file {str(path)!r} not found{hint}"


def close_files(
    path: Path, *, suffix: str | None = None, n: int = 3, most: int = 5000
) -> list[Path]:
    """Existing files like the missing ``path`` (ending in ``suffix``, by default its own; at
    the same depth below the nearest folder that exists, so a typo in a folder's name is found
    too), closest first."""
    suffix = suffix or path.suffix
    anchor = next((p for p in path.parents if p.is_dir()), None)
    if anchor is None or not suffix:
        return []
    relative = path.relative_to(anchor)
    if len(relative.parts) > 3:  # a typo that deep is not worth a search of the tree
        return []
    pattern = "/".join(["*"] * (len(relative.parts) - 1) + [f"*{suffix}"])
    candidates = []
    for found in anchor.glob(pattern):
        candidates.append(str(found.relative_to(anchor)))
        if len(candidates) >= most:
            break
    close = difflib.get_close_matches(str(relative), candidates, n=n, cutoff=0.6)
    return [anchor / name for name in close]
