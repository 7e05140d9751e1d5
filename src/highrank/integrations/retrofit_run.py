"""Old home of ``highrank retrofit``'s orchestration, kept for old imports: the verb lives in
:mod:`highrank.integrations.retrofit.run` (its plan in ``retrofit.plan``)."""

from highrank.integrations.retrofit.cache import load_cache
from highrank.integrations.retrofit.plan import DEFAULT_LR, MODES, RetrofitError, RetrofitPlan
from highrank.integrations.retrofit.run import LORA_TARGETS, retrofit

__all__ = ["DEFAULT_LR", "LORA_TARGETS", "MODES", "RetrofitError", "RetrofitPlan", "load_cache",
           "retrofit"]
