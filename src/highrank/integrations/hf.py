"""Any highrank head inside a Hugging Face ``transformers`` causal LM.

One call turns a GPT-2, Llama, SmolLM2, ... into the same model with a Mixture of Softmaxes,
Mixtape or any other head of ``highrank.heads.HEADS`` as its output layer, a model of its own
class (``HighrankForCausalLM``, ``model_type = "highrank"``) that trains with ``Trainer``,
saves with ``save_pretrained`` and reloads with plain ``AutoModelForCausalLM`` (safetensors,
no ``trust_remote_code``) once this module has been imported::

    import highrank.integrations.hf  # registers "highrank" with AutoConfig / AutoModelForCausalLM
    from highrank.integrations.hf import attach_head
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    base = AutoModelForCausalLM.from_pretrained("path/to/gpt2-or-llama")
    model = attach_head(base, "mixtape", gate_dim=64)      # decoder matrix taken from lm_head
    Trainer(model, TrainingArguments("out", report_to="none"), train_dataset=data).train()
    model.save_pretrained("mixtape-model")
    model = AutoModelForCausalLM.from_pretrained("mixtape-model")   # a HighrankForCausalLM
    tokens = model.generate(input_ids, max_new_tokens=20)           # greedy, sampling or beams

What ``attach_head(model, name, **knobs)`` builds and initialises:

* the **body** is the base model's ``base_model`` (e.g. ``LlamaModel``), reused as it is (not
  copied: the original model shares it, so copy the model first if you need both);
* the **head** is ``build_head(name, d_in=<lm_head input width>, vocab_size=<lm_head rows>,
  **knobs)``. Its decoder matrix E (V x d) and bias b are taken from ``lm_head`` where the
  shapes agree: when the base ties ``lm_head`` to the input embedding, E *is* that embedding
  (one shared Parameter, kept shared through save and load; ``save_pretrained`` writes the tie
  the tensors have into config.json, so a head trained apart from the embedding, as PEFT's
  ``modules_to_save=["head"]`` trains a copy, saves and reloads untied); otherwise
  ``lm_head.weight`` is copied into E (unless a ``d_embed`` knob changes its width: then E
  keeps the head's own U(-0.1, 0.1) init); b is ``lm_head.bias`` or zeros. With
  ``init="base"`` (the default) the head then starts exactly at the base model's
  distribution: MoS, MoC and Mixtape are built with residual contexts
  h_k = g + Z_k tanh(W_k g + a_k), Z_k = 0 (``heads/residual.py``), GSS with a learned
  slope starting at k = 1 and PLIF with every slope 1 (both then the identity); SigSoftmax
  has no such knob and is refused (one line).
  With ``init="paper"`` everything but E and b (MoS/MoC priors and latents, Mixtape
  components and gates, PLIF slopes) keeps its paper's random initialisation, and SigSoftmax
  and GSS start from the base model's logits.
* heads with internal dropout get ``dropout_time_dim=1``: hidden states are batch-first
  ``(B, T, d)``, so their masks are locked over each sequence as in the MoS/AWD-LSTM papers.
* Mixtape gives its own gates to the ids below ``frequent_fraction x V``, which presumes ids
  ordered by frequency as highrank's vocabularies are; a tokenizer's ids follow its merge
  order (for byte-level BPE only roughly by frequency), so "frequent" is approximate there.

What ``forward`` returns (``CausalLMOutputWithPast``):

* without ``labels`` (and outside ``generate``, see Generation), ``logits`` are the head's
  **normalised log-probabilities** (float32) at the positions ``logits_to_keep`` keeps (an int
  keeps the last ones, 0 all; a tensor picks positions, as transformers does), so any code
  applying ``log_softmax`` to them sees the head's true distribution;
* with ``labels`` (or ``shift_labels``), ``loss`` is the mean NLL of the next tokens, shifted
  exactly as transformers shifts them and with ``-100`` ignored (``num_items_in_batch``, which
  ``Trainer`` passes under gradient accumulation, replaces the count of valid tokens), computed
  by the head's chunked loss: **in training mode no (tokens x V) logits are built**, so
  ``logits`` is None unless ``logits_to_keep`` asks for some positions (then their
  log-probabilities); in eval mode ``logits`` holds the log-probabilities too, as
  ``Trainer.evaluate(compute_metrics=...)`` and ``Trainer.predict`` need. Label
  smoothing in ``Trainer`` needs logits and is therefore not supported. Eager mode leaves
  ignored positions out of the head's work; under ``torch.compile`` no label is read on the
  host (the head scores every position and zeroes the ignored ones), so
  ``torch.compile(model, fullgraph=True)`` captures the forward with labels whole.

Generation: ``generate`` marks its forward passes (``prepare_inputs_for_generation``), and
they return the logits transformers' logits processors are written for. Softmax hands over its
raw logits z = E h + b, and SigSoftmax, GSS and PLIF their transformed logits f(z) (whose
softmax is their distribution), so penalties defined on raw logits act as on the base model:
``attach_head(base, "softmax")`` (and GSS or PLIF with ``init="base"``) generates exactly the
base's tokens under ``repetition_penalty`` or ``exponential_decay_length_penalty`` (tested).
The mixtures (MoS, MoC, Mixtape), ``mlp_softmax``, MFS and Softmax-CPR (whose partitions
add to its logits) hand over their log-probabilities
log p <= 0, on which the penalties have this meaning: ``repetition_penalty=theta`` multiplies
the log-probability of every token already in the sequence by theta, i.e. raises its
probability to the power theta (p -> p**theta, then renormalised by the search): a token the
model is sure of (p near 1) is barely penalised, an unlikely one strongly;
``exponential_decay_length_penalty=(start, r)`` turns the end-of-sequence log-probability
log p into log p * (2 - r**i) after ``start + i`` tokens (p -> p**(2 - r**i)), so EOS becomes
ever likelier and, once r**i >= 2, scores at least as high as any token. Greedy search,
sampling and beam search are unaffected by the choice (a log_softmax of either gives the
same distribution); ``output_logits=True`` returns what the processors saw.

TRL: its trainers (``SFTTrainer``, and DPO/KTO/GRPO/RLOO, trl 1.16) install a fused LM head
(``add_fused_lm_head``) that would score hidden states as a plain softmax through
``get_output_embeddings()``, which is None here on purpose (nothing may train or resize a
high-rank head as an ``nn.Linear``). The model keeps its own forward instead, and that forward
answers TRL's ``fused_lm_head=True`` with the head's own per-token log-probabilities, entropy,
top-1 hits (``hf_fused.py``), so ``SFTTrainer`` trains the head's loss and logs
``mean_token_accuracy`` and ``entropy`` of the head's distribution, without a subclass. A
temperature other than 1 (GRPO/RLOO options) is refused in one line. TRL's
``disable_dropout`` (``p = 0`` on every ``nn.Dropout``: the default of DPO and KTO) reaches the
head's own dropouts and Mixtape's gate noise (``heads/dropout.py``), so a policy and its
reference score alike before the first update (DPO's first loss is log 2 for every head).

Training: ``model.parameters()`` holds a tied embedding once, so any optimizer works; a head
whose paper gives some parameters their own learning rate (PLIF's slopes) lists them in
``model.head.parameter_groups(lr)``: pass an optimizer built from those groups (and the body's
parameters) to ``Trainer(optimizers=...)`` to honour it.

New tokens: ``model.resize_token_embeddings(n, pad_to_multiple_of=None, mean_resizing=True)``
resizes the body's input embedding as transformers does, then every V-shaped tensor of the
head (``resize_head``: decoder rows unless tied, where the decoder stays the embedding; bias;
Mixtape keeps its per-token gates for the same S ids and new ids join its rare block), and
``config.vocab_size`` (and the base config's); forward, generate and a save/reload round trip
are tested for every head.

Several processes and devices (``docs/distributed-training.md``): ``from_pretrained(folder,
device_map="auto")`` places a saved model (the head is never split, ``_no_split_modules``; a
tied head stays with its embedding, ``_tied_weights_keys`` in transformers 5's dict form); the
model is built on the meta device without reading a tensor value (``from_pretrained`` does
so); DDP and the ``Trainer`` under ``torchrun`` take it as any model; FSDP2 through
``fully_shard_highrank(model)`` (the tied head grouped with the input embedding, the head's
methods registered); ``save_pretrained_gathered(model, folder)`` writes one folder from every
process (``hf_parallel.py``).

Limits: the base model's body must be the class ``AutoModel`` builds from its config (true of
every causal LM in transformers), since that is how ``from_pretrained`` rebuilds it.
"""

