"""The ``awd-lstm`` family's config (:class:`highrank.models.backbones.awd_lstm.AWDLSTM`, trained by
:mod:`highrank.train.awd_lstm`): the keys only it reads, with their ranges."""

from __future__ import annotations

from highrank.config.families.stream import STREAM_DATA, check_stream_data
from highrank.config.keys import (
    NON_NEGATIVE,
    NON_NEGATIVE_FINITE,
    POSITIVE,
    PROBABILITY,
    Family,
    one_of,
)

# train.optimizer: the SGD -> ASGD switch policies of highrank.train.asgd (which reads them here)
SWITCH_POLICIES = ("nt-asgd", "et-asgd", "sgd")

AWD_LSTM = Family(
    name="awd-lstm",
    keys={
        "data": STREAM_DATA,
        "model": {
            "d_hidden": POSITIVE,
            "n_layers": POSITIVE,
            "d_last": POSITIVE,
            "d_project": POSITIVE,
            "dropout_embedding": PROBABILITY,
            "dropout_input": PROBABILITY,
            "dropout_hidden": PROBABILITY,
            "dropout_output": PROBABILITY,
            "weight_drop": PROBABILITY,
            "ar_alpha": NON_NEGATIVE_FINITE,
            "tar_beta": NON_NEGATIVE_FINITE,
        },
        # the recipe's (highrank.train.awd_lstm): variable BPTT and the SGD -> ASGD switch
        "train": {
            "max_seq_len_delta": NON_NEGATIVE,
            "optimizer": one_of(SWITCH_POLICIES),
            "nonmono": POSITIVE,
            "switch_epoch": POSITIVE,
            "latest_switch_epoch": POSITIVE,
        },
        "finetune": {"max_seq_len_delta": NON_NEGATIVE},
    },
    check=check_stream_data,
    # its layers differ in width (d_hidden, ..., d_last): a head gets the last one
    head_layers=lambda config: (1, "its last only: its layers differ in width"),
)

__all__ = ["AWD_LSTM", "SWITCH_POLICIES"]
