"""Machine translation: what the ``seq2seq`` family needs besides the model and its recipe.

    bitext.py       parallel corpora ``{train,valid,test}.<lang>``: checks, max_tokens batches
    subwords.py     SentencePiece vocabularies (the ``[mt]`` extra), saved in RUN_DIR/subwords/
    decoding.py     batched greedy and beam search (GNMT length penalty), incremental
    bleu.py         sacreBLEU corpus BLEU and its signature (the ``[mt]`` extra)
    translation.py  a translation run's data, loading a trained run, translating a split
"""
