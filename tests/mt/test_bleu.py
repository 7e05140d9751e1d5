"""highrank.mt.bleu: sacreBLEU's corpus BLEU against known answers and closed forms."""

from __future__ import annotations

import math
import sys

import pytest

pytest.importorskip("sacrebleu", reason="BLEU needs the 'mt' extra: pip install 'highrank[mt]'")

from highrank.mt.bleu import corpus_bleu  # noqa: E402


def test_identical_hypotheses_score_100():
    refs = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee."]
    result = corpus_bleu(refs, refs)
    assert result.score == pytest.approx(100.0, abs=1e-12)
    assert result.brevity_penalty == 1.0 and result.hyp_len == result.ref_len


def test_sacrebleu_readme_example():
    """The two-reference example of the sacreBLEU README (and its documented output)."""
    hyps = ["The dog bit the man.", "It wasn't surprising.", "The man had just bitten him."]
    refs = [
        ["The dog bit the man.", "It was not unexpected.", "The man bit him first."],
        ["The dog had bit the man.", "No one was surprised.", "The man had bitten the dog."],
    ]
    result = corpus_bleu(hyps, refs)
    assert result.summary.startswith(
        "BLEU = 48.53 82.4/50.0/45.5/37.5 (BP = 0.943 ratio = 0.944 hyp_len = 17 ref_len = 18)"
    )
    assert result.signature.startswith("nrefs:2|case:mixed|eff:no|tok:13a|smooth:exp|version:")


def test_closed_form_precisions_and_brevity_penalty():
    # n-gram matches of "a b c d e f" against "a b c d x f": 5/6, 3/5, 2/4, 1/3; no length gap.
    result = corpus_bleu(["a b c d e f"], ["a b c d x f"])
    assert result.score == pytest.approx(100 * (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25, rel=1e-12)
    # A correct but short hypothesis: precisions 1, BP = exp(1 - 6/4).
    short = corpus_bleu(["a b c d"], ["a b c d e f"])
    assert short.score == pytest.approx(100 * math.exp(1 - 6 / 4), rel=1e-12)
    assert short.signature.startswith("nrefs:1|")


def test_mismatched_counts_and_bad_entries_are_named():
    with pytest.raises(ValueError, match="2 hypotheses but 1 references in reference set 0"):
        corpus_bleu(["a", "b"], ["a"])
    with pytest.raises(ValueError, match=r"hypotheses\[1\] is int; expected str"):
        corpus_bleu(["a", 3], ["a", "b"])
    with pytest.raises(ValueError, match=r"hypotheses\[0\] holds a newline"):
        corpus_bleu(["a\nb"], ["a"])
    with pytest.raises(ValueError, match="hypotheses is empty"):
        corpus_bleu([], [])


def test_missing_sacrebleu_says_how_to_install(monkeypatch):
    from highrank.mt import bleu

    monkeypatch.setitem(sys.modules, "sacrebleu", None)  # import now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'highrank\[mt\]'"):
        bleu.corpus_bleu(["a"], ["a"])
