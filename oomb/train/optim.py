"""The optimizers ``train.optimizer`` names, built by :func:`build_optimizer`; their state bytes are counted in
:mod:`oomb.memory.optimizer`.

All are AdamW (decoupled weight decay, Loshchilov & Hutter 2019) with eps 1e-8:

* ``adamw``: ``torch.optim.AdamW`` (fused on CUDA), states like the parameter (``zeros_like``).
* ``adamw8bit``: torchao's ``AdamW8bit``: block-wise 8-bit states (Dettmers et al. 2022, "8-bit Optimizers via
  Block-wise Quantization"; blocks of 256, a float32 scale each); tensors under 4,096 elements keep plain states.
* ``adamw-bf16``: torchao's ``_AdamW`` with ``bf16_stochastic_round``: the update is computed in float32 and
  rounded stochastically to bf16 weights (states like the parameter), so updates smaller than half a bf16 ulp
  are not lost on average.
* ``adamw-cpu``: :class:`HostAdamW`: the states and the update in host memory.

On the CPU the torchao optimizers step eagerly (``torch.compiler.set_stance("force_eager")``): their step is
otherwise compiled per parameter shape, which takes tens of seconds on a CPU; on CUDA it is compiled as torchao
ships it. Every optimizer here accepts a float ``group["lr"]`` set between steps (torchao's own keep a tensor).
"""

from __future__ import annotations

import functools
import logging
from typing import Iterable

import torch

from ..memory.optimizer import OPTIMIZER_NAMES

__all__ = ["OPTIMIZER_NAMES", "HostAdamW", "OptimizerUnavailable", "build_optimizer", "check_available"]

_EPS = 1e-8


class OptimizerUnavailable(ValueError):
    """The optimizer cannot be built here (a missing library); the message is 'problem; fix'."""


def build_optimizer(name: str, params: Iterable[torch.nn.Parameter], *, lr: float, weight_decay: float,
                    betas: tuple[float, float] = (0.9, 0.95), device: torch.device | str) -> torch.optim.Optimizer:
    """The optimizer ``name`` (one of :data:`OPTIMIZER_NAMES`) over ``params`` (on ``device``).

    Raises:
        ValueError: an unknown name.
        OptimizerUnavailable: torchao is not installed ('adamw8bit', 'adamw-bf16').
    """
    device = torch.device(device)
    params = list(params)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, fused=device.type == "cuda")
    if name == "adamw-cpu":
        return HostAdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
    if name in ("adamw8bit", "adamw-bf16"):
        check_available(name)
        eight_bit, bf16 = _torchao_optimizers()
        eager = device.type != "cuda"
        if name == "adamw8bit":
            return eight_bit(params, lr=lr, betas=betas, eps=_EPS, weight_decay=weight_decay, eager=eager)
        return bf16(params, lr=lr, betas=betas, eps=_EPS, weight_decay=weight_decay, eager=eager,
                    bf16_stochastic_round=True)
    raise ValueError(f"unknown optimizer {name!r}; use one of {', '.join(OPTIMIZER_NAMES)}")


def check_available(name: str) -> None:
    """Raise :class:`OptimizerUnavailable` where :func:`build_optimizer` could not build ``name`` for want of its
    library (torchao), without building anything."""
    if name in ("adamw8bit", "adamw-bf16"):
        try:
            _torchao_optimizers()
        except ImportError as exc:
            raise OptimizerUnavailable(
                f"optimizer={name!r} needs torchao, which is not installed ({exc}); pip install torchao, or use "
                "optimizer='adamw'") from exc


class _TorchaoStep:
    """torchao's AdamW step with a float ``lr`` allowed (turned into the float32 tensor torchao reads) and, with
    ``eager``, without ``torch.compile``."""

    def __init__(self, *args, eager: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.eager = eager

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if not isinstance(group["lr"], torch.Tensor):
                group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32)
        if self.eager:
            with torch.compiler.set_stance("force_eager"):
                return super().step(closure)
        return super().step(closure)


@functools.lru_cache(maxsize=None)
def _torchao_optimizers() -> tuple[type, type]:
    """``(AdamW8bit, AdamW with bf16 stochastic rounding)`` of torchao, with :class:`_TorchaoStep`'s step.

    Raises:
        ImportError: torchao is not installed.
    """
    # torchao warns on import about its CUDA kernels that do not load on this machine (its optimizers do not
    # use them); only its errors are shown.
    log = logging.getLogger("torchao")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        from torchao.optim import AdamW8bit, _AdamW
    finally:
        log.setLevel(level)

    class TorchaoAdamW8bit(_TorchaoStep, AdamW8bit):
        """torchao's ``AdamW8bit`` (:class:`_TorchaoStep`)."""

    class TorchaoAdamWBf16(_TorchaoStep, _AdamW):
        """torchao's ``_AdamW`` (:class:`_TorchaoStep`)."""

    return TorchaoAdamW8bit, TorchaoAdamWBf16


