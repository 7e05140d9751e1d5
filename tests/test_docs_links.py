"""Every relative Markdown link in the documentation resolves, and README.md stays a front door."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 420

# [text](target) and ![alt](target); the target may be <wrapped> and may carry a "title".
_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]"  # [text] or ![alt], one level of nested brackets
    r"\(\s*(<[^>]*>|[^()\s]*(?:\([^()\s]*\)[^()\s]*)*)"  # (target, balanced parentheses allowed
)
_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", flags=re.DOTALL | re.MULTILINE)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1)(?!\n[ \t]*\n).)+?\1", flags=re.DOTALL)  # within a paragraph
_EXTERNAL = re.compile(r"^(?:[a-zA-Z][a-zA-Z0-9+.-]*:|//)")  # http:, https:, mailto:, ...


def _documents() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "ARCHITECTURE.md"]
    files += sorted((ROOT / "docs").rglob("*.md"))
    files += sorted((ROOT / "benchmarks" / "results").rglob("README.md"))
    return [path for path in files if path.is_file()]


def _link_targets(text: str) -> list[str]:
    """Link targets outside code: fenced blocks and inline code spans are not Markdown links."""
    text = _FENCE.sub("", text)
    text = _CODE_SPAN.sub("", text)
    return [match.group(1).strip("<>") for match in _LINK.finditer(text)]


def _relative_path(target: str) -> str | None:
    """The file part of a relative link, or None for external links and pure anchors."""
    if not target or target.startswith("#") or _EXTERNAL.match(target):
        return None
    return target.split("#", 1)[0].split("?", 1)[0] or None


def test_link_parser_finds_what_it_should():
    text = (
        "See [a](docs/a.md#part), ![fig](plot.png), [web](https://example.org), "
        "[mail](mailto:x@example.org), [here](#anchor), `[not](code.md)`.\n"
        "```bash\necho [not](fenced.md)\n```\n"
    )
    targets = [_relative_path(t) for t in _link_targets(text)]
    assert [t for t in targets if t] == ["docs/a.md", "plot.png"]


@pytest.mark.parametrize("document", _documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(document: Path):
    broken = []
    for target in _link_targets(document.read_text(encoding="utf-8")):
        path = _relative_path(target)
        if path is not None and not (document.parent / path).exists():
            broken.append(target)
    assert not broken, f"{document.relative_to(ROOT)}: links that resolve to nothing: {broken}"


def test_the_documents_are_found():
    documents = {str(p.relative_to(ROOT)) for p in _documents()}
    assert {"README.md", "ARCHITECTURE.md"} <= documents
    assert any(name.startswith("docs/") for name in documents)
    assert any(name.startswith("benchmarks/results/") for name in documents)


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines; at most {README_MAX_LINES}: move detail to docs/"
    )
