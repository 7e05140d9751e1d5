"""Text in, token ids out: corpora, the vocabulary, batching.

    corpus.py     a corpus folder (train/valid/test.txt) read whole: Vocab (frequency-ordered),
                  word / char tokenisation, the token-id cache, batchify / get_batch (BPTT),
                  corpus statistics; what ``highrank.data`` exports
    streaming.py  corpora larger than memory (``data.memmap``): shard folders, one-pass
                  vocabulary, memory-mapped ids, sentence-shuffled batching; open_corpus
                  picks the loader a config asks for
    chars.py      Mikolov's character-level PTB (``ptb.char``) and bits per character
    zipf.py       a seeded Zipfian synthetic corpus (``highrank data zipf``)

``from highrank.data import Vocab, load_corpus, batchify`` keeps working as it did when this
package was one module; the other modules are imported by their own names.
"""

from highrank.data.corpus import (
    CACHE_VERSION,
    EOS,
    MODES,
    SPLITS,
    UNK,
    VOCAB_FORMAT,
    Corpus,
    CorpusError,
    Vocab,
    batchify,
    check_directory,
    check_mode,
    check_split_name,
    corpus_stats,
    decode_utf8,
    default_cache_dir,
    empty_split_error,
    format_stats,
    get_batch,
    iter_batches,
    load_corpus,
    tokenize,
)

__all__ = [
    "CACHE_VERSION",
    "EOS",
    "MODES",
    "SPLITS",
    "UNK",
    "VOCAB_FORMAT",
    "Corpus",
    "CorpusError",
    "Vocab",
    "batchify",
    "check_directory",
    "check_mode",
    "check_split_name",
    "corpus_stats",
    "decode_utf8",
    "default_cache_dir",
    "empty_split_error",
    "format_stats",
    "get_batch",
    "iter_batches",
    "load_corpus",
    "tokenize",
]
