"""Fused kernels for the memory-bound "glue" around a decoder's GEMMs, from Liger-Kernel.

``fused_glue="liger"`` (an engine setting) replaces, on one model instance, the PyTorch code of

- every ``*RMSNorm`` module (decoder norms, the final norm, Qwen3's q/k norms) by Liger's fused RMSNorm
  (``casting_mode="llama"``: the same fp32 normalisation and cast back before the weight as transformers'
  Llama/Qwen2/Mistral/Qwen3 norms; not in place),
- every gated MLP (``gate_proj``, ``up_proj``, ``down_proj`` with SiLU) by Liger's fused SiLU-and-multiply
  between the same projections (LoRA-wrapped projections stay as they are),
- the model family's ``apply_rotary_pos_emb`` by Liger's fused RoPE -- a module-level function of transformers,
  so it is swapped only inside :meth:`FusedGlue.active` (the engine enters it around each chunk's forward and
  backward), never for other models of the process,
- the training cross-entropy by Liger's fused linear cross-entropy (the logits never leave the kernel's own
  blocks; weight gradients accumulated in float32), where the output projection is a plain ``nn.Linear``, in
  blocks of at most the engine's ``loss_chunk_size`` rows (:func:`liger_chunk_mem_const`).

Liger's kernels are Triton kernels for CUDA: :func:`check_fused_glue` refuses the CPU and a missing install.
The fp64 parity tests of the engine run with ``fused_glue="none"``, the exact reference path.

Source: Hsu et al., "Liger Kernel: Efficient Triton Kernels for LLM Training" (2024),
github.com/linkedin/Liger-Kernel (``liger_kernel.transformers.functional``).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from types import MethodType
from typing import get_args

import torch

from ..config.engine import FusedGlue as FusedGlueKind
from ..config.errors import ConfigError

__all__ = ["FUSED_GLUE", "FusedGlue", "FusedGlueError", "check_fused_glue", "liger_chunk_mem_const"]

FUSED_GLUE = get_args(FusedGlueKind)
"""The choices of the engine's ``fused_glue`` setting (declared in :mod:`oomb.config.engine`)."""


class FusedGlueError(ConfigError):
    """Fused glue cannot run here (a :class:`~oomb.config.errors.ConfigError` of ``engine.fused_glue``); the
    message names the install or the alternative."""

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__("fused_glue", problem, fix, section="engine")


def _functional():
    try:
        return importlib.import_module("liger_kernel.transformers.functional")
    except ImportError as exc:
        raise FusedGlueError(f"{{fused_glue}} 'liger' needs Liger-Kernel, which cannot be imported ({exc})",
                             "pip install 'liger-kernel>=0.8.5,<0.9' (or oomb[liger]), or use {fused_glue} 'none'") from None


def check_fused_glue(kind: str, device: torch.device) -> None:
    """Raise :class:`FusedGlueError` when glue ``kind`` cannot run on ``device`` (Liger needs CUDA and the
    ``liger-kernel`` package); ``"none"`` always runs."""
    if kind not in FUSED_GLUE:
        raise FusedGlueError(f"{{fused_glue}} is {kind!r}", f"pass one of {', '.join(FUSED_GLUE)}")
    if kind == "none":
        return
    if torch.device(device).type != "cuda":
        raise FusedGlueError(f"{{fused_glue}} 'liger' runs Triton kernels on CUDA, and the model is on {device}",
                             "use {fused_glue} 'none' on the CPU")
    _functional()


def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return self._oomb_liger.liger_rms_norm(hidden_states, self.weight, self._oomb_eps, 0.0, "llama", False)


def _swiglu_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(self._oomb_liger.liger_swiglu(self.gate_proj(x), self.up_proj(x)))


