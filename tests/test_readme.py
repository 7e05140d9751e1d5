"""The README's usage example runs as written, and its command lines are the tested ones."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def test_usage_example_runs():
    blocks = _python_blocks(README.read_text(encoding="utf-8"))
    assert blocks, "README.md has no ```python example"
    namespace: dict = {}
    exec(compile(blocks[0], "README.md example", "exec"), namespace)
    log_probs = namespace["next_token_log_probs"]
    assert log_probs.shape == (8, 1000)
    assert abs(float(log_probs.exp().sum(-1).mean()) - 1.0) < 1e-5
    assert namespace["loss"].item() > 0


def test_readme_opens_with_the_two_commands():
    text = README.read_text(encoding="utf-8")
    first_block = re.search(r"```bash\n(.*?)```", text, flags=re.DOTALL).group(1)
    lines = [line for line in first_block.splitlines() if line.strip()]
    assert len(lines) == 2
    assert lines[0].startswith("python3 -m venv") and lines[0].endswith("highrank demo")
    assert lines[1].startswith("python3 -m venv") and "pytest" in lines[1]
    ci = (README.parent / ".ci" / "run").read_text(encoding="utf-8")
    assert "README.md" in ci  # CI runs the README's own test line
