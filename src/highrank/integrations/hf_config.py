"""``HighrankConfig``: the configuration of a transformers causal LM with a highrank head.

It nests the base model's own configuration (``base_config``, serialised as a dict with its
``model_type``, so ``AutoConfig`` rebuilds it) and records the head: its name in
``highrank.heads.HEADS``, its knobs, and the shape it reads (``head_d_in``) and writes
(``vocab_size``). Saved as ``config.json`` with ``model_type = "highrank"``; importing
``highrank.integrations.hf`` registers it with ``AutoConfig``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import transformers
from transformers import AutoConfig, PreTrainedConfig

try:
    from transformers.configuration_utils import SubConfigSpec
except ImportError:  # older transformers: other configuration and weight-tying machinery
    raise ImportError(
        "highrank.integrations.hf needs a transformers 5 release with SubConfigSpec (written "
        f"and tested against 5.23); found {transformers.__version__}: pip install -U transformers"
    ) from None

MODEL_TYPE = "highrank"
# The module every saved folder carries (a copy of highrank_auto.py, which imports the
# installed highrank) and the auto_map that names its classes: a fresh process that passes
# trust_remote_code=True (lm_eval --model hf, ...) then loads the folder without importing
# highrank first; transformers' plugin-free Auto classes offer no other way in.
AUTO_MODULE = "highrank_auto"
AUTO_MAP = {
    "AutoConfig": f"{AUTO_MODULE}.HighrankConfig",
    "AutoModelForCausalLM": f"{AUTO_MODULE}.HighrankForCausalLM",
}
# The fields in which configs state their context length (lm-eval's HFLM and others read them
# from model.config): copied from the base model's text config.
LENGTH_FIELDS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length")


class HighrankConfig(PreTrainedConfig):
    """Configuration of :class:`highrank.integrations.hf.HighrankForCausalLM`.

    Args:
        base_config: the base causal LM's configuration (a config object, or its ``to_dict()``
            with ``model_type``); the body is ``AutoModel.from_config(base_config)``.
        head_name: a name in ``highrank.heads.HEADS``.
        head_knobs: the head's keyword knobs (JSON values); ``tied_weight`` and
            ``dropout_time_dim`` are wired by the model, never stored.
        head_d_in: width of the hidden states the head reads (the base ``lm_head``'s input).
        vocab_size: V, the rows of the base ``lm_head`` (may exceed the tokenizer's size).
        tie_word_embeddings: whether the head's decoder matrix is the input embedding
            (``attach_head`` copies this from the base model's actual tying).
    """

    model_type = MODEL_TYPE
    # Trainer's evaluation gathers every other output: the cache is "cache" from transformers
    # 5.24 on, "past_key_values" before (5.23).
    keys_to_ignore_at_inference = ["past_key_values", "cache"]
    # "llama" is only the fallback type for a base_config dict without its own model_type.
    sub_configs_defaults = {
        "base_config": SubConfigSpec(config_class=AutoConfig, model_type="llama")
    }

    base_config: dict | PreTrainedConfig | None = None
    head_name: str = "softmax"
    head_knobs: dict | None = None
    head_d_in: int | None = None
    vocab_size: int | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        if isinstance(self.base_config, PreTrainedConfig):
            # The base class sets these on every sub-config (to None unless given): keep the
            # base model's, since attach_head shares its config object with its body.
            for key in ("attn_implementation", "experts_implementation"):
                kwargs.setdefault(key, getattr(self.base_config, f"_{key}", None))
        super().__post_init__(**kwargs)
        self.head_knobs = dict(self.head_knobs or {})
        text = self.base_config.get_text_config(decoder=True)
        if self.head_d_in is None:
            self.head_d_in = text.hidden_size
        if self.vocab_size is None:
            self.vocab_size = text.vocab_size
        for name in LENGTH_FIELDS:  # the base model's context length, where tools look for it
            if getattr(text, name, None) is not None:
                setattr(self, name, getattr(text, name))

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs) -> None:
        """``config.json`` with the ``auto_map`` of ``AUTO_MAP``, and ``highrank_auto.py``."""
        self.auto_map = dict(AUTO_MAP)
        # Written first, so that push_to_hub uploads it with config.json.
        source = Path(__file__).with_name(f"{AUTO_MODULE}.py")
        Path(save_directory).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, Path(save_directory) / source.name)
        super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoConfig") -> None:
        """Nothing: transformers calls this after loading a folder through its ``auto_map``,
        and would then copy this module's source into every later save; the folders carry
        ``highrank_auto.py`` instead, which imports the installed highrank."""

    def get_text_config(self, decoder=None, encoder=None) -> PreTrainedConfig:
        """The base model's text config: generation and caches read layers, heads and the
        vocabulary size from it, as for any composite model."""
        return self.base_config.get_text_config(decoder=decoder, encoder=encoder)
