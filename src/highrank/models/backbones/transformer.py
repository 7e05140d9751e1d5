"""Transformer blocks (Vaswani et al., "Attention Is All You Need", NeurIPS 2017) in the
pre-LayerNorm arrangement (Xiong et al., "On Layer Normalization in the Transformer
Architecture", ICML 2020; GPT-2), and a causal decoder-only Transformer language model built
from them. ``models/seq2seq.py`` builds its encoder and decoder from the same blocks.

One block (``d`` = d_model, ``LN`` = LayerNorm, dropouts as in Vaswani et al. Sec. 5.4)::

    x = x + dropout_residual(SelfAttention(LN(x)))         causal in a decoder, masked padding
    x = x + dropout_residual(CrossAttention(LN(x), memory)) seq2seq decoder blocks only
    x = x + dropout_residual(W_2 GELU(W_1 LN(x) + b_1) + b_2)

and a stack of blocks ends in a final LN (pre-LN needs it: the residual stream is never
normalised otherwise). Inputs are ``dropout_input(sqrt(d) E[token] + P[position])``
(Sec. 3.4, 3.5). Positions are a knob:

* ``"learned"``: a table of ``max_len`` vectors (GPT-2; fairseq's learned positions);
* ``"sinusoidal"``: ``P[pos, 2i] = sin(pos / 10000^(2i/d))``, ``P[pos, 2i+1] = cos(...)``
  (Vaswani Sec. 3.5), no length limit;
* ``"rotary"``: nothing is added; queries and keys of every head are rotated by their
  position instead (RoPE, Su et al., "RoFormer", 2021, eq. 34), so attention scores depend
  on relative positions only.

Attention is ``F.scaled_dot_product_attention``: ``is_causal=True`` for a full causal
sequence, an explicit boolean mask when keys were cached (the queries then sit at the end of
the key sequence, which ``is_causal`` would not know) or when keys are padding.

Layout: blocks are batch-first, ``(B, T, d)``, as attention wants ``(B, H, T, d_head)``.
:class:`CausalTransformer` keeps the backbone contract of ``backbones/awd_lstm.py``:
time-major tokens ``(T, B)`` in, hidden states ``(T, B, d)`` out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from highrank.util.checks import check_positive_int, check_probability

POSITIONS = ("learned", "sinusoidal", "rotary")
ROTARY_BASE = 10000.0  # RoFormer's theta_i = 10000^(-2i/d)

KV = tuple[torch.Tensor, torch.Tensor]  # keys and values, each (B, H, S, d_head)


# ---- positions ----------------------------------------------------------------------------


def sinusoidal_positions(positions: torch.Tensor, d_model: int) -> torch.Tensor:
    """Vaswani et al. Sec. 3.5: ``P[pos, 2i] = sin(pos w_i)``, ``P[pos, 2i+1] = cos(pos w_i)``,
    ``w_i = 10000^(-2i/d)``. positions ``(T,)`` -> ``(T, d_model)`` float32."""
    freq = 10000.0 ** (-torch.arange(0, d_model, 2, device=positions.device) / d_model)  # (d/2,)
    angles = positions.float()[:, None] * freq  # (T, d/2)
    return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1)  # (T, d): 2i, 2i+1


def rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """RoPE (Su et al. 2021, eq. 34): rotate each pair ``(x_2i, x_2i+1)`` of the last axis by
    the angle ``pos * theta_i``, ``theta_i = 10000^(-2i/d_head)``, so that
    ``rotate(q, m) . rotate(k, n)`` depends on ``m - n`` only.

    x: ``(B, H, T, d_head)``, positions: ``(T,)`` -> same shape and dtype as x.
    """
    d_head = x.shape[-1]
    theta = ROTARY_BASE ** (-torch.arange(0, d_head, 2, device=x.device) / d_head)  # (d/2,)
    angles = positions.float()[:, None] * theta  # (T, d/2)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]  # (B, H, T, d/2)
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return rotated.flatten(-2)  # pairs back in place: (B, H, T, d_head)


class InputEmbedding(nn.Module):
    """``dropout(sqrt(d) * token_vectors + P[positions])`` (Vaswani Sec. 3.4, 3.5, 5.4).

    The token lookup stays with the owner (whose ``embedding`` a head may tie to); this adds
    the scale, the positions (nothing for rotary: they act inside attention) and the dropout.
    """

    def __init__(self, d_model: int, *, positions: str, max_len: int, dropout: float) -> None:
        super().__init__()
        if positions not in POSITIONS:
            raise ValueError(f"positions={positions!r}; expected one of {', '.join(POSITIONS)}")
        if positions != "learned" and d_model % 2:
            raise ValueError(f"{positions} positions need an even d_model; got {d_model}")
        self.kind = positions
        self.d_model = d_model
        self.max_len = check_positive_int("max_len", max_len)
        self.scale = math.sqrt(d_model)
        self.table = nn.Embedding(max_len, d_model) if positions == "learned" else None
        if self.table is not None:
            nn.init.normal_(self.table.weight, std=d_model**-0.5)
        self.dropout = nn.Dropout(check_probability("dropout_input", dropout))

    def forward(self, vectors: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """vectors ``(B, T, d)`` (looked-up tokens), positions ``(T,)`` -> ``(B, T, d)``."""
        x = vectors * self.scale
        if self.kind == "learned":
            last = int(positions[-1])
            if last >= self.max_len:
                raise ValueError(
                    f"position {last} is beyond max_len={self.max_len} of the learned position "
                    "table; use shorter sequences or a larger max_len"
                )
            x = x + self.table(positions)
        elif self.kind == "sinusoidal":
            x = x + sinusoidal_positions(positions, self.d_model).to(x.dtype)
        return self.dropout(x)


# ---- attention ----------------------------------------------------------------------------


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    key_padding: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Scaled dot-product attention, ``softmax(q k^T / sqrt(d_head)) v`` (Vaswani eq. 1).

    q: ``(B, H, T, d_head)``; k, v: ``(B, H, S, d_head)`` with S >= T. With ``causal``, the T
    queries are the *last* T of the S positions (earlier ones come from a cache), and query i
    sees keys ``j <= S - T + i``. key_padding: ``(B, S)``, True where a key is padding.
    """
    n_queries, n_keys = q.shape[-2], k.shape[-2]
    if causal and n_queries == n_keys and key_padding is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    mask = None  # (B | 1, 1, T, S), True where a query may attend
    if causal and n_queries > 1:
        mask = torch.ones(n_queries, n_keys, dtype=torch.bool, device=q.device)
        mask = mask.tril(diagonal=n_keys - n_queries)
    if key_padding is not None:
        keep = ~key_padding[:, None, None, :]  # (B, 1, 1, S)
        mask = keep if mask is None else mask & keep
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


