"""The post-grad pass that folds a sum of gradients into ``norm_bwd`` (``dy2``, ``dy3``): which
graphs it rewrites, that the rewritten graph computes the same, its place in inductor's config,
and a compiled training step on CPU."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import tilenorm  # noqa: F401  (registers the tilenorm:: ops)
from tilenorm.pytorch import graph_passes
from tilenorm.pytorch.functional import rms_norm
from tilenorm.testing import fresh_generator, rel_error

aten = torch.ops.aten
N = 16


def _norm_bwd(dy, h, w, rstd, **extra):
    """norm_bwd of an RMSNorm over the last dimension, no residual."""
    return torch.ops.tilenorm.norm_bwd(dy, None, h, w, None, None, rstd, 0.0, 1, False,
                                       torch.float32, None, **extra)


def _operands(g, terms=3, rows=(2, 3), dtype=torch.float32):
    """(a, ws, h, w, rstd): ``a @ ws[i]`` viewed as ``rows + (N,)`` are the sum's terms."""
    count = rows[0] * rows[1]
    a = torch.randn(count, N, generator=g, dtype=dtype)
    ws = [torch.randn(N, N, generator=g, dtype=dtype) for _ in range(terms)]
    h = torch.randn(*rows, N, generator=g)
    w = torch.rand(N, generator=g) + 0.5
    rstd = torch.rsqrt(h.square().mean(-1) + 1e-6)
    return a, ws, h, w, rstd


def _mm(a, w, rows=(2, 3)):
    return torch.mm(a, w).view(*rows, N)


def _trace(fn, *args, mode="fake"):
    return make_fx(fn, tracing_mode=mode)(*args)


def _norm_bwd_node(gm):
    nodes = [n for n in gm.graph.nodes if n.target is torch.ops.tilenorm.norm_bwd.default]
    assert len(nodes) == 1
    return nodes[0]


def _mm_of(node):
    """The mm behind a term (through its view), to say which term is which."""
    assert node.target in (aten.view.default, aten.reshape.default), node.target
    mm = node.args[0]
    assert mm.target is aten.mm.default
    return mm


def _weights(terms):
    """The placeholders that are the terms' mm weights, in the terms' order."""
    return [_mm_of(t).args[1].name for t in terms]


def three_mms(a, w1, w2, w3, h, w, rstd):
    return _norm_bwd(_mm(a, w1) + _mm(a, w2) + _mm(a, w3), h, w, rstd)


def three_mms_nested_right(a, w1, w2, w3, h, w, rstd):
    return _norm_bwd(_mm(a, w1) + (_mm(a, w2) + _mm(a, w3)), h, w, rstd)


def two_mms(a, w1, w2, h, w, rstd):
    return _norm_bwd(_mm(a, w1) + _mm(a, w2), h, w, rstd)


def _placeholder_names(gm):
    return [n.name for n in gm.graph.nodes if n.op == "placeholder"]


@pytest.mark.parametrize("mode", ["fake", "symbolic"])
@pytest.mark.parametrize("fn", [three_mms, three_mms_nested_right])
def test_three_matmul_gradients_fold_left_to_right(fn, mode):
    g, _ = fresh_generator()
    a, ws, h, w, rstd = _operands(g)
    gm = _trace(fn, a, *ws, h, w, rstd, mode=mode)
    terms = graph_passes.fold_terms(_norm_bwd_node(gm))
    assert terms is not None and _weights(terms) == _placeholder_names(gm)[1:4]


def test_two_matmul_gradients_fold():
    g, _ = fresh_generator()
    a, ws, h, w, rstd = _operands(g, terms=2)
    gm = _trace(two_mms, a, *ws, h, w, rstd)
    terms = graph_passes.fold_terms(_norm_bwd_node(gm))
    assert terms is not None and _weights(terms) == _placeholder_names(gm)[1:3]


