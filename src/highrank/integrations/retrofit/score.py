"""Perplexity of a retrofit, one tally for every mode: the float64 NLL of the targets (and the
KL from a reference distribution) over blocks of log-probability rows.

The rows come from the cache through a head (frozen mode, :func:`evaluate_head`, which can
also write the first rows of the matrix to a ``.npy`` for the rank instruments) or from a
causal LM run over whole windows (lora / full mode and the base model,
:func:`score_windows`); both add them to a :class:`Tally`.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from highrank.heads import OutputHead
from highrank.integrations.hf_parallel import is_sharded
from highrank.integrations.retrofit.cache import FeatureCache, check_head_fits
from highrank.train import distributed
from highrank.util.checks import check_positive_int
from highrank.util.denormals import flush_denormals
from highrank.util.npy import write_matrix
from highrank.util.progress import progress_bar


def finite_perplexity(nll_per_token: float) -> float:
    """``exp(nll)``, ``inf`` where that overflows a float (a diverged head's 2e20 nats)."""
    return math.exp(nll_per_token) if nll_per_token < 709.0 else math.inf


@dataclass
class Tally:
    """Running totals over blocks of rows: tokens, NLL (float64), KL(reference || rows) and
    the seconds spent computing the rows."""

    tokens: int = 0
    nll: float = 0.0
    kl: float = 0.0
    seconds: float = 0.0

    @torch.no_grad()
    def add(self, log_probs: torch.Tensor, targets: torch.Tensor,
            reference: torch.Tensor | None = None) -> None:
        """Rows ``log_probs (..., V)`` (normalised, float32) of ``targets (...)``; with the
        ``reference`` rows of the same contexts, their KL from it (nats, summed)."""
        if reference is not None:
            self.kl += float((reference.exp() * (reference - log_probs)).sum().double())
        self.nll -= float(log_probs.gather(-1, targets.unsqueeze(-1)).double().sum())
        self.tokens += targets.numel()

    def summed(self) -> Tally:
        """The tally of every process (tokens, NLL and KL summed in rank order, float64; the
        seconds of the slowest): under torchrun each process scores its share of the rows;
        ``self`` in one process."""
        if not distributed.active():
            return self
        parts = distributed.gathered([self.tokens, self.nll, self.kl, self.seconds])
        return Tally(int(sum(p[0] for p in parts)), sum(p[1] for p in parts),
                     sum(p[2] for p in parts), max(p[3] for p in parts))

    def record(self) -> dict:
        """``tokens``, ``nll_per_token``, ``perplexity`` and ``seconds``."""
        nll = self.nll / self.tokens
        return {"tokens": self.tokens, "nll_per_token": nll,
                "perplexity": finite_perplexity(nll), "seconds": self.seconds}


@flush_denormals()
def evaluate_head(
    head: OutputHead,
    cache: FeatureCache,
    *,
    block_tokens: int = 512,
    matrix_path: str | os.PathLike | None = None,
    matrix_rows: int | None = None,
    reference: OutputHead | None = None,
    groups: dict[str, torch.Tensor] | None = None,
) -> dict:
    """Perplexity ``exp(total NLL / N)`` of ``head`` over every token of ``cache`` (eval mode,
    no autograd, float32). With ``matrix_path`` the log-probabilities of the first
    ``matrix_rows`` tokens (all when None) are written there as a float32 ``(rows, V)``
    ``.npy``, from the same forward pass, for the rank instruments. With a ``reference`` head
    (e.g. the base model's own), ``kl_from_reference`` is the mean over the tokens of
    KL(p_reference || p_head) in nats: how far ``head`` has moved from it. With ``groups``
    (name: an ``(N,)`` bool mask of the cache's rows), ``groups`` in the record gives the
    tokens, NLL and perplexity (and KL) of each group's rows too (e.g. the tokens seen earlier
    in their window, :meth:`~highrank.integrations.retrofit.cache.FeatureCache.seen_in_window`,
    and the others)."""
    check_head_fits(head, cache)
    check_positive_int("block_tokens", block_tokens)
    if matrix_path is not None and distributed.active():
        raise ValueError("evaluate_head writes a matrix in one process only, not under torchrun")
    rows = len(cache) if matrix_rows is None else matrix_rows
    if matrix_path is not None and not 0 < rows <= len(cache):
        raise ValueError(f"matrix_rows must lie in 1..{len(cache)}; got {matrix_rows!r}")
    tally = Tally()
    masks = groups or {}
    for name, mask in masks.items():
        if mask.shape != (len(cache),) or mask.dtype != torch.bool:
            raise ValueError(f"group {name!r} must be a bool mask of the {len(cache)} cached "
                             f"rows; got {mask.dtype} {tuple(mask.shape)}")
    by_group = {name: Tally() for name in masks}
    modes = [(module, module.training) for module in (head, reference) if module is not None]
    for module, _ in modes:
        module.eval()
    try:
        blocks = _cache_blocks(head, cache, block_tokens, tally, reference,
                               {name: (masks[name], by_group[name]) for name in masks})
        if matrix_path is not None:
            write_matrix(matrix_path, _first_rows(blocks, rows), (rows, head.vocab_size))
        for _ in blocks:  # every token counts (those after the matrix's rows too)
            pass
    finally:
        for module, mode in modes:
            module.train(mode)
    tally = tally.summed()
    record = tally.record()
    seconds = record.pop("seconds")
    kl = (lambda t: t.kl / max(t.tokens, 1)) if reference is not None else (lambda t: None)
    parts = {}
    for name, part in by_group.items():
        part = part.summed()
        parts[name] = ({k: v for k, v in part.record().items() if k != "seconds"}
                       | {"kl_from_reference": kl(part)} if part.tokens else {"tokens": 0})
    return {**record, "kl_from_reference": kl(tally), "seconds": seconds,
            "matrix_rows": rows if matrix_path is not None else None,
            **({"groups": parts} if groups is not None else {})}


def _first_rows(blocks: Iterator[tuple[int, torch.Tensor]], rows: int) -> Iterator[torch.Tensor]:
    """The row blocks of ``blocks`` up to row ``rows``, leaving the rest to be drawn."""
    for start, log_probs in blocks:
        yield log_probs[: rows - start]
        if start + log_probs.shape[0] >= rows:
            return


def _cache_blocks(head, cache, block_tokens, tally: Tally, reference=None,
                  groups: dict | None = None) -> Iterator[tuple[int, torch.Tensor]]:
    """``(start, log_probs (b, V))`` per block of cached tokens, each added to ``tally``
    (under torchrun this process's contiguous share of the blocks). A head that reads its
    context is given whole windows of the sequence cache (``block_tokens // window`` of them,
    at least one), as it trained; its rows come out in the cache's order all the same."""
    device = next(head.parameters()).device
    whole_windows = head.reads != ("hidden",)
    step = max(1, block_tokens // cache.window) * cache.window if whole_windows else block_tokens
    for start in _own_share(range(0, len(cache), step)):
        began = time.perf_counter()
        stop = min(start + step, len(cache))
        if whole_windows:
            hidden, inputs, targets = cache.windows(
                torch.arange(start // cache.window, stop // cache.window), device, head.reads)
        else:
            hidden, inputs = cache.rows(slice(start, stop)).to(device), {}
            targets = cache.targets[start:stop]
        with torch.no_grad():  # (stop - start, V) rows either way
            log_probs = head.log_prob(hidden, **inputs).float().reshape(stop - start, -1)
            base = None if reference is None else reference.log_prob(hidden).float().reshape(
                stop - start, -1)
        targets = targets.reshape(-1).to(log_probs.device)
        tally.add(log_probs, targets, base)
        for mask, part in (groups or {}).values():  # (mask (N,), its Tally)
            rows = mask[start:stop].to(log_probs.device)
            part.add(log_probs[rows], targets[rows], None if base is None else base[rows])
        tally.seconds += time.perf_counter() - began
        yield start, log_probs.cpu()


@torch.no_grad()
def score_windows(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, *,
                  base: bool = False, batch: int = 4, label: str = "",
                  progress: bool = False) -> dict:
    """Perplexity over every token of the windows ``inputs (W, L)`` with their ``targets``:
    the ``log_softmax`` of a base model's logits (``base``), or a highrank model's
    log-probabilities (its ``logits`` are already normalised). Under torchrun each process
    scores its contiguous share of the batches and the tallies are summed."""
    model.eval()
    tally, device = Tally(), next(model.parameters()).device
    batches = range(0, inputs.shape[0], batch)
    firsts = _own_share(batches)
    bar = progress_bar(total=inputs.shape[0], desc=f"score {label}", unit="window",
                       disable=not (progress and distributed.is_writer()))
    for first in firsts:
        began = time.perf_counter()
        bar.update(min(batch, inputs.shape[0] - first))
        logits = model(input_ids=inputs[first:first + batch].to(device)).logits.float()
        log_probs = torch.log_softmax(logits, dim=-1) if base else logits
        tally.add(log_probs, targets[first:first + batch].to(device))
        tally.seconds += time.perf_counter() - began
    # An FSDP2-sharded model gathers its weights in every forward, all processes together:
    # a process with a share one batch shorter runs one more, uncounted.
    if is_sharded(model):
        for _ in range(-(-len(batches) // distributed.world_size()) - len(firsts)):
            model(input_ids=inputs[:batch].to(device))
    bar.close()
    return tally.summed().record()


def _own_share(blocks: range) -> range:
    """This process's contiguous share of ``blocks`` (all of them in one process): process r
    of N takes blocks [r n / N, (r + 1) n / N)."""
    n, world, rank = len(blocks), distributed.world_size(), distributed.rank()
    return blocks[rank * n // world : (rank + 1) * n // world]


__all__ = ["Tally", "evaluate_head", "finite_perplexity", "score_windows"]
