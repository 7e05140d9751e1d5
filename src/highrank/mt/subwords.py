"""Subword vocabularies for translation, learned with SentencePiece on the train split only.

SentencePiece (Kudo & Richardson 2018, "SentencePiece: A simple and language independent
subword tokenizer and detokenizer for Neural Text Processing") learns BPE (Sennrich et al.
2016) or unigram-LM (Kudo 2018) pieces straight from raw text and decodes pieces back to raw
text, so translations are scored detokenised against raw references (``highrank.mt.bleu``).
Knobs (:class:`SubwordSettings`): the model type, the size, and ``joint`` (one vocabulary for
both languages, learned on both train sides, the default for en-de: Vaswani et al. 2017
Sec. 5.1 used a shared source-target BPE vocabulary; 8,000 pieces by default for the 29,000
pairs of Multi30k) or one per language.

Ids. The first four ids are fixed, as in fairseq's ``Dictionary``: ``<s>`` 0 (bos), ``<pad>``
1, ``</s>`` 2 (eos), ``<unk>`` 3. Every other piece is renumbered by its count in the encoded
train split, most frequent first (ties: source count, then SentencePiece's own order): BPE
numbers pieces by merge order, which puts the single characters last, but the Mixtape head's
gate sharing needs "the S most frequent tokens are the smallest ids" (here: ids 4 .. S-1 plus
the four specials). A joint vocabulary is ordered by *target* counts (the side a head
predicts); source-only pieces follow, by source count.

Files: :meth:`Subwords.save` writes ``<run_dir>/subwords/`` — each vocabulary's SentencePiece
model (``joint.model``, or ``<src_lang>.model`` and ``<tgt_lang>.model``) and
``subwords.json`` (settings, languages, each model's sha256 and the id order);
:meth:`Subwords.load` reads them back and checks them. Training is deterministic
(one thread, no sentence sampling or shuffling): the same text and settings give byte-identical
models.

Needs the optional extra ``mt`` (``pip install 'highrank[mt]'``); importing this module does
not, using it without sentencepiece raises an ImportError saying so.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from highrank.mt.bitext import SpecialIds
from highrank.util.atomic import write_bytes_atomic, write_text_atomic

MODEL_TYPES = ("bpe", "unigram")
BOS_ID, PAD_ID, EOS_ID, UNK_ID = 0, 1, 2, 3  # fairseq's Dictionary order
N_SPECIAL = 4
FORMAT = "highrank-subwords"
FOLDER = "subwords"
MANIFEST = "subwords.json"


class SubwordError(ValueError):
    """Bad subword settings or files; the message names the key or file."""


def _sentencepiece():
    """The sentencepiece module, or an ImportError that says how to get it."""
    try:
        import sentencepiece
    except ImportError:
        raise ImportError(
            "highrank.mt.subwords needs the 'sentencepiece' package, which is not installed; "
            "install the translation extra: pip install 'highrank[mt]'"
        ) from None
    return sentencepiece


@dataclass(frozen=True)
class SubwordSettings:
    """How to learn the vocabulary (see the module docstring)."""

    model_type: str = "bpe"
    vocab_size: int = 8000
    joint: bool = True
    character_coverage: float = 1.0  # every train character gets a piece (small corpora)

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise SubwordError(
                f"subwords.model_type = {self.model_type!r}; expected one of {MODEL_TYPES}"
            )
        size = self.vocab_size
        if isinstance(size, bool) or not isinstance(size, int) or size <= N_SPECIAL:
            raise SubwordError(f"subwords.vocab_size = {size!r}; expected an int > {N_SPECIAL}")
        if not isinstance(self.joint, bool):
            raise SubwordError(f"subwords.joint = {self.joint!r}; expected true or false")
        coverage = self.character_coverage
        if isinstance(coverage, bool) or not isinstance(coverage, int | float):
            raise SubwordError(f"subwords.character_coverage = {coverage!r}; expected a number")
        if not 0.98 <= coverage <= 1.0:  # SentencePiece's own bounds
            raise SubwordError(
                f"subwords.character_coverage = {coverage!r}; expected 0.98 <= value <= 1"
            )


# ---- one vocabulary -----------------------------------------------------------------------


class SubwordVocab:
    """A SentencePiece model with its pieces renumbered by train frequency.

    ``order[i]`` is the SentencePiece id of our id ``i`` (a permutation fixing ids 0..3).
    """

    pad_id, bos_id, eos_id, unk_id = PAD_ID, BOS_ID, EOS_ID, UNK_ID

    def __init__(self, model_proto: bytes, order: Sequence[int], *, name: str = "vocabulary"):
        spm = _sentencepiece()
        self.name, self.model_proto = name, bytes(model_proto)
        self._sp = spm.SentencePieceProcessor(model_proto=self.model_proto)
        found = (self._sp.bos_id(), self._sp.pad_id(), self._sp.eos_id(), self._sp.unk_id())
        if found != (BOS_ID, PAD_ID, EOS_ID, UNK_ID):
            raise SubwordError(
                f"{name}: the SentencePiece model has bos/pad/eos/unk ids {found}; expected "
                f"{(BOS_ID, PAD_ID, EOS_ID, UNK_ID)} (a model learned by highrank.mt.subwords)"
            )
        self.order = np.asarray(order, dtype=np.int64)
        _check_order(self.order, self._sp.get_piece_size(), name)
        self._rank = np.empty_like(self.order)  # SentencePiece id -> our id
        self._rank[self.order] = np.arange(len(self.order))

    def __len__(self) -> int:
        return len(self.order)

    def __repr__(self) -> str:
        return f"SubwordVocab({self.name!r}, size={len(self)})"

    def piece(self, index: int) -> str:
        """The piece of our id ``index`` (``▁`` marks a word start)."""
        return self._sp.id_to_piece(int(self.order[index]))

    def encode(self, text: str) -> list[int]:
        """Our ids of one line (no ``<bos>``/``<eos>``; batching adds them)."""
        return self.encode_lines([text])[0]

    def encode_lines(self, lines: Iterable[str]) -> list[list[int]]:
        """Our ids of each line."""
        rows = self._sp.encode(list(lines))
        return [self._rank[np.asarray(row, dtype=np.int64)].tolist() for row in rows]

    def decode(self, ids: Iterable[int]) -> str:
        """Raw text of ``ids``: read up to the first ``<eos>``, ``<bos>``/``<pad>`` dropped."""
        return self.decode_lines([ids])[0]

    def decode_lines(self, rows: Iterable[Iterable[int]]) -> list[str]:
        """:meth:`decode` of each row (lists, 1-D arrays or tensors, or a 2-D tensor's rows)."""
        out = []
        for row in rows:
            ids = np.asarray(
                row.tolist() if hasattr(row, "tolist") else list(row), dtype=np.int64
            ).reshape(-1)
            ends = np.flatnonzero(ids == EOS_ID)
            ids = ids[: ends[0]] if ends.size else ids
            ids = ids[(ids != BOS_ID) & (ids != PAD_ID)]
            if ids.size and (ids.min() < 0 or ids.max() >= len(self)):
                raise SubwordError(f"{self.name}: ids must lie in [0, {len(self)}); got {ids}")
            out.append(self._sp.decode(self.order[ids].tolist()))
        return out

    def sp_counts(self, lines: Iterable[str]) -> np.ndarray:
        """How often each SentencePiece id occurs in the encoded ``lines``."""
        rows = self._sp.encode(list(lines))
        flat = np.fromiter((i for row in rows for i in row), dtype=np.int64)
        return np.bincount(flat, minlength=self._sp.get_piece_size())


def _check_order(order: np.ndarray, size: int, name: str) -> None:
    if order.shape != (size,) or not np.array_equal(np.sort(order), np.arange(size)):
        raise SubwordError(f"{name}: the id order is not a permutation of the model's {size} ids")
    if not np.array_equal(order[:N_SPECIAL], np.arange(N_SPECIAL)):
        raise SubwordError(f"{name}: the id order must keep ids 0..3 (<s>, <pad>, </s>, <unk>)")


def frequency_order(primary: np.ndarray, secondary: np.ndarray) -> np.ndarray:
    """SentencePiece ids ordered as our ids: specials 0..3, then by ``primary`` count,
    ``secondary`` count (both descending), SentencePiece id."""
    ids = np.arange(N_SPECIAL, len(primary))
    # lexsort: the last key is the primary one; ids last-resort tie-break (ascending).
    ranked = ids[np.lexsort((ids, -secondary[ids], -primary[ids]))]
    return np.concatenate([np.arange(N_SPECIAL), ranked])


# ---- learning -----------------------------------------------------------------------------


def train_sentencepiece(lines: Sequence[str], settings: SubwordSettings, *, name: str) -> bytes:
    """A serialized SentencePiece model learned on ``lines`` (deterministic: one thread,
    every sentence used, no shuffling)."""
    spm = _sentencepiece()
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=model,
            model_type=settings.model_type,
            vocab_size=settings.vocab_size,
            character_coverage=settings.character_coverage,
            bos_id=BOS_ID,
            pad_id=PAD_ID,
            eos_id=EOS_ID,
            unk_id=UNK_ID,
            num_threads=1,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            minloglevel=2,
        )
    except RuntimeError as err:  # e.g. "Vocabulary size too high (8000). Please set it to ..."
        raise SubwordError(
            f"learning the {name} vocabulary ({settings.model_type}, subwords.vocab_size = "
            f"{settings.vocab_size}) on {len(lines):,} lines failed: {err}"
        ) from None
    return model.getvalue()