class _Heads(nn.Module):
    """Splitting ``(B, T, d)`` into ``(B, H, T, d_head)`` and merging back; the output
    projection W^O (Vaswani Sec. 3.2.2)."""

    def __init__(self, d_model: int, n_heads: int, dropout_attention: float) -> None:
        super().__init__()
        check_positive_int("n_heads", n_heads)
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.d_head = d_model // n_heads
        self.dropout_attention = check_probability("dropout_attention", dropout_attention)
        self.out = nn.Linear(d_model, d_model)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, self.n_heads, self.d_head).transpose(1, 2)  # (B, H, T, dh)

    def merge(self, y: torch.Tensor) -> torch.Tensor:
        batch, _, length, _ = y.shape
        return self.out(y.transpose(1, 2).reshape(batch, length, -1))  # (B, T, d)

    def dropout_p(self) -> float:
        return self.dropout_attention if self.training else 0.0


class SelfAttention(_Heads):
    """Multi-head self-attention with an optional cache of past keys and values."""

    def __init__(
        self, d_model: int, n_heads: int, *, dropout_attention: float = 0.0, rotary: bool = False
    ) -> None:
        super().__init__(d_model, n_heads, dropout_attention)
        if rotary and self.d_head % 2:
            raise ValueError(f"rotary positions need an even d_head; got {self.d_head}")
        self.rotary = rotary
        self.qkv = nn.Linear(d_model, 3 * d_model)

    def forward(
        self,
        x: torch.Tensor,
        *,
        causal: bool,
        positions: torch.Tensor,
        key_padding: torch.Tensor | None = None,
        past: KV | None = None,
    ) -> tuple[torch.Tensor, KV]:
        """x ``(B, T, d)`` at ``positions (T,)``; past: the cached keys/values of the positions
        before them. Returns ``(B, T, d)`` and the keys/values of all positions so far."""
        q, k, v = (self.split(part) for part in self.qkv(x).chunk(3, dim=-1))  # (B, H, T, dh)
        if self.rotary:
            q, k = rotate(q, positions), rotate(k, positions)  # cached keys stay rotated
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)  # (B, H, S, dh)
        y = attend(q, k, v, causal=causal, key_padding=key_padding, dropout_p=self.dropout_p())
        return self.merge(y), (k, v)


