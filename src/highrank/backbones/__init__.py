"""Old path kept for compatibility; the code lives in highrank.models.backbones."""

from highrank.models.backbones import (
    AWDLSTM,
    AWDLSTMExtras,
    AWDLSTMState,
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