# ---- the pair of vocabularies of a translation direction ----------------------------------


@dataclass(frozen=True, eq=False)
class Subwords:
    """Source and target vocabularies (the same object when ``settings.joint``)."""

    src: SubwordVocab
    tgt: SubwordVocab
    settings: SubwordSettings
    src_lang: str
    tgt_lang: str

    def special_ids(self) -> SpecialIds:
        """The ``<pad>``, ``<bos>``, ``<eos>`` ids batches need (the same in both vocabularies)."""
        return SpecialIds(pad=PAD_ID, bos=BOS_ID, eos=EOS_ID)

    def save(self, run_dir: str | os.PathLike) -> Path:
        """Write the model(s) and ``subwords.json`` under ``run_dir/subwords``; returns it."""
        folder = Path(run_dir).expanduser() / FOLDER
        entries = {}
        for side, vocab in self._vocabularies().items():
            write_bytes_atomic(folder / f"{vocab.name}.model", vocab.model_proto)
            entries[side] = {
                "model": f"{vocab.name}.model",
                "sha256": hashlib.sha256(vocab.model_proto).hexdigest(),
                "order": vocab.order.tolist(),
            }
        manifest = {
            "format": FORMAT,
            "version": 1,
            "settings": asdict(self.settings),
            "src_lang": self.src_lang,
            "tgt_lang": self.tgt_lang,
            "vocabularies": entries,
        }
        write_text_atomic(folder / MANIFEST, json.dumps(manifest, indent=1))
        return folder

    def _vocabularies(self) -> dict[str, SubwordVocab]:
        return {"joint": self.src} if self.settings.joint else {"src": self.src, "tgt": self.tgt}

    @classmethod
    def load(cls, run_dir: str | os.PathLike) -> Subwords:
        """Read what :meth:`save` wrote under ``run_dir/subwords``."""
        folder = Path(run_dir).expanduser() / FOLDER
        manifest = _read_manifest(folder / MANIFEST)
        try:
            settings = SubwordSettings(**manifest["settings"])
            vocabularies = {
                side: _load_vocab(folder, entry) for side, entry in manifest["vocabularies"].items()
            }
            src_lang, tgt_lang = manifest["src_lang"], manifest["tgt_lang"]
            src = vocabularies["joint" if settings.joint else "src"]
            tgt = vocabularies["joint" if settings.joint else "tgt"]
        except (KeyError, TypeError) as err:
            raise SubwordError(f"{folder / MANIFEST}: missing or malformed entry {err}") from None
        return cls(src, tgt, settings, src_lang, tgt_lang)


