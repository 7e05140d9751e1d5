"""highrank.mt.subwords: learning on train, frequency-ordered ids, determinism, run-dir files."""

from __future__ import annotations

import sys

import numpy as np
import pytest

pytest.importorskip(
    "sentencepiece", reason="subword vocabularies need the 'mt' extra: pip install 'highrank[mt]'"
)

from highrank.mt import subwords  # noqa: E402
from highrank.mt.subwords import (  # noqa: E402
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    SubwordError,
    Subwords,
    SubwordSettings,
    learn_subwords,
    load_or_learn_subwords,
)
from tests.conftest import SHARED_DATA  # noqa: E402

MULTI30K = SHARED_DATA / "multi30k"

EN = ["a man", "a woman", "the dog", "the cat", "runs", "sits", "in the park", "on a bench"]
DE = [
    "ein Mann",
    "eine Frau",
    "der Hund",
    "die Katze",
    "läuft",
    "sitzt",
    "im Park",
    "auf einer Bank",
]


def upper_first(text: str) -> str:
    return text[0].upper() + text[1:]  # str.capitalize would lower-case "Hund"


def toy_pairs(n: int = 300, seed: int = 0) -> tuple[list[str], list[str]]:
    """Aligned toy sentences: subject, verb, place, drawn with a fixed seed."""
    rng = np.random.default_rng(seed)
    src, tgt = [], []
    for _ in range(n):
        s, v, p = rng.integers(0, 4), rng.integers(4, 6), rng.integers(6, 8)
        src.append(f"{upper_first(EN[s])} {EN[v]} {EN[p]}.")
        tgt.append(f"{upper_first(DE[s])} {DE[v]} {DE[p]}.")
    return src, tgt


SMALL = SubwordSettings(vocab_size=60)


@pytest.fixture(scope="module")
def joint() -> Subwords:
    src, tgt = toy_pairs()
    return learn_subwords(src, tgt, SMALL, src_lang="en", tgt_lang="de")


def test_specials_come_first_in_fairseq_order(joint):
    vocab = joint.tgt
    assert joint.src is vocab and len(vocab) == 60
    assert (BOS_ID, PAD_ID, EOS_ID, UNK_ID) == (0, 1, 2, 3)
    assert [vocab.piece(i) for i in range(4)] == ["<s>", "<pad>", "</s>", "<unk>"]
    assert (vocab.bos_id, vocab.pad_id, vocab.eos_id, vocab.unk_id) == (0, 1, 2, 3)
    special = joint.special_ids()
    assert (special.pad, special.bos, special.eos) == (PAD_ID, BOS_ID, EOS_ID)


def test_joint_ids_follow_target_frequency_then_source_frequency(joint):
    src, tgt = toy_pairs()
    vocab = joint.tgt
    count = {
        side: np.bincount(
            [i for row in vocab.encode_lines(lines) for i in row], minlength=len(vocab)
        )[4:]
        for side, lines in (("src", src), ("tgt", tgt))
    }
    in_tgt = count["tgt"] > 0
    n_tgt = int(in_tgt.sum())
    assert in_tgt[:n_tgt].all() and not in_tgt[n_tgt:].any()  # target pieces first
    assert (np.diff(count["tgt"][:n_tgt]) <= 0).all()  # by descending target count
    src_only = count["src"][n_tgt:]
    assert (np.diff(src_only) <= 0).all()  # then by descending source count


def test_encode_decode_round_trips_raw_text(joint):
    src, tgt = toy_pairs(20, seed=1)
    for vocab, lines in ((joint.src, src), (joint.tgt, tgt)):
        assert vocab.decode_lines(vocab.encode_lines(lines)) == lines
        assert all(4 <= i < len(vocab) for row in vocab.encode_lines(lines) for i in row)


def test_decode_reads_to_eos_and_drops_bos_and_pad(joint):
    vocab = joint.tgt
    ids = vocab.encode("Der Hund läuft im Park.")
    assert vocab.decode([BOS_ID, *ids, EOS_ID, *ids, PAD_ID]) == "Der Hund läuft im Park."
    assert vocab.decode(np.array([BOS_ID, *ids, PAD_ID, PAD_ID])) == "Der Hund läuft im Park."
    with pytest.raises(SubwordError, match=r"ids must lie in \[0, 60\)"):
        vocab.decode([60])


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_learning_is_deterministic(model_type):
    src, tgt = toy_pairs()
    settings = SubwordSettings(model_type=model_type, vocab_size=40)
    first = learn_subwords(src, tgt, settings, src_lang="en", tgt_lang="de")
    again = learn_subwords(src, tgt, settings, src_lang="en", tgt_lang="de")
    assert first.tgt.model_proto == again.tgt.model_proto  # byte-identical models
    assert np.array_equal(first.tgt.order, again.tgt.order)
    assert first.src.encode_lines(src) == again.src.encode_lines(src)


