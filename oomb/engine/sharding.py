"""Parameter sharding of the trained model over the ranks of ``torchrun`` with FSDP2 (docs/design.md §8).

:func:`shard_model` applies ``torch.distributed.fsdp.fully_shard`` to each decoder layer and to the causal LM
around them (the root: input embeddings, final norm, output head, tied or not), with the settings of a mode:

* ``"params"`` (ZeRO-3-like): every parameter lives as a 1/W shard (W ranks). A middle layer is all-gathered
  for each use and freed after it (``reshard_after_forward=True``): Stage 1's forward of every chunk but the
  last, Stage 2's forward, and again for its backward (per-layer recompute and backward share one gather). The
  root and the last layer stay gathered from their first use to the end of the optimizer step (both are
  gathered at a chunk's peak, the start of its backward, anyway: the root holds the loss head, the last
  layer's backward follows its forward), and the first layer stays gathered from a chunk's backward, its
  last use, into the next chunk's forward, its next one: no peak memory for fewer gathers. Each layer
  prefetches the next one in the forward (``set_modules_to_forward_prefetch``); the backward prefetches in
  reverse order (FSDP2's default). Gradients are reduce-scattered after every chunk's backward, so no
  full-size gradient exists.
* ``"grads-optim"`` (ZeRO-2-like): every layer is all-gathered once per optimizer step (at its first use) and
  kept through the step (``reshard_after_forward=False``, ``reshard_after_backward=False``); gradients are
  summed unsharded over all chunks and sequences of the step and reduce-scattered once, at the step's last
  backward (``set_requires_gradient_sync(False)`` before); each rank keeps and updates only its shard of the
  parameters, gradients and optimizer states. Per step: one all-gather and one reduce-scatter of the
  parameters' bytes, what one all-reduce of unsharded data parallelism costs.

Gradients are summed over ranks, not averaged (``set_gradient_divide_factor(1.0)`` with sum reductions): the
engine divides each rank's loss by the valid tokens of the whole step on every rank. Parameters a rank did not
use in a backward (the output head of a chunk without a target) reduce-scatter zeros
(``set_reduce_scatter_unused_params``), so every rank issues the same collectives.

The engine (:class:`oomb.engine.Engine`) finds the :class:`Sharding` of a model with :func:`sharding_of` and
runs every chunk's forward, loss included, through :meth:`Sharding.run` (a forward method of the root that
FSDP2 knows: ``register_fsdp_forward_method``), because it calls the decoder and the output head itself, not
the model's ``forward``. Every rank must run the same number of chunks per step (equal sequence lengths).

The engine's own gradient machinery under sharding:

* :class:`~oomb.engine.fused_wgrad.FusedWeightGradAccumulation` stays on: it adds into ``.grad`` of the
  unsharded parameter the layer's forward used (FSDP2 hands it to the module), so with ``grads-optim`` the
  GEMM accumulates the step's sum in place; with ``params`` FSDP2 takes each chunk's ``.grad`` away for its
  reduce-scatter and the next chunk's first GEMM writes a new one (autograd's path).
* ``grad_accum_dtype='float32'`` (:class:`~oomb.engine.grad_accum.Float32GradAccumulator`): the reduction
  dtype is float32 (``MixedPrecisionPolicy(reduce_dtype=float32)``). With ``grads-optim`` FSDP2 itself keeps
  the unsharded sums in float32 across backwards (the accumulator is not used); with ``params`` FSDP2 calls
  the accumulator's post-accumulate-grad hooks on the sharded parameters (:attr:`Sharding.parameters`) after
  each chunk's reduce-scatter, so it sums the shards in float32 (4 bytes per parameter / W) and rounds once
  per step, as on one process.
"""

from __future__ import annotations

import types
from typing import Callable, TypeVar

import torch

from ..config.job import SHARDS as SHARD_MODES

__all__ = ["SHARD_MODES", "Sharding", "shard_model", "sharding_of"]

_ATTR = "_oomb_sharding"
_T = TypeVar("_T")


def _causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers ``*ForCausalLM`` of ``model`` (inside a peft wrapper, the model it adapts)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _decoder_layers(base: torch.nn.Module) -> list[torch.nn.Module]:
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else base.model
    return list(decoder.layers)


def _run(self, fn: Callable[[], _T]) -> _T:  # the root's forward method (self: the root, unused)
    return fn()


