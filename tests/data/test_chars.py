"""highrank.data.chars: Mikolov's ptb.char format, agreement with data.mode="char", BPC."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest

from highrank.data import EOS, CorpusError, load_corpus
from highrank.data.chars import bits_per_char, char_symbols, ptb_char_text, write_ptb_char
from tests.conftest import SHARED_DATA

SHARED_PTB = SHARED_DATA / "ptb"

# The first two lines of ptb.valid.txt and, verbatim, the first bytes of the published
# ptb.char.valid.txt (youngjoo-epfl/gconvRNN datasets/ptb_char/, blob 940c7ea5).
WORD_SAMPLE = (
    " consumers may want to move their telephones a little closer to the tv set \n"
    " <unk> <unk> watching abc 's monday night football \n"
)
CHAR_SAMPLE = (
    "c o n s u m e r s _ m a y _ w a n t _ t o _ m o v e _ t h e i r _ t e l e p h o n e s _ "
    "a _ l i t t l e _ c l o s e r _ t o _ t h e _ t v _ s e t \n"
    " < u n k > _ < u n k > _ w a t c h i n g _ a b c _ ' s _ m o n d a y _ n i g h t _ "
    "f o o t b a l l \n "
)


def git_blob_id(data: bytes) -> str:
    """The id git gives a file with these bytes (sha1 of a "blob <size>\\0" header + bytes)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_symbols_spell_words_and_unk_with_underscore_between():
    assert char_symbols(" the <unk> N \n") == list("the") + ["_"] + list("<unk>") + ["_", "N"]
    assert char_symbols("   ") == []


def test_text_matches_the_published_file_layout():
    assert ptb_char_text(WORD_SAMPLE) == CHAR_SAMPLE
    assert ptb_char_text("") == ""


def test_underscore_in_word_text_is_an_error_naming_the_line():
    with pytest.raises(CorpusError, match=r"x\.txt line 2: holds '_'"):
        ptb_char_text("a b\nsnake_case\n", source="x.txt")


def write_split_files(folder: Path, texts: dict[str, str], prefix: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for split, text in texts.items():
        (folder / f"{prefix}{split}.txt").write_text(text, encoding="utf-8")
    return folder


def test_char_mode_is_ptb_char_with_space_for_underscore(tmp_path):
    """data.mode="char" on word files == ptb.char files read word by word, "_" renamed " ".

    Up to one quirk of the published layout: the file ends with "\\n " and that last lone
    space reads as one more (blank) line, so word mode sees one extra final <eos>."""
    texts = {"train": WORD_SAMPLE, "valid": " a <unk> \n\n", "test": " tv 's \n"}
    words = write_split_files(tmp_path / "words", texts)
    written = write_ptb_char(words, tmp_path / "chars", prefix="")
    assert sorted(written) == ["test", "train", "valid"]
    as_chars = load_corpus(words, mode="char", use_cache=False)
    as_words = load_corpus(tmp_path / "chars", mode="word", use_cache=False)
    for split in ("train", "valid", "test"):
        mikolov = as_words.vocab.decode(as_words.split(split))
        ours = ["_" if t == " " else t for t in as_chars.vocab.decode(as_chars.split(split))]
        assert mikolov[-2:] == [EOS, EOS] and as_words.lines[split] == as_chars.lines[split] + 1
        assert ours == mikolov[:-1]
    # the blank valid line is a lone <eos>
    assert as_chars.vocab.decode(as_chars.valid)[-2:] == [EOS, EOS] and as_chars.lines["valid"] == 2


def test_write_refuses_to_overwrite_and_names_missing_files(tmp_path):
    folder = write_split_files(tmp_path / "w", {"train": "a\n", "valid": "a\n"})
    with pytest.raises(CorpusError, match="refusing to overwrite"):
        write_ptb_char(folder, folder, prefix="")
    with pytest.raises(CorpusError, match=r"missing split file .*test\.txt"):
        write_ptb_char(folder, tmp_path / "out")


@pytest.mark.skipif(not SHARED_PTB.is_dir(), reason=f"PTB not found at {SHARED_PTB}")
@pytest.mark.parametrize(
    "split, blob",
    [
        ("valid", "940c7ea52db925f46874bc9e1ea37424beec6c98"),
        ("test", "4e866a8573cdd7d0ce6af45c034055adecc3bbd4"),
    ],
)
def test_conversion_of_real_ptb_is_byte_identical_to_published_ptb_char(split, blob):
    """Git blob ids of ptb.char.{valid,test}.txt in youngjoo-epfl/gconvRNN and
    arthurdehgan/IFT6135_assignment_2 (train's blob is not in either snapshot)."""
    text = (SHARED_PTB / f"{split}.txt").read_text(encoding="utf-8")
    assert git_blob_id(ptb_char_text(text).encode("utf-8")) == blob


def test_bits_per_char_is_nats_over_ln2_per_symbol():
    assert bits_per_char(4 * math.log(2), 4) == pytest.approx(1.0, rel=1e-15)
    assert bits_per_char(math.log(50), 1) == pytest.approx(math.log2(50), rel=1e-15)
    assert bits_per_char(0.0, 3) == 0.0


@pytest.mark.parametrize("nll, n", [(1.0, 0), (1.0, True), (1.0, 2.0), (-1.0, 2), (math.nan, 2)])
def test_bits_per_char_rejects_bad_input(nll, n):
    with pytest.raises(ValueError, match="n_symbols|total_nll_nats"):
        bits_per_char(nll, n)


@pytest.mark.skipif(not SHARED_PTB.is_dir(), reason=f"PTB not found at {SHARED_PTB}")
def test_char_mode_on_real_ptb_valid_and_test_is_ptb_char(tmp_path):
    """data.mode="char" streams of PTB valid/test == the ptb.char symbols (train is valid here
    only to keep the test fast; every test character occurs in valid)."""
    folder = tmp_path / "ptb"
    texts = {s: (SHARED_PTB / f"{s}.txt").read_text(encoding="utf-8") for s in ("valid", "test")}
    write_split_files(folder, {"train": texts["valid"], **texts})
    corpus = load_corpus(folder, mode="char", use_cache=False)
    for split, n_tokens in (("valid", 393_042), ("test", 442_423)):
        stream = ["_" if t == " " else t for t in corpus.vocab.decode(corpus.split(split))]
        expected = [s for line in texts[split].splitlines() for s in (*char_symbols(line), EOS)]
        assert stream == expected and len(stream) == n_tokens
