"""highrank's vLLM plugin: ``vllm serve FOLDER`` for a folder saved by ``attach_head(...)``.

``pip install 'highrank[vllm]'`` in vLLM's environment installs it; vLLM then finds it through
the ``vllm.general_plugins`` entry point ``highrank = highrank.integrations.vllm:register``
(pyproject.toml) and calls :func:`register` in every process it starts. Nothing else is
needed: ``vllm.LLM(model=FOLDER)`` or ``vllm serve FOLDER`` (no ``--trust-remote-code``).

What ``register`` does:

* the configuration: ``model_type = "highrank"`` becomes :class:`config.HighrankConfig`, a
  configuration class written for the transformers releases vLLM pins (5.16 to 5.19), not the
  ``hf`` extra's (5.23 and later, which vLLM's pins exclude);
* the model: the architecture ``HighrankForCausalLM`` becomes
  :class:`model.HighrankForCausalLM` (imported lazily, by vLLM, in the processes that build
  it), which runs vLLM's own model of the base architecture for the body (its attention, KV
  cache, batching) and the highrank head in ``compute_logits``.

The package imports only torch, ``highrank.heads`` and what transformers 5.16 to 5.19 and vLLM
offer; importing it (this module) imports neither vLLM nor transformers.
"""

from __future__ import annotations

from highrank.integrations.vllm.names import ARCHITECTURE, MODEL_CLASS, PLUGIN

_registered = False


def register() -> None:
    """vLLM's entry point: the highrank configuration and model class (idempotent)."""
    global _registered
    from vllm import ModelRegistry

    from highrank.integrations.vllm.config import register_config

    register_config()
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
    _registered = True


def registered() -> bool:
    """Whether :func:`register` ran in this process (vLLM skips plugins that its
    ``VLLM_PLUGINS`` variable leaves out)."""
    return _registered


__all__ = ["ARCHITECTURE", "PLUGIN", "register", "registered"]
