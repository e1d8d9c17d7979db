"""Eager autograd over the prepared calls: a ``torch.autograd.Function`` straight to the
kernels (the custom-op dispatcher would add ~8 us a call, ``../shared/FINDINGS.md``)."""

from __future__ import annotations

import torch

from tilenorm.pytorch.calls import backward_call


class NormFunction(torch.autograd.Function):
    """Returns y, or (y, h) with a fused residual add."""

    @staticmethod
    def forward(ctx, prepared, x, weight, bias, residual):
        """``prepared``: the call's :class:`ForwardCall` (``.call``) with its eps and
        offset."""
        call, offset = prepared.call, prepared.offset
        y, h, mean, rstd = call.run(x, weight, bias, residual, prepared.eps, offset)
        ctx.save_for_backward(h, weight, bias, mean, rstd)
        ctx.call, ctx.offset, ctx.x_dtype = call, offset, x.dtype
        ctx.residual_dtype = None if residual is None else residual.dtype
        if residual is None:
            return y
        return y, h

    @staticmethod
    def backward(ctx, dy, dh=None):
        h, weight, bias, mean, rstd = ctx.saved_tensors
        call = ctx.call
        # The saved operands' layouts are the forward call's: only the gradients' can vary.
        key = (dy.shape, dy.stride(), dy.dtype, None if dh is None else (dh.stride(), dh.dtype),
               ctx.offset != 0)
        bwd = call.backward_calls.get(key)
        if bwd is None:
            bwd = call.backward_calls[key] = backward_call(
                call.spec, dy, dh, h, weight, bias, ctx.offset, ctx.x_dtype, ctx.residual_dtype)
        dx, dres, dweight, dbias = bwd.run(dy, dh, h, weight, bias, mean, rstd, ctx.offset)
        return None, dx, dweight, dbias, dres
