"""The corpus keys of the stream language models (``awd-lstm``, ``transformer``): the text on
disk read by :func:`highrank.data.streaming.load_stream_corpus`, and their cross-key rule."""

from __future__ import annotations

from typing import Any

from highrank.config.keys import ANY, ConfigError, Rule, Show, Where, one_of
from highrank.data.streaming import BATCHINGS

STREAM_DATA: dict[str, Rule | None] = {
    "memmap": ANY,
    "max_vocab": (lambda v: v >= 2, ">= 2 (<eos> and <unk> at least)"),
    "batching": one_of(BATCHINGS),
}


def check_stream_data(config: Any, where: Where, show: Show) -> None:
    """data.max_vocab and sentence batching are features of the memory-mapped loader."""
    data = config.data
    for dotted, used in (
        ("data.max_vocab", data.max_vocab is not None),
        ("data.batching", data.batching == "sentences"),
    ):
        if used and not data.memmap:
            value = getattr(data, dotted.split(".")[1])
            raise ConfigError(
                f"{where(dotted)}: {dotted} = {show(value)} needs the memory-mapped "
                f"corpus loader, but data.memmap = false; set data.memmap = true"
            )


__all__ = ["STREAM_DATA", "check_stream_data"]