from __future__ import annotations

import copy
import inspect
import math

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    GenerationMixin,
    PreTrainedModel,
)
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.auto.modeling_auto import MODEL_MAPPING
from transformers.utils.generic import can_return_tuple

from highrank.heads import (
    HEADS,
    OutputHead,
    base_init_knobs,
    build_head,
    check_init,
)
from highrank.heads.mixtape import Mixtape
from highrank.heads.softmax import PointwiseSoftmax
from highrank.integrations.attach_knobs import check_attach_knobs
from highrank.integrations.hf_config import MODEL_TYPE, HighrankConfig
from highrank.integrations.hf_context import (
    GENERATION_MASK,
    NO_PADDING,
    check_layers_given,
    check_not_packed,
    head_inputs,
    layers_read,
    reads_more,
    reorder,
    shifted_targets,
)
from highrank.integrations.hf_fused import FIELDS as FUSED_FIELDS
from highrank.integrations.hf_fused import FusedCausalLMOutput, fused_output, trl_fused_settings
from highrank.integrations.hf_parallel import fully_shard_highrank, save_pretrained_gathered

# Fewest rows of V logits per chunk of the training loss (see loss_chunk_tokens).
MIN_CHUNK_ROWS = 256
# Keyword arguments of forward that belong to the loss, not to the body.
LOSS_KWARGS = ("num_items_in_batch", "shift_labels", "ignore_index")
# transformers 5.24 renamed the key-value cache, as an argument and an output field, from
# `past_key_values` to `cache` (the old name warns on every call and goes in 5.40); 5.23, the
# oldest release the hf extra admits, knows only the old name. The body gets its own.
CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
OLD_CACHE_NAMES = ("past_key_values",) if CACHE == "cache" else ()
# The flag prepare_inputs_for_generation adds to the inputs of each forward pass of generate.
GENERATING = "highrank_generating"


