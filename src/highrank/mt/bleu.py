"""Corpus BLEU of detokenised translations, with sacreBLEU (Post 2018, "A Call for Clarity in
Reporting BLEU Scores").

BLEU (Papineni et al. 2002) is ``BP * exp(sum_n w_n log p_n)``: modified n-gram precisions
``p_1 .. p_4`` pooled over the whole corpus, uniform weights, brevity penalty
``BP = min(1, exp(1 - r / c))`` (``r`` reference length, ``c`` hypothesis length). sacreBLEU
computes it on *detokenised* text with its own tokenisation (``13a`` by default, the one of
the WMT ``mteval-v13a.pl`` script), so scores are comparable across papers, and it prints a
signature saying exactly how (``nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0``).

Translations are detokenised by the subword model that made them
(``highrank.mt.subwords.SubwordVocab.decode_lines``); references are the raw target-side lines
of the test split as ``highrank.mt.bitext`` reads them (Multi30k: ``test.de``, the 1,000
sentences of test2016, stripped of leading/trailing whitespace), not the lower-cased
Moses-tokenised ``tok/`` copies.

Needs the optional extra ``mt`` (``pip install 'highrank[mt]'``); importing this module does
not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def _sacrebleu():
    """The sacrebleu package, or an ImportError that says how to get it."""
    try:
        import sacrebleu
    except ImportError:
        raise ImportError(
            "highrank.mt.bleu needs the 'sacrebleu' package, which is not installed; "
            "install the translation extra: pip install 'highrank[mt]'"
        ) from None
    return sacrebleu


@dataclass(frozen=True)
class BleuResult:
    """A corpus BLEU score (0..100), the sacreBLEU signature and sacreBLEU's one-line
    summary (``BLEU = 48.53 82.4/50.0/45.5/37.5 (BP = 0.943 ratio = 0.944 ...)``)."""

    score: float
    signature: str
    summary: str
    precisions: tuple[float, ...]
    brevity_penalty: float
    hyp_len: int
    ref_len: int

    def as_dict(self) -> dict:
        """Plain JSON-ready fields."""
        return {
            "bleu": self.score,
            "signature": self.signature,
            "summary": self.summary,
            "precisions": list(self.precisions),
            "brevity_penalty": self.brevity_penalty,
            "hyp_len": self.hyp_len,
            "ref_len": self.ref_len,
        }


def corpus_bleu(
    hypotheses: Sequence[str],
    references: Sequence[str] | Sequence[Sequence[str]],
    *,
    tokenize: str = "13a",
    lowercase: bool = False,
) -> BleuResult:
    """sacreBLEU's corpus BLEU of ``hypotheses`` against ``references``.

    ``references`` is one string per hypothesis (one reference set), or a list of such
    lists (several reference sets, sacreBLEU's layout). Counts must match: a mismatch is an
    error naming both counts.
    """
    sacrebleu = _sacrebleu()
    hypotheses = _check_strings("hypotheses", hypotheses)
    ref_sets = [references] if _is_flat(references) else list(references)
    ref_sets = [_check_strings(f"reference set {i}", refs) for i, refs in enumerate(ref_sets)]
    for i, refs in enumerate(ref_sets):
        if len(refs) != len(hypotheses):
            raise ValueError(
                f"{len(hypotheses):,} hypotheses but {len(refs):,} references in reference set "
                f"{i}; expected one reference per hypothesis, in the same order"
            )
    metric = sacrebleu.metrics.BLEU(tokenize=tokenize, lowercase=lowercase)
    score = metric.corpus_score(hypotheses, ref_sets)
    return BleuResult(
        score=float(score.score),
        signature=str(metric.get_signature()),
        summary=str(score),
        precisions=tuple(float(p) for p in score.precisions),
        brevity_penalty=float(score.bp),
        hyp_len=int(score.sys_len),
        ref_len=int(score.ref_len),
    )


def _is_flat(references) -> bool:
    return len(references) == 0 or isinstance(references[0], str)


def _check_strings(what: str, items) -> list[str]:
    items = list(items)
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise ValueError(f"{what}[{i}] is {type(item).__name__}; expected str (detokenised)")
        if "\n" in item:
            raise ValueError(f"{what}[{i}] holds a newline; expected one sentence per entry")
    if not items:
        raise ValueError(f"{what} is empty; expected at least one sentence")
    return items
