"""Retrofitting a new output layer onto a pretrained causal LM: ``highrank retrofit``.

The frozen-body protocol ("frozen mode"): keep a pretrained Transformer LM's body frozen, and
train only its output layer, replaced by the layer under study, so that every candidate head
sees exactly the same hidden states. It is a cheaper protocol of its own, not Softmax-CPR's:
Chang & McCallum (2023, "Revisiting the Architectures like Pointer Networks to Efficiently
Improve the Next Word Distribution, Summarization Factuality, and Beyond"; iesl/Softmax-CPR)
fine-tune the *whole* GPT-2 with the new head (one epoch of OpenWebText, lr 1e-5, batches of
4 x 200 tokens), which is ``--mode full``; ``--mode lora`` trains LoRA adapters of the body with
the head. Because the frozen body's final hidden states (the input of ``lm_head``: after the
final norm) do not change, they are computed once and cached; every head is then trained and
evaluated on the cache alone, which is what makes the comparison affordable.

The modules, in the order a run uses them:

    plan.py    RetrofitPlan (OUT/plan.json), MODES, RetrofitError: checked before any work
    cache.py   the frozen body's hidden states cached (cache_hidden_states, load_cache,
               FeatureCache); head_from_lm_head: a head warm-started from the model's lm_head
    train.py   ONE training loop for every mode (train_loop; train_head over cached rows,
               train_windows over windows): TrainBudget, the non-finite guard, signals,
               state.pt
    score.py   ONE perplexity tally (Tally): evaluate_head over a cache (KL from a reference,
               the matrix for the rank instruments), score_windows over windows
    run.py     the verb: retrofit(plan, progress=, restart=)

Every public name of those modules is importable from here (and, for old imports,
:mod:`highrank.integrations.retrofit_run` keeps the verb's).
"""

from highrank.causal_lm import window_tokens
from highrank.integrations.retrofit.cache import (
    CACHE_DTYPES,
    FEATURES_FILE,
    META_FILE,
    PROGRESS_FILE,
    TARGETS_FILE,
    CacheSettingsError,
    FeatureCache,
    SavedFileError,
    cache_hidden_states,
    check_head_fits,
    head_from_lm_head,
    load_cache,
    output_layer,
    read_record,
    tokens_sha256,
)
from highrank.integrations.retrofit.plan import (
    DEFAULT_LR,
    MODES,
    RetrofitError,
    RetrofitPlan,
    check_out,
    read_plan,
    resolve_device,
)
from highrank.integrations.retrofit.run import (
    LORA_TARGETS,
    check_before_loading,
    dry_run,
    effective_budget,
    make_trainable,
    retrofit,
)
from highrank.integrations.retrofit.score import (
    Tally,
    evaluate_head,
    finite_perplexity,
    score_windows,
)
from highrank.integrations.retrofit.train import (
    MAX_NONFINITE_STEPS,
    RESTART_ADVICE,
    NonFiniteSteps,
    TrainBudget,
    Trainee,
    all_finite_parameters,
    batch_indices,
    check_finite_tensors,
    check_history,
    check_saved_budget,
    load_train_state,
    read_train_state,
    save_train_state,
    step_record,
    train_head,
    train_loop,
    train_windows,
    training_summary,
)

__all__ = [
    "CACHE_DTYPES",
    "DEFAULT_LR",
    "FEATURES_FILE",
    "LORA_TARGETS",
    "MAX_NONFINITE_STEPS",
    "META_FILE",
    "MODES",
    "PROGRESS_FILE",
    "RESTART_ADVICE",
    "TARGETS_FILE",
    "CacheSettingsError",
    "FeatureCache",
    "NonFiniteSteps",
    "RetrofitError",
    "RetrofitPlan",
    "SavedFileError",
    "Tally",
    "TrainBudget",
    "Trainee",
    "all_finite_parameters",
    "batch_indices",
    "cache_hidden_states",
    "check_before_loading",
    "check_finite_tensors",
    "check_head_fits",
    "check_history",
    "check_out",
    "check_saved_budget",
    "dry_run",
    "effective_budget",
    "evaluate_head",
    "finite_perplexity",
    "head_from_lm_head",
    "load_cache",
    "load_train_state",
    "make_trainable",
    "output_layer",
    "read_plan",
    "read_record",
    "read_train_state",
    "resolve_device",
    "retrofit",
    "save_train_state",
    "score_windows",
    "step_record",
    "tokens_sha256",
    "train_head",
    "train_loop",
    "train_windows",
    "training_summary",
    "window_tokens",
]
