"""The layers of src/highrank, as ARCHITECTURE.md draws them, checked on the import graph.

The graph has one node per module (a package is its ``__init__``) and an edge for every
``import`` / ``from ... import`` anywhere in a file, at module level or inside a function (read
with ``ast``, nothing is imported). ``from P import x`` is an edge to module ``P.x`` when that
is a module, otherwise to ``P`` (its ``__init__``). So a package that re-exports its modules'
names (``highrank.data``, ``highrank.config``, ``highrank.evaluate``) has edges to those
modules, and a module inside it that took a name back through the package's ``__init__``
would close a cycle: inside a package, a module imports the sibling that defines the name.
Python running a parent package's ``__init__`` before a submodule is not an edge (it happens
whoever imports the submodule).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "highrank"

# The layers of ARCHITECTURE.md, bottom first: a module imports only modules of its own layer
# or of layers before it (the longest matching prefix decides a module's layer).
LAYERS = [
    ("highrank.util",),
    ("highrank", "highrank.data", "highrank.heads"),
    ("highrank.config",),
    ("highrank.runs",),
    ("highrank.mt",),
    ("highrank.models.backbones", "highrank.backbones"),
    ("highrank.models.seq2seq", "highrank.models.decoding"),
    ("highrank.models.language_model",),
    ("highrank.models.load",),
    ("highrank.models", "highrank.model"),
    ("highrank.causal_lm",),
    ("highrank.train", "highrank.evaluate"),
    ("highrank.analysis",),
    ("highrank.demo", "highrank.bench", "highrank.integrations"),
    ("highrank.cli", "highrank.__main__"),
]
# What the files-and-formats layers (runs/, config/) must never reach, even indirectly.
ABOVE_RUNS_AND_CONFIG = (
    "highrank.model",
    "highrank.models",
    "highrank.train",
    "highrank.analysis",
    "highrank.evaluate",
    "highrank.backbones",
    "highrank.mt",
    "highrank.integrations",
    "highrank.bench",
    "highrank.demo",
    "highrank.cli",
)
# Who may import the instruments: the command line, the demo and the benchmark (and analysis
# itself). What others need of a causal LM or a file format lives below (causal_lm, util).
ANALYSIS_USERS = ("highrank.analysis", "highrank.cli", "highrank.demo", "highrank.bench")
RECIPES = ("highrank.train.awd_lstm", "highrank.train.transformer", "highrank.train.seq2seq")
HEAVY = ("torch", "numpy", "scipy")
# The imports of a highrank module inside a function, outside highrank.cli (whose verbs import
# the library when run, so that --help stays free of torch): each one here says why it is not
# at the top of its module. Everything else imports at module level, so a module's
# dependencies are the first thing it shows. (module, function, imported module): the reason.
DEFERRED_IMPORTS = {
    ("highrank.analysis.output", "read_npy", "highrank.runs.run_dir"):
        "runs.run_dir imports torch (config -> heads); output's tables and paths need numpy only",
    ("highrank.analysis.significance", "read_eval", "highrank.evaluate.records"):
        "evaluate.records imports torch; `compare` of analysis records needs numpy and scipy only",
    ("highrank.models.language_model", "build_seq2seq", "highrank.mt.subwords"):
        "`import highrank.models` loads no translation module (tests/mt/test_bitext.py)",
    ("highrank.integrations.retrofit.run", "_run_frozen", "highrank.integrations.hf"):
        "the hf extra: integrations.hf imports transformers",
    ("highrank.integrations.retrofit.run", "_run_end_to_end", "highrank.integrations.hf"):
        "the hf extra: integrations.hf imports transformers",
    ("highrank.integrations.vllm", "register", "highrank.integrations.vllm.config"):
        "vllm.config imports transformers; importing the plugin loads neither it nor vLLM",
}  # fmt: skip


@cache
def modules() -> dict[str, Path]:
    """Module name -> file, for every module of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


@cache
def imports() -> dict[str, list[tuple[str, int]]]:
    """Module -> [(imported highrank module, line)], every import statement in the file."""
    known = modules()
    graph: dict[str, list[tuple[str, int]]] = {}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = []
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            for target in _targets(node, package, known):
                if target != name:
                    edges.append((target, node.lineno))
        graph[name] = edges
    return graph


