"""bench/tune_norm.py's settings variants on the CPU: the fields a variant replaces and the
module attributes its patch sets, restored after."""

from __future__ import annotations

import pytest

from bench import tune_norm
from tilenorm import dispatch
from tilenorm.settings import SM90

OFF = {"rms_norm": {}, "layer_norm": {}}


def test_a_variant_replaces_its_fields_and_leaves_its_patch_to_patched():
    variant = {"cute_forward_two_pass": OFF,
               tune_norm.PATCH: {"tilenorm.dispatch.CUTE_FORWARD_MIN_BYTES": 0}}
    settings = tune_norm.variant_settings(variant, SM90)
    assert settings.cute_forward_two_pass == OFF != SM90.cute_forward_two_pass
    assert settings.cute_forward == SM90.cute_forward
    with pytest.raises(SystemExit, match="unknown settings"):
        tune_norm.variant_settings({"no_such_table": {}}, SM90)


def _bound() -> int:
    return dispatch.CUTE_FORWARD_MIN_BYTES


def test_patched_sets_each_attribute_for_the_block_and_restores_it():
    before = _bound()
    assert before > 0
    with tune_norm.patched({"tilenorm.dispatch.CUTE_FORWARD_MIN_BYTES": 0}):
        assert _bound() == 0
    assert _bound() == before
    # A name that is not there fails before the block, and what was set is restored.
    with (pytest.raises(SystemExit, match="no attribute NO_SUCH"),
          tune_norm.patched({"tilenorm.dispatch.CUTE_FORWARD_MIN_BYTES": 1,
                             "tilenorm.dispatch.NO_SUCH": 1})):
        pytest.fail("the block ran")
    assert _bound() == before
