"""tilenorm.benchmark.graph_ms's capture retry, on the CPU: the CUDA calls stand in as fakes,
the capture is what fails."""

import contextlib
import types

import pytest
import torch

from tilenorm import benchmark


class _Graph:
    def replay(self):
        pass


class _Event:
    def record(self):
        pass

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return 2.0


@pytest.fixture
def fake_cuda(monkeypatch):
    stream = types.SimpleNamespace(wait_stream=lambda other: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing: _Event())


def _failing_captures(monkeypatch, errors):
    """_capture raises each of ``errors`` in turn, then captures; returns the call count."""
    calls = []

    def capture(fn, calls_per_graph):
        calls.append(calls_per_graph)
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return _Graph()

    monkeypatch.setattr(benchmark, "_capture", capture)
    return calls


INVALIDATED = torch.AcceleratorError(
    "CUDA error: operation failed due to a previous error during capture")


def test_an_invalidated_capture_is_retried_once(fake_cuda, monkeypatch):
    calls = _failing_captures(monkeypatch, [INVALIDATED])
    assert benchmark.graph_ms(lambda: None, calls_per_graph=10) == pytest.approx(0.2)
    assert len(calls) == 2


def test_a_second_invalidated_capture_is_the_providers(fake_cuda, monkeypatch):
    calls = _failing_captures(monkeypatch, [INVALIDATED, INVALIDATED])
    with pytest.raises(torch.AcceleratorError, match="during capture"):
        benchmark.graph_ms(lambda: None)
    assert len(calls) == 2


def test_other_capture_errors_are_not_retried(fake_cuda, monkeypatch):
    calls = _failing_captures(monkeypatch, [torch.AcceleratorError("CUDA error: out of memory")])
    with pytest.raises(torch.AcceleratorError, match="out of memory"):
        benchmark.graph_ms(lambda: None)
    assert len(calls) == 1
