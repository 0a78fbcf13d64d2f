"""The shape of a model and the memory of a machine: the inputs of every byte count in :mod:`oomb.memory`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["GiB", "Machine", "ModelShape", "dtype_size", "host_memory", "parse_dtype"]

GiB = 1 << 30


def dtype_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype from itself or a name ('bfloat16', 'bf16', 'float32', ...).

    Raises:
        ValueError: an unknown name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
             "float32": torch.float32, "fp32": torch.float32, "float64": torch.float64}
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(names)}")
    return names[dtype]


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
"""The layers LoRA adapts by default (``ModelConfig.lora_targets``'s default)."""

@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only LM that memory depends on."""

    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool

    @classmethod
    def from_config(cls, config: Any) -> "ModelShape":
        """From a transformers config, or a preset name / local directory (via :func:`oomb.models.presets.load_config`)."""
        if isinstance(config, str):
            from ..models.presets import load_config

            config = load_config(config)
        mt = getattr(config, "model_type", "llama")
        heads = config.num_attention_heads
        attn_bias = bool(getattr(config, "attention_bias", False))
        return cls(
            model_type=mt,
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab_size=config.vocab_size,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=mt == "qwen2" or attn_bias,
            o_bias=attn_bias and mt != "qwen2",
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=mt == "qwen3",
        )

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Parameters of the ``*ForCausalLM`` model."""
        h, i, q, kv, V = self.hidden_size, self.intermediate_size, self.q_dim, self.kv_dim, self.vocab_size
        layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
        layer += (q + 2 * kv) * self.qkv_bias + h * self.o_bias + (2 * i + h) * self.mlp_bias
        layer += 2 * self.head_dim * self.qk_norm
        return self.num_layers * layer + V * h * (1 if self.tied_embeddings else 2) + h

    def linear_dims(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of a decoder layer, by its module name."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_dim, self.kv_dim
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def lora_targets(self, targets: str | tuple[str, ...] | list[str] = LORA_TARGETS) -> list[str]:
        """The linear layers of ``targets`` ('all-linear', a comma list or a sequence of names).

        Raises:
            ValueError: a name that is not a linear layer of the decoder layers.
        """
        dims = self.linear_dims()
        if isinstance(targets, str):
            if targets.strip() == "all-linear":
                return list(dims)
            targets = list(dict.fromkeys(n.strip() for n in targets.split(",") if n.strip()))
        unknown = [t for t in targets if t not in dims]
        if unknown:
            raise ValueError(f"LoRA targets {', '.join(unknown)} are not linear layers of a {self.model_type} decoder "
                             f"layer ({', '.join(dims)})")
        return list(targets)

    def lora_params(self, rank: int, targets: str | tuple[str, ...] | list[str] = LORA_TARGETS) -> int:
        """LoRA parameters of rank ``rank`` on the linear layers ``targets`` names (:meth:`lora_targets`) of every
        decoder layer: ``rank * (in + out)`` each."""
        dims = self.linear_dims()
        return self.num_layers * rank * sum(sum(dims[t]) for t in self.lora_targets(targets))

    def embedding_norm_params(self) -> int:
        """Parameters of the input embeddings and every norm layer: what LoRA with ``train_embeddings_norms`` also
        trains (a copy of each; a tied output projection shares the embeddings' copy)."""
        per_layer = 2 * self.hidden_size + 2 * self.head_dim * self.qk_norm
        return self.vocab_size * self.hidden_size + self.num_layers * per_layer + self.hidden_size


@dataclass(frozen=True)
class Machine:
    """Memory of the machine, in bytes; ``gpu_name`` and ``host_name`` say where the GPU and host figures come
    from, as a plan's table names them."""

    gpu_free_bytes: int
    gpu_total_bytes: int
    host_available_bytes: int
    host_total_bytes: int
    gpu_name: str = "GPU"
    host_name: str = "available RAM"

    @classmethod
    def detect(cls, device: torch.device | str | None = None) -> "Machine":
        """GPU free/total (torch.cuda.mem_get_info; 0 without CUDA) and host available/total RAM."""
        free = total = 0
        name = "no GPU"
        if torch.cuda.is_available():
            dev = torch.device(device) if device is not None else torch.device("cuda")
            if dev.type == "cuda":
                free, total = torch.cuda.mem_get_info(dev)
                name = torch.cuda.get_device_name(dev)
        avail, host_total = host_memory()
        return cls(int(free), int(total), avail, host_total, name)


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation that failed: ``torch.OutOfMemoryError`` (GPU), or the ``RuntimeError`` of
    PyTorch's CPU allocator ("DefaultCPUAllocator: can't allocate memory") or of another "out of memory"."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text)


def host_memory() -> tuple[int, int]:
    """(available, total) host RAM in bytes (psutil, else /proc/meminfo)."""
    try:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)
    except ImportError:  # pragma: no cover
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                info[k] = int(v.split()[0]) * 1024
        return info.get("MemAvailable", info["MemFree"]), info["MemTotal"]

