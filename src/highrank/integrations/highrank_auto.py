"""The classes of a model saved by highrank, for tools that load it in a fresh process.

``HighrankConfig.save_pretrained`` copies this file into every saved folder and points the
folder's ``auto_map`` at it, so that a process which never imported highrank, such as
``lm_eval --model hf --model_args pretrained=FOLDER,trust_remote_code=True``, can load the
model with ``AutoModelForCausalLM``. The only "remote code" it runs is this import of the
*installed* highrank (``pip install highrank[hf]``): the model's code is never copied.
"""

from highrank.integrations.hf import HighrankConfig, HighrankForCausalLM  # noqa: F401
