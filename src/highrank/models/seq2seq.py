"""An encoder-decoder Transformer (Vaswani et al., "Attention Is All You Need", NeurIPS 2017;
pre-LayerNorm variant, Xiong et al. 2020) whose decoder ends in any highrank output head::

    src (B, S)    -> dropout(sqrt(d) E_src[src] + P)           (B, S, d)
                  -> N_enc blocks: self-attention (padding masked), feed-forward
                  -> LN -> memory (B, S, d)
    tgt_in (B, T) = <bos> y_1 ... y_{T-1}
                  -> dropout(sqrt(d) E_tgt[tgt_in] + P)        (B, T, d)
                  -> N_dec blocks: causal self-attention, cross-attention on memory, feed-forward
                  -> LN -> hidden (B, T, d)
    head          log p(y_t | y_<t, x) = head.log_prob(hidden)      (B, T, V_tgt)

The blocks are those of ``backbones/transformer.py``. The head is any of ``highrank.heads``:
it owns the loss, so label smoothing and padding are the head's business
(``head.loss(hidden, tgt_out, ignore_index=pad_id, label_smoothing=eps)``).

Layout: batch-first, ``(B, T)``; sentences are padded on the *right* with ``pad_id``. Padded
source positions are masked as keys in the encoder and in cross-attention; padded target
positions need no mask in the causal self-attention (a real position never sees a later one)
and are ignored by the loss. Heads with internal dropout (MoS, MoC, Mixtape) get
``dropout_time_dim=1``: one mask per sentence, shared over its target positions.

Embeddings: ``share_embeddings`` makes the source and target embeddings one matrix (one joint
subword vocabulary, Vaswani Sec. 3.4); ``tie_output`` ties the head's decoder to the target
embedding (Press & Wolf 2017).

Decoding (``highrank.models.decoding``): :meth:`encode` once, :meth:`start_decoding` projects the
encoder output into every layer's cross-attention keys/values once, and :meth:`decode_step`
feeds new target tokens with the self-attention keys/values of earlier ones cached.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from highrank.heads import HEADS, build_head
from highrank.models.backbones.transformer import (
    KV,
    BlockSizes,
    InputEmbedding,
    KVCache,
    TransformerStack,
)
from highrank.util.checks import check_positive_int


class Memory(NamedTuple):
    """The encoder's output for a batch of source sentences."""

    states: torch.Tensor  # (B, S, d)
    padding: torch.Tensor  # (B, S) bool, True at padded source positions

    def select(self, index: torch.Tensor) -> Memory:
        """Rows ``index`` of the batch (beam search repeats each sentence once per beam)."""
        return Memory(self.states[index], self.padding[index])


@dataclass
class DecoderState:
    """Everything incremental decoding keeps between steps.

    Attributes:
        memory_kv: per decoder layer, the cross-attention keys/values of the encoder output,
            each ``(B, H, S, d_head)``: projected once per sentence.
        memory_padding: ``(B, S)``, True at padded source positions.
        cache: the self-attention keys/values of the target positions fed so far.
    """

    memory_kv: list[KV]
    memory_padding: torch.Tensor
    cache: KVCache

    @property
    def length(self) -> int:
        """Target positions fed so far (the position of the next token)."""
        return self.cache.length

    def select(self, index: torch.Tensor) -> DecoderState:
        """The state of batch rows ``index`` (beam search: reorder hypotheses)."""
        return DecoderState(
            [(k[index], v[index]) for k, v in self.memory_kv],
            self.memory_padding[index],
            self.cache.select(index),
        )


