"""The vLLM model of a saved highrank model: vLLM's own body, highrank's head.

``HighrankForCausalLM(vllm_config=..., prefix=...)`` builds, as ``self.base``, vLLM's own model
class of the base architecture (``LlamaForCausalLM`` for Llama and SmolLM2, ``Qwen2ForCausalLM``,
``GPT2LMHeadModel``, ...) from the nested base configuration, so attention, the paged KV cache,
batching and ``torch.compile`` of the body are vLLM's; the base's ``lm_head`` is dropped. The
head is ``highrank.heads.build_head`` of ``config.json``'s ``head_name`` and ``head_knobs``, in
eval mode (no dropout), fed the body's last hidden states: the same states the transformers
body hands the head in ``highrank.integrations.hf``.

What ``compute_logits`` hands vLLM's sampler: as ``HighrankForCausalLM.generate`` in
``integrations/hf.py``, raw logits where the head is one softmax over pointwise logits
(softmax: E h + b; SigSoftmax, GSS, PLIF: their transformed logits f(z)), else (MoS, MoC,
Mixtape, mlp_softmax) the normalised log-probabilities. vLLM's sampler takes a log_softmax of
either (the identity on log-probabilities, up to rounding), so greedy, sampling (temperature,
top-p, top-k, min-p) and returned logprobs (vLLM's default ``raw_logprobs``) are the head's
distribution; penalties act on these values as in transformers' ``generate``.

Weights: the folder's ``model.*`` tensors (the transformers body's names) are renamed to the
base class's checkpoint names (``model.`` -> the transformers class's ``base_model_prefix``,
e.g. ``transformer.`` for GPT-2) and loaded by the base's own ``load_weights`` (which fuses
q/k/v and gate/up as vLLM does); ``head.*`` tensors go into the head. A tied head's decoder
is the first V rows of vLLM's input embedding (one tensor, not a copy).

Refused in one line naming the plugin (``ValueError``): a base architecture vLLM has no
model of its own for (it would need vLLM's Transformers backend, which cannot host the head;
refused already when the configuration is read, ``config.served_architecture``), one that is
not a text-only generator, a head this highrank does not have or one that reads more than the
last hidden state (MFS, CPR: vLLM hands compute_logits nothing else), pipeline parallelism, and
tensor parallelism for a tied head (its decoder would be a shard of the embedding). An untied
head runs whole on every tensor-parallel rank (untested).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import transformers
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.models import ModelRegistry
from vllm.model_executor.models.utils import init_vllm_registered_model, maybe_prefix
from vllm.sequence import IntermediateTensors

from highrank.heads import OutputHead, build_head
from highrank.heads.softmax import PointwiseSoftmax
from highrank.integrations.vllm.config import check_head, served_architecture
from highrank.integrations.vllm.names import PLUGIN

# The prefix of the body's tensors in a folder saved by highrank.integrations.hf.
BODY_PREFIX = "model."
HEAD_PREFIX = "head."


class HighrankForCausalLM(nn.Module):
    """vLLM's model of the base architecture as the body, a highrank head in
    ``compute_logits`` (see the module docstring)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise ValueError(f"{PLUGIN} does not support pipeline parallelism; use one stage")
        if parallel.tensor_parallel_size > 1 and config.tie_word_embeddings:
            raise ValueError(
                f"{PLUGIN}: a tied head needs the whole input embedding, which tensor "
                "parallelism splits; serve it with --tensor-parallel-size 1"
            )
        base_config = config.get_text_config()
        self.architecture = base_architecture(base_config, vllm_config)
        self.base = init_vllm_registered_model(
            vllm_config,
            prefix=maybe_prefix(prefix, "base"),
            hf_config=base_config,
            architectures=[self.architecture],
        )
        # The base's own output layer (and its logits processor) are never used.
        for name in ("lm_head", "logits_processor"):
            if name in self.base._modules:
                delattr(self.base, name)
        self.checkpoint_prefix = f"{_base_model_prefix(self.architecture)}."
        self.tied = bool(config.tie_word_embeddings)
        self.head = _build_head(config, _input_embedding(self.base, base_config.vocab_size))
        self.head.eval().requires_grad_(False)
        self.make_empty_intermediate_tensors = getattr(
            self.base, "make_empty_intermediate_tensors", None
        )

    # ---- vLLM's model interface ----------------------------------------------------------

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.base.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """The body's last hidden states ``(tokens, d)``, as vLLM's base model returns them."""
        return self.base(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``(tokens, V)`` float32: raw logits of a softmax-like head, else log-probabilities
        (see the module docstring); the sampler's log_softmax of either is the head's."""
        if self.head.training:  # nothing here trains; a stray .train() must not add dropout
            self.head.eval()
        if isinstance(self.head, PointwiseSoftmax):
            return self.head.transformed_logits(hidden_states).float()
        return self.head.log_prob(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The folder's tensors: the body's through the base's own loader, the head's here."""
        head_tensors: dict[str, torch.Tensor] = {}

        def body_tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith(HEAD_PREFIX):
                    head_tensors[name.removeprefix(HEAD_PREFIX)] = tensor
                elif name.startswith(BODY_PREFIX):
                    yield self.checkpoint_prefix + name.removeprefix(BODY_PREFIX), tensor
                else:
                    raise ValueError(
                        f"{PLUGIN}: the folder holds a tensor {name!r}, neither the body's "
                        f"({BODY_PREFIX}*) nor the head's ({HEAD_PREFIX}*); was it saved by "
                        "highrank.integrations.hf?"
                    )

        loaded = {f"base.{name}" for name in self.base.load_weights(body_tensors())}
        return loaded | self._load_head(head_tensors)

    # ---- pieces --------------------------------------------------------------------------

    @torch.no_grad()
    def _load_head(self, tensors: dict[str, torch.Tensor]) -> set[str]:
        own = dict(self.head.named_parameters())
        own.update(self.head.named_buffers())
        tied = self.tied
        expected = set(own) - ({"weight"} if tied else set())
        missing = sorted(expected - set(tensors))
        unexpected = sorted(set(tensors) - set(own) - ({"weight"} if tied else set()))
        if missing or unexpected:
            raise ValueError(
                f"{PLUGIN}: the head's tensors in the folder do not fit head "
                f"{type(self.head).__name__}: missing {missing}, unexpected {unexpected}"
            )
        for name, tensor in tensors.items():
            if tied and name == "weight":
                continue  # the decoder is the input embedding
            target = own[name]
            if target.shape != tensor.shape:
                raise ValueError(
                    f"{PLUGIN}: head.{name} has shape {tuple(tensor.shape)} in the folder, "
                    f"{tuple(target.shape)} in head {type(self.head).__name__}"
                )
            target.copy_(tensor)
        return {f"head.{name}" for name, _ in self.head.named_parameters()}


def base_architecture(base_config, vllm_config: VllmConfig) -> str:
    """vLLM's architecture for the base model (``config.served_architecture``), checked to be
    a text-only generator; else a one-line refusal naming the plugin."""
    architecture = served_architecture(base_config)
    base_model_config = vllm_config.with_hf_config(
        base_config, architectures=[architecture]
    ).model_config
    if not ModelRegistry.is_text_generation_model([architecture], base_model_config):
        raise ValueError(
            f"{PLUGIN} cannot serve this folder: vLLM's {architecture} is not a text generator"
        )
    if ModelRegistry.is_multimodal_model([architecture], base_model_config):
        raise ValueError(
            f"{PLUGIN} serves text-only base models; vLLM's {architecture} is multimodal"
        )
    return architecture


def _base_model_prefix(architecture: str) -> str:
    """Where the transformers class of ``architecture`` keeps its body (``model``,
    ``transformer``, ...): the prefix of the body's tensors in its checkpoints."""
    model_class = getattr(transformers, architecture, None)
    return getattr(model_class, "base_model_prefix", None) or "model"


def _build_head(config, embedding: torch.Tensor) -> OutputHead:
    """The head ``config.json`` records; a tied head's decoder is ``embedding[:V]``."""
    check_head(config.head_name, config.head_knobs, config.head_d_in, config.vocab_size)
    vocab_size = config.vocab_size
    wired = {}
    if config.tie_word_embeddings:
        if embedding.shape[0] < vocab_size:
            raise ValueError(
                f"{PLUGIN}: the tied head has V = {vocab_size} tokens but the input embedding "
                f"{embedding.shape[0]} rows"
            )
        wired["tied_weight"] = nn.Parameter(embedding.data[:vocab_size], requires_grad=False)
    return build_head(
        config.head_name,
        d_in=config.head_d_in,
        vocab_size=vocab_size,
        **config.head_knobs,
        **wired,
    )


def _input_embedding(base: nn.Module, vocab_size: int) -> torch.Tensor:
    """vLLM's input embedding matrix of ``base`` (rows padded beyond V, as vLLM pads them):
    its first vocabulary-sized ``VocabParallelEmbedding`` (GPT-2's positions come after)."""
    for module in base.modules():
        if isinstance(module, VocabParallelEmbedding) and module.org_vocab_size == vocab_size:
            return module.weight
    raise ValueError(f"{PLUGIN}: found no input embedding of {vocab_size} rows in the body")