class HighrankForCausalLM(PreTrainedModel, GenerationMixin):
    """A transformers causal LM whose output layer is a highrank head (see the module guide).

    ``self.model`` is the body (``AutoModel.from_config(config.base_config)``), ``self.head``
    the head; build one with :func:`attach_head`, or reload one with ``from_pretrained``.
    """

    config_class = HighrankConfig
    base_model_prefix = "model"
    _skip_keys_device_placement = [CACHE]
    # device_map="auto" never splits a head across devices (its forward reads all its
    # parameters at once); post_init adds the body's blocks (LlamaDecoderLayer, GPT2Block).
    # A tied head stays with the embedding: _tied_weights_keys (set in __init__, the dict
    # {"head.weight": "<embedding>.weight"} of transformers 5) tells accelerate so.
    _no_split_modules = sorted({head.__name__ for head in HEADS.values()})
    # Attention runs in the body, which checks its own support; the wrapper must not veto it.
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True

    def __init__(
        self,
        config: HighrankConfig,
        *,
        body: PreTrainedModel | None = None,
        head: OutputHead | None = None,
    ) -> None:
        super().__init__(config)
        # attach_head hands in the base model's body and an initialised head; from_pretrained
        # builds both from the config and then loads their weights.
        self.model = body if body is not None else AutoModel.from_config(config.base_config)
        self.head = head if head is not None else _build_head_for(config, self.model)
        # Activation checkpointing runs in the body; offer it exactly when the body does.
        self.supports_gradient_checkpointing = self.model.supports_gradient_checkpointing
        if config.tie_word_embeddings:
            # transformers re-ties after loading (the checkpoint stores the tensor once).
            self._tied_weights_keys = {"head.weight": _embedding_key(self)}
        self.post_init()

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoModel") -> None:
        """Nothing, as ``HighrankConfig.register_for_auto_class``: saved folders load through
        their ``highrank_auto.py``, never through a copy of this module."""

    def _init_weights(self, module: nn.Module) -> None:
        """Nothing to do: each head initialises itself in its constructor as its paper says,
        and the body is initialised by its own class."""

    # ---- embeddings ----------------------------------------------------------------------

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.set_input_embeddings(value)

    def get_output_embeddings(self) -> None:
        # The head is not an nn.Linear; transformers must not resize or re-tie it as one.
        return None

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' ``save_pretrained``, once ``config.tie_word_embeddings`` says what the
        tensors are (``tie_state_from_tensors``): the saved config always matches them."""
        self.tie_state_from_tensors()
        return super().save_pretrained(save_directory, *args, **kwargs)

    def tie_state_from_tensors(self) -> bool:
        """Whether the head's decoder is the input embedding (one Parameter), now written into
        ``config.tie_word_embeddings`` and the tied-weights keys. A tie can be lost after
        ``attach_head``: PEFT's ``modules_to_save=["head"]`` trains a copy of the head, which
        ``merge_and_unload`` makes the head, its decoder then apart from the embedding; saved
        with a config still saying "tied", the folder held both tensors under a config that
        contradicted them (transformers warned on reload; any later re-tie would replace the
        trained decoder by the embedding)."""
        tied = self.head.weight is self.get_input_embeddings().weight
        if tied != self.config.tie_word_embeddings:
            self.config.tie_word_embeddings = tied
            self._tied_weights_keys = {"head.weight": _embedding_key(self)} if tied else None
            self.all_tied_weights_keys = self.get_expanded_tied_weights_keys(all_submodels=False)
        return tied

    def resize_token_embeddings(
        self,
        new_num_tokens: int | None = None,
        pad_to_multiple_of: int | None = None,
        mean_resizing: bool = True,
    ) -> nn.Embedding:
        """Resize the vocabulary as transformers does, head included (see the module guide)."""
        embeddings = super().resize_token_embeddings(
            new_num_tokens, pad_to_multiple_of, mean_resizing
        )
        # transformers sets the text config's vocab_size (the base's); ours records V too.
        self.config.vocab_size = self.head.vocab_size
        if isinstance(self.head, Mixtape):  # the same S ids keep their gates when rebuilt
            self.config.head_knobs["frequent_fraction"] = mixtape_fraction(self.head)
        return embeddings

    def _resize_token_embeddings(self, new_num_tokens, pad_to_multiple_of=None, mean_resizing=True):
        # The body resizes the input embedding in place (same Parameter, new data), so a tied
        # decoder follows it; then every V-shaped tensor of the head follows the new rows.
        embeddings = self.model._resize_token_embeddings(
            new_num_tokens, pad_to_multiple_of, mean_resizing
        )
        resize_head(self.head, embeddings.weight.shape[0], self.model, mean_resizing)
        return embeddings

    # ---- forward -------------------------------------------------------------------------

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Next-token log-probabilities (without labels) or the head's loss (with labels).

        ``labels (B, T)``: position t is scored on ``labels[:, t + 1]``, ``-100`` ignored;
        ``shift_labels (B, T)`` gives the already-shifted targets instead. ``logits_to_keep``:
        an int keeps the last positions (0 keeps all; with labels, 0 returns no logits), a
        tensor the positions it names. ``cache`` is the key-value cache (``past_key_values``
        on transformers 5.23, also accepted). Other keyword arguments go to the body.
        """
        loss_kwargs = {key: kwargs.pop(key) for key in LOSS_KWARGS if key in kwargs}
        generating = kwargs.pop(GENERATING, False)
        generation_mask = kwargs.pop(GENERATION_MASK, None)
        fused = kwargs.pop("fused_lm_head", False)  # TRL's trainers (hf_fused.py)
        if fused:
            use_cache = False  # as TRL's own fused forward: training needs no cache
        cache = _one_cache(cache, kwargs)
        # MFS and CPR read the last layers (hf_context.py): asked of the body, returned if asked
        forced_states = layers_read(self.head) > 1 and not kwargs.get("output_hidden_states")
        if forced_states:
            kwargs["output_hidden_states"] = True
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            return_dict=True,
            **{CACHE: cache},
            **kwargs,
        )
        hidden = outputs.last_hidden_state  # (B, T, d)
        inputs = {}
        if reads_more(self.head):  # the layers and tokens of the context so far
            check_not_packed(type(self.head).__name__, position_ids, attention_mask)
            states = getattr(outputs, "hidden_states", None)
            mask = attention_mask if generation_mask is None else generation_mask
            if mask is NO_PADDING:
                mask = None
            hidden, inputs = head_inputs(
                self.head, hidden, states, input_ids, mask, outputs.get(CACHE)
            )
        if fused:
            return self._fused_output(hidden, labels, **loss_kwargs, **inputs)
        loss, logits = None, None
        if labels is not None or loss_kwargs.get("shift_labels") is not None:
            loss = self._next_token_loss(hidden, labels, **loss_kwargs, inputs=inputs)
        # The fused-loss convention: only training skips the (tokens x V) output; evaluation
        # (Trainer.evaluate / predict with compute_metrics) gets the loss and the log-probs.
        if loss is None or not _keeps_all(logits_to_keep) or not self.training:
            logits = self._kept_logits(hidden, logits_to_keep, generating, inputs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=None if forced_states else getattr(outputs, "hidden_states", None),
            attentions=getattr(outputs, "attentions", None),
            **{CACHE: outputs.get(CACHE)},
        )

    def _kept_logits(
        self, hidden: torch.Tensor, logits_to_keep, generating: bool, inputs: dict
    ) -> torch.Tensor:
        """The logits of the positions ``logits_to_keep`` names. A head that reads its context
        (``inputs``) scores the last positions directly (the context ends with them) and any
        other choice of positions from all of them."""

        def score(rows: torch.Tensor) -> torch.Tensor:
            if generating:
                return self._generation_logits(rows, inputs)
            return self.head.log_prob(rows, **inputs)

        if not inputs or isinstance(logits_to_keep, int):
            return score(_keep_positions(hidden, logits_to_keep))
        return _keep_positions(score(hidden), logits_to_keep)

    def _reorder_cache(self, cache, beam_idx: torch.Tensor):
        """Beam search's reordering: the cache's, and the head's context kept on it (MFS,
        CPR: ``hf_context.py``)."""
        cache.reorder_cache(beam_idx)
        reorder(cache, beam_idx)
        return cache

    # ---- TRL ------------------------------------------------------------------------------

    def __setattr__(self, name: str, value) -> None:
        # TRL's add_fused_lm_head replaces forward by one that scores hidden states with
        # get_output_embeddings() as a plain softmax (None here, on purpose); this forward
        # answers TRL's fused_lm_head=True itself, with the head's own distribution.
        if name == "forward" and (settings := trl_fused_settings(value)) is not None:
            super().__setattr__("_trl_fused_outputs", settings["outputs"])
            return
        super().__setattr__(name, value)

    def _fused_output(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor | None,
        *,
        shift_labels: torch.Tensor | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = -100,
        **inputs: object,
    ) -> FusedCausalLMOutput:
        """TRL's per-token fields (``log_probs``, ``entropy``, ``is_top1``, ...) and loss."""
        if labels is None and shift_labels is None:
            raise ValueError("fused_lm_head=True scores labels: pass labels or shift_labels")
        if ignore_index != -100:
            raise ValueError(f"fused_lm_head=True ignores -100 labels only; got {ignore_index}")
        raw = self.head.transformed_logits if isinstance(self.head, PointwiseSoftmax) else None
        return fused_output(
            self.head, hidden, labels, shift_labels=shift_labels,
            num_items_in_batch=num_items_in_batch, raw_logits=raw,
            chunk_tokens=loss_chunk_tokens(self.head, hidden.device),
            # the fields TRL asked add_fused_lm_head for; all of them for a direct call
            outputs=getattr(self, "_trl_fused_outputs", FUSED_FIELDS), inputs=inputs,
        )  # fmt: skip

    # ---- generation ----------------------------------------------------------------------

    def prepare_inputs_for_generation(self, *args, inputs_embeds=None, **kwargs) -> dict:
        """transformers' own inputs, marked so that ``forward`` returns the generation logits
        (``_generation_logits``): every forward pass of ``generate`` goes through here.
        ``inputs_embeds`` is named so that ``generate(inputs_embeds=...)`` is accepted."""
        inputs = super().prepare_inputs_for_generation(*args, inputs_embeds=inputs_embeds, **kwargs)
        inputs[GENERATING] = True
        mask = kwargs.get("attention_mask")
        if reads_more(self.head) and (mask is None or mask.dim() == 2):
            # the body may get a 4-D mask (hf_context.py), made by transformers even from none
            inputs[GENERATION_MASK] = NO_PADDING if mask is None else mask
        return inputs

    def _generation_logits(self, hidden: torch.Tensor, inputs: dict | None = None) -> torch.Tensor:
        """What ``generate`` sees as logits: the raw logits where the head is one softmax.

        Logits processors such as ``repetition_penalty`` and
        ``exponential_decay_length_penalty`` act on raw logits (z / theta where z > 0, z * theta
        where z < 0), so a softmax head must hand them the same z as the base model's
        ``lm_head`` for the same text; SigSoftmax, GSS and PLIF hand them their transformed
        logits f(z), whose softmax is their distribution. Mixtures (MoS, MoC, Mixtape) and
        ``mlp_softmax`` have no such z: they hand over their log-probabilities, which every
        processor and search also reads correctly (see the module docstring for what the
        penalties then mean).
        """
        if isinstance(self.head, PointwiseSoftmax):
            return self.head.transformed_logits(hidden).float()
        return self.head.log_prob(hidden, **(inputs or {}))

    def _next_token_loss(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor | None,
        *,
        shift_labels: torch.Tensor | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = -100,
        inputs: dict | None = None,
    ) -> torch.Tensor:
        """Mean NLL over the valid next tokens, as transformers' ``ForCausalLMLoss``."""
        if inputs:  # a head that reads its context scores every row of it (hf_context.py)
            if shift_labels is None:
                labels = shifted_targets(labels.to(hidden.device), ignore_index)
            return self._context_loss(
                hidden, shift_labels if labels is None else labels, inputs,
                num_items_in_batch=num_items_in_batch, ignore_index=ignore_index,
            )  # fmt: skip
        if shift_labels is None:
            # transformers pads labels with ignore_index and shifts them left: position t
            # predicts labels[t + 1] and the last position predicts nothing, so drop it.
            hidden, targets = hidden[:, :-1], labels[:, 1:]
        else:
            targets = shift_labels
        if targets.shape != hidden.shape[:-1]:
            raise ValueError(
                f"labels give targets of shape {tuple(targets.shape)} for hidden states "
                f"{tuple(hidden.shape[:-1])}; expected labels of shape (batch, sequence length)"
            )
        targets = targets.to(hidden.device)
        valid = targets != ignore_index
        total = self._nll_sum(hidden, targets, valid, ignore_index)
        count = valid.sum() if num_items_in_batch is None else num_items_in_batch
        if torch.is_tensor(count):
            count = count.to(total.device)
        return total / count

    def _context_loss(
        self, hidden, targets, inputs, *, num_items_in_batch, ignore_index
    ) -> torch.Tensor:
        """Mean NLL of ``targets (B, T)`` (already shifted) for a head that reads its context:
        (B, T, d) as it is, ignored rows zeroed by the head."""
        if targets.shape != hidden.shape[:-1]:
            raise ValueError(
                f"labels give targets of shape {tuple(targets.shape)} for hidden states "
                f"{tuple(hidden.shape[:-1])}; expected labels of shape (batch, sequence length)"
            )
        targets = targets.to(hidden.device)
        chunk_size = loss_chunk_tokens(self.head, hidden.device)
        total = self.head.loss(
            hidden, targets, reduction="sum", chunk_size=chunk_size, ignore_index=ignore_index,
            **inputs,
        )  # fmt: skip
        count = num_items_in_batch
        if count is None:
            count = (targets != ignore_index).sum()
        if torch.is_tensor(count):
            count = count.to(total.device)
        return total / count

    def _nll_sum(
        self, hidden: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor, ignore_index: int
    ) -> torch.Tensor:
        """Summed NLL of the valid targets ``(B, T)``, by the head's chunked loss."""
        if torch.compiler.is_compiling():
            # No label is read on the host, so torch.compile captures one graph (fullgraph=True):
            # the head scores every row, (B, T, d) as it is (one locked mask per sequence), and
            # zeroes the ignored ones (0 when all are). Eager mode leaves the ignored rows out.
            return self._head_loss_sum(hidden, targets, ignore_index)
        if not bool(valid.any()):
            return hidden.sum() * 0.0  # nothing to score; keeps the graph for backward
        if bool(valid.all()):
            # (B, T, d) as it is: locked dropout masks stay one per sequence.
            return self._head_loss_sum(hidden, targets)
        if self.head.training and self.head.dropout_time_dim is not None:
            # Dropout locked over time needs each sequence's valid rows together: one call per
            # sequence, each (1, n_b, d), keeps one mask per sequence.
            return sum(
                self._head_loss_sum(hidden[b, keep][None], targets[b, keep][None])
                for b, keep in enumerate(valid)
                if bool(keep.any())
            )
        return self._head_loss_sum(hidden[valid], targets[valid])  # (N_valid, d)

    def _head_loss_sum(
        self, hidden: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
    ) -> torch.Tensor:
        chunk_size = loss_chunk_tokens(self.head, hidden.device)
        return self.head.loss(
            hidden, targets, reduction="sum", chunk_size=chunk_size, ignore_index=ignore_index
        )


