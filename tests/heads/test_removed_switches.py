"""The path switches ``reference_paths()`` replaced are refused, not silently ignored."""

from __future__ import annotations

import pytest
import torch

from highrank.heads import HEADS, build_head
from highrank.heads.kernels.paths import REMOVED_SWITCHES


@pytest.mark.parametrize("switch", REMOVED_SWITCHES)
def test_setting_a_removed_switch_on_a_head_class_is_refused(switch):
    head_class = HEADS["mos"]
    with pytest.raises(AttributeError, match=f"{switch}.*reference_paths"):
        setattr(head_class, switch, False)
    assert switch not in vars(head_class)


@pytest.mark.parametrize("switch", REMOVED_SWITCHES)
def test_setting_a_removed_switch_on_a_head_object_is_refused(switch):
    head = build_head("softmax", d_in=4, vocab_size=9)
    with pytest.raises(AttributeError, match=f"{switch}.*reference_paths"):
        setattr(head, switch, False)


def test_a_subclass_defining_a_removed_switch_is_refused():
    with pytest.raises(AttributeError, match="fused_loss"):
        type("Patched", (HEADS["mixtape"],), {"fused_loss": False})


def test_other_attributes_are_set_as_before():
    head = build_head("mos", d_in=4, vocab_size=9, n_components=2)
    head.note = "kept"
    HEADS["mos"].note_for_test = 1
    try:
        assert head.note == "kept" and head.note_for_test == 1
        assert torch.isfinite(head.log_prob(torch.randn(2, 4))).all()
    finally:
        del HEADS["mos"].note_for_test