def test_separate_vocabularies_save_and_load(tmp_path):
    src, tgt = toy_pairs()
    settings = SubwordSettings(vocab_size=40, joint=False)
    pair = learn_subwords(src, tgt, settings, src_lang="en", tgt_lang="de")
    assert pair.src is not pair.tgt and pair.src.name == "en" and pair.tgt.name == "de"
    for vocab, lines in ((pair.src, src), (pair.tgt, tgt)):
        counts = np.bincount([i for r in vocab.encode_lines(lines) for i in r], minlength=40)
        assert (np.diff(counts[4:]) <= 0).all()  # each ordered by its own side's counts
    folder = pair.save(tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == ["de.model", "en.model", "subwords.json"]
    loaded = Subwords.load(tmp_path)
    assert loaded.settings == settings and (loaded.src_lang, loaded.tgt_lang) == ("en", "de")
    assert loaded.tgt.encode_lines(tgt) == pair.tgt.encode_lines(tgt)


def test_joint_save_load_and_tampering(tmp_path, joint):
    folder = joint.save(tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == ["joint.model", "subwords.json"]
    loaded = Subwords.load(tmp_path)
    assert loaded.src is loaded.tgt and np.array_equal(loaded.tgt.order, joint.tgt.order)
    (folder / "joint.model").write_bytes(joint.tgt.model_proto[:-1])
    with pytest.raises(SubwordError, match=r"joint\.model is not the model .*sha256 differs"):
        Subwords.load(tmp_path)
    with pytest.raises(SubwordError, match=r"subwords\.json does not exist"):
        Subwords.load(tmp_path / "elsewhere")


def test_a_foreign_sentencepiece_model_is_refused():
    import io

    import sentencepiece as spm

    src, tgt = toy_pairs()
    model = io.BytesIO()  # SentencePiece's defaults: unk 0, bos 1, eos 2, no pad
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(src + tgt), model_writer=model, vocab_size=40, minloglevel=2
    )
    with pytest.raises(SubwordError, match=r"bos/pad/eos/unk ids \(1, -1, 2, 0\)"):
        subwords.SubwordVocab(model.getvalue(), np.arange(40), name="foreign")


def test_load_or_learn_reuses_the_run_vocabulary(tmp_path, monkeypatch):
    src, tgt = toy_pairs()
    first = load_or_learn_subwords(tmp_path, src, tgt, SMALL, src_lang="en", tgt_lang="de")

    def no_learning(*args, **kwargs):
        raise AssertionError("a saved vocabulary must be loaded, not learned again")

    monkeypatch.setattr(subwords, "learn_subwords", no_learning)
    again = load_or_learn_subwords(tmp_path, src, tgt, SMALL, src_lang="en", tgt_lang="de")
    assert again.tgt.model_proto == first.tgt.model_proto
    with pytest.raises(SubwordError, match="use a new run directory"):
        load_or_learn_subwords(
            tmp_path, src, tgt, SubwordSettings(vocab_size=50), src_lang="en", tgt_lang="de"
        )


@pytest.mark.parametrize(
    "knobs, match",
    [
        ({"model_type": "wordpiece"}, "subwords.model_type = 'wordpiece'"),
        ({"vocab_size": 4}, "subwords.vocab_size = 4; expected an int > 4"),
        ({"vocab_size": 8000.0}, "subwords.vocab_size"),
        ({"joint": 1}, "subwords.joint = 1"),
        ({"character_coverage": 0.5}, "subwords.character_coverage = 0.5"),
    ],
)
def test_bad_settings_name_the_key(knobs, match):
    with pytest.raises(SubwordError, match=match):
        SubwordSettings(**knobs)


def test_too_large_a_vocabulary_names_the_key():
    src, tgt = toy_pairs(20)
    with pytest.raises(SubwordError, match=r"subwords.vocab_size = 8000\) on 40 lines failed"):
        learn_subwords(src, tgt, SubwordSettings(), src_lang="en", tgt_lang="de")


def test_mismatched_train_sides_are_an_error():
    with pytest.raises(SubwordError, match="got 2 and 1"):
        learn_subwords(["a", "b"], ["a"], SMALL, src_lang="en", tgt_lang="de")


def test_missing_sentencepiece_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # import now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'highrank\[mt\]'"):
        learn_subwords(["a"], ["b"], SMALL, src_lang="en", tgt_lang="de")


@pytest.mark.skipif(not MULTI30K.is_dir(), reason=f"Multi30k not found at {MULTI30K}")
def test_multi30k_joint_bpe_round_trips_every_test_reference():
    """The default vocabulary (joint BPE, 8,000) learned on train detokenises test exactly."""
    from highrank.mt.bitext import load_bitext

    bitext = load_bitext(MULTI30K, "en", "de", splits=("train", "test"))
    train, test = bitext.split("train"), bitext.split("test")
    pair = learn_subwords(train.src, train.tgt, SubwordSettings(), src_lang="en", tgt_lang="de")
    assert len(pair.tgt) == 8000
    assert pair.tgt.decode_lines(pair.tgt.encode_lines(test.tgt)) == list(test.tgt)
    assert pair.src.decode_lines(pair.src.encode_lines(test.src)) == list(test.src)
