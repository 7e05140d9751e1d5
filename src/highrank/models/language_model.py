"""LanguageModel = embedding + backbone + head: the composition, and the weight tying.

The backbone (AWD-LSTM, or the decoder-only Transformer of ``backbones/transformer.py``) owns
the input embedding and produces time-major hidden states ``(T, B, d_last)``; the head turns
them into a normalised next-token distribution and owns the loss. Tying passes the embedding's
Parameter to the head explicitly, so the two share one tensor. Heads with internal dropout get
``dropout_time_dim=0`` so that it is *locked* over time (one mask per window and column) as in
the AWD-LSTM and MoS code, for either backbone.

A head that reads more than the hidden states (``OutputHead.reads``: MFS, CPR) gets them here,
``time_dim=0`` wired: ``layers``, the last ``head.input_layers`` layers (the Transformer's
block outputs; AWD-LSTM gives its last layer only, its layers having different widths, and
refuses more), and ``context_ids``, the window's input tokens. Their context is the window
(the segment of a BPTT step, a Transformer's window): AWD-LSTM's carried state does not carry
it, and the Transformer's incremental decoding with a cache is refused for them.

:func:`build_model` builds the model a config describes (dispatching on ``model.backbone``),
:func:`build_seq2seq` the translation model; :mod:`highrank.models.load` the model of a
trained run directory.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from highrank.config import Config
from highrank.heads import HEADS, OutputHead, build_head
from highrank.models.backbones.awd_lstm import AWDLSTM, AWDLSTMExtras, AWDLSTMState
from highrank.models.backbones.transformer import CausalTransformer, KVCache
from highrank.models.seq2seq import TransformerSeq2Seq


class LanguageModel(nn.Module):
    """``log p(x_{t+1} | x_{<=t})`` from a backbone and an output head."""

    def __init__(self, backbone: AWDLSTM, head: OutputHead) -> None:
        super().__init__()
        if head.d_in != backbone.d_last:
            raise ValueError(
                f"head reads d_in={head.d_in} but the backbone outputs d_last={backbone.d_last}"
            )
        check_layers_read(backbone, head)
        self.backbone = backbone
        self.head = head

    def forward(
        self,
        tokens: torch.Tensor,
        target: torch.Tensor,
        state: AWDLSTMState | None = None,
        *,
        chunk_size: int | None | str = "auto",
        reduction: str = "mean",
    ) -> tuple[torch.Tensor, AWDLSTMState, AWDLSTMExtras]:
        """NLL of ``target (T, B)`` given ``tokens (T, B)`` (mean, or ``reduction``), the new
        state, and the backbone extras (for AR/TAR: ``backbone.regularization_loss(extras)``)."""
        hidden, state, extras, inputs = self.body(tokens, state)
        loss = self.head.loss(hidden, target, chunk_size=chunk_size, reduction=reduction, **inputs)
        return loss, state, extras

    def nll(
        self, tokens: torch.Tensor, target: torch.Tensor, state: AWDLSTMState | None = None
    ) -> tuple[torch.Tensor, AWDLSTMState]:
        """Per-token NLL ``(T, B)`` and the new state (for evaluation)."""
        hidden, state, _, inputs = self.body(tokens, state)
        return self.head.loss(hidden, target, reduction="none", **inputs), state

    def log_prob(
        self, tokens: torch.Tensor, state: AWDLSTMState | None = None
    ) -> tuple[torch.Tensor, AWDLSTMState]:
        """Next-token log-probabilities ``(T, B, V)`` and the new state."""
        hidden, state, _, inputs = self.body(tokens, state)
        return self.head.log_prob(hidden, **inputs), state

    def body(self, tokens: torch.Tensor, state=None) -> tuple[torch.Tensor, Any, Any, dict]:
        """The backbone on ``tokens (T, B)``: hidden ``(T, B, d_last)``, the new state, the
        extras, and what else the head reads (``head.reads``: layers, context ids)."""
        reads = self.head.reads
        if reads == ("hidden",):
            return (*self.backbone(tokens, state), {})
        if isinstance(state, KVCache):
            raise ValueError(
                f"{type(self.head).__name__} reads the context's tokens and states, which a "
                "key-value cache does not carry: score whole windows (state=None)"
            )
        wanted = self.head.input_layers if "layers" in reads else 0
        if wanted > 1:
            hidden, state, extras = self.backbone(tokens, state, layers=wanted)
            layers = extras.layers
        else:
            hidden, state, extras = self.backbone(tokens, state)
            layers = (hidden,)
        inputs: dict = {"layers": layers} if "layers" in reads else {}
        if "context_ids" in reads:
            inputs["context_ids"] = tokens
        return hidden, state, extras, inputs

    def init_state(self, batch_size: int) -> AWDLSTMState:
        return self.backbone.init_state(batch_size)

    def parameter_groups(self, lr: float) -> list[dict]:
        """Optimizer groups: the head's (which may carry their own lr, e.g. PLIF's slopes)
        and the backbone's, each Parameter once (a tied embedding is shared by both)."""
        groups = self.head.parameter_groups(lr)
        seen = {id(p) for group in groups for p in group["params"]}
        rest = [p for p in self.backbone.parameters() if p.requires_grad and id(p) not in seen]
        groups[0] = {**groups[0], "params": list(groups[0]["params"]) + rest}
        return groups