class CrossAttention(_Heads):
    """Encoder-decoder attention (Vaswani Sec. 3.2.3): queries from the decoder, keys and
    values from the encoder output, projected once per sentence (:meth:`memory_kv`)."""

    def __init__(self, d_model: int, n_heads: int, *, dropout_attention: float = 0.0) -> None:
        super().__init__(d_model, n_heads, dropout_attention)
        self.q = nn.Linear(d_model, d_model)
        self.kv = nn.Linear(d_model, 2 * d_model)

    def memory_kv(self, memory: torch.Tensor) -> KV:
        """Keys and values of the encoder output ``(B, S, d)``: each ``(B, H, S, d_head)``."""
        k, v = self.kv(memory).chunk(2, dim=-1)
        return self.split(k), self.split(v)

    def forward(
        self, x: torch.Tensor, memory_kv: KV, memory_padding: torch.Tensor | None
    ) -> torch.Tensor:
        """x ``(B, T, d)``; memory_padding ``(B, S)`` True at padded source positions."""
        y = attend(
            self.split(self.q(x)),
            *memory_kv,
            causal=False,
            key_padding=memory_padding,
            dropout_p=self.dropout_p(),
        )
        return self.merge(y)


class FeedForward(nn.Module):
    """Position-wise ``W_2 GELU(W_1 x + b_1) + b_2`` (Vaswani eq. 2 with GELU, Hendrycks &
    Gimpel 2016, as GPT and BERT use it)."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.up = nn.Linear(d_model, check_positive_int("d_ff", d_ff))
        self.down = nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


# ---- blocks and stacks --------------------------------------------------------------------


@dataclass(frozen=True)
class BlockSizes:
    """What every block of a stack shares."""

    d_model: int
    n_heads: int
    d_ff: int
    dropout_attention: float = 0.0
    dropout_residual: float = 0.0
    rotary: bool = False


class TransformerBlock(nn.Module):
    """One pre-LN block: self-attention, optional cross-attention, feed-forward; each
    sub-layer ``x + dropout(sublayer(LN(x)))`` (see the module docstring)."""

    def __init__(self, sizes: BlockSizes, *, cross_attention: bool = False) -> None:
        super().__init__()
        d = sizes.d_model
        self.self_norm = nn.LayerNorm(d)
        self.self_attention = SelfAttention(
            d, sizes.n_heads, dropout_attention=sizes.dropout_attention, rotary=sizes.rotary
        )
        self.cross_norm = nn.LayerNorm(d) if cross_attention else None
        self.cross_attention = (
            CrossAttention(d, sizes.n_heads, dropout_attention=sizes.dropout_attention)
            if cross_attention
            else None
        )
        self.ff_norm = nn.LayerNorm(d)
        self.feed_forward = FeedForward(d, sizes.d_ff)
        self.dropout = nn.Dropout(check_probability("dropout_residual", sizes.dropout_residual))

    def forward(
        self,
        x: torch.Tensor,
        *,
        causal: bool,
        positions: torch.Tensor,
        key_padding: torch.Tensor | None = None,
        past: KV | None = None,
        memory_kv: KV | None = None,
        memory_padding: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, KV]:
        """x ``(B, T, d)`` -> ``(B, T, d)`` and this layer's self-attention keys/values."""
        normed = self.self_norm(x)
        attended, kv = self.self_attention(
            normed, causal=causal, positions=positions, key_padding=key_padding, past=past
        )
        x = x + self.dropout(attended)
        if self.cross_attention is not None:
            if memory_kv is None:
                raise ValueError("a block with cross-attention needs memory_kv (the encoder's)")
            attended = self.cross_attention(self.cross_norm(x), memory_kv, memory_padding)
            x = x + self.dropout(attended)
        x = x + self.dropout(self.feed_forward(self.ff_norm(x)))
        return x, kv