def _read_manifest(path: Path) -> dict:
    if not path.is_file():
        raise SubwordError(
            f"{path} does not exist; expected the subword vocabulary of a translation run "
            "(written by Subwords.save when the run started)"
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise SubwordError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise SubwordError(f"{path}: expected a JSON object with format {FORMAT!r}")
    return manifest


def _load_vocab(folder: Path, entry: dict) -> SubwordVocab:
    path = folder / entry["model"]
    if not path.is_file():
        raise SubwordError(f"{path} does not exist; {folder / MANIFEST} names it")
    proto = path.read_bytes()
    if hashlib.sha256(proto).hexdigest() != entry["sha256"]:
        raise SubwordError(
            f"{path} is not the model {folder / MANIFEST} was written with (sha256 differs); "
            "was it replaced?"
        )
    return SubwordVocab(proto, entry["order"], name=path.stem)


def learn_subwords(
    train_src: Sequence[str],
    train_tgt: Sequence[str],
    settings: SubwordSettings,
    *,
    src_lang: str,
    tgt_lang: str,
) -> Subwords:
    """Learn the vocabulary (or two) of a translation direction from the *train* sentences.

    Pass the train split only (``bitext.split("train").src`` / ``.tgt``): valid and test
    stay unseen, as the references are.
    """
    if len(train_src) != len(train_tgt) or not train_src:
        raise SubwordError(
            f"expected the same non-zero number of source and target train lines; got "
            f"{len(train_src):,} and {len(train_tgt):,}"
        )
    if settings.joint:
        proto = train_sentencepiece([*train_src, *train_tgt], settings, name="joint")
        vocab = SubwordVocab(proto, np.arange(_piece_count(proto)), name="joint")
        order = frequency_order(vocab.sp_counts(train_tgt), vocab.sp_counts(train_src))
        joint = SubwordVocab(proto, order, name="joint")
        return Subwords(joint, joint, settings, src_lang, tgt_lang)
    sides = {}
    for lang, lines in ((src_lang, train_src), (tgt_lang, train_tgt)):
        proto = train_sentencepiece(list(lines), settings, name=lang)
        counts = SubwordVocab(proto, np.arange(_piece_count(proto)), name=lang).sp_counts(lines)
        sides[lang] = SubwordVocab(proto, frequency_order(counts, counts), name=lang)
    return Subwords(sides[src_lang], sides[tgt_lang], settings, src_lang, tgt_lang)


def _piece_count(proto: bytes) -> int:
    return _sentencepiece().SentencePieceProcessor(model_proto=proto).get_piece_size()


def load_or_learn_subwords(
    run_dir: str | os.PathLike,
    train_src: Sequence[str],
    train_tgt: Sequence[str],
    settings: SubwordSettings,
    *,
    src_lang: str,
    tgt_lang: str,
) -> Subwords:
    """The run's vocabulary: loaded when ``run_dir/subwords`` exists (a resumed run; its
    settings and languages must match), else learned from train and saved there."""
    if (Path(run_dir).expanduser() / FOLDER / MANIFEST).is_file():
        found = Subwords.load(run_dir)
        wanted = (settings, src_lang, tgt_lang)
        if (found.settings, found.src_lang, found.tgt_lang) != wanted:
            raise SubwordError(
                f"{Path(run_dir) / FOLDER} holds a vocabulary for {found.settings} "
                f"{found.src_lang}->{found.tgt_lang}, not {settings} {src_lang}->{tgt_lang}; "
                "use a new run directory"
            )
        return found
    learned = learn_subwords(train_src, train_tgt, settings, src_lang=src_lang, tgt_lang=tgt_lang)
    learned.save(run_dir)
    return learned
