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

# python -m benchmarks.GROUP.NAME (NAME, GROUP: placeholders), bash benchmarks/GROUP/NAME.sh
SCRIPT = re.compile(r"python -m (benchmarks(?:\.[a-z0-9_]+)+)")
SHELL = re.compile(r"bash (benchmarks/[a-z0-9_./-]+\.sh)")
GROUPS = ("heads", "studies", "checks")
# The index's script column: `studies/NAME.py`, relative to benchmarks/.
INDEX_SCRIPT = re.compile(r"`((?:heads|studies|checks)/[a-z0-9_]+\.(?:py|sh))`")
VERB = re.compile(r"(?:^|[\s`(])highrank ([a-z-]+)", re.MULTILINE)
NOT_RECORDED = "command that made it is not recorded"


def verbs() -> set[str]:
    from highrank.cli import VERBS

    return {verb.name for verb in VERBS}


def commands(text: str) -> list[str]:
    """The commands a page names: benchmark scripts, shell scripts, highrank verbs."""
    found = [module.replace(".", "/") + ".py" for module in SCRIPT.findall(text)]
    found += SHELL.findall(text)
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
        f"{page} names no command (python -m benchmarks.GROUP.NAME, "
        f"bash benchmarks/GROUP/NAME.sh or highrank VERB), nor says the {NOT_RECORDED}"
    )


@pytest.mark.parametrize(
    "page", [BENCHMARKS / "README.md", *sorted(RESULTS.glob("*/README.md"))],
    ids=lambda p: str(p.relative_to(BENCHMARKS)),
)  # fmt: skip
def test_the_scripts_a_page_names_exist(page):
    """A command naming a module or script that is not there (an old path after a move, say)
    fails here: pages name the command that works now."""
    text = page.read_text(encoding="utf-8")
    named = [c for c in commands(text) if c.startswith("benchmarks/")]
    if page == BENCHMARKS / "README.md":
        named += [f"benchmarks/{script}" for script in INDEX_SCRIPT.findall(text)]
    missing = [c for c in named if not (BENCHMARKS.parent / c).is_file()]
    assert not missing, f"{page} names scripts that do not exist: {missing}"


def test_the_index_names_every_script_of_the_three_groups():
    index = (BENCHMARKS / "README.md").read_text(encoding="utf-8")
    named = set(INDEX_SCRIPT.findall(index))
    scripts = sorted(f"{p.parent.name}/{p.name}" for group in GROUPS
                     for p in (BENCHMARKS / group).iterdir()
                     if p.suffix in (".py", ".sh") and p.name != "__init__.py")  # fmt: skip
    assert scripts, "no scripts found under benchmarks/{heads,studies,checks}"
    assert not [s for s in scripts if s not in named], (
        f"benchmarks/README.md does not name {[s for s in scripts if s not in named]}")
    shared = ("__init__.py", "_common.py", "study.py", "_workers.sh")  # what scripts share: on top
    loose = sorted(p.name for p in BENCHMARKS.iterdir()
                   if p.suffix in (".py", ".sh") and p.name not in shared)  # fmt: skip
    assert not loose, f"scripts on top of benchmarks/, not in heads/, studies/, checks/: {loose}"


def test_the_index_links_every_results_folder_and_its_links_resolve():
    index = BENCHMARKS / "README.md"
    text = index.read_text(encoding="utf-8")
    for folder in FOLDERS:
        assert f"results/{folder.name}/" in text, f"{index} does not list {folder.name}"
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        assert (index.parent / target).exists(), f"{index} links {target}, which is missing"
