"""Machine translation data: what the ``seq2seq`` family reads besides the model and its recipe.

    bitext.py            parallel corpora ``{train,valid,test}.<lang>``: checks, max_tokens batches
    subwords.py          SentencePiece vocabularies (the ``[mt]`` extra), saved in RUN_DIR/subwords/
    bleu.py              sacreBLEU corpus BLEU and its signature (the ``[mt]`` extra)
    translation_data.py  a translation run's data: its parallel text and saved subwords

The model and its greedy and beam search live in :mod:`highrank.models` (``seq2seq.py``,
``decoding.py``); loading a trained run, translating a split and its BLEU record in
:mod:`highrank.evaluate.translation`. Nothing here imports a model.
"""
