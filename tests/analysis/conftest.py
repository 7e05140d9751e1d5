"""Fixtures of the analysis tests: the word-similarity benchmarks (the tiny corpus, the tiny
run and their settings are the whole suite's: tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import SHARED_DATA

WORD_SIM = SHARED_DATA / "word-sim"


@pytest.fixture
def word_sim_dir() -> Path:
    """The shared word-sim benchmark folder; the test is skipped when it is absent."""
    if not WORD_SIM.is_dir():
        pytest.skip(f"word-similarity benchmarks not found at {WORD_SIM}")
    return WORD_SIM
