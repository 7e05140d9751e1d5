"""Every file a benchmark writes goes through benchmarks/_common.py (issue 31 item 7): JSON
records through ``write_json``, text through ``write_text``, arrays, tensors and figures through
``save_array``, ``save_torch`` and ``save_figure``, each a temporary file renamed onto its
target; logs are appended to (``append_line``). A script that writes a file itself is named
here, with its reason, or fails."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from benchmarks import _common

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

# (script, kind of write) -> why it writes directly
ALLOWED = {
    ("checks/fault_campaign.py", "*"): "it makes its attacks' inputs and tears files on purpose "
    "(a truncated last.pt, a torn metrics.jsonl) in its own scratch folder",
    ("checks/fault_campaign_surfaces.py", "*"): "as fault_campaign.py, on every surface",
    ("checks/suite_timing.py", "open"): "each suite's log is its child's stdout, as it runs",
}
METHODS = {"write_text", "write_bytes", "savefig", "tofile", "to_csv"}  # path.write_text(...)
MODULE_CALLS = {("json", "dump"), ("np", "save"), ("np", "savez"), ("np", "savez_compressed"),
                ("numpy", "save"), ("torch", "save"), ("pickle", "dump")}  # fmt: skip


def _mode(call: ast.Call, position: int) -> str | None:
    """The mode of an ``open`` call: positional argument ``position`` or ``mode=``."""
    if len(call.args) > position:
        node = call.args[position]
    else:
        node = next((k.value for k in call.keywords if k.arg == "mode"), None)
    if node is None:
        return "r"
    return node.value if isinstance(node, ast.Constant) else "?"  # not a literal: suspect


def direct_writes(source: str) -> list[tuple[int, str]]:
    """(line, kind) of every call in ``source`` that writes a file without the shared writers.
    ``open`` for appending (``"a"``: logs, lock files) is not a rewrite and passes."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id == "open":
            mode = _mode(node, 1)
        elif isinstance(func, ast.Attribute) and func.attr == "open":  # Path.open("w")
            mode = _mode(node, 0)
            mode = None if mode == "?" else mode  # RunDir.open(path): not a file mode
        else:
            mode = None
        if mode is not None and (mode == "?" or set(mode) & set("wx+")):
            found.append((node.lineno, "open"))
        if not isinstance(func, ast.Attribute):
            continue
        owner = func.value.id if isinstance(func.value, ast.Name) else None
        if owner == "_common":  # _common.write_text(...): the shared writer itself
            continue
        if (owner, func.attr) in MODULE_CALLS:
            found.append((node.lineno, f"{owner}.{func.attr}"))
        elif func.attr in METHODS:
            found.append((node.lineno, func.attr))
    return found


def scripts() -> list[Path]:
    return sorted(p for p in BENCHMARKS.rglob("*.py")
                  if p.name != "_common.py" and "results" not in p.parts)  # fmt: skip


def test_the_checker_finds_what_it_should():
    source = (
        "import json, numpy as np\n"
        "json.dump(x, h)\n"                        # 2
        "open(p, 'w')\n"                           # 3
        "open(p, mode='wb')\n"                     # 4
        "open(p, 'a')\n"                           # appending: passes
        "open(p)\n"                                # reading: passes
        "path.write_text('x')\n"                   # 7
        "figure.savefig(path)\n"                   # 8
        "np.save(path, a)\n"                       # 9
        "_common.write_text(path, 'x')\n"          # the shared writer: passes
        "path.open('w')\n"                         # 11
        "open(p, mode)\n"                          # 12: a mode not written out
        "RunDir.open(run)\n"                       # not a file mode: passes
    )  # fmt: skip
    assert direct_writes(source) == [(2, "json.dump"), (3, "open"), (4, "open"),
                                     (7, "write_text"), (8, "savefig"), (9, "np.save"),
                                     (11, "open"), (12, "open")]  # fmt: skip


def test_no_benchmark_writes_a_file_but_through_the_shared_writers():
    assert len(scripts()) > 30
    found = []
    for path in scripts():
        name = str(path.relative_to(BENCHMARKS))
        for line, kind in direct_writes(path.read_text(encoding="utf-8")):
            if (name, "*") not in ALLOWED and (name, kind) not in ALLOWED:
                found.append(f"benchmarks/{name}:{line}: {kind}")
    assert not found, (
        "write through benchmarks/_common.py (write_json, write_text, save_array, save_torch, "
        "save_figure, append_line), or name the script and its reason in ALLOWED:\n"
        + "\n".join(found)
    )


def test_the_allow_list_names_scripts_that_exist():
    assert all((BENCHMARKS / name).is_file() for name, _ in ALLOWED)


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def test_the_shared_writers_replace_files_whole(tmp_path):
    np = pytest.importorskip("numpy")
    folder = tmp_path / "new" / "folder"
    _common.write_json(folder / "a.json", {"b": 1, "a": [1.5]}, indent=1, sort_keys=True)
    assert (folder / "a.json").read_text() == '{\n "a": [\n  1.5\n ],\n "b": 1\n}\n'
    _common.write_json(folder / "a.json", {"x": 1}, indent=1, end="")
    assert json.loads((folder / "a.json").read_text()) == {"x": 1}
    _common.write_text(folder / "b.md", "table\n")
    assert (folder / "b.md").read_text() == "table\n"
    _common.save_array(folder / "c.npy", np.arange(3.0))
    assert np.load(folder / "c.npy").tolist() == [0.0, 1.0, 2.0]
    _common.append_line(folder / "commands.txt", "highrank train a")
    _common.append_line(folder / "commands.txt", "highrank eval a")
    assert (folder / "commands.txt").read_text() == "highrank train a\nhighrank eval a\n"
    assert _leftovers(folder) == []


def test_save_figure_writes_the_format_its_name_says(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(1, 1))
    axis.plot([0, 1], [1, 0])
    _common.save_figure(figure, tmp_path / "plot.png", dpi=20)
    _common.save_figure(figure, tmp_path / "plot.svg")
    plt.close(figure)
    assert (tmp_path / "plot.png").read_bytes().startswith(b"\x89PNG")
    assert b"<svg" in (tmp_path / "plot.svg").read_bytes()
    assert _leftovers(tmp_path) == []