class TransformerSeq2Seq(nn.Module):
    """Encoder-decoder Transformer with any output head. Defaults: Vaswani et al.'s base model
    (d 512, 8 heads, d_ff 2048, 6 + 6 layers, dropout 0.1, sinusoidal positions).

    Args:
        src_vocab_size, tgt_vocab_size: vocabulary sizes (equal when embeddings are shared).
        pad_id: the padding id of both vocabularies.
        head: a name in :data:`highrank.heads.HEADS`.
        head_knobs: that head's keyword knobs (``{"n_components": 9}``); the model sets
            ``d_embed``, ``tied_weight`` and ``dropout_time_dim`` itself.
        d_model, n_heads, d_ff: block sizes (see ``backbones/transformer.py``).
        n_encoder_layers, n_decoder_layers: blocks in each stack.
        positions: ``"learned"``, ``"sinusoidal"`` or ``"rotary"``.
        max_len: longest sentence (learned positions only).
        dropout_input, dropout_attention, dropout_residual: as in
            :class:`highrank.models.backbones.transformer.CausalTransformer`.
        share_embeddings: one embedding matrix for source and target.
        tie_output: the head's decoder weight is the target embedding.
    """

    def __init__(
        self,
        src_vocab_size: int,
        tgt_vocab_size: int,
        *,
        pad_id: int,
        head: str = "softmax",
        head_knobs: dict | None = None,
        d_model: int = 512,
        n_heads: int = 8,
        d_ff: int = 2048,
        n_encoder_layers: int = 6,
        n_decoder_layers: int = 6,
        positions: str = "sinusoidal",
        max_len: int = 1024,
        dropout_input: float = 0.1,
        dropout_attention: float = 0.0,
        dropout_residual: float = 0.1,
        share_embeddings: bool = False,
        tie_output: bool = True,
    ) -> None:
        super().__init__()
        self.src_vocab_size = check_positive_int("src_vocab_size", src_vocab_size)
        self.tgt_vocab_size = check_positive_int("tgt_vocab_size", tgt_vocab_size)
        self.d_model = check_positive_int("d_model", d_model)
        self.pad_id = _check_pad_id(pad_id, src_vocab_size, tgt_vocab_size)
        self.src_embedding, self.tgt_embedding = _embeddings(
            src_vocab_size, tgt_vocab_size, d_model, share_embeddings
        )
        sizes = BlockSizes(
            d_model=d_model,
            n_heads=n_heads,
            d_ff=d_ff,
            dropout_attention=dropout_attention,
            dropout_residual=dropout_residual,
            rotary=positions == "rotary",
        )
        inputs = {"positions": positions, "max_len": max_len, "dropout": dropout_input}
        self.src_inputs = InputEmbedding(d_model, **inputs)
        self.tgt_inputs = InputEmbedding(d_model, **inputs)
        self.encoder = TransformerStack(n_encoder_layers, sizes, causal=False)
        self.decoder = TransformerStack(n_decoder_layers, sizes, causal=True, cross_attention=True)
        self.head = self._build_head(head, dict(head_knobs or {}), tie_output)

    def _build_head(self, name: str, knobs: dict, tie_output: bool) -> nn.Module:
        if name in HEADS and HEADS[name].reads != ("hidden",):
            raise ValueError(
                f"head {name!r} reads {', '.join(HEADS[name].reads)}; the translation decoder "
                "gives a head its hidden states alone"
            )
        wired = {"d_embed": self.d_model}
        if tie_output:
            wired["tied_weight"] = self.tgt_embedding.weight
        if "dropout_time_dim" in inspect.signature(HEADS[name]).parameters:
            wired["dropout_time_dim"] = 1  # batch-first (B, T, d): one mask per sentence
        clash = sorted(set(knobs) & set(wired))
        if clash:
            raise ValueError(f"head knob(s) {', '.join(clash)} are set by the model, not by hand")
        return build_head(name, d_in=self.d_model, vocab_size=self.tgt_vocab_size, **knobs, **wired)

    # ---- encoder --------------------------------------------------------------------------

    def encode(self, src: torch.Tensor) -> Memory:
        """src ``(B, S)`` right-padded with ``pad_id`` -> :class:`Memory` ``(B, S, d)``."""
        _check_ids("src", src)
        padding = src == self.pad_id  # (B, S)
        empty = (~padding).sum(1) == 0
        if bool(empty.any()):
            rows = empty.nonzero().flatten().tolist()
            raise ValueError(f"src rows {rows} are all padding; every source needs a token")
        positions = torch.arange(src.shape[1], device=src.device)
        x = self.src_inputs(self.src_embedding(src), positions)  # (B, S, d)
        states, _ = self.encoder(x, positions=positions, key_padding=padding)
        return Memory(states, padding)

    # ---- decoder --------------------------------------------------------------------------

    def start_decoding(self, memory: Memory) -> DecoderState:
        """The decoder state before the first target token: cross-attention keys/values of
        ``memory`` for every layer, an empty self-attention cache."""
        memory_kv = [
            block.cross_attention.memory_kv(memory.states) for block in self.decoder.blocks
        ]
        return DecoderState(memory_kv, memory.padding, KVCache())

    def decode_step(
        self, tgt: torch.Tensor, state: DecoderState
    ) -> tuple[torch.Tensor, DecoderState]:
        """Feed target tokens ``(B, T)`` at positions ``state.length ..``: hidden ``(B, T, d)``
        for the head, and the state with their keys/values cached."""
        _check_ids("tgt", tgt)
        start = state.length
        positions = torch.arange(start, start + tgt.shape[1], device=tgt.device)  # (T,)
        x = self.tgt_inputs(self.tgt_embedding(tgt), positions)  # (B, T, d)
        hidden, kv = self.decoder(
            x,
            positions=positions,
            past=state.cache.layers,
            memory_kv=state.memory_kv,
            memory_padding=state.memory_padding,
        )
        return hidden, DecoderState(state.memory_kv, state.memory_padding, KVCache(kv))

    def decode(self, tgt_in: torch.Tensor, memory: Memory) -> torch.Tensor:
        """Teacher forcing: hidden ``(B, T, d)`` for ``tgt_in (B, T)`` in one causal pass."""
        hidden, _ = self.decode_step(tgt_in, self.start_decoding(memory))
        return hidden

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        """Decoder hidden states ``(B, T, d)``: the head's input for predicting ``tgt_out``."""
        return self.decode(tgt_in, self.encode(src))

    def loss(
        self,
        src: torch.Tensor,
        tgt_in: torch.Tensor,
        tgt_out: torch.Tensor,
        *,
        label_smoothing: float = 0.0,
        reduction: str = "mean",
        chunk_size: int | None | str = "auto",
    ) -> torch.Tensor:
        """The head's (label-smoothed) loss of ``tgt_out (B, T)`` (``tgt_in`` shifted left,
        padded with ``pad_id``), padded positions ignored; "mean" is per real target token."""
        if tuple(tgt_out.shape) != tuple(tgt_in.shape):
            raise ValueError(
                f"tgt_out has shape {tuple(tgt_out.shape)}; expected tgt_in's {tuple(tgt_in.shape)}"
            )
        return self.head.loss(
            self(src, tgt_in),
            tgt_out,
            reduction=reduction,
            chunk_size=chunk_size,
            ignore_index=self.pad_id,
            label_smoothing=label_smoothing,
        )


