"""Bridges from highrank to other libraries; each lives in its own module, imported on demand.

* ``highrank.integrations.hf``: any highrank head inside a Hugging Face ``transformers`` causal
  LM (``attach_head``), saved and reloaded with ``AutoModelForCausalLM``. Needs the ``hf``
  extra: ``pip install -e '.[hf]'``.

This package imports nothing itself, so ``import highrank`` never pulls in an optional extra.
"""
