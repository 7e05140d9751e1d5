"""The classes of a model saved by highrank, for tools that load it in a fresh process.

``HighrankConfig.save_pretrained`` copies this file into every saved folder and points the
folder's ``auto_map`` at it, so that a process which never imported highrank, such as
``lm_eval --model hf --model_args pretrained=FOLDER,trust_remote_code=True``, can load the
model with ``AutoModelForCausalLM``. The only "remote code" it runs is this import of the
*installed* highrank (``pip install highrank[hf]``): the model's code is never copied.

In vLLM's process (``--trust-remote-code``), whose transformers is older than the ``hf``
extra's, only highrank's vLLM plugin can serve the folder; without it vLLM's Transformers
backend would be left to read it, so the import refuses, in one line naming the plugin.
"""

import sys

try:
    from highrank.integrations.hf import HighrankConfig, HighrankForCausalLM  # noqa: F401
except ImportError:
    if "vllm" not in sys.modules:
        raise
    _NO_PLUGIN = (
        "this folder holds a highrank model, which vLLM serves only through highrank's vLLM "
        "plugin: pip install 'highrank[vllm]' in vLLM's environment"
    )
    try:
        from highrank.integrations.vllm import registered
        from highrank.integrations.vllm.config import HighrankConfig  # noqa: F401
    except ImportError:
        raise ImportError(_NO_PLUGIN) from None
    if not registered():
        _NO_PLUGIN += " (installed, but VLLM_PLUGINS leaves out 'highrank')"
        raise ImportError(_NO_PLUGIN) from None
