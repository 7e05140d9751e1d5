"""Backbones: produce hidden states; they know nothing about the vocabulary distribution."""

from highrank.backbones.awd_lstm import AWDLSTM, AWDLSTMExtras, AWDLSTMState
from highrank.backbones.regularizers import (
    BpttLength,
    LockedDropout,
    LSTMState,
    WeightDrop,
    activation_regularization,
    embedding_dropout,
    temporal_activation_regularization,
    variable_bptt_length,
)

__all__ = [
    "AWDLSTM",
    "AWDLSTMExtras",
    "AWDLSTMState",
    "BpttLength",
    "LSTMState",
    "LockedDropout",
    "WeightDrop",
    "activation_regularization",
    "embedding_dropout",
    "temporal_activation_regularization",
    "variable_bptt_length",
]
