"""Autotune configs of the attention kernels, and :class:`TunedKernel`: one kernel, autotuned over its full list or
its first entry.

A config is ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``. The ``autotune`` setting
(:attr:`oomb.config.KernelConfig.autotune`) picks, per launch:

* ``'full'``: every config of the kernel's list is measured once per autotune key (cached on disk);
* ``'first'``: only the list's first entry (test runs compile dozens of small shapes, and autotuning each over
  every config takes seconds per compile).

Both add the fp32-only tile (:data:`FP32_TILE`); under the interpreter every kernel has one small config.
"""

from __future__ import annotations

import torch
import triton

from .interpreter import INTERPRET

__all__ = ["AUTOTUNE", "AUTOTUNE_KEY", "FP32_TILE", "PRUNE", "RestoreRows", "TunedKernel", "check_autotune",
           "configs", "gpu_configs", "prune_by_dtype", "tuned"]

AUTOTUNE = ("full", "first")
"""The values of the ``autotune`` argument."""

AUTOTUNE_KEY = ["G", "HEAD_DIM", "PAGE_SIZE", "HAS_DOC", "HAS_OWN"]
"""Autotune key of the dense paged kernels (constexpr arguments that change the best tile)."""

# fp32 inputs on a GPU get their own small tile: fp32 dots run without tensor cores, and the
# bf16-sized tiles (e.g. dk/dv's 64 x 128 x 128 with two fp32 accumulators) took LLVM minutes to
# compile per shape on the H200 (the kernel test file, all fp32, did not get past its second test in
# 400 s). Autotuning never measures them against the bf16/fp16 configs: ``prune_by_dtype`` keeps only
# them for fp32 q and drops them otherwise.
FP32_TILE = (32, 32, 4, 2)
_FP32_ONLY: list[triton.Config] = []


def check_autotune(autotune: str) -> None:
    """Raises ValueError unless ``autotune`` is 'full' or 'first'."""
    if autotune not in AUTOTUNE:
        raise ValueError(f"autotune must be 'full' or 'first'; got {autotune!r}")


def gpu_configs(gpu: list[tuple[int, int, int, int]], autotune: str = "full") -> list[triton.Config]:
    """The GPU configs (BLOCK_M, BLOCK_N, num_warps, num_stages) of ``gpu`` (only its first with
    ``autotune='first'``) plus the fp32-only tile.

    Raises:
        ValueError: ``autotune`` not 'full' or 'first'.
    """
    check_autotune(autotune)
    if autotune == "first":
        gpu = gpu[:1]
    fp32 = triton.Config({"BLOCK_M": FP32_TILE[0], "BLOCK_N": FP32_TILE[1]}, num_warps=FP32_TILE[2], num_stages=FP32_TILE[3])
    _FP32_ONLY.append(fp32)
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in gpu] + [fp32]


def configs(gpu: list[tuple[int, int, int, int]], autotune: str = "full") -> list[triton.Config]:
    """Autotune configs of a kernel whose GPU list is ``gpu``: :func:`gpu_configs`, or one small config when
    interpreting."""
    if INTERPRET:
        check_autotune(autotune)
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=1, num_stages=1)]
    return gpu_configs(gpu, autotune)


def prune_by_dtype(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Autotuner ``early_config_prune``: the fp32-only tile for fp32 q, every other config otherwise.

    The launchers pass every argument by keyword, and Triton's autotuner hands positional arguments in
    ``named_args`` and keyword arguments in ``kwargs``; q is looked up in both (reading only
    ``named_args`` kept every config for fp32, and the bf16 128 x 128 dq tile then asked the H200 for
    320 KiB of shared memory at head dim 80/96).
    """
    q = named_args["q_ptr"] if "q_ptr" in named_args else kwargs.get("q_ptr")
    fp32 = getattr(q, "dtype", None) == torch.float32
    keep = [c for c in configs if any(c is f for f in _FP32_ONLY) == fp32]
    return keep or list(configs)


PRUNE = {"early_config_prune": prune_by_dtype}


class RestoreRows:
    """Autotuner ``pre_hook``/``post_hook`` pair for a kernel that adds into page pools (``names``): before each
    benchmark run it saves only the pool rows (pages, dim 0) the launch can write, ``rows(nargs)``, and puts them
    back after, instead of Triton's ``restore_value``, which clones and copies back the WHOLE tensors on every run
    (at 1M tokens a 2 x 31 GiB dK/dV pool: memory the step does not have, and a copy that, not the kernel, decided
    the timing). Not called outside autotuning (nor with a single config, as in the interpreter)."""

    def __init__(self, names: tuple[str, ...], rows) -> None:
        self.names, self.rows, self.saved = names, rows, None

    def pre_hook(self, nargs: dict, reset_only: bool = False) -> None:
        if reset_only:  # called once more before the real launch, to reset arguments (none here)
            return
        idx = self.rows(nargs)
        self.saved = (idx, [nargs[n].index_select(0, idx) if idx is not None else nargs[n].clone() for n in self.names])

    def post_hook(self, nargs: dict, exception=None) -> None:
        if self.saved is None:
            return
        idx, copies = self.saved
        for n, c in zip(self.names, copies):
            if idx is None:
                nargs[n].copy_(c)
            else:
                nargs[n].index_copy_(0, idx, c)
        self.saved = None


class TunedKernel:
    """A ``@triton.jit`` kernel autotuned two ways: over every config of its GPU list (``'full'``) and over the
    first (``'first'``), each a ``triton.autotune`` of the same function with the same key, hooks and pruning.

    Launch: ``kernel[autotune][grid](...)``. Both share the function's compiled binaries; each keeps its own
    autotune results (the on-disk cache is keyed by the config list too).

    Args:
        fn: the ``@triton.jit`` function.
        gpu: its GPU config list (see :func:`configs`).
        **autotune_kwargs: ``key``, ``pre_hook``, ... as ``triton.autotune`` takes them; ``prune_configs_by``
            defaults to :data:`PRUNE` and ``cache_results`` to True.
    """

    def __init__(self, fn, gpu: list[tuple[int, int, int, int]], **autotune_kwargs) -> None:
        autotune_kwargs.setdefault("prune_configs_by", PRUNE)
        autotune_kwargs.setdefault("cache_results", True)
        self.fn = fn
        self.configs = {mode: configs(gpu, mode) for mode in AUTOTUNE}
        self._tuned = {mode: triton.autotune(configs=self.configs[mode], **autotune_kwargs)(fn) for mode in AUTOTUNE}

    def __getitem__(self, autotune: str):
        """The autotuned kernel for ``autotune`` ('full' or 'first'); raises ValueError for another value."""
        check_autotune(autotune)
        return self._tuned[autotune]


def tuned(gpu: list[tuple[int, int, int, int]], **autotune_kwargs):
    """Decorator: ``@tuned(gpu, key=...)`` over a ``@triton.jit`` function makes a :class:`TunedKernel`."""
    return lambda fn: TunedKernel(fn, gpu, **autotune_kwargs)