def _targets(node: ast.AST, package: str, known: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: from . import x, from ..y import z
            parts = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*parts, *([node.module] if node.module else [])])
        names = [
            f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
            for alias in node.names
        ]
    else:
        return []
    return [_owner(name, known) for name in names if name.split(".")[0] == "highrank"]


def _owner(name: str, known: dict[str, Path]) -> str:
    """The module ``name`` is, or is in (``highrank.data.Vocab`` -> ``highrank.data``)."""
    while name not in known:
        name = name.rpartition(".")[0]
    return name


def _in(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _reachable(start: str) -> set[str]:
    graph, seen, todo = imports(), set(), [start]
    while todo:
        for target, _ in graph[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def _where(module: str, target: str) -> str:
    lines = [line for t, line in imports()[module] if t == target]
    return f"{modules()[module].relative_to(SRC)}:{lines[0]}"


# ---- the rules ------------------------------------------------------------------------------


def test_the_graph_is_read():
    graph = imports()
    assert len(graph) > 80
    assert any(t == "highrank.runs.checkpoint" for t, _ in graph["highrank.models.load"])
    # a function-level import counts: cli/train.py imports highrank.train inside run()
    assert any(t == "highrank.train" for t, _ in graph["highrank.cli.train"])


def _layer(module: str) -> int:
    matches = [
        (len(prefix), index)
        for index, layer in enumerate(LAYERS)
        for prefix in layer
        if module == prefix or (prefix != "highrank" and module.startswith(prefix + "."))
    ]
    assert matches, f"{module} is in no layer of LAYERS: add it (and to ARCHITECTURE.md)"
    return max(matches)[1]


def test_every_module_imports_only_its_own_layer_and_those_below():
    offenders = [
        f"{_where(module, target)}: {module} (layer {_layer(module)}) imports {target} "
        f"(layer {_layer(target)})"
        for module, edges in imports().items()
        for target, _ in edges
        if _layer(target) > _layer(module)
    ]
    assert not offenders, "\n".join(offenders)


def test_nothing_below_the_command_line_imports_it():
    """``highrank.cli`` sits on top: only ``highrank.__main__`` (``python -m highrank``, which
    is the command line itself) may import it."""
    offenders = [
        f"{_where(module, target)}: {module} imports {target}"
        for module, edges in imports().items()
        for target, _ in edges
        if _in(target, "highrank.cli")
        and not _in(module, "highrank.cli")
        and module != "highrank.__main__"
    ]
    assert not offenders, "\n".join(offenders)


def test_only_the_command_line_demo_and_bench_import_analysis():
    """``analysis/`` is the instruments; loading a causal LM, windows, JSON records, the memory
    probe and the streamed matrix live below it, so an integration never needs it."""
    offenders = [
        f"{_where(module, target)}: {module} imports {target}"
        for module, edges in imports().items()
        if not any(_in(module, user) for user in ANALYSIS_USERS)
        for target, _ in edges
        if _in(target, "highrank.analysis")
    ]
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("layer", ["highrank.runs", "highrank.config"])
def test_runs_and_config_know_no_model_training_or_analysis(layer):
    """Directly or through anything they import."""
    offenders = []
    for module in (m for m in modules() if _in(m, layer)):
        reached = _reachable(module)
        offenders += [
            f"{module} reaches {target}"
            for target in sorted(reached)
            if any(_in(target, above) for above in ABOVE_RUNS_AND_CONFIG)
        ]
    assert not offenders, "\n".join(offenders)


def test_runs_imports_no_backbone_or_head_itself():
    """runs/ reads files; the model of a run is built by highrank.models.load_run. (The config
    it reads names the heads, so ``highrank.config`` does import them.)"""
    offenders = [
        f"{_where(module, target)}: {module} imports {target}"
        for module, edges in imports().items()
        if _in(module, "highrank.runs")
        for target, _ in edges
        if any(_in(target, p) for p in ("highrank.heads", "highrank.models", "highrank.backbones"))
    ]
    assert not offenders, "\n".join(offenders)


# The paths the models package had before issue 31: thin re-exports kept for users.
OLD_PATHS = ("highrank.model", "highrank.backbones")


def test_nothing_inside_the_package_imports_the_old_model_paths():
    """``highrank.model`` and ``highrank.backbones`` re-export ``highrank.models`` for users;
    the package itself imports the new homes."""
    offenders = [
        f"{_where(module, target)}: {module} imports {target}"
        for module, edges in imports().items()
        for target, _ in edges
        if target in OLD_PATHS
    ]
    assert not offenders, "\n".join(offenders)


def test_translation_data_knows_no_model_training_or_evaluation():
    """``mt/`` is parallel text, subwords and BLEU: the model, its decoding and loading a
    trained run are ``models/`` and ``evaluate/translation.py``. Directly or indirectly."""
    above = [prefix for prefix in ABOVE_RUNS_AND_CONFIG if prefix != "highrank.mt"]
    offenders = [
        f"{module} reaches {target}"
        for module in modules()
        if _in(module, "highrank.mt")
        for target in sorted(_reachable(module))
        if any(_in(target, prefix) for prefix in above)
    ]
    assert not offenders, "\n".join(offenders)


def test_training_recipes_never_import_each_other():
    offenders = [
        f"{_where(recipe, target)}: {recipe} imports {target}"
        for recipe in RECIPES
        for target, _ in imports()[recipe]
        if target in RECIPES
    ]
    assert not offenders, "\n".join(offenders)


def function_level_imports() -> dict[tuple[str, str, str], int]:
    """(module, innermost function, imported highrank module) -> line, for every import inside
    a function body of a module outside ``highrank.cli``."""
    known, found = modules(), {}
    for name, path in known.items():
        if _in(name, "highrank.cli") or name == "highrank.__main__":
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        todo = [(node, None) for node in ast.parse(path.read_text(encoding="utf-8")).body]
        while todo:
            node, function = todo.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                function = node.name
            elif function is not None:
                for target in _targets(node, package, known):
                    if target != name:
                        found.setdefault((name, function, target), node.lineno)
            todo += [(child, function) for child in ast.iter_child_nodes(node)]
    return found


def test_highrank_modules_are_imported_at_module_level_outside_the_command_line():
    """Issue 31: a module's dependencies show at its top. An import inside a function is for
    an optional extra, a heavy dependency a light module stays free of, or a cycle: add it to
    DEFERRED_IMPORTS with its reason (the command line's verbs are exempt: --help stays light)."""
    found = function_level_imports()
    new = [
        f"{modules()[module].relative_to(SRC)}:{line}: {function}() imports {target}"
        for (module, function, target), line in sorted(found.items())
        if (module, function, target) not in DEFERRED_IMPORTS
    ]
    assert not new, "move these to module level, or give the reason in DEFERRED_IMPORTS:\n" + (
        "\n".join(new)
    )
    stale = [entry for entry in DEFERRED_IMPORTS if entry[0] in modules() and entry not in found]
    assert not stale, f"DEFERRED_IMPORTS names imports that are gone; remove them: {stale}"


def test_function_level_imports_are_found():
    found = function_level_imports()
    assert ("highrank.models.language_model", "build_seq2seq", "highrank.mt.subwords") in found
    assert not any(module.startswith("highrank.cli") for module, _, _ in found)
    assert all(reason for reason in DEFERRED_IMPORTS.values())


def test_the_import_graph_has_no_cycle():
    cycles = _cycles({m: {t for t, _ in edges} for m, edges in imports().items()})
    shown = []
    for cycle in cycles:
        edges = [
            _where(a, b) + f": {a} -> {b}" for a in cycle for b, _ in imports()[a] if b in cycle
        ]
        shown.append(" <-> ".join(cycle) + "\n  " + "\n  ".join(sorted(set(edges))))
    assert not cycles, "import cycles:\n" + "\n".join(shown)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_one():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]


# ---- the command line starts light ------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["train", "--help"],
        ["eval", "--help"],
        ["config", "show", "--vocab-size", "0"],
        ["retrofit", "--help"],
    ],
)
def test_highrank_help_imports_no_torch_numpy_or_scipy(argv):
    """``python -m highrank --help`` (and these verbs' help and option errors) import only
    argparse-level code: ``-X importtime`` lists every module the process imported."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "highrank", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode in (0, 2), done.stderr[-2000:]
    imported = {
        line.rsplit("|", 1)[1].strip()
        for line in done.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }
    assert "highrank.cli" in imported  # the listing is what we think it is
    heavy = sorted(m for m in imported if m.split(".")[0] in HEAVY)
    assert not heavy, f"`highrank {' '.join(argv)}` imported {heavy[:10]}"


# Run in a fresh process: every verb's --help, every sub-verb's (analyze KIND, data ACTION,
# config ACTION) found by walking the lazy parser, then ARGUMENT_ERRORS; after each, the heavy
# modules it brought into sys.modules.
EVERY_HELP_PROBE = """
import argparse, contextlib, io, json, sys
from highrank.cli import build_parser, main

