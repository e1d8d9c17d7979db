"""Operand layouts as the kernels see them: any (..., N) array folded, without a copy where
its strides allow, into a (rows, heads, N) view. Framework-neutral: shapes and strides in
elements, as tuples."""

from __future__ import annotations


def view_3d(shape: tuple[int, ...], strides: tuple[int, ...], keep_heads: bool
            ) -> tuple[tuple[int, int, int], tuple[int, int, int]] | None:
    """(shape, strides) of a (rows, heads, N) view of an array with this shape and these
    strides, or None when its leading dimensions do not fold into two. With ``keep_heads``
    the heads axis is exactly the second-to-last dimension."""
    n, n_stride = shape[-1], strides[-1]
    groups: list[list[int]] = []  # [size, stride], innermost first
    lead = list(zip(shape[:-1], strides[:-1], strict=True))
    if keep_heads:
        groups.append([lead[-1][0], lead[-1][1]])
        lead = lead[:-1]
    for size, stride in reversed(lead):
        if size == 1:
            continue
        # Fold into the group outside it when contiguous with it, never into the kept heads.
        if groups and not (keep_heads and len(groups) == 1) and \
                stride == groups[-1][0] * groups[-1][1]:
            groups[-1][0] *= size
        else:
            groups.append([size, stride])
    if len(groups) > 2:
        return None
    if not keep_heads and len(groups) == 1:
        groups.insert(0, [1, 0])  # one folded leading group: all rows, one head
    while len(groups) < 2:
        groups.append([1, 0])
    (h, h_stride), (a, a_stride) = groups
    return (a, h, n), (a_stride, h_stride, n_stride)


def max_offset(shape: tuple[int, ...], strides: tuple[int, ...]) -> int:
    """The largest element offset from the first element of an array with these strides."""
    return sum((s - 1) * st for s, st in zip(shape, strides, strict=True))


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of a dense array of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def view_strides(shape3: tuple[int, ...], strides3: tuple[int, ...]) -> tuple[int, ...]:
    """The strides ``torch.Tensor.view`` gives a (rows, heads, cols) view: a dimension of
    size one takes the stride of the dimension inside it times that dimension's size. Its
    value addresses nothing; cuTile specializes on it, so the lean launch keeps torch's (and
    the JAX launch the same, to share the compiled variants)."""
    out = list(strides3)
    for d in range(len(shape3) - 2, -1, -1):
        if shape3[d] == 1:
            out[d] = out[d + 1] * shape3[d + 1]
    return tuple(out)
