"""Models: a backbone's hidden states, ended by a head (embedding -> backbone -> head).

    backbones/         AWD-LSTM (+ its regularizers), the Transformer blocks and causal body
    seq2seq.py         TransformerSeq2Seq: the encoder-decoder whose decoder ends in a head
    decoding.py        batched greedy and beam search (GNMT length penalty), incremental
    language_model.py  LanguageModel (backbone + head, tying), the builders: build_model
                       (MODEL_BUILDERS, by ``model.backbone``), build_seq2seq; count_parameters
    load.py            load_run, load_run_corpus: the model (and corpus) of a run directory

``highrank.model`` and ``highrank.backbones``, where this code lived, re-export it.
"""

from highrank.models.backbones import AWDLSTM, CausalTransformer
from highrank.models.decoding import beam_search, greedy_search
from highrank.models.language_model import (
    MODEL_BUILDERS,
    LanguageModel,
    build_model,
    build_seq2seq,
    check_layers_read,
    count_parameters,
)
from highrank.models.load import load_run, load_run_corpus
from highrank.models.seq2seq import TransformerSeq2Seq

__all__ = [
    "AWDLSTM",
    "MODEL_BUILDERS",
    "CausalTransformer",
    "LanguageModel",
    "TransformerSeq2Seq",
    "beam_search",
    "build_model",
    "build_seq2seq",
    "check_layers_read",
    "count_parameters",
    "greedy_search",
    "load_run",
    "load_run_corpus",
]