def test_graph_inputs_and_custom_op_outputs_fold():
    """Terms in memory anyway: a graph input and an output of an opaque custom op."""
    g, _ = fresh_generator()
    a, (w1,), h, w, rstd = _operands(g, terms=1)
    dy = torch.randn(2, 3, N, generator=g)

    def fn(dy, a, w1, h, w, rstd):
        y = torch.ops.tilenorm.norm_fwd(h, w, None, None, 1e-6, 0.0, False, 1, False, None,
                                        None)[0]
        return _norm_bwd(dy + y + _mm(a, w1), h, w, rstd)

    gm = _trace(fn, dy, a, w1, h, w, rstd)
    terms = graph_passes.fold_terms(_norm_bwd_node(gm))
    assert terms is not None
    assert [t.op for t in terms] == ["placeholder", "call_function", "call_function"]
    assert terms[1].args[0].target is torch.ops.tilenorm.norm_fwd.default


def _pointwise_term(a, w1, w2, h, w, rstd):
    return _norm_bwd(_mm(a, w1) + _mm(a, w2) * 2, h, w, rstd)


def _four_terms(a, w1, w2, w3, w4, h, w, rstd):
    return _norm_bwd(_mm(a, w1) + _mm(a, w2) + _mm(a, w3) + _mm(a, w4), h, w, rstd)


def _inner_add_used_twice(a, w1, w2, w3, h, w, rstd):
    s = _mm(a, w1) + _mm(a, w2)
    return _norm_bwd(s + _mm(a, w3), h, w, rstd), s


def _sum_used_twice(a, w1, w2, h, w, rstd):
    s = _mm(a, w1) + _mm(a, w2)
    return _norm_bwd(s, h, w, rstd), s


def _broadcast(a, w1, w2, h, w, rstd):
    return _norm_bwd(_mm(a, w1) + torch.mm(a[:3], w2), h, w, rstd)


def _alpha(a, w1, w2, h, w, rstd):
    return _norm_bwd(torch.add(_mm(a, w1), _mm(a, w2), alpha=2), h, w, rstd)


def _same_add_twice(a, w1, w2, h, w, rstd):
    s = _mm(a, w1) + _mm(a, w2)
    return _norm_bwd(s + s, h, w, rstd)


def _dy_given_twice(a, w1, w2, w3, h, w, rstd):
    s = _mm(a, w1) + _mm(a, w2)
    return torch.ops.tilenorm.norm_bwd(s, s, h, w, None, None, rstd, 0.0, 1, False,
                                       torch.float32, torch.float32)


def _dy2_given(a, w1, w2, w3, h, w, rstd):
    return _norm_bwd(_mm(a, w1) + _mm(a, w2), h, w, rstd, dy2=_mm(a, w3))


def _single_term(a, w1, h, w, rstd):
    return _norm_bwd(_mm(a, w1), h, w, rstd)


@pytest.mark.parametrize("fn,terms", [
    (_pointwise_term, 2), (_four_terms, 4), (_inner_add_used_twice, 3), (_sum_used_twice, 2),
    (_broadcast, 2), (_alpha, 2), (_same_add_twice, 2), (_dy_given_twice, 3),
    (_dy2_given, 3), (_single_term, 1)])
def test_left_alone(fn, terms):
    g, _ = fresh_generator()
    a, ws, h, w, rstd = _operands(g, terms=terms)
    gm = _trace(fn, a, *ws, h, w, rstd)
    assert graph_passes.fold_terms(_norm_bwd_node(gm)) is None
    before = gm.code
    assert graph_passes.fold_norm_bwd_sums(gm.graph) == 0
    assert gm.graph.python_code("self").src == before


def test_mixed_dtypes_left_alone():
    """A bfloat16 term in a float32 sum (type promotion) is not y's gradient as it stands."""
    g, _ = fresh_generator()
    a, (w1,), h, w, rstd = _operands(g, terms=1)
    a16, (w2,), *_ = _operands(g, terms=1, dtype=torch.bfloat16)
    gm = _trace(lambda a, w1, a16, w2, h, w, rstd:
                _norm_bwd(_mm(a, w1) + _mm(a16, w2), h, w, rstd), a, w1, a16, w2, h, w, rstd)
    assert graph_passes.fold_terms(_norm_bwd_node(gm)) is None


def test_nodes_without_tensor_metadata_left_alone():
    g, _ = fresh_generator()
    a, ws, h, w, rstd = _operands(g)
    gm = _trace(three_mms, a, *ws, h, w, rstd)
    for node in gm.graph.nodes:
        node.meta.pop("val", None)
    assert graph_passes.fold_terms(_norm_bwd_node(gm)) is None
    assert graph_passes.fold_norm_bwd_sums(gm.graph) == 0