def _liger_rows_per_block(rows: int, hidden: int, vocab: int, mem_const: int) -> int:
    """Rows per block of Liger's fused linear cross-entropy for ``chunk_mem_const=mem_const`` (its own formula:
    ``next_power_of_2(cdiv(rows, cdiv(vocab, mem_const * hidden)))``, at most ``rows``)."""
    blocks = -(-vocab // (mem_const * hidden))
    per = -(-rows // blocks)
    return min(1 << (per - 1).bit_length(), rows)


def liger_chunk_mem_const(rows: int, hidden: int, vocab: int, block: int) -> int:
    """The ``chunk_mem_const`` of Liger's fused linear cross-entropy that makes its row blocks as large as
    possible but at most ``block`` rows (or 1, Liger's smallest blocks of about ``rows x hidden`` logits, where
    even those are larger).

    Liger's default (1) bounds the transient logits to about ``rows x hidden`` elements: about ``vocab / hidden``
    blocks, rounded to powers of two (32 blocks of 128 rows for a 4096-row chunk of the Qwen2.5-7B shape), and
    each block adds its GEMM into the whole float32 ``[vocab, hidden]`` weight gradient, a read and a write of
    2.2 GB per block for that shape. At ``block`` rows (the engine's ``loss_chunk_size``) the bf16 logits block is
    at most half the float32 block of the unfused cross-entropy the memory model counts, and the weight gradient
    is touched ``rows / block`` times.

    Args:
        rows: rows (tokens) of the hidden states; hidden: their width; vocab: the output projection's rows;
            block: the most rows per block (>= 1).

    Returns:
        An int >= 1.
    """
    mem_const = max(1, -(-vocab // hidden))  # the smallest value that makes one block of all rows
    while mem_const > 1 and _liger_rows_per_block(rows, hidden, vocab, mem_const) > block:
        mem_const -= 1
    return mem_const


def _is_rms_norm(module: torch.nn.Module) -> bool:
    eps = getattr(module, "variance_epsilon", None) or getattr(module, "eps", None)
    weight = getattr(module, "weight", None)
    return type(module).__name__.endswith("RMSNorm") and eps is not None and isinstance(weight, torch.Tensor)


def _is_swiglu(module: torch.nn.Module) -> bool:
    if not all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj")):
        return False
    act = getattr(module, "act_fn", None)
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ in ("SiLU", "SiLUActivation")


class FusedGlue:
    """The fused glue of one model instance (see the module).

    Args:
        model: a transformers ``*ForCausalLM`` (or its peft wrapper's base model) on CUDA.

    Raises:
        FusedGlueError: Liger-Kernel is not installed, or the model is not on CUDA.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        device = next(model.parameters()).device
        check_fused_glue("liger", device)
        self._liger = _functional()
        self.norms = self.mlps = 0
        for module in model.modules():
            if _is_rms_norm(module):
                module._oomb_liger = self._liger
                module._oomb_eps = float(getattr(module, "variance_epsilon", None) or module.eps)
                module.forward = MethodType(_rms_norm_forward, module)
                self.norms += 1
            elif _is_swiglu(module):
                module._oomb_liger = self._liger
                module.forward = MethodType(_swiglu_forward, module)
                self.mlps += 1
        # The modeling module whose apply_rotary_pos_emb the attention layers call (modeling_qwen2, ...).
        self._modeling = None
        for module in model.modules():
            if type(module).__name__.endswith("Attention"):
                candidate = sys.modules.get(type(module).__module__)
                if candidate is not None and hasattr(candidate, "apply_rotary_pos_emb"):
                    self._modeling = candidate
                break
        self._depth = 0
        self._original_rope = None

    @property
    def fuses_rope(self) -> bool:
        """Whether the model's RoPE goes through Liger inside :meth:`active`."""
        return self._modeling is not None

    @contextlib.contextmanager
    def active(self):
        """Within this context the model family's ``apply_rotary_pos_emb`` is Liger's fused RoPE (re-entrant;
        restored on exit, also on an error)."""
        if self._modeling is None:
            yield
            return
        if self._depth == 0:
            self._original_rope = self._modeling.apply_rotary_pos_emb
            self._modeling.apply_rotary_pos_emb = self._liger.liger_rope
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._modeling.apply_rotary_pos_emb = self._original_rope
                self._original_rope = None

    def cross_entropy_sum(self, hidden: torch.Tensor, lm_head: torch.nn.Module, targets: torch.Tensor, block: int):
        """Sum of the token cross-entropies of ``lm_head(hidden)`` against ``targets`` (-100: no loss), through
        Liger's fused linear cross-entropy in blocks of at most ``block`` rows (see :func:`liger_chunk_mem_const`),
        or None where ``lm_head`` is not a plain ``nn.Linear`` (the caller then uses the chunked cross-entropy).

        Args:
            hidden: [n, hidden_size] final hidden states (after the final norm), with a graph.
            targets: int64 [n].
            block: the most rows per logits block (the engine's ``loss_chunk_size``).

        Returns:
            A 0-dim float32 tensor, or None.
        """
        if type(lm_head) is not torch.nn.Linear:
            return None
        loss = self._liger.liger_fused_linear_cross_entropy(
            hidden, lm_head.weight, targets, lm_head.bias, ignore_index=-100, reduction="sum",
            accum_dtype=torch.float32,
            chunk_mem_const=liger_chunk_mem_const(hidden.shape[0], hidden.shape[1], lm_head.weight.shape[0], block))
        loss = loss[0] if isinstance(loss, tuple) else loss
        return loss.float()
