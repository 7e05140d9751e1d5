"""Backbones: produce hidden states; they know nothing about the vocabulary distribution.

    awd_lstm.py      AWD-LSTM (Merity et al. 2018): its state, its extras for AR/TAR
    regularizers.py  what AWD-LSTM regularises with: locked, embedding and weight dropout,
                     AR/TAR, the variable BPTT length
    transformer.py   the pre-LN Transformer blocks and the causal decoder-only body (KVCache)

The encoder-decoder built from the same blocks is :mod:`highrank.models.seq2seq`.
"""

from highrank.models.backbones.awd_lstm import AWDLSTM, AWDLSTMExtras, AWDLSTMState
from highrank.models.backbones.regularizers import (
    BpttLength,
    LockedDropout,
    LSTMState,
    WeightDrop,
    activation_regularization,
    embedding_dropout,
    temporal_activation_regularization,
    variable_bptt_length,
)
from highrank.models.backbones.transformer import CausalTransformer, KVCache

__all__ = [
    "AWDLSTM",
    "AWDLSTMExtras",
    "AWDLSTMState",
    "BpttLength",
    "CausalTransformer",
    "KVCache",
    "LSTMState",
    "LockedDropout",
    "WeightDrop",
    "activation_regularization",
    "embedding_dropout",
    "temporal_activation_regularization",
    "variable_bptt_length",
]