def check_layers_read(backbone: nn.Module, head: OutputHead) -> None:
    """A head that reads several layers needs a backbone that gives them (one clear error)."""
    wanted = head.input_layers if "layers" in head.reads else 0
    if wanted > 1 and isinstance(backbone, AWDLSTM):
        widths = ", ".join(map(str, backbone.layer_sizes))
        raise ValueError(
            f"{type(head).__name__} reads the last {wanted} layers, but AWD-LSTM gives a head "
            f"its last layer only (its layers differ in width: {widths}); set "
            "head.input_layers = 1 (or head.multi_input = false)"
        )


def _awd_lstm(config: Config, vocab_size: int) -> AWDLSTM:
    m = config.model
    return AWDLSTM(
        vocab_size,
        d_embed=m.d_embed,
        d_hidden=m.d_hidden,
        n_layers=m.n_layers,
        d_last=m.d_last,
        d_project=m.d_project,
        dropout_embedding=m.dropout_embedding,
        dropout_input=m.dropout_input,
        dropout_hidden=m.dropout_hidden,
        dropout_output=m.dropout_output,
        weight_drop=m.weight_drop,
        ar_alpha=m.ar_alpha,
        tar_beta=m.tar_beta,
    )


def _transformer(config: Config, vocab_size: int) -> CausalTransformer:
    m = config.model
    return CausalTransformer(
        vocab_size,
        d_model=m.d_embed,
        n_layers=m.n_layers,
        n_heads=m.n_heads,
        d_ff=m.d_ff,
        positions=m.positions,
        max_len=m.max_len,
        dropout_input=m.dropout_input,
        dropout_attention=m.dropout_attention,
        dropout_residual=m.dropout_residual,
    )


def build_seq2seq(config: Config, vocab_size: int | tuple[int, int]) -> TransformerSeq2Seq:
    """The translation model of a ``seq2seq`` config: an encoder-decoder Transformer whose
    decoder ends in the head of ``[head]``. ``vocab_size``: the joint vocabulary's size, or
    ``(source, target)`` sizes; padding is the subword vocabularies' ``<pad>`` id."""
    from highrank.mt.subwords import PAD_ID  # translation modules load on use (test_bitext)

    src_size, tgt_size = (vocab_size, vocab_size) if isinstance(vocab_size, int) else vocab_size
    m = config.model
    return TransformerSeq2Seq(
        src_size,
        tgt_size,
        pad_id=PAD_ID,
        head=config.head.name,
        head_knobs=config.head.knobs,
        d_model=m.d_embed,
        n_heads=m.n_heads,
        d_ff=m.d_ff if m.d_ff is not None else 4 * m.d_embed,
        n_encoder_layers=m.n_encoder_layers,
        n_decoder_layers=m.n_decoder_layers,
        positions=m.positions,
        max_len=m.max_len,
        dropout_input=m.dropout_input,
        dropout_attention=m.dropout_attention,
        dropout_residual=m.dropout_residual,
        share_embeddings=m.share_embeddings,
        tie_output=m.tie_weights,
    )


def _language_model(
    build_backbone: Callable[[Config, int], nn.Module], config: Config, vocab_size: int
) -> LanguageModel:
    """The backbone ``build_backbone`` makes and the head of ``[head]``. A backbone owns the
    input embedding (``.embedding``, the tied weight) and outputs ``.d_last`` features."""
    m = config.model
    backbone = build_backbone(config, vocab_size)
    # the decoder's width: the input embedding's, unless an untied head reads a projected
    # output (model.d_project): then the output width, so that it alone varies (the map)
    untied_projection = getattr(m, "d_project", None) is not None and not m.tie_weights
    wired: dict = {"d_embed": m.d_project if untied_projection else m.d_embed}
    if m.tie_weights:
        wired["tied_weight"] = backbone.embedding.weight
    parameters = inspect.signature(HEADS[config.head.name]).parameters
    if "dropout_time_dim" in parameters:
        wired["dropout_time_dim"] = 0  # time-major (T, B, d): locked dropout as in MoS
    if "time_dim" in parameters:
        wired["time_dim"] = 0  # time-major (T, B, d): the sequences of heads that read them
    head = build_head(
        config.head.name, d_in=backbone.d_last, vocab_size=vocab_size, **config.head.knobs, **wired
    )
    return LanguageModel(backbone, head)


# model.backbone (the model family) -> the function that builds its model from a config and
# the vocabulary size: a language model of a backbone and a head, or the translation model.
MODEL_BUILDERS: dict[str, Callable[[Config, Any], nn.Module]] = {
    "awd-lstm": functools.partial(_language_model, _awd_lstm),
    "seq2seq": build_seq2seq,
    "transformer": functools.partial(_language_model, _transformer),
}


def build_model(config: Config, vocab_size: int) -> LanguageModel:
    """The model a config describes, for a vocabulary of ``vocab_size`` tokens: that of
    ``model.backbone`` in :data:`MODEL_BUILDERS`, the backbone and the head of ``[head]``;
    for ``seq2seq`` the translation model of :func:`build_seq2seq`."""
    return MODEL_BUILDERS[config.model.backbone](config, vocab_size)


def count_parameters(model: nn.Module) -> int:
    """Trainable parameters, each shared tensor counted once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