@pytest.mark.parametrize("fn,terms", [(three_mms, 3), (three_mms_nested_right, 3),
                                      (two_mms, 2)])
def test_rewrite_passes_the_terms_and_computes_the_same(fn, terms):
    g, seed = fresh_generator()
    operands = _operands(g, terms=terms)
    a, ws, h, w, rstd = operands
    gm = _trace(fn, a, *ws, h, w, rstd)
    want = gm(a, *ws, h, w, rstd)
    expected = graph_passes.fold_terms(_norm_bwd_node(gm))
    assert graph_passes.fold_norm_bwd_sums(gm.graph) == 1
    gm.graph.lint()
    gm.recompile()
    node = _norm_bwd_node(gm)
    assert [node.args[0], *node.kwargs.values()] == expected
    assert list(node.kwargs) == ["dy2", "dy3"][:terms - 1]
    assert not [n for n in gm.graph.nodes if n.target is aten.add.Tensor]
    got = gm(a, *ws, h, w, rstd)
    for x, y in zip(got, want, strict=True):
        assert rel_error(x, y) <= 1e-6, seed
    # A second run finds nothing left to fold.
    assert graph_passes.fold_norm_bwd_sums(gm.graph) == 0


def test_dy2_and_dy3_given_as_none_are_folded_over():
    g, _ = fresh_generator()
    a, ws, h, w, rstd = _operands(g)
    gm = _trace(three_mms, a, *ws, h, w, rstd)
    node = _norm_bwd_node(gm)
    node.args = (*node.args, None, None)
    want = gm(a, *ws, h, w, rstd)
    assert graph_passes.fold_norm_bwd_sums(gm.graph) == 1
    gm.recompile()
    assert len(node.args) == 12 and list(node.kwargs) == ["dy2", "dy3"]
    for x, y in zip(gm(a, *ws, h, w, rstd), want, strict=True):
        assert rel_error(x, y) <= 1e-6


# -- the pass in inductor's config ------------------------------------------------------------

@pytest.fixture
def pass_slot():
    """inductor's config with an empty ``post_grad_custom_post_pass``; afterwards as before."""
    from torch._inductor import config

    was_installed = graph_passes.installed()
    graph_passes.uninstall()
    saved = config.post_grad_custom_post_pass
    config.post_grad_custom_post_pass = None
    try:
        yield config
    finally:
        graph_passes.uninstall()
        config.post_grad_custom_post_pass = saved
        if was_installed and not graph_passes.installed():
            graph_passes.install()


def _recorder(log, name, uuid=None):
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class Recorder(CustomGraphPass):
        def __call__(self, graph):
            log.append((name, graph))

        def uuid(self):
            return uuid

    return Recorder()


def test_install_is_idempotent_and_uninstall_restores(pass_slot):
    from torch._inductor.custom_graph_pass import CustomGraphPass

    graph_passes.install()
    ours = pass_slot.post_grad_custom_post_pass
    assert isinstance(ours, CustomGraphPass) and graph_passes.installed()
    assert isinstance(ours.uuid(), bytes) and ours.uuid() == graph_passes.pass_class()().uuid()
    graph_passes.install()
    assert pass_slot.post_grad_custom_post_pass is ours
    graph_passes.uninstall()
    assert pass_slot.post_grad_custom_post_pass is None and not graph_passes.installed()
    graph_passes.uninstall()
    assert pass_slot.post_grad_custom_post_pass is None


@pytest.mark.parametrize("kind", ["single", "list", "tuple"])
def test_install_chains_the_pass_already_there(pass_slot, kind):
    log = []
    previous = [_recorder(log, "first", b"1"), _recorder(log, "second", b"2")]
    previous = {"single": previous[0], "list": previous, "tuple": tuple(previous)}[kind]
    pass_slot.post_grad_custom_post_pass = previous
    graph_passes.install()
    ours = pass_slot.post_grad_custom_post_pass
    assert ours is not previous and graph_passes.installed()
    names, uuids = (["first"], (b"1",)) if kind == "single" else (["first", "second"],
                                                                    (b"1", b"2"))
    assert ours.uuid() == (graph_passes.pass_class()().uuid(), *uuids)

    # The chained passes see the graph after the fold.
    g, _ = fresh_generator()
    a, ws, h, w, rstd = _operands(g)
    gm = _trace(three_mms, a, *ws, h, w, rstd)
    ours(gm.graph)
    assert [name for name, _ in log] == names
    assert all(graph is gm.graph for _, graph in log)
    assert "dy3" in _norm_bwd_node(gm).kwargs

    graph_passes.uninstall()
    assert pass_slot.post_grad_custom_post_pass is previous


