"""Float32 accumulation of the per-chunk parameter gradients of one step (``OOMBConfig.grad_accum_dtype``).

Stage 2 back-propagates one chunk at a time, so autograd adds each chunk's weight gradient
into ``.grad``: N roundings to the parameter dtype for N chunks, where full-sequence training
computes each weight gradient in one matrix product (float32 accumulation) and rounds it once.
In bfloat16 the running sum loses the small per-chunk increments: on a tiny Qwen2 model
(1,024 tokens, CPU, against a float64 reference) the worst parameter's gradient error was
1.44x the full-sequence bf16 error with 16 chunks and 2.90x with 128 (median 1.08x / 1.56x);
a 1M-token sequence has 256 chunks of 4,096. With ``grad_accum_dtype='float32'`` each
low-precision trainable parameter's gradients are summed in a float32 buffer (a
``register_post_accumulate_grad_hook`` moves each chunk's gradient there and frees it) and
rounded into ``.grad`` once, at the end of the step.

Memory: 4 bytes per such parameter during the step instead of its gradient's 2 (bf16/fp16),
e.g. +14.2 GiB for a 7.6B-parameter full fine-tune; nothing for float32 parameters (peft's LoRA
adapters are float32) or frozen ones.

Under FSDP2 sharding (:mod:`oomb.engine.sharding`) the accumulator is given the parameters' shards
(``Sharding.parameters``, not ``model.parameters()``, which yields the gathered weight of a unit FSDP2 holds
gathered, whose ``.grad`` FSDP2 must reduce): FSDP2 calls its hooks after each chunk's reduce-scatter
(``params``), so the float32 sums are of 1/W of the gradient. With ``grads-optim`` FSDP2 keeps the unsharded
sums in float32 itself (reduce dtype float32) and the engine does not use this class.
"""

from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["LOW_PRECISION", "Float32GradAccumulator", "extra_grad_bytes"]

LOW_PRECISION = (torch.bfloat16, torch.float16)


def _accumulated(params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    seen, out = set(), []
    for p in params:
        if p.requires_grad and p.dtype in LOW_PRECISION and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def extra_grad_bytes(params: Iterable[torch.nn.Parameter]) -> int:
    """Bytes the float32 buffers add during a step over what ``.grad`` holds now: 4 per element of each
    low-precision trainable parameter, less its current gradient's bytes."""
    total = 0
    for p in _accumulated(params):
        total += 4 * p.numel() - (p.grad.numel() * p.grad.element_size() if p.grad is not None else 0)
    return total


class Float32GradAccumulator:
    """Context manager around Stage 2: sums the low-precision parameters' gradients in float32.

    On entry an existing ``.grad`` (earlier sequences of a gradient-accumulation step) becomes the
    start of the float32 sum and ``.grad`` is cleared; each backward's gradient is then added to the
    sum and freed as soon as autograd has accumulated it; on exit (also after an error) ``.grad`` is
    the sum rounded once to the parameter dtype, and the hooks are removed. Float32/float64 and
    frozen parameters are left alone.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        self.params = _accumulated(params)
        self._sums: dict[int, torch.Tensor] = {}
        self._handles: list = []

    def __enter__(self) -> "Float32GradAccumulator":
        for p in self.params:
            if p.grad is not None:
                self._sums[id(p)] = p.grad.float()
                p.grad = None
            self._handles.append(p.register_post_accumulate_grad_hook(self._add))
        return self

    def _add(self, p: torch.Tensor) -> None:
        s = self._sums.get(id(p))
        if s is None:
            self._sums[id(p)] = p.grad.float()
        else:
            s.add_(p.grad)
        p.grad = None

    def __exit__(self, *exc) -> bool:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for p in self.params:  # one parameter at a time: the float32 sum is freed as its .grad appears
            s = self._sums.pop(id(p), None)
            if s is not None:
                p.grad = s.to(p.dtype)
        return False
