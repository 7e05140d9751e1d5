"""Fixtures of the training tests: a fresh training corpus per test (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import write_train_corpus


@pytest.fixture
def corpus(tmp_path) -> Path:
    """The training corpus (120 / 30 / 30 lines over 30 words, seed 0) in ``tmp_path``."""
    return write_train_corpus(tmp_path / "corpus")