def test_chained_pass_without_uuid_turns_the_cache_off(pass_slot):
    pass_slot.post_grad_custom_post_pass = _recorder([], "no uuid")
    graph_passes.install()
    assert pass_slot.post_grad_custom_post_pass.uuid() is None


def test_uninstall_leaves_a_replaced_config_alone(pass_slot):
    graph_passes.install()
    theirs = _recorder([], "theirs", b"t")
    pass_slot.post_grad_custom_post_pass = theirs
    graph_passes.uninstall()
    assert pass_slot.post_grad_custom_post_pass is theirs


# -- a compiled training step -----------------------------------------------------------------

class Layer(torch.nn.Module):
    """An attention-like norm feeding three projections, an MLP-like norm feeding two."""

    def __init__(self, n=32):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.rand(n) + 0.5)
        self.w2 = torch.nn.Parameter(torch.rand(n) + 0.5)
        self.q, self.k, self.v = (torch.nn.Linear(n, n) for _ in range(3))
        self.gate, self.up = torch.nn.Linear(n, n), torch.nn.Linear(n, n)

    def forward(self, x):
        y = rms_norm(x, self.w1, 1e-6)
        x = x + self.q(y) * self.k(y) + self.v(y)
        y = rms_norm(x, self.w2, 1e-6)
        return torch.nn.functional.silu(self.gate(y)) * self.up(y)


def _can_compile_on_cpu():
    from torch._inductor import cpp_builder

    try:
        return shutil.which(cpp_builder.get_cpp_compiler()) is not None
    except Exception:
        return False


@pytest.mark.skipif(not _can_compile_on_cpu(), reason="inductor's CPU backend needs a C++ "
                                                       "compiler")
def test_compiled_step_folds_and_matches_eager(pass_slot, compiled_as_custom_ops):
    from torch._functorch import config as functorch_config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    seen = []

    class Record(CustomGraphPass):
        """Runs after the fold: each norm_bwd's gradient arguments, as inductor has them."""

        def __call__(self, graph):
            for n in graph.nodes:
                if n.target is torch.ops.tilenorm.norm_bwd.default:
                    seen.append({name: (term.target, term.args[0].target)
                                 for name, term in (("dy", n.args[0]), *n.kwargs.items())})

        def uuid(self):
            return None  # inductor's caches off: the passes run

    pass_slot.post_grad_custom_post_pass = Record()  # tracing puts the fold before it
    g, seed = fresh_generator()
    torch.manual_seed(seed)
    model = Layer()
    x = torch.randn(2, 5, 32, generator=g, requires_grad=True)
    dout = torch.randn(2, 5, 32, generator=g)

    def step(fn):
        x.grad = None
        model.zero_grad()
        fn(x).backward(dout)
        return [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]

    torch._dynamo.reset()
    with pass_slot.patch(fx_graph_cache=False), functorch_config.patch(
            enable_autograd_cache=False):
        got = step(torch.compile(model, backend="inductor", fullgraph=True))
    torch._dynamo.reset()
    want = step(model)
    for a, b in zip(got, want, strict=True):
        assert rel_error(a, b) <= 1e-5, seed

    assert sorted(list(args) for args in seen) == [["dy", "dy2"], ["dy", "dy2", "dy3"]]
    views = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
    for args in seen:
        assert all(view in views and mm is aten.mm.default for view, mm in args.values()), args


def test_tracing_the_ops_installs_the_pass(pass_slot):
    """The ops' fake implementations install the pass, not the import of tilenorm."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert not graph_passes.installed()
    with FakeTensorMode():
        x = torch.empty(4, 64)
        torch.ops.tilenorm.norm_fwd(x, None, None, None, 1e-6, 0.0, False, 1, False, None,
                                    None)
    assert graph_passes.installed()
