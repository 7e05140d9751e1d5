"""The configuration of a saved highrank model, as vLLM's transformers (5.16 to 5.19) reads it.

``config.json`` of a folder saved by ``attach_head(...).save_pretrained`` has
``model_type = "highrank"``, the base model's configuration nested as ``base_config`` (with its
own ``model_type``) and the head: ``head_name``, ``head_knobs``, ``head_d_in``, ``vocab_size``,
``tie_word_embeddings`` (``highrank/integrations/hf_config.py`` writes it). This class reads
the same file with the configuration machinery of the releases vLLM pins; the ``hf`` extra's
class needs transformers 5.23 or later. ``get_text_config()`` is the base model's
configuration, from which vLLM sizes the attention, the KV cache and the context length.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from highrank.heads import HEADS, build_head
from highrank.integrations.vllm.names import ARCHITECTURE, PLUGIN

MODEL_TYPE = "highrank"


class HighrankConfig(PretrainedConfig):
    """A highrank model's ``config.json`` (see the module docstring); the fields are those of
    ``highrank.integrations.hf_config.HighrankConfig``."""

    model_type = MODEL_TYPE
    sub_configs = {"base_config": AutoConfig}

    base_config: dict | PretrainedConfig | None = None
    head_name: str = "softmax"
    head_knobs: dict | None = None
    head_d_in: int | None = None
    vocab_size: int | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        # transformers builds a default instance too (to find non-default fields): no base.
        if isinstance(self.base_config, dict):
            base = dict(self.base_config)
            model_type = base.pop("model_type", "llama")
            if model_type not in CONFIG_MAPPING:
                raise ValueError(
                    f"{PLUGIN}: the base model of this highrank model is a {model_type!r}, which "
                    "the installed transformers does not know"
                )
            self.base_config = CONFIG_MAPPING[model_type](**base)
        self.head_knobs = dict(self.head_knobs or {})
        if self.base_config is not None:
            # Refused here, in the process that reads the folder, before any process starts.
            served_architecture(self.base_config)
            text = self.base_config.get_text_config(decoder=True)
            if self.head_d_in is None:
                self.head_d_in = text.hidden_size
            if self.vocab_size is None:
                self.vocab_size = text.vocab_size
            check_head(self.head_name, self.head_knobs, self.head_d_in, self.vocab_size)
        super().__post_init__(**kwargs)

    def get_text_config(self, decoder=None, encoder=None) -> PretrainedConfig:
        """The base model's text configuration (layers, heads, vocabulary, context length)."""
        if self.base_config is None:
            raise ValueError(
                f"{PLUGIN}: config.json of this highrank model has no base_config; save the "
                "model with highrank.integrations.hf (attach_head(...).save_pretrained)"
            )
        return self.base_config.get_text_config(decoder=decoder, encoder=encoder)


def served_architecture(base_config: PretrainedConfig) -> str:
    """The architecture of vLLM's own model for the base model (its causal-LM class), or a
    one-line ``ValueError`` naming the plugin: without a model of vLLM's own, vLLM would need
    its Transformers backend, which builds the body but scores with the base ``lm_head``."""
    from vllm.model_executor.models import ModelRegistry

    model_type = base_config.model_type
    candidates = list(getattr(base_config, "architectures", None) or [])
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        candidates.append(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    native = ModelRegistry.get_supported_archs()
    for architecture in candidates:
        if architecture in native and architecture != ARCHITECTURE:
            return architecture
    raise ValueError(
        f"{PLUGIN} cannot serve this folder: its base model ({model_type!r}, "
        f"{'/'.join(candidates) or 'no causal-LM class'}) has no model of vLLM's own, and "
        "vLLM's Transformers backend cannot run a highrank head"
    )


def check_head(name: str, knobs: dict, d_in: int, vocab_size: int) -> None:
    """A one-line ``ValueError`` naming the plugin unless head ``name`` (built on the meta
    device: no memory) exists and reads the last hidden state alone, which is all vLLM hands
    ``compute_logits``: heads that also read earlier layers or the context's tokens (MFS, CPR)
    cannot be served."""
    if name not in HEADS:
        raise ValueError(
            f"{PLUGIN}: config.json names the head {name!r}, which this highrank does not "
            f"have (it has: {', '.join(HEADS)}); upgrade highrank in vLLM's environment"
        )
    try:
        with torch.device("meta"):
            head = build_head(name, d_in=d_in, vocab_size=vocab_size, **knobs)
    except (TypeError, ValueError) as error:
        message = f"{PLUGIN}: config.json's head {name!r} cannot be built: {error}"
        raise ValueError(message) from None
    if tuple(head.reads) != ("hidden",):
        raise ValueError(
            f"{PLUGIN} serves heads that read the last hidden state only; head {name!r} also "
            f"reads {', '.join(r for r in head.reads if r != 'hidden')} of its context, which "
            "vLLM does not hand a model's compute_logits"
        )


def register_config() -> None:
    """``model_type = "highrank"`` becomes :class:`HighrankConfig` for transformers' and
    vLLM's configuration loaders (vLLM then ignores the folder's ``auto_map``, the way in for
    plain transformers, which would import the ``hf`` extra)."""
    AutoConfig.register(MODEL_TYPE, HighrankConfig, exist_ok=True)
    try:  # vLLM's own table: a registered type is loaded without trust_remote_code
        from vllm.transformers_utils.config import _CONFIG_REGISTRY
    except ImportError:  # another vLLM layout: AutoConfig's registration is the way in
        return
    _CONFIG_REGISTRY[MODEL_TYPE] = HighrankConfig
