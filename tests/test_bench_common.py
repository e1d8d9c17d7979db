"""bench/common.py on the CPU: a record refuses to start while tilenorm's rows would time its
reference path (its kernels experimental and experimental kernels off)."""

from __future__ import annotations

import argparse

import pytest

import tilenorm
from bench import common
from tilenorm import validation
from tilenorm._experimental import experimental_enabled


def test_a_record_refuses_experimental_kernels_unless_asked(monkeypatch):
    monkeypatch.setattr(validation, "is_stable", lambda family: family.name != "cutile/norm")
    monkeypatch.setattr(common, "copy_gbps", lambda: pytest.fail("measured before the check"))
    previous = experimental_enabled()
    tilenorm.set_experimental(False)
    try:
        with pytest.raises(SystemExit, match="cutile/norm kernels are experimental"):
            common.new_record(argparse.Namespace(experimental=False))
        # Another op's families decide only for that op's benchmark.
        with pytest.raises(RuntimeError, match="copied"):
            monkeypatch.setattr(common, "copy_gbps",
                                lambda: (_ for _ in ()).throw(RuntimeError("copied")))
            common.new_record(argparse.Namespace(experimental=False),
                              families=("cute/norm-fp8",))
    finally:
        tilenorm.set_experimental(previous)
