"""Weight gradients of ``nn.Linear`` layers accumulated inside the matrix product (Stage 2).

Stage 2 back-propagates chunk by chunk, so autograd's default path computes each chunk's
weight gradient into a new tensor and then adds it into ``.grad``: per chunk one write of every
weight gradient, then a read of both and a write (~46 GB of traffic per chunk for a 7.6B bf16
model, ~0.08 s of a 32K-token step on an H200). Inside :class:`FusedWeightGradAccumulation`
a patched ``nn.Linear.forward`` uses :class:`_LinearAccumulateGrad`, whose backward adds the
chunk's gradient straight into the existing ``.grad`` with one ``addmm_`` (the GEMM reads and
writes ``.grad``; beta = 1): the same sum, with one rounding less (the product is not rounded
before the add). This is Megatron-LM's "gradient accumulation fusion" (Narayanan et al. 2021,
``--gradient-accumulation-fusion``), here into the parameter's own ``.grad``.

Where the default path is kept: the first chunk that creates ``.grad`` (the GEMM has nothing to
add into), a ``.grad`` of another dtype, shape or layout, parameters with gradient hooks (e.g.
:class:`oomb.engine.grad_accum.Float32GradAccumulator`), frozen weights (peft's base layers),
modules that already carry an instance-level ``forward``, calls under ``torch.autocast``, and
everything when the context is made with ``enabled=False`` (:attr:`oomb.config.KernelConfig.fused_wgrad`; A/B
runs).

Scope: the engine enters the context around its own Stage-2 ``backward()`` calls only. Inside it a
patched weight's gradient never reaches autograd once ``.grad`` exists, so a
``torch.autograd.grad(...)`` or ``backward(inputs=...)`` that leaves the weight out still adds into
its ``.grad``, and a hook registered on the weight after entry sees None; hooks present at entry
exclude their layer.

Under FSDP2 sharding (:mod:`oomb.engine.sharding`) the patched layers see the gathered (unsharded) weight FSDP2
puts on the module for the forward, and add into its ``.grad``: FSDP2 reduce-scatters that ``.grad`` (``params``:
after every chunk, so each chunk's first GEMM takes the default path; ``grads-optim``: once per step, so the
GEMM sums the whole step in place).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["FusedWeightGradAccumulation"]


def _fusable(weight: torch.Tensor) -> bool:
    g = weight.grad
    return (g is not None and g.dtype == weight.dtype and g.shape == weight.shape and g.is_contiguous()
            and not g.is_sparse)


def _has_hooks(p: torch.Tensor) -> bool:
    return bool(getattr(p, "_post_accumulate_grad_hooks", None)) or bool(getattr(p, "_backward_hooks", None))


class _LinearAccumulateGrad(torch.autograd.Function):
    """``F.linear`` whose backward adds the weight gradient into ``weight.grad`` in place where it can."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        # The Parameter itself: a saved tensor unpacked under activation checkpointing is another
        # tensor object (without the parameter's .grad).
        ctx.param = weight
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out.matmul(weight)
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])
            if _fusable(ctx.param):
                ctx.param.grad.addmm_(g2.t(), x2)  # .grad += g^T x, one GEMM with beta = 1
            else:
                grad_w = g2.t().mm(x2)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.sum(0)
        return grad_x, grad_w, grad_b


def _forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    # Under autocast F.linear casts its inputs, which the saved tensors would not match: the default path.
    if torch.is_grad_enabled() and module.weight.requires_grad and not torch.is_autocast_enabled(x.device.type):
        return _LinearAccumulateGrad.apply(x, module.weight, module.bias)
    return F.linear(x, module.weight, module.bias)


class FusedWeightGradAccumulation:
    """Context manager: the trainable ``nn.Linear`` layers of ``model`` accumulate weight gradients in the GEMM.

    Patches the ``forward`` of every module whose type is exactly ``torch.nn.Linear``, whose weight
    requires grad and has no gradient hooks, and that has no instance-level ``forward`` already;
    restores them on exit (also after an error).

    Args:
        model: the module whose ``nn.Linear`` layers are patched.
        enabled: False: the context does nothing (autograd's default path everywhere).

    Raises:
        ValueError: ``enabled`` not a bool.
    """

    def __init__(self, model: torch.nn.Module, enabled: bool = True) -> None:
        if not isinstance(enabled, bool):
            raise ValueError(f"FusedWeightGradAccumulation: enabled must be True or False; got {enabled!r}")
        self.model = model
        self.enabled = enabled
        self._patched: list[torch.nn.Linear] = []

    def __enter__(self) -> "FusedWeightGradAccumulation":
        if not self.enabled:
            return self
        for m in self.model.modules():
            if (type(m) is torch.nn.Linear and m.weight.requires_grad and not _has_hooks(m.weight)
                    and "forward" not in m.__dict__):
                m.forward = _forward.__get__(m)  # bound to this instance only
                self._patched.append(m)
        return self

    def __exit__(self, *exc) -> None:
        for m in self._patched:
            m.__dict__.pop("forward", None)
        self._patched.clear()