class HostAdamW(torch.optim.Optimizer):
    """AdamW whose states and update live in host memory; the parameters and their gradients stay where they are.

    Each :meth:`step` copies every parameter and its gradient into host buffers (pinned when the parameter is on
    CUDA; the copies run on a side stream, one event per parameter), runs ``torch.optim.AdamW`` (fused) on the
    host copy as soon as its copy has landed, and copies the result back. The parameter on the device is the
    truth between steps (a checkpoint load or a broadcast changes it; the host copy is refreshed each step).

    Host bytes: per parameter, a pinned copy and a pinned gradient buffer in the parameter dtype, plus
    ``exp_avg`` and ``exp_avg_sq`` in pageable memory (:func:`oomb.memory.optimizer.optimizer_bytes`).

    Unlike torchao's ``CPUOffloadOptimizer``, the gradients are copied once per step, not in a
    post-accumulate-grad hook, which would fire (and copy) on every chunk of a chunk-recurrent step and turn
    off the engine's fused weight-gradient accumulation.

    ``state_dict()`` is ``{"host": [each parameter's AdamW state_dict], "param_groups": [...]}``.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95), eps: float = _EPS,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self._host: list[tuple[torch.nn.Parameter, torch.Tensor, torch.optim.AdamW]] = []
        for group in self.param_groups:
            for p in group["params"]:
                pin = p.device.type == "cuda"
                h = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin)
                h.grad = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin)
                self._host.append((p, h, torch.optim.AdamW([h], fused=True, **self._hyper(group))))
        self._stream = None

    @staticmethod
    def _hyper(group: dict) -> dict:
        return {k: group[k] for k in ("lr", "betas", "eps", "weight_decay")}

    def _groups_of(self):
        for group in self.param_groups:
            for p in group["params"]:
                yield group, p

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [(g, p, h, opt) for (g, p), (_, h, opt) in zip(self._groups_of(), self._host) if p.grad is not None]
        cuda = [p for _, p, _, _ in work if p.device.type == "cuda"]
        if cuda and self._stream is None:
            self._stream = torch.cuda.Stream(device=cuda[0].device)
        events = []
        if cuda:  # the copies start once the backward and the gradient clipping have finished
            self._stream.wait_stream(torch.cuda.current_stream(cuda[0].device))
        for _, p, h, _ in work:  # device -> host, all queued first
            if p.device.type == "cuda":
                with torch.cuda.stream(self._stream):
                    h.copy_(p.detach(), non_blocking=True)
                    h.grad.copy_(p.grad, non_blocking=True)
                    events.append(torch.cuda.Event())
                    events[-1].record(self._stream)
            else:
                h.copy_(p.detach())
                h.grad.copy_(p.grad)
                events.append(None)
        for (group, p, h, opt), event in zip(work, events):
            if event is not None:
                event.synchronize()
            opt.param_groups[0].update(self._hyper(group))
            opt.step()
            if p.device.type == "cuda":
                with torch.cuda.stream(self._stream):
                    p.copy_(h, non_blocking=True)
            else:
                p.copy_(h)
        if self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
            self._stream.synchronize()  # the host buffers are reused by the next step's copies
        return loss

    def state_dict(self) -> dict:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return {"host": [opt.state_dict() for _, _, opt in self._host], "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load :meth:`state_dict` of a HostAdamW over parameters of the same shapes.

        Raises:
            ValueError: another optimizer's state, or another number of parameters or groups.
        """
        host, groups = state_dict.get("host"), state_dict.get("param_groups")
        if host is None or groups is None:
            raise ValueError("not the state of a HostAdamW (optimizer 'adamw-cpu')")
        if len(host) != len(self._host) or len(groups) != len(self.param_groups):
            raise ValueError(f"the state holds {len(host)} parameters in {len(groups)} groups, the optimizer "
                             f"{len(self._host)} in {len(self.param_groups)}")
        for (_, _, opt), sd in zip(self._host, host):
            opt.load_state_dict(sd)
        for group, saved in zip(self.param_groups, groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
