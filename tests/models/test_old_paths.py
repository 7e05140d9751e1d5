"""The paths the models package had before issue 31 still give the same objects.

``highrank.model`` (LanguageModel, the builders, load_run) and ``highrank.backbones`` (AWD-LSTM
and its regularizers) re-export ``highrank.models``; code written against them keeps working.
"""

from __future__ import annotations

import subprocess
import sys

import highrank.backbones
import highrank.model
import highrank.models
import highrank.models.backbones
import highrank.models.language_model
import highrank.models.load


def test_highrank_model_re_exports_the_models_package():
    for name in highrank.model.__all__:
        assert getattr(highrank.model, name) is getattr(highrank.models, name), name
    assert highrank.model.build_model is highrank.models.language_model.build_model
    assert highrank.model.load_run is highrank.models.load.load_run
    assert highrank.model.MODEL_BUILDERS is highrank.models.MODEL_BUILDERS
    assert set(highrank.model.__all__) == {
        "LanguageModel", "MODEL_BUILDERS", "build_model", "build_seq2seq",
        "check_layers_read", "count_parameters", "load_run", "load_run_corpus",
    }  # fmt: skip


def test_highrank_backbones_re_exports_the_backbones():
    for name in highrank.backbones.__all__:
        assert getattr(highrank.backbones, name) is getattr(highrank.models.backbones, name), name
    assert highrank.backbones.AWDLSTM is highrank.models.AWDLSTM
    assert "variable_bptt_length" in highrank.backbones.__all__


def test_the_old_paths_import_in_a_fresh_process():
    code = (
        "from highrank.model import LanguageModel, build_model, load_run, load_run_corpus\n"
        "from highrank.backbones import AWDLSTM, LockedDropout, variable_bptt_length\n"
        "import highrank.models as m\n"
        "assert build_model is m.build_model and AWDLSTM is m.AWDLSTM\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