class TransformerStack(nn.Module):
    """``n_layers`` blocks and the final LayerNorm: an encoder (``causal=False``), a
    decoder-only LM (``causal=True``) or a seq2seq decoder (``causal=True,
    cross_attention=True``)."""

    def __init__(
        self, n_layers: int, sizes: BlockSizes, *, causal: bool, cross_attention: bool = False
    ) -> None:
        super().__init__()
        check_positive_int("n_layers", n_layers)
        self.causal = causal
        self.blocks = nn.ModuleList(
            TransformerBlock(sizes, cross_attention=cross_attention) for _ in range(n_layers)
        )
        self.final_norm = nn.LayerNorm(sizes.d_model)

    def forward(
        self,
        x: torch.Tensor,
        *,
        positions: torch.Tensor,
        key_padding: torch.Tensor | None = None,
        past: list[KV] | None = None,
        memory_kv: list[KV] | None = None,
        memory_padding: torch.Tensor | None = None,
        states: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, list[KV]]:
        """x ``(B, T, d)`` -> ``LN(x_L) (B, T, d)`` and every layer's keys/values so far.
        ``states``: a list to which the input x_0 and each block's output x_1 ... x_L are
        appended (what a head that reads several layers needs)."""
        new_kv: list[KV] = []
        if states is not None:
            states.append(x)
        for i, block in enumerate(self.blocks):
            x, kv = block(
                x,
                causal=self.causal,
                positions=positions,
                key_padding=key_padding,
                past=None if past is None else past[i],
                memory_kv=None if memory_kv is None else memory_kv[i],
                memory_padding=memory_padding,
            )
            new_kv.append(kv)
            if states is not None:
                states.append(x)
        return self.final_norm(x), new_kv


@dataclass
class KVCache:
    """The self-attention keys and values of every layer for the positions decoded so far.

    ``layers[i] = (k, v)``, each ``(B, H, S, d_head)``; empty (``layers=None``) before the
    first call. The next position is ``length``. Rotary keys are cached already rotated.
    """

    layers: list[KV] | None = None

    @property
    def length(self) -> int:
        return 0 if self.layers is None else self.layers[0][0].shape[2]

    def select(self, index: torch.Tensor) -> KVCache:
        """The cache of batch rows ``index`` (beam search: reorder and repeat hypotheses)."""
        if self.layers is None:
            return KVCache()
        return KVCache([(k[index], v[index]) for k, v in self.layers])

    def detach(self) -> KVCache:
        if self.layers is None:
            return KVCache()
        return KVCache([(k.detach(), v.detach()) for k, v in self.layers])


# ---- the decoder-only language model ------------------------------------------------------


@dataclass(frozen=True)
class LayerStates:
    """The extras of ``CausalTransformer.forward(..., layers=n)``: the last n layers' hidden
    states, each ``(T, B, d_model)``, top last (the top one is the returned hidden)."""

    layers: tuple[torch.Tensor, ...]