def _embeddings(
    src_vocab_size: int, tgt_vocab_size: int, d_model: int, share: bool
) -> tuple[nn.Embedding, nn.Embedding]:
    """Source and target embeddings, N(0, d^-1/2) so that sqrt(d) E has unit scale."""
    if share and src_vocab_size != tgt_vocab_size:
        raise ValueError(
            f"share_embeddings needs one joint vocabulary; got src_vocab_size={src_vocab_size}, "
            f"tgt_vocab_size={tgt_vocab_size}"
        )
    src = nn.Embedding(src_vocab_size, d_model)
    nn.init.normal_(src.weight, std=d_model**-0.5)
    if share:
        return src, src
    tgt = nn.Embedding(tgt_vocab_size, d_model)
    nn.init.normal_(tgt.weight, std=d_model**-0.5)
    return src, tgt


def _check_pad_id(pad_id: object, src_vocab_size: int, tgt_vocab_size: int) -> int:
    limit = min(src_vocab_size, tgt_vocab_size)
    if not isinstance(pad_id, int) or isinstance(pad_id, bool) or not 0 <= pad_id < limit:
        raise ValueError(f"pad_id must be an id in both vocabularies, [0, {limit}); got {pad_id!r}")
    return pad_id


def _check_ids(name: str, ids: torch.Tensor) -> None:
    if ids.dim() != 2:
        raise ValueError(f"{name} has shape {tuple(ids.shape)}; expected batch-first (B, T)")
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must hold integer ids; got dtype {ids.dtype}")
    if ids.shape[1] == 0:
        raise ValueError(f"{name} is empty along time (T = 0)")