heavy = {heavy!r}
parser = build_parser(lazy=True)
argvs = []
for verb_action in parser._subparsers._group_actions:
    for verb, sub in verb_action.choices.items():
        argvs.append([verb, "--help"])
        sub.declare_now([])  # its options and sub-verbs: torch-free too (checked below)
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):
                argvs += [[verb, name, "--help"] for name in action.choices]
argvs += json.loads(sys.argv[1])
found = []
for argv in argvs:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            status = main(argv)
        except SystemExit as stop:
            status = stop.code
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in heavy)
    found.append([argv, status, loaded[:5]])
    if loaded:
        break
print(json.dumps(found))
"""
# Argument errors and paths that are wrong on their face: answered before the library loads.
ARGUMENT_ERRORS = [
    ["analyze", "rank", "--max-contexts", "-5"],
    ["analyze", "kl", "RUN", "--pairs", "0"],
    ["analyze", "saturation", "--top-k", "0"],
    ["analyze", "rank", "NOWHERE"],
    ["analyze", "hidden-size", "NOWHERE.npy"],
    ["analyze", "kl", "--hf", "m", "--text", "NOWHERE", "--out", "o"],
    ["demo", "--heads", "softmax,foo"],
    ["demo", "--rank", "0"],
    ["bench", "heads", "--cases", "softmax,moz"],
    ["compare", "a1", "a2", "--", "b1", "b2", "--alpha", "2"],
    ["compare", "NOWHERE", "a2", "--", "b1", "b2"],
    ["report", "NOWHERE", "--out", "o"],
    ["eval", "NOWHERE"],
    ["dynamic-eval", "NOWHERE"],
    ["data", "stats", "NOWHERE"],
    ["train", "NOWHERE.toml"],
    ["config", "show", "NOWHERE.toml"],
    ["retrofit", "--steps", "0"],
]


def test_every_verbs_help_and_argument_errors_import_no_torch_numpy_or_scipy(tmp_path):
    """Issue 29: `analyze --help`, `demo`, `bench`, `report`, `compare` imported torch and the
    analyses (45-136 s under load against 3 s), and `analyze rank --max-contexts -5` answered
    after those imports. Every verb's and sub-verb's --help, and these errors, import none."""
    errors = [[str(tmp_path / a) if a.startswith("NOWHERE") else a for a in argv]
              for argv in ARGUMENT_ERRORS]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", EVERY_HELP_PROBE.format(heavy=HEAVY), json.dumps(errors)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout)
    ran = [argv for argv, _, _ in found]
    assert ["analyze", "gradient-bottleneck", "--help"] in ran and ["data", "get", "--help"] in ran
    assert len(ran) == len(found)
    heavy = [(argv, loaded) for argv, _, loaded in found if loaded]
    assert not heavy, f"`highrank {' '.join(heavy[0][0])}` imported {heavy[0][1]}"
    assert ran[-len(errors):] == errors  # every error ran, each refused: status 2
    assert all(status == 2 for _, status, _ in found[-len(errors):]), found[-len(errors):]
    assert all(status == 0 for _, status, _ in found[: -len(errors)]), found


def test_analysis_is_a_library_without_argparse_or_print():
    """``analysis/`` returns data; every option and every printed line of the analysis verbs
    lives in ``cli/analyze/`` (progress lines go through ``util.progress``)."""
    found = []
    for name, path in modules().items():
        if not _in(name, "highrank.analysis"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import) and any(
                alias.name.split(".")[0] == "argparse" for alias in node.names
            ):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}: imports argparse")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == (
                "argparse"
            ):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}: imports argparse")
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "print"
            ):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}: calls print")
    assert not found, "\n".join(found)
