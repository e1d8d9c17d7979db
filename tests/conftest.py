import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU host)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def compiled_as_custom_ops(monkeypatch):
    """Under torch.compile every norm is tilenorm's custom op, however small (the tests' shapes
    are small enough to be left to inductor otherwise: tilenorm.dispatch.compiled_by_inductor)."""
    from tilenorm import dispatch

    monkeypatch.setattr(dispatch, "COMPILED_INDUCTOR_MAX_BYTES", -1)