class CausalTransformer(nn.Module):
    """A causal decoder-only Transformer LM body (pre-LN; GPT-2 shape), behind the backbone
    contract of :class:`highrank.models.backbones.AWDLSTM`.

    ``forward(tokens (T, B), state) -> (hidden (T, B, d_model), state, None)``; the head reads
    ``hidden`` (``d_last = d_model``) and may tie its decoder to ``embedding.weight``.

    Windows. A Transformer carries no recurrent state: with ``state=None`` (what
    :meth:`init_state` returns) each call is one independent window and returns ``None``.
    Trained and evaluated as ``highrank`` lays out a corpus, the stream is cut into B
    contiguous columns read in consecutive, non-overlapping windows of ``bptt`` tokens, and
    the position t of a window sees exactly the tokens 0..t of *that window* (nothing of the
    window before): the first token of a window is predicted from one token of context, the
    last from ``bptt``. (Transformer-XL's recurrence and sliding-window evaluation, which give
    every prediction a long context, are not implemented; perplexities are for this protocol.)

    Layers. ``forward(..., layers=n)`` also returns the hidden states of the last n layers in
    ``extras`` (:class:`LayerStates`, time-major like ``hidden``): the outputs of blocks
    L - n + 1 ... L - 1 (the input embedding counting as layer 0, as transformers'
    ``hidden_states``) and, on top, ``hidden`` itself (the last block after the final LN), for
    heads that read several layers (``OutputHead.reads``: MFS, CPR).

    Incremental decoding. Given a :class:`KVCache` (``KVCache()`` to start), a call appends
    the keys and values of its tokens, whose positions continue from ``state.length``, and
    returns the longer cache; the outputs equal those of one call on the whole sequence.

    Args:
        vocab_size: V, rows of the token embedding.
        d_model: width of the residual stream, the embedding and the output.
        n_layers: number of blocks.
        n_heads: attention heads (d_model must be divisible by it).
        d_ff: inner size of the feed-forward layer; None: 4 d_model (Vaswani, GPT-2).
        positions: ``"learned"``, ``"sinusoidal"`` or ``"rotary"`` (module docstring).
        max_len: longest sequence (learned positions only: the table's rows).
        dropout_input: dropout on the input vectors, embeddings plus positions (the name of
            AWD-LSTM's ``dropouti``, dropout on its embedding output; here not locked).
        dropout_attention: dropout on attention weights.
        dropout_residual: dropout on every sub-layer's output before the residual sum.
    """

    def __init__(
        self,
        vocab_size: int,
        *,
        d_model: int = 256,
        n_layers: int = 4,
        n_heads: int = 4,
        d_ff: int | None = None,
        positions: str = "learned",
        max_len: int = 512,
        dropout_input: float = 0.1,
        dropout_attention: float = 0.1,
        dropout_residual: float = 0.1,
    ) -> None:
        super().__init__()
        self.vocab_size = check_positive_int("vocab_size", vocab_size)
        self.d_model = check_positive_int("d_model", d_model)
        self.d_embed = self.d_last = d_model  # the backbone contract's names
        self.embedding = nn.Embedding(vocab_size, d_model)
        nn.init.normal_(self.embedding.weight, std=d_model**-0.5)  # unit scale after sqrt(d)
        self.inputs = InputEmbedding(
            d_model, positions=positions, max_len=max_len, dropout=dropout_input
        )
        sizes = BlockSizes(
            d_model=d_model,
            n_heads=n_heads,
            d_ff=4 * d_model if d_ff is None else d_ff,
            dropout_attention=dropout_attention,
            dropout_residual=dropout_residual,
            rotary=positions == "rotary",
        )
        self.stack = TransformerStack(n_layers, sizes, causal=True)

    @property
    def n_layers(self) -> int:
        return len(self.stack.blocks)

    def forward(
        self, tokens: torch.Tensor, state: KVCache | None = None, *, layers: int = 0
    ) -> tuple[torch.Tensor, KVCache | None, LayerStates | None]:
        """tokens ``(T, B)`` -> hidden ``(T, B, d_model)``, the new state, and no extras (or
        with ``layers=n`` the last n layers' states, class docstring)."""
        _check_tokens(tokens)
        if not 0 <= layers <= self.n_layers + 1:
            raise ValueError(
                f"a head reads the last {layers} layers but this Transformer has "
                f"{self.n_layers} blocks (and the embedding): at most {self.n_layers + 1}"
            )
        if state is not None and not isinstance(state, KVCache):
            raise TypeError(f"CausalTransformer: state must be None or a KVCache; got {state!r}")
        start = 0 if state is None else state.length
        positions = torch.arange(start, start + tokens.shape[0], device=tokens.device)  # (T,)
        x = self.inputs(self.embedding(tokens.t()), positions)  # (B, T, d)
        past = None if state is None else state.layers
        states: list[torch.Tensor] | None = [] if layers else None
        hidden, kv = self.stack(x, positions=positions, past=past, states=states)  # (B, T, d)
        new_state = None if state is None else KVCache(kv)
        extras = None
        if states is not None:  # the last blocks' outputs, the top one after the final LN
            kept = [*states[len(states) - layers : -1], hidden]
            extras = LayerStates(tuple(layer.transpose(0, 1) for layer in kept))
        return hidden.transpose(0, 1), new_state, extras  # (T, B, d)

    def init_state(self, batch_size: int) -> None:
        """None: every window starts afresh (see the class docstring)."""
        check_positive_int("batch_size", batch_size)
        return None

    @staticmethod
    def detach_state(state: KVCache | None) -> KVCache | None:
        return None if state is None else state.detach()

    def regularization_loss(self, extras: LayerStates | None) -> torch.Tensor:
        """Zero: this backbone adds no activation regularisation (AWD-LSTM's AR/TAR)."""
        return self.embedding.weight.new_zeros(())

    def extra_repr(self) -> str:
        return (
            f"vocab_size={self.vocab_size}, d_model={self.d_model}, n_layers={self.n_layers}, "
            f"positions={self.inputs.kind!r}"
        )


def _check_tokens(tokens: torch.Tensor) -> None:
    if tokens.dim() != 2:
        raise ValueError(
            f"CausalTransformer: tokens has shape {tuple(tokens.shape)}; expected time-major (T, B)"
        )
    if tokens.dtype not in (torch.int64, torch.int32):
        raise TypeError(
            f"CausalTransformer: tokens must hold integer ids; got dtype {tokens.dtype}"
        )
    if tokens.shape[0] == 0:
        raise ValueError("CausalTransformer: tokens is empty along time (T = 0)")