class Sharding:
    """How a model is sharded (:func:`shard_model`) and what the engine and the trainer do with it per step.

    Attributes:
        mode: ``"params"`` or ``"grads-optim"``.
        root: the ``*ForCausalLM`` (an ``FSDPModule``); ``layers``: its decoder layers (each an ``FSDPModule``).
        world_size: ranks the parameters are sharded over.
        parameters: every parameter of the model as its ``DTensor`` shard. (``model.parameters()`` yields, for a
            module FSDP2 holds gathered at that moment, the gathered parameter instead.)
    """

    def __init__(self, mode: str, root, layers: list, world_size: int, parameters: list) -> None:
        self.mode, self.root, self.layers, self.world_size = mode, root, layers, world_size
        self.parameters = parameters

    @property
    def reduces_every_chunk(self) -> bool:
        """Whether gradients are reduce-scattered after every chunk's backward (``params``) rather than once per
        optimizer step (``grads-optim``)."""
        return self.mode == "params"

    def run(self, fn: Callable[[], _T]) -> _T:
        """``fn()`` as a forward of the root: FSDP2 gathers the root's parameters before it (and does the root's
        once-per-forward work) and hooks the backward of the tensors it returns."""
        return self.root.oomb_chunk(fn)

    def before_backward(self, last_chunk: bool, sync: bool) -> None:
        """Set whether the next backward reduce-scatters: every chunk with ``params``; with ``grads-optim`` the
        last chunk of a sequence whose step ends with it (``sync``), else the gradients accumulate unsharded."""
        reduce = self.reduces_every_chunk or (sync and last_chunk)
        self.root.set_requires_gradient_sync(reduce)
        self.root.set_is_last_backward(reduce)

    def end_step(self) -> None:
        """Free every gathered parameter (call after the step's last backward, before the optimizer changes the
        shards): the layers kept gathered across chunks would otherwise serve the next step stale weights."""
        for m in (*self.layers, self.root):
            m.reshard()

    def gradient_bytes(self, float32_sums: bool) -> int:
        """Bytes of gradients a step allocates on this rank that do not exist yet: each trainable parameter's
        shard of the gradient (float32 with ``float32_sums`` for a bfloat16/float16 parameter) and, with
        ``grads-optim``, its unsharded sum over the step (in the reduction dtype)."""
        total = 0
        for p in self.parameters:
            if not p.requires_grad or p.grad is not None:
                continue
            size = 4 if float32_sums and p.dtype in (torch.bfloat16, torch.float16) else p.element_size()
            total += p.to_local().numel() * size + (p.numel() * size if self.mode == "grads-optim" else 0)
        return total


def sharding_of(model: torch.nn.Module) -> Sharding | None:
    """The :class:`Sharding` :func:`shard_model` gave ``model`` (or the causal LM a peft model wraps), else None."""
    return getattr(_causal_lm(model), _ATTR, None)


def _check_uniform_grad_dtypes(units: list[torch.nn.Module]) -> None:
    own = set()
    for unit in reversed(units):  # layers first: their parameters are not the root's
        dtypes = {p.dtype for p in unit.parameters() if p.requires_grad and id(p) not in own}
        own.update(id(p) for p in unit.parameters())
        if len(dtypes) > 1:
            names = " and ".join(sorted(str(d).replace("torch.", "") for d in dtypes))
            raise ValueError(
                f"a sharded layer trains parameters of two dtypes ({names}: float32 LoRA adapters beside model-dtype "
                "copies of the norms or embeddings), and FSDP2 reduce-scatters one dtype per layer; train in float32 "
                "(dtype='float32'), leave out train_embeddings_norms, or use shard='none'")


def shard_model(model: torch.nn.Module, mode: str, *, device: torch.device | str | None = None,
                reduce_dtype: torch.dtype | None = None) -> Sharding | None:
    """Shard ``model``'s parameters over the default process group with FSDP2, in place (module docstring).

    Call it after peft has added its adapters, before the optimizer is built over ``model.parameters()`` (they
    become ``DTensor`` shards) and before :class:`oomb.engine.Engine`.

    Args:
        model: a transformers ``*ForCausalLM``, optionally peft-wrapped, on ``device`` or in host memory: FSDP2
            moves each unit (a layer, then the root) to ``device`` and keeps only this rank's shard there, so
            the GPU never holds more than the shards and one whole unit.
        mode: ``"params"``, ``"grads-optim"`` or ``"none"`` (nothing is done; returns None).
        device: where the shards live ('cuda': this rank's current CUDA device); None: where the model is.
        reduce_dtype: dtype of the gradient reduction (and, with ``grads-optim``, of the unsharded sums):
            ``torch.float32`` for ``grad_accum_dtype='float32'``; None: the gradients' dtype.

    Returns:
        The :class:`Sharding`, also found later with :func:`sharding_of`; None for ``"none"``.

    Raises:
        ValueError: an unknown mode; no initialised process group; a layer whose trainable parameters have two
            dtypes (FSDP2 reduce-scatters one dtype per layer).
    """
    if mode not in SHARD_MODES:
        raise ValueError(f"unknown shard mode {mode!r}; use one of {', '.join(SHARD_MODES)}")
    if mode == "none":
        return None
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"shard mode {mode!r} needs an initialised process group (run under torchrun)")
    base = _causal_lm(model)
    layers = _decoder_layers(base)
    _check_uniform_grad_dtypes([base, *layers])
    device = torch.device(device) if device is not None else next(base.parameters()).device
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    mp = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    last = len(layers) - 1
    for i, layer in enumerate(layers):
        # params: the last layer stays gathered from its first use to the end of the step; the first layer is kept
        # from each chunk's backward into the next chunk's forward. grads-optim: every layer is kept.
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=mode == "params" and i != last)
        if mode == "grads-optim" or i in (0, last):
            layer.set_reshard_after_backward(False, recurse=False)
    fully_shard(base, mesh=mesh, mp_policy=mp)  # the root: not resharded after its forward
    base.set_reshard_after_backward(False, recurse=False)
    if mode == "params":
        for a, b in zip(layers, layers[1:]):
            a.set_modules_to_forward_prefetch([b])
    for m in (*layers, base):
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)
        m.set_reduce_scatter_unused_params(True, recurse=False)
    base.oomb_chunk = types.MethodType(_run, base)
    register_fsdp_forward_method(base, "oomb_chunk")
    sharding = Sharding(mode, base, layers, world, list(model.parameters()))
    setattr(base, _ATTR, sharding)
    return sharding
