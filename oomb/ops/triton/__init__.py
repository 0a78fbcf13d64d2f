"""Triton kernels of oomb (an optional dependency: nothing here is imported until a Triton path runs).

Layers, each importing only the ones above it:

* :mod:`.interpreter` -- whether the kernels run in Triton's CPU interpreter;
* :mod:`.autotune` -- autotune config lists, the fp32-only tile, restoring pools between autotune runs, and
  :class:`~.autotune.TunedKernel` (one kernel tuned over its full list or its first entry, ``autotune``);
* :mod:`.tma` -- when a launch reads tiles through tensor descriptors (TMA), and their scratch allocator;
* :mod:`.tiles` -- ``@triton.jit`` tile helpers shared by the attention kernels;
* kernels: :mod:`.paged_fwd_kernel`, :mod:`.paged_bwd_kernels`, :mod:`.sparse_kernels`, :mod:`.lse_merge`,
  :mod:`.page_gather`;
* :mod:`.inputs` -- the launchers' checks and output allocations;
* functionals (launchers): :mod:`.paged_attention` (``paged_attention_fwd`` / ``paged_attention_bwd``),
  :mod:`.sparse_attention` (``sparse_attention_fwd`` / ``sparse_attention_bwd``).

The autograd Functions over these (and over the PyTorch references) are :mod:`oomb.ops.paged_attention` and
:mod:`oomb.ops.sparse_attention`.
"""
