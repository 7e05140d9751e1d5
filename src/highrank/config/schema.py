"""The config schema: one dataclass per TOML section (every key's type and default), and the
error every config problem raises.

Which family reads which key, the keys' ranges and the families' cross-checks are declared by
the families themselves (:mod:`highrank.config.families`). Growing a family: its module there,
one line in :data:`~highrank.config.families.FAMILIES`, and its new keys here (with defaults).
Reading and checking a config: :mod:`highrank.config.loader`; writing one:
:mod:`highrank.config.toml_writer`.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Any

from highrank.config.families import FAMILIES
from highrank.config.families.awd_lstm import SWITCH_POLICIES
from highrank.config.keys import ConfigError

BACKBONES = tuple(FAMILIES)  # model.backbone: the model families
# Head constructor arguments that the model sets from [model], not the user from [head].
MODEL_SET_KNOBS = ("d_embed", "tied_weight", "dropout_time_dim", "time_dim")


# ---- schema ---------------------------------------------------------------------------------


@dataclass
class DataConfig:
    """The corpus: a directory with train.txt, valid.txt, test.txt (see :mod:`highrank.data`).

    Attributes:
        dir: corpus directory.
        mode: ``"word"`` (whitespace tokens) or ``"char"`` (characters).
        cache_dir: where token-id caches go; None (unset): the user cache (~/.cache/highrank).
        src_lang, tgt_lang: (``seq2seq``) the file suffixes of the two sides of a parallel
            corpus, ``{train,valid,test}.<lang>`` (:mod:`highrank.mt.bitext`).
        subword_type: (``seq2seq``) SentencePiece ``"bpe"`` or ``"unigram"``, learned on the
            train split only (:mod:`highrank.mt.subwords`).
        subword_vocab_size: (``seq2seq``) pieces per vocabulary, the four specials included.
        subword_joint: (``seq2seq``) one vocabulary for both languages.
        memmap: (``awd-lstm``, ``transformer``) read the corpus through
            :func:`highrank.data.streaming.load_stream_corpus`: vocabulary in one streaming pass,
            token ids in a memory-mapped cache file, a split may be a folder of shards
            (``train/``), for corpora that do not fit in memory. Same ids and batches as the
            in-memory loader (false).
        max_vocab: (``awd-lstm``, ``transformer``; needs memmap) keep ``<eos>`` and the
            most frequent other tokens, max_vocab in all with ``<unk>``, which the rest map to
            (the 1B-Word recipe's 100K); None (unset): every train token.
        batching: (``awd-lstm``, ``transformer``) ``"stream"``: the training text in order,
            as B contiguous columns; ``"sentences"`` (needs memmap): the training sentences
            (lines) shuffled before each epoch by a generator seeded with (train.seed,
            epoch), then packed into that stream (the 1B-Word recipe).
    """

    dir: str = "data/ptb"
    mode: str = "word"
    cache_dir: str | None = None
    src_lang: str = "en"
    tgt_lang: str = "de"
    subword_type: str = "bpe"
    subword_vocab_size: int = 8000
    subword_joint: bool = True
    memmap: bool = False
    max_vocab: int | None = None
    batching: str = "stream"


@dataclass
class ModelConfig:
    """The AWD-LSTM backbone (Merity et al., 2018; PTB values; WT2: dropout_input 0.65,
    dropout_hidden 0.2; MoS PTB: d_embed 280, d_hidden 960, d_last 620, dropout_hidden 0.225).

    Attributes:
        backbone: the model family, ``"awd-lstm"`` (see :data:`highrank.config.families.FAMILIES`).
        d_embed: embedding size (the tied decoder's size).
        d_hidden: hidden size of the inner LSTM layers.
        n_layers: number of stacked single-layer LSTMs.
        d_last: output size of the last LSTM; None (unset): d_embed.
        d_project: a linear projection of the last LSTM's output to this width, then the
            output width the head reads; None (unset): no projection.
        tie_weights: share the embedding matrix with the head's decoder.
        dropout_embedding: ``dropoute``, whole embedding rows dropped.
        dropout_input: ``dropouti``, locked dropout on the embeddings.
        dropout_hidden: ``dropouth``, locked dropout between LSTM layers.
        dropout_output: ``dropout``, locked dropout on the last layer's output.
        weight_drop: ``wdrop``, DropConnect on the hidden-to-hidden matrices.
        ar_alpha: activation regularisation weight (alpha).
        tar_beta: temporal activation regularisation weight (beta).

    The ``seq2seq`` family (Vaswani et al. 2017; defaults: their base model; d_model is
    d_embed, and tie_weights ties the head's decoder to the target embedding):

    Attributes:
        n_encoder_layers, n_decoder_layers: Transformer blocks in each stack.
        n_heads: attention heads (d_embed must be a multiple).
        d_ff: feed-forward width; None (unset): 4 d_embed.
        positions: ``"sinusoidal"``, ``"learned"`` or ``"rotary"``.
        max_len: longest sentence in tokens (the learned position table; longer training
            pairs are dropped).
        dropout_input: (``seq2seq``) dropout on the scaled embeddings plus positions, as
            ``dropouti`` is on the AWD-LSTM's embedding output.
        dropout_attention: dropout on the attention weights.
        dropout_residual: dropout on each block's output before the residual sum.
        share_embeddings: one embedding matrix for source and target (needs
            data.subword_joint).

    The ``transformer`` family (:class:`highrank.models.backbones.transformer.CausalTransformer`,
    a decoder-only LM; d_model is d_embed, tie_weights ties the head's decoder to the
    token embedding) reads n_layers (blocks), n_heads, d_ff, positions, max_len (the
    learned position table: at least train.bptt), dropout_input, dropout_attention and
    dropout_residual as above.
    """

    backbone: str = "awd-lstm"
    d_embed: int = 400
    d_hidden: int = 1150
    n_layers: int = 3
    d_last: int | None = None
    d_project: int | None = None
    tie_weights: bool = True
    dropout_embedding: float = 0.1
    dropout_input: float = 0.4
    dropout_hidden: float = 0.25
    dropout_output: float = 0.4
    weight_drop: float = 0.5
    ar_alpha: float = 2.0
    tar_beta: float = 1.0
    n_encoder_layers: int = 6
    n_decoder_layers: int = 6
    n_heads: int = 8
    d_ff: int | None = None
    positions: str = "sinusoidal"
    max_len: int = 256
    dropout_attention: float = 0.0
    dropout_residual: float = 0.1
    share_embeddings: bool = True


@dataclass
class HeadConfig:
    """The output head: ``name`` in :data:`highrank.heads.HEADS` and its keyword knobs.

    In TOML the knobs sit beside the name: ``[head]`` ``name = "mos"`` ``n_components = 15``.
    ``build_head(name, d_in=..., vocab_size=..., **knobs, <model-set knobs>)`` builds it.
    """

    name: str = "softmax"
    knobs: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainConfig:
    """Training (Merity et al., 2018, PTB; MoS PTB: batch_size 12, lr 20, epochs 1000).

    Attributes:
        batch_size: training batch size B.
        bptt: base sequence length of variable BPTT.
        max_seq_len_delta: a sampled sequence length is capped at bptt + this (MoS: 40 PTB,
            20 WT2).
        lr: SGD learning rate (scaled per step by seq_len / bptt).
        weight_decay: L2 weight decay on all parameters.
        clip: gradient-norm clip; 0: no clipping.
        epochs: maximum number of epochs.
        optimizer: SGD -> ASGD policy, ``"nt-asgd"``, ``"et-asgd"`` or ``"sgd"``.
        nonmono: n of the non-monotone trigger (also the finetune stop rule).
        switch_epoch: the epoch after which ``et-asgd`` switches (rank study: 200).
        latest_switch_epoch: ``nt-asgd`` switches after this epoch at the latest if its
            non-monotone rule has not fired by then (a run bounded by train.epochs then
            averages for the epochs after it); None (unset): the rule alone.
        seed: random seed.
        eval_batch_size: validation batch size.
        test_batch_size: test batch size.
        log_every: log every this many training steps.
        checkpoint_every: save checkpoints/last.pt every this many training steps (it is
            also saved at every epoch end and when a run stops at its step limit or on SIGINT /
            SIGTERM); changes nothing that is computed, so a resumed run may change it.
        checkpoint_minutes: also save last.pt once this many minutes of wall time have passed
            since the last save (checked after each step); 0: by steps only. Like
            checkpoint_every it changes nothing computed.
        chunk_size: tokens per chunk of the head loss; None (unset): "auto", chunks of about
            2**21 logits (see OutputHead.loss).
        max_nonfinite_skips: steps with a non-finite loss or gradient that may be skipped
            before the run stops with an error.
        patience: stop the stage when this many epoch-end validations in a row did not lower
            the best validation loss by more than patience_min_delta (early stopping; it
            applies to finetuning too), counted within the optimizer's phase (a switch to
            averaged SGD starts the count again); None (unset): run to train.epochs.
        patience_min_delta: the improvement in nats per token that counts for patience.

    The ``seq2seq`` family (:mod:`highrank.train.seq2seq`; lr is the peak learning rate):

    Attributes:
        max_tokens: a batch holds at most this many padded tokens on its longer side
            (fairseq ``--max-tokens``).
        label_smoothing: epsilon of the label-smoothed loss (Szegedy et al. 2016).
        warmup_steps: updates of linear warm-up from 0 to lr.
        lr_schedule: after the warm-up, ``"inverse-sqrt"`` (lr sqrt(warmup / step), Vaswani
            et al. 2017 eq. 3) or ``"cosine"`` (to 0 at the last update of train.epochs).
        adam_beta2: AdamW's beta2 (beta1 0.9, epsilon 1e-9: Vaswani et al. 2017).
        eval_every: updates between validations besides every epoch end; None (unset): at
            epoch ends only.

    The ``transformer`` family (:mod:`highrank.train.transformer`; lr is the peak learning
    rate, bptt the window length) reads warmup_steps, lr_schedule, adam_beta2 and
    eval_every as above (AdamW epsilon 1e-8), and:

    Attributes:
        accumulate: windows (micro-batches of batch_size x bptt tokens) per update.
        bf16: run the forward passes of training under bfloat16 autocast (weights,
            gradients and optimizer state stay float32; validation is float32).
    """

    batch_size: int = 20
    bptt: int = 70
    max_seq_len_delta: int = 40
    lr: float = 30.0
    weight_decay: float = 1.2e-6
    clip: float = 0.25
    epochs: int = 500
    optimizer: str = "nt-asgd"
    nonmono: int = 5
    switch_epoch: int = 200
    latest_switch_epoch: int | None = None
    seed: int = 141
    eval_batch_size: int = 10
    test_batch_size: int = 1
    log_every: int = 200
    checkpoint_every: int = 1000
    checkpoint_minutes: float = 10.0
    chunk_size: int | None = None
    max_nonfinite_skips: int = 10
    patience: int | None = None
    patience_min_delta: float = 0.0
    max_tokens: int = 4096
    label_smoothing: float = 0.1
    warmup_steps: int = 4000
    lr_schedule: str = "inverse-sqrt"
    adam_beta2: float = 0.98
    eval_every: int | None = None
    accumulate: int = 1
    bf16: bool = False


@dataclass
class FinetuneConfig:
    """Finetuning: averaged SGD restarted from the best checkpoint, stopped by the
    non-monotone rule (AWD-LSTM: lr 30; MoS: lr 25 PTB / 20 WT2).

    Attributes:
        lr: learning rate.
        epochs: maximum number of epochs; 0: no finetuning.
        max_seq_len_delta: a sampled window is capped at train.bptt + this while finetuning:
            10 as salesforce/awd-lstm-lm ``finetune.py``; the MoS ``finetune.py`` caps at
            bptt + its max_seq_len_delta instead (40), so MoS recipes set 40 to follow it.
    """

    lr: float = 30.0
    epochs: int = 500
    max_seq_len_delta: int = 10


@dataclass
class DynamicEvalConfig:
    """Dynamic evaluation (Krause et al., 2017, as shipped with MoS; PTB values; WT2:
    epsilon 0.002, prior_decay 0.02).

    Attributes:
        lr: eta, the adaptation step size.
        epsilon: added to the RMS gradient statistic.
        prior_decay: lambda, the decay rate towards the trained parameters.
        batch_size: evaluation batch size.
        bptt: segment length: score a segment, then adapt.
        stats_batch_size: batch size for the gradient statistics on the training set.
    """

    lr: float = 0.002
    epsilon: float = 0.001
    prior_decay: float = 0.075
    batch_size: int = 1
    bptt: int = 5
    stats_batch_size: int = 100


@dataclass
class DecodeConfig:
    """Decoding a translation model (``seq2seq``; :mod:`highrank.models.decoding`).

    Attributes:
        beam_size: hypotheses kept per sentence; 1 is greedy search's output.
        length_penalty: alpha of GNMT's ((5 + |y|) / 6) ** alpha (Wu et al. 2016); 0: none.
        max_len_a, max_len_b: at most ``a * (longest source of the batch) + b`` tokens are
            generated (fairseq ``--max-len-a/b``), and never beyond model.max_len.
    """

    beam_size: int = 5
    length_penalty: float = 1.0
    max_len_a: float = 1.5
    max_len_b: int = 10


@dataclass
class RunConfig:
    """Where and on what a run happens.

    Attributes:
        out_dir: run directory (checkpoints, logs, the resolved config).
        device: ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"mps"``.
    """

    out_dir: str = "runs/default"
    device: str = "auto"


@dataclass
class Config:
    """A whole experiment; each field is one TOML table."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    dynamic_eval: DynamicEvalConfig = field(default_factory=DynamicEvalConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    run: RunConfig = field(default_factory=RunConfig)


# Section name -> its dataclass, in file order.
SECTIONS: dict[str, type] = typing.get_type_hints(Config)


def section_fields(section: str) -> dict[str, Any]:
    """Key -> type hint of a section (the head's keys are its name plus free knobs)."""
    hints = typing.get_type_hints(SECTIONS[section])
    return {"name": str} if section == "head" else hints


__all__ = [
    "BACKBONES",
    "MODEL_SET_KNOBS",
    "SECTIONS",
    "SWITCH_POLICIES",
    "Config",
    "ConfigError",
    "DataConfig",
    "DecodeConfig",
    "DynamicEvalConfig",
    "FinetuneConfig",
    "HeadConfig",
    "ModelConfig",
    "RunConfig",
    "TrainConfig",
    "section_fields",
]
