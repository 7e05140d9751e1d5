"""Every folder of benchmarks/results/ has a page naming the command that made it, and the
benchmark index (benchmarks/README.md) links every folder (issue 31 item 7)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
RESULTS = BENCHMARKS / "results"
FOLDERS = sorted(p for p in RESULTS.iterdir() if p.is_dir())
# Studies whose results are being made now: their page comes with them.
IN_PROGRESS: dict[str, str] = {}

SCRIPT = re.compile(r"python -m benchmarks\.([a-z0-9_]+)")  # NAME: a placeholder
SHELL = re.compile(r"bash benchmarks/([a-z0-9_.-]+\.sh)")
VERB = re.compile(r"(?:^|[\s`(])highrank ([a-z-]+)", re.MULTILINE)
NOT_RECORDED = "command that made it is not recorded"


def verbs() -> set[str]:
    from highrank.cli import VERBS

    return {verb.name for verb in VERBS}


def commands(text: str) -> list[str]:
    """The commands a page names: benchmark scripts, shell scripts, highrank verbs."""
    found = [f"benchmarks/{name}.py" for name in SCRIPT.findall(text)]
    found += [f"benchmarks/{name}" for name in SHELL.findall(text)]
    found += [f"highrank {verb}" for verb in VERB.findall(text) if verb in verbs()]
    return found


@pytest.mark.parametrize("folder", FOLDERS, ids=[p.name for p in FOLDERS])
def test_every_results_folder_has_a_page_naming_its_command(folder):
    page = folder / "README.md"
    if not page.is_file() and folder.name in IN_PROGRESS:
        pytest.skip(f"{folder.name} is being made ({IN_PROGRESS[folder.name]})")
    assert page.is_file(), f"{folder} has no README.md naming the command that made it"
    text = page.read_text(encoding="utf-8")
    assert commands(text) or NOT_RECORDED in text, (
        f"{page} names no command (python -m benchmarks.NAME, bash benchmarks/NAME.sh or "
        f"highrank VERB), nor says the {NOT_RECORDED}"
    )


@pytest.mark.parametrize(
    "page", [BENCHMARKS / "README.md", *sorted(RESULTS.glob("*/README.md"))],
    ids=lambda p: str(p.relative_to(BENCHMARKS)),
)  # fmt: skip
def test_the_scripts_a_page_names_exist(page):
    text = page.read_text(encoding="utf-8")
    missing = [c for c in commands(text) if c.startswith("benchmarks/")
               and not (BENCHMARKS.parent / c).is_file()]  # fmt: skip
    assert not missing, f"{page} names scripts that do not exist: {missing}"


def test_the_index_links_every_results_folder_and_its_links_resolve():
    index = BENCHMARKS / "README.md"
    text = index.read_text(encoding="utf-8")
    for folder in FOLDERS:
        assert f"results/{folder.name}/" in text, f"{index} does not list {folder.name}"
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        assert (index.parent / target).exists(), f"{index} links {target}, which is missing"