# ---- building the head -------------------------------------------------------------------


def loss_chunk_tokens(head: OutputHead, device: torch.device | str | None = None) -> int:
    """Tokens per chunk of the training loss: the head's own ``auto_chunk_tokens()``, but at
    least ``MIN_CHUNK_ROWS`` rows of V logits (``MIN_CHUNK_ROWS / K`` tokens for K mixture
    components).

    Why: each chunk of the fused losses (softmax, MoS, MoC) adds a rank-(chunk rows) update
    to the full V x d decoder gradient, a pass over V x d floats. With the heads' "auto"
    chunks (about 2**21 logits: 42 tokens at V = 49,152) those passes dominate at LLM
    vocabulary sizes, and the loss was slower than the base model's own; 256 rows remove
    that (measured in benchmarks/results/hf-loss-cost/) while 256 rows of V logits (48 MiB
    at V = 49,152) stay far below the (tokens x V) logits the base model's loss builds.
    """
    rows_per_token = max(1, head.logits_per_token() // head.vocab_size)  # K
    return max(head.auto_chunk_tokens(device), math.ceil(MIN_CHUNK_ROWS / rows_per_token))


@torch.no_grad()
def resize_head(
    head: OutputHead, vocab_size: int, body: PreTrainedModel, mean_resizing: bool = True
) -> None:
    """Give ``head`` ``vocab_size`` tokens: rows are added or removed at the end, as
    transformers resizes an ``lm_head``.

    The decoder E (unless tied: the body has already resized the embedding it shares) is
    resized by transformers' own ``_get_resized_lm_head``, so new rows are drawn as a new
    lm_head's would be: from a normal with the old rows' mean and (1e-9 x) covariance under
    ``mean_resizing``, by the body's ``_init_weights`` otherwise. New bias entries take the old
    mean (``mean_resizing``, as transformers' lm_head bias) or 0. No other tensor of a head is
    V-shaped, except Mixtape's per-token gates: those cover the S most frequent ids, and new
    ids (appended, so the rarest) join the rare block; S is kept (cut to V when shrinking
    below it), so the trained gates stay with their tokens.
    """
    old = head.vocab_size
    if vocab_size == old:
        return
    if head.weight.shape[0] != vocab_size:  # untied (a tied E already has the new rows)
        # A Linear around E for transformers' resizer (built on "meta": no second V x d copy).
        decoder = nn.Linear(head.d_embed, old, bias=False, device="meta")
        decoder.weight = head.weight
        resized = body._get_resized_lm_head(decoder, vocab_size, mean_resizing=mean_resizing)
        head.weight = nn.Parameter(resized.weight.data, requires_grad=head.weight.requires_grad)
    head.bias = nn.Parameter(
        _resized_bias(head.bias.data, vocab_size, mean_resizing),
        requires_grad=head.bias.requires_grad,
    )
    head.vocab_size = vocab_size
    if isinstance(head, Mixtape) and head.n_frequent > vocab_size:
        head.n_frequent = vocab_size
        head.token_gate = nn.Parameter(head.token_gate.data[:vocab_size].clone())
        head.token_gate_bias = nn.Parameter(head.token_gate_bias.data[:vocab_size].clone())


def _resized_bias(bias: torch.Tensor, vocab_size: int, mean_resizing: bool) -> torch.Tensor:
    kept = bias[:vocab_size]
    added = vocab_size - len(kept)
    fill = bias.float().mean().to(bias.dtype) if mean_resizing else bias.new_zeros(())
    return torch.cat([kept, fill.expand(added)]) if added > 0 else kept.clone()


def mixtape_fraction(head: Mixtape) -> float:
    """A ``frequent_fraction`` from which Mixtape rebuilds the S = ``head.n_frequent`` it has
    (floor(round(r V, 9)) = S: config.json records r, not S)."""
    fraction = head.n_frequent / head.vocab_size
    if math.floor(round(fraction * head.vocab_size, 9)) != head.n_frequent:
        raise ValueError(f"no frequent_fraction gives Mixtape S = {head.n_frequent} of V")
    return fraction


def _build_head_for(config: HighrankConfig, body: PreTrainedModel) -> OutputHead:
    """The head ``config`` records, wired to ``body`` (tied embedding, batch-first layout)."""
    if config.head_name not in HEADS:
        raise ValueError(
            f"config.json names the head {config.head_name!r}, which this highrank does not "
            f"have (it has: {', '.join(HEADS)}); upgrade highrank, or fix head_name"
        )
    wired: dict = {}
    if config.tie_word_embeddings:
        wired["tied_weight"] = body.get_input_embeddings().weight
    parameters = inspect.signature(HEADS[config.head_name]).parameters
    if "dropout_time_dim" in parameters:
        wired["dropout_time_dim"] = 1  # hidden states are (B, T, d)
    if "time_dim" in parameters:
        wired["time_dim"] = 1  # the sequences of heads that read their context (MFS, CPR)
    return build_head(
        config.head_name,
        d_in=config.head_d_in,
        vocab_size=config.vocab_size,
        **config.head_knobs,
        **wired,
    )


def _embedding_key(model: HighrankForCausalLM) -> str:
    """The state-dict name of the input embedding's weight (``model.embed_tokens.weight``,
    ``model.wte.weight``, ...), found by identity since every architecture names it its way."""
    embedding = model.get_input_embeddings().weight
    for name, parameter in model.model.named_parameters():
        if parameter is embedding:
            return f"model.{name}"
    raise ValueError("the body's input embedding weight is not one of its parameters")


def _one_cache(cache, kwargs: dict):
    """The cache passed under its current name or (popped from ``kwargs``) the old one
    (``generate`` of transformers 5.23 and older callers pass ``past_key_values``)."""
    # On 5.23 CACHE itself is "past_key_values" and arrives in kwargs: take it from there.
    for name in (CACHE, *OLD_CACHE_NAMES):
        if name in kwargs:
            if cache is not None:
                raise ValueError(f"pass the key-value cache once, as {CACHE}= (got it twice)")
            cache = kwargs.pop(name)
    return cache


def _keeps_all(logits_to_keep: int | torch.Tensor) -> bool:
    return isinstance(logits_to_keep, int) and logits_to_keep == 0


def _keep_positions(hidden: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The rows of ``hidden (B, T, d)`` that ``logits_to_keep`` names, as transformers'
    causal LMs slice them: an int keeps the last ones (0 all), a 1-D tensor those positions
    in every sequence, a 2-D integer tensor positions per sequence, a 2-D bool tensor a mask
    (flattened to ``(kept, d)``)."""
    if isinstance(logits_to_keep, int):
        return hidden if logits_to_keep == 0 else hidden[:, -logits_to_keep:]
    if logits_to_keep.ndim == 2:
        if logits_to_keep.dtype == torch.bool:
            return hidden[logits_to_keep]
        return torch.take_along_dim(hidden, logits_to_keep[..., None], dim=1)
    return hidden[:, logits_to_keep]


# ---- attach_head -------------------------------------------------------------------------


def attach_head(
    model: PreTrainedModel, name: str, *, init: str = "base", untie: bool = False, **knobs
) -> HighrankForCausalLM:
    """``model`` (any transformers causal LM) with the highrank head ``name`` as its output layer.

    ``knobs`` are the head's own (``highrank.heads.head_knobs(name)``), e.g. ``n_components``
    for MoS or ``gate_dim`` for Mixtape; ``tied_weight`` and ``dropout_time_dim`` are wired
    from the base model. The body is reused, not copied; the head's decoder matrix and bias
    come from ``model``'s ``lm_head`` where the shapes agree (see the module docstring).

    ``init="base"`` (default) starts the head exactly at the base model's distribution
    (``OutputHead.start_at_base``; mixtures get residual contexts, GSS a learned slope from 1,
    PLIF unit slopes); SigSoftmax cannot and says so. ``init="paper"`` keeps each paper's
    random initialisation of everything but the decoder. ``untie=True`` gives the head its
    own copy of a tied ``lm_head`` (training it then leaves the input embedding alone: what a
    head trained on cached features of the frozen body needs).
    """
    lm_head = _check_causal_lm(model)
    check_attach_knobs(name, knobs)
    if check_init(init) == "base":
        knobs = base_init_knobs(name, knobs)
    body = model.base_model
    embedding = model.get_input_embeddings()
    tied = embedding is not None and lm_head.weight is embedding.weight and not untie
    vocab_size, d_in = lm_head.weight.shape
    d_embed = knobs.get("d_embed")
    if d_embed not in (None, d_in):  # an output embedding of another width
        if init == "base":
            raise ValueError(_base_needs_lm_head((vocab_size, d_in), (vocab_size, d_embed)))
        if tied:
            raise ValueError(
                f"d_embed={d_embed} asks for an output embedding of another width than this "
                f"model's, which it ties to its input embedding ({vocab_size}, {d_in}): pass "
                "untie=True to give the head its own (or drop d_embed)"
            )
    config = HighrankConfig(
        base_config=model.config,
        head_name=name,
        head_knobs=knobs,
        head_d_in=d_in,
        vocab_size=vocab_size,
        tie_word_embeddings=tied,
    )
    head = _build_head_for(config, body)
    check_layers_given(head, model.config)
    _initialise_from_lm_head(head, lm_head, tied)
    if init == "base":
        _start_at_lm_head(head, lm_head)
    head.to(device=lm_head.weight.device, dtype=lm_head.weight.dtype)
    highrank_model = HighrankForCausalLM(config, body=body, head=head)
    highrank_model.generation_config = copy.deepcopy(model.generation_config)
    highrank_model.train(model.training)
    return highrank_model


@torch.no_grad()
def _initialise_from_lm_head(head: OutputHead, lm_head: nn.Module, tied: bool) -> None:
    """E and b from ``lm_head`` where shapes agree (a tied E already is the embedding)."""
    if not tied and head.weight.shape == lm_head.weight.shape:
        head.weight.copy_(lm_head.weight)
    bias = getattr(lm_head, "bias", None)
    if bias is not None and head.bias.shape == bias.shape:
        head.bias.copy_(bias)


def _start_at_lm_head(head: OutputHead, lm_head: nn.Module) -> None:
    if head.weight.shape != lm_head.weight.shape:
        raise ValueError(_base_needs_lm_head(lm_head.weight.shape, head.weight.shape))
    head.start_at_base()


def _base_needs_lm_head(lm_head_shape, head_shape) -> str:
    return (
        f"init='base' needs the head's decoder to be lm_head's {tuple(lm_head_shape)} matrix, "
        f"but d_embed makes it {tuple(head_shape)}; drop d_embed or use init='paper'"
    )


def _check_causal_lm(model: object) -> nn.Module:
    """The model's ``lm_head``, or one clear error saying why ``model`` is not usable."""
    if isinstance(model, HighrankForCausalLM):
        raise TypeError(
            f"the model already has a highrank head ({model.config.head_name!r}); attach a "
            "head to the base model instead"
        )
    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"attach_head needs a transformers causal LM (a PreTrainedModel such as "
            f"GPT2LMHeadModel or LlamaForCausalLM); got {type(model).__name__}"
        )
    kind = type(model).__name__
    lm_head = model.get_output_embeddings()
    if lm_head is None or not isinstance(getattr(lm_head, "weight", None), torch.Tensor):
        raise TypeError(
            f"{kind} has no output embeddings (lm_head) to replace; attach_head needs a causal "
            "LM such as GPT2LMHeadModel or LlamaForCausalLM, not a bare body like LlamaModel"
        )
    if getattr(model.config, "is_encoder_decoder", False) or not model.can_generate():
        raise TypeError(f"{kind} is not a causal (decoder-only) language model")
    body = model.base_model
    expected = MODEL_MAPPING.get(type(model.config), None)
    classes = expected if isinstance(expected, tuple) else (expected,)
    if body is model or expected is None or type(body) not in classes:
        raise TypeError(
            f"{kind}'s body ({type(body).__name__}) is not what AutoModel builds from its config "
            f"({getattr(expected, '__name__', 'no class registered')}), so from_pretrained "
            "could not rebuild it"
        )
    return lm_head


# Importing this module makes "highrank" a model type that the Auto classes know.
AutoConfig.register(MODEL_TYPE, HighrankConfig, exist_ok=True)
AutoModelForCausalLM.register(HighrankConfig, HighrankForCausalLM, exist_ok=True)

__all__ = [
    "HighrankConfig",
    "HighrankForCausalLM",
    "attach_head",
    "fully_shard_highrank",
    "save_pretrained_gathered",
]
