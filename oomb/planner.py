"""Memory planner: GPU and host bytes of a training run, computed before anything is allocated.

From the model config, the context length and the engine settings it predicts
the peak GPU memory of one chunk-recurrent step (what
``torch.cuda.max_memory_allocated`` reports) and the host memory of the KV
host tier, chooses the tiering (all pages on the GPU, or a GPU pool of
resident pages + staging with the rest in pinned host memory, DESIGN.md §2.3),
and finds the largest context that fits the machine.

Peak GPU bytes of a step (the peak is in Stage 2, during the backward of the
top layer of a chunk, when every layer's saved activations are alive)::

    weights + grads + optimizer states + KV pool (resident + staging + own-gradient + write buffers)
      + saved activations + max(attention temporaries, loss temporaries) + small terms

**Saved activations** per token per layer (bytes; e = model dtype size, a = 4,
h hidden, q = Hq*D, kv = Hkv*D, i intermediate), from what autograd keeps for
a Hugging Face Llama/Qwen2 decoder layer:

=============================  ===================  ==========================================
input + post-attention norm    2 (a + e) h          RMSNorm keeps the fp32 upcast and its output
q                              3 e q                projection out, rotate_half(q), post-RoPE q
k, v                           3 e kv + e kv        k like q; v as projected
attention output               e q                  saved by the attention (also o_proj's input)
MLP                            4 e i                gate, SiLU(gate), up, SiLU(gate)*up
Qwen3 q/k norms                (a + e)(q + kv)
=============================  ===================  ==========================================

Qwen2.5-7B, bf16: 12h + 8q + 8kv + 8i = 227,328 B/token/layer -> 24.28 GiB for
4096 tokens x 28 layers. With ``checkpoint_layers`` only each layer's input
(e h per token) is kept for all layers, plus one layer's activations while it is
recomputed.

**Attention temporaries.** The PyTorch reference backward holds three fp32
score-sized tensors (s, p, ds) of ``Hq x C x W`` (W = max(C, min(block, past)))
plus ~6 fp32 ``C x q`` copies: 5.25 + 0.33 GiB at C = 4096, Hq = 28. The Triton
kernels keep only an fp32 ``dq`` and ``delta`` (2 x C x q x 4 B; to be
measured). **Loss temporaries:** one block of logits, ``loss_chunk x V x (2e + 8)``.

Calibration (H200, Qwen2.5-7B, bf16, chunk 4096, torch reference, no per-layer
checkpointing): measured peak minus KV store 58.36 GiB at 32K and 128K;
predicted 14.19 + 14.19 (weights, grads) + 24.28 + 5.25 + 0.33 + 0.10 = 58.3 GiB.

Offload GPU tier: ``L x R`` resident pages + two staging buffers of ``min(SP, n - R)`` pages (SP =
``offload_segment_pages``, 32K tokens by default; with whole-layer staging ``K`` = 2 to 4 buffers of ``n - R``,
:func:`oomb.engine.offload.choose_staging_sets`, 2 where more would overflow the host budget) + two one-chunk
own-gradient (dK, dV) and two one-chunk K/V write buffers: flat in the context length with segments.
Segmented attention adds ~3 fp32 ``C x q`` temporaries (part output, merge, dq parts; ~170 MiB for
Qwen2.5-7B at C = 4096), not counted below (the GPU reserve covers them).

Host tier: ``L x (n - R)`` pages in pinned memory, where ``n`` pages per
layer and ``R`` resident (:mod:`oomb.engine.offload`). The host budget is a
fraction (default 0.75) of available RAM: 96 GiB could be pinned on the H200
host with 125 GiB (DESIGN.md §2.3).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .config.engine import HOST_FRACTION

__all__ = [
    "Machine",
    "MemoryPlan",
    "MemoryPlanError",
    "ModelShape",
    "Tiering",
    "activation_bytes",
    "add_offload_arguments",
    "add_plan_subcommand",
    "choose_engine_tiering",
    "choose_tiering",
    "offload_traffic",
    "plan",
    "plan_for_train_args",
    "run_plan",
]

GiB = 1 << 30
_LINK_BYTES_PER_S = 55e9  # pinned host<->H200 copies, each way (DESIGN.md §2.3)
_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


class MemoryPlanError(ValueError):
    """A run that cannot fit the machine; the message says what is short, by how much, and what to change."""


def _dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
             "float32": torch.float32, "fp32": torch.float32, "float64": torch.float64}
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(names)}")
    return names[dtype]


# ---------------------------------------------------------------------- model
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
            from .models.presets import load_config

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

    def lora_params(self, rank: int) -> int:
        """LoRA parameters of rank ``rank`` on q/k/v/o projections."""
        h, q, kv = self.hidden_size, self.q_dim, self.kv_dim
        return self.num_layers * rank * ((h + q) + 2 * (h + kv) + (q + h))


def activation_bytes(
    shape: ModelShape,
    chunk_size: int,
    dtype: torch.dtype,
    checkpoint_layers: bool = False,
    attention_backend: str = "triton",
    attention_block_size: int = 4096,
    loss_chunk_size: int = 1024,
    max_past: int | None = None,
    lora_rank: int = 0,
) -> dict[str, int]:
    """Peak bytes of one Stage-2 chunk's activations and temporaries (see the module docstring).

    Args:
        max_past: longest past in tokens (T - chunk); None = at least one attention block.

    Returns:
        {"saved": ..., "attention_temp": ..., "loss_temp": ..., "other": ..., "total": ...} in bytes.
    """
    e, a = _dtype_size(dtype), 4
    acc = 8 if dtype == torch.float64 else 4
    h, i, q, kv = shape.hidden_size, shape.intermediate_size, shape.q_dim, shape.kv_dim
    C, L = chunk_size, shape.num_layers
    per_layer = 2 * (a + e) * h + 4 * e * q + 4 * e * kv + 4 * e * i
    if shape.qk_norm:
        per_layer += (a + e) * (q + kv)
    if lora_rank:
        per_layer += len(_LORA_TARGETS) * 4 * lora_rank  # fp32 adapter activations (A outputs)
    if checkpoint_layers:
        saved = L * C * e * h + C * per_layer
    else:
        saved = L * C * per_layer
    if attention_backend == "torch":
        past = attention_block_size if max_past is None else max_past
        width = max(C, min(attention_block_size, past))
        attn = 3 * shape.num_heads * C * width * acc + 6 * C * q * acc
    else:
        attn = 2 * C * q * acc
        if attention_backend == "sdpa":
            # cuDNN returns the past's dK/dV in the model dtype before they are added into the float32 pages
            # (oomb.ops.sdpa_attention), and each part's out/dq in the model dtype before the merge.
            attn += 2 * (max_past or 0) * kv * e + 2 * C * q * e
    loss = min(loss_chunk_size, C) * shape.vocab_size * (2 * e + 8)
    other = C * h * (a + 2 * e)  # final norm and the hidden state's gradient
    total = saved + max(attn, loss) + other
    return {"saved": saved, "attention_temp": attn, "loss_temp": loss, "other": other, "total": total}


# -------------------------------------------------------------------- machine
@dataclass(frozen=True)
class Machine:
    """Memory of the machine, in bytes."""

    gpu_free_bytes: int
    gpu_total_bytes: int
    host_available_bytes: int
    host_total_bytes: int
    gpu_name: str = "GPU"

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
        avail, host_total = _host_memory()
        return cls(int(free), int(total), avail, host_total, name)


def _host_memory() -> tuple[int, int]:
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


# ----------------------------------------------------------------------- plan
@dataclass(frozen=True)
class Tiering:
    """Where the KV pages go: ``offload`` False = all on the GPU; else a GPU pool of ``gpu_pages`` pages."""

    offload: bool
    gpu_pages: int | None
    resident_pages_per_layer: int
    staging_sets: int = 2  # staging buffers in the pool (oomb.engine.offload.choose_staging_sets)


@dataclass
class MemoryPlan:
    """Predicted memory of a run (bytes unless named otherwise). ``table()`` prints it; ``check()`` refuses it."""

    model: str
    shape: ModelShape
    seq_len: int
    chunk_size: int
    page_size: int
    dtype: torch.dtype
    num_params: int
    trainable_params: int
    weights: int
    grads: int
    optimizer: int
    activations: dict[str, int]
    page_bytes: int
    pages_per_layer: int
    kv_total: int
    tiering: Tiering
    gpu_pool: int
    write_buffers: int
    host_kv: int
    gpu_peak: int
    host_peak: int
    gpu_budget: int
    host_budget: int
    machine: Machine
    max_seq_len_gpu_only: int  # longest context with every page on the GPU (in the given gpu_page_budget's pool)
    max_seq_len_offload: int  # longest context with offload (through the given gpu_page_budget's pool)
    traffic: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    segment_pages: int | None = None  # offload staging segment in pages (None: whole-layer staging)
    own_buffers: int = 0  # GPU bytes of the two own-gradient buffers (segmented staging)
    host_fraction: float = HOST_FRACTION  # share of the available host RAM that is ``host_budget``
    save_attention: str = "off"  # as asked; "off" in the plan when offload makes the engine recompute instead
    save_attention_note: str = ""  # why an asked save_attention is not in the plan, or a tip to use it
    grad_accum_dtype: str = "param"  # 'float32': grads counts the step's float32 gradient sums
    saved_attention_host: int = 0  # host bytes of save_attention="host"
    kv_stash_reserved: int = 0  # GPU bytes kept free for the K/V stash (OOMB_OFFLOAD_KV_STASH_MIB; in the reserve)
    layout_note: str = ""  # how the table's layout relates to a refused gpu_page_budget
    gpu_page_budget: int | None = None  # as given; the largest contexts (max_seq_len_*) are then under this pool
    tiering_found: bool = True  # False: no tiering fits (the table shows the layout the verdict speaks of)

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def staging(self) -> int:
        """GPU bytes of the staging buffers (K, V, dK, dV): two segments, or ``tiering.staging_sets`` layers with
        whole-layer staging."""
        from .engine.offload import _staging

        t = self.tiering
        if not t.offload:
            return 0
        return t.staging_sets * _staging(self.pages_per_layer, t.resident_pages_per_layer, self.segment_pages) * self.page_bytes

    def check(self) -> "MemoryPlan":
        """Return self if the run fits, else raise :class:`MemoryPlanError` saying why and what to change."""
        if self.problems:
            raise MemoryPlanError("; ".join(self.problems))
        return self

    def engine_settings(self) -> dict:
        """:class:`~oomb.config.OffloadConfig` fields for the chosen tiering: ``{"mode": "on" | "off",
        "gpu_page_budget": int | None, "staging_sets": int | None}`` (the sets only for whole-layer staging; the
        store takes this K instead of picking it from the pool again)."""
        t = self.tiering
        whole = t.offload and self.segment_pages is None
        return {"mode": "on" if t.offload else "off", "gpu_page_budget": t.gpu_pages if t.offload else None,
                "staging_sets": t.staging_sets if whole else None}

    def table(self) -> str:
        """A plain-text breakdown (GiB) for printing."""
        g = lambda b: f"{b / GiB:9.2f}"  # noqa: E731
        t, act = self.tiering, self.activations
        rows = [
            f"oomb memory plan: {self.model}, {self.seq_len:,} tokens, chunk {self.chunk_size}, page {self.page_size}, "
            f"{str(self.dtype).replace('torch.', '')}",
            f"  parameters {_count(self.num_params)}, trainable {_count(self.trainable_params)}; "
            f"KV {self.page_bytes * self.shape.num_layers // self.page_size / 1024:.0f} KiB/token (K/V + dK/dV)",
            "",
            f"{'GPU':<42}{'GiB':>9}",
            f"  {'weights':<40}{g(self.weights)}",
            f"  {'gradients' + (' (float32 sums)' if self.grad_accum_dtype == 'float32' else ''):<40}{g(self.grads)}",
            f"  {'optimizer states':<40}{g(self.optimizer)}",
            f"  {'activations: saved':<40}{g(act['saved'])}",
            # the peak holds the larger of the attention and loss temporaries (not both), and the final norm's
            # and hidden state's gradient bytes ("other"): the rows add up to the predicted peak
            f"  {self._temporaries_label():<40}{g(max(act['attention_temp'], act['loss_temp']))}",
            f"  {'activations: other (final norm, grads)':<40}{g(act['other'])}",
            *([f"  {'sparse: page summaries + selections':<40}{g(act['sparse_state'])}"] if "sparse_state" in act else []),
            *([f"  {'attention outputs (save_attention=' + self.save_attention + ')':<40}{g(act['saved_attention'])}"]
              if act.get("saved_attention") else []),
            f"  {'KV pages on GPU (' + ('all' if not t.offload else f'{t.resident_pages_per_layer} resident/layer') + ')':<40}"
            f"{g(self.gpu_pool - self.staging)}",
            f"  {self._staging_label():<40}{g(self.staging + self.own_buffers + self.write_buffers)}",
            f"  {'predicted peak':<40}{g(self.gpu_peak)}",
            f"  {'budget (' + self.machine.gpu_name + ', free less reserve)':<40}{g(self.gpu_budget)}",
            *([f"  {'  reserve incl. K/V stash (env)':<40}{g(self.kv_stash_reserved)}"] if self.kv_stash_reserved else []),
            f"{'host':<42}",
            f"  {'KV pages in pinned memory':<40}{g(self.host_kv)}",
            *([f"  {'attention outputs (save_attention=host)':<40}{g(self.saved_attention_host)}"]
              if self.saved_attention_host else []),
            f"  {f'budget ({self.host_fraction:.0%} of available RAM)':<40}{g(self.host_budget)}",
            "",
            f"tiering: {self._tiering_label()}",
        ]
        if self.save_attention_note:
            rows.append(self.save_attention_note)
        if t.offload and self.traffic:
            h2d, d2h = self.traffic["h2d_bytes"], self.traffic["d2h_bytes"]
            rows.append(f"host<->GPU traffic per step: {h2d / GiB:,.1f} GiB in, {d2h / GiB:,.1f} GiB out "
                        f"(~{max(h2d, d2h) / _LINK_BYTES_PER_S:,.0f} s of copies at 55 GB/s each way, the two directions "
                        "on their own streams, overlapped with compute)")
            if "sparse_state" in act:
                rows.append("  sparse: an upper bound (whole layers); Stage 2 moves only the (page, KV head) tiles the "
                            "selections read (a 1M-token step with random weights: ~25% of its Stage-2 bytes)")
        def most(t: int) -> str:  # the search stops at 2**26 pages per layer
            return f"{t:,}" + (" or more (the search limit)" if t >= ((1 << 26) * self.page_size) // self.chunk_size * self.chunk_size else "")

        if self.gpu_page_budget is None:
            largest = (f"largest context: {most(self.max_seq_len_gpu_only)} tokens with every page on the GPU, "
                       f"{most(self.max_seq_len_offload)} with offload")
        else:  # both under the pool the caller fixed (not the largest pool the GPU could hold)
            largest = (f"largest context with the given {self.gpu_page_budget:,}-page GPU pool: "
                       f"{most(self.max_seq_len_gpu_only)} tokens with every page in it, "
                       f"{most(self.max_seq_len_offload)} with offload")
        rows += [
            largest,
            "fits" if self.fits else "DOES NOT FIT: " + "; ".join(self.problems),
        ]
        return "\n".join(rows)


    def _temporaries_label(self) -> str:
        act = self.activations
        attn, loss = act["attention_temp"], act["loss_temp"]
        if attn >= loss:
            return f"temporaries: attention (loss {loss / GiB:.2f})"
        return f"temporaries: loss (attention {attn / GiB:.2f})"

    def _tiering_label(self) -> str:
        t = self.tiering
        if not t.offload:
            # a refused plan shows the pages on the GPU but does not claim they fit there (a fresh-user review read
            # 'every page on the GPU' next to a 286,102 GiB KV row)
            return "every page on the GPU" if self.tiering_found else "none fits (shown: every page on the GPU)"
        if t.gpu_pages is None:  # no GPU pool fits (the reason is in problems)
            return "offload, no GPU pool fits"
        note = f" ({self.layout_note})" if self.layout_note else ""
        return f"offload, GPU pool {t.gpu_pages:,} pages{note}"

    def _staging_label(self) -> str:
        if not self.tiering.offload:
            return "KV staging: none (no offload)"
        if self.segment_pages is None:
            k = self.tiering.staging_sets
            return f"KV staging ({k} layers) + write buffers"
        # a staging buffer holds min(segment, host pages of a layer) pages (the layout the table's bytes count)
        n = -(-self.seq_len // self.page_size)
        pages = max(min(self.segment_pages, n - self.tiering.resident_pages_per_layer), 0)
        tokens = pages * self.page_size
        size = f"{tokens // 1024}K" if tokens % 1024 == 0 else f"{tokens:,}"
        return f"KV staging (2 x {size} tok) + buffers"


def _count(n: int) -> str:
    """A parameter count for the plan: billions from 1e9 up, else millions (a tiny model printed '0.00 B')."""
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def _page_bytes(shape: ModelShape, page_size: int, dtype: torch.dtype) -> int:
    g = 8 if dtype == torch.float64 else 4
    return page_size * shape.kv_dim * 2 * (_dtype_size(dtype) + g)


def _base_gpu(shape, seq_len, chunk_size, dtype, lora_rank, optimizer, checkpoint_layers, attention_backend,
              attention_block_size, loss_chunk_size, grad_accum_dtype="param"):
    n_params = shape.num_params()
    e = _dtype_size(dtype)
    if lora_rank:
        trainable = shape.lora_params(lora_rank)
        weights = n_params * e + trainable * 4  # peft keeps bf16/fp16 adapters in float32
        grads = trainable * 4
    else:
        trainable = n_params
        weights = n_params * e
        # grad_accum_dtype='float32': bf16/fp16 gradients are summed in float32 during the step (4 B each).
        grads = n_params * (4 if grad_accum_dtype == "float32" and e < 4 else e)
    optim = 8 * trainable if optimizer == "adamw" else 0
    # A sequence shorter than the chunk is one chunk of seq_len tokens: activations for those only.
    act = activation_bytes(shape, min(chunk_size, seq_len), dtype, checkpoint_layers, attention_backend,
                           attention_block_size, loss_chunk_size, max(seq_len - chunk_size, 0), lora_rank)
    return n_params, trainable, weights, grads, optim, act


def _grown_with_context(act: dict[str, int], short: tuple, gpu_budget: int) -> list[str]:
    """The GPU rows of ``act`` (one chunk's activations and temporaries at the planned context) that grow with the
    context, by name, where they are why the fixed GPU part does not fit: ``short`` (``(parts, bytes)`` of the
    same plan at a one-chunk context) fits ``gpu_budget``. Empty otherwise (the usual fixes then help)."""
    short_act, short_bytes = short[0][5], short[1]
    if short_bytes > gpu_budget:
        return []
    temp = lambda a: max(a["attention_temp"], a["loss_temp"])  # noqa: E731 (the peak holds the larger one)
    names = [name for name, grew in (
        ("attention temporaries", temp(act) > temp(short_act)),
        ("sparse page summaries and selections", act.get("sparse_state", 0) > short_act.get("sparse_state", 0)),
        ("saved attention outputs", act.get("saved_attention", 0) > short_act.get("saved_attention", 0)),
    ) if grew]
    return names


def _tier(L: int, n: int, pb: int, pool_budget: int, host_budget: int, offload: bool | str,
          gpu_page_budget: int | None, segment_pages: int | None = None,
          staging_sets: int | None = None, stash_bytes: int = 0) -> tuple[Tiering | None, str | None]:
    """Choose the tiering for n pages per layer, or (None, why not). ``segment_pages``: the staging
    segment (None: whole-layer staging). ``staging_sets``: requested whole-layer staging sets (None: picked from
    the pool by :func:`oomb.engine.offload.choose_staging_sets`, and 2 where more would overflow ``host_budget``).
    ``stash_bytes``: GPU bytes ``pool_budget`` keeps free for the K/V stash, which only an offloading store
    allocates: the all-on-GPU tiering may use them."""
    from .engine.offload import _staging, choose_staging_sets, min_gpu_pages, resident_pages_for_budget

    all_pages = L * n
    room = pool_budget + stash_bytes  # for every page on the GPU (no stash then)
    if offload is False or (offload == "auto" and gpu_page_budget is None and all_pages * pb <= room):
        if all_pages * pb > room:
            return None, (f"the KV store needs {all_pages * pb / GiB:.2f} GiB on the GPU but only "
                          f"{max(room, 0) / GiB:.2f} GiB of GPU memory is left for it; "
                          "turn offload on (offload='auto' or True)")
        return Tiering(False, None, n), None
    if gpu_page_budget is not None:
        pages = gpu_page_budget
        if pages * pb > pool_budget:
            return None, (f"gpu_page_budget {pages:,} pages = {pages * pb / GiB:.2f} GiB but only "
                          f"{max(pool_budget, 0) / GiB:.2f} GiB of GPU memory is left for KV pages; "
                          "lower gpu_page_budget, or leave it out to use the largest pool that fits")
    else:
        pages = min(max(pool_budget, 0) // pb, all_pages)
    need = min_gpu_pages(L, n, segment_pages, staging_sets)
    if pages < need:
        k = need // n  # the fewest staging sets (2, or as requested), each a whole layer
        what = f"{k} layers of staging" if segment_pages is None else "two staging segments"
        if gpu_page_budget is not None:  # the caller's budget is too small, not the GPU
            return None, (f"gpu_page_budget {pages:,} pages is below the {need:,} pages offload needs for {n:,} pages "
                          f"per layer ({what}); raise gpu_page_budget to {need:,} or more, or leave it out to use the "
                          "largest pool that fits")
        # The GPU is too small: what is left of it after the weights, states and activations cannot stage.
        shorter = ", or shorten the context" if segment_pages is None else ""
        return None, (f"offload needs at least {need:,} GPU pages ({need * pb / GiB:.2f} GiB: {what}) but only "
                      f"{max(pool_budget, 0) / GiB:.2f} GiB of GPU memory is left for KV pages after the weights, "
                      "gradients, optimizer states and activations; free GPU memory for them: "
                      f"use LoRA, checkpoint_layers or a smaller chunk_size{shorter}, or use a GPU with more memory")
    K = choose_staging_sets(L, n, pages, segment_pages, staging_sets)
    R = resident_pages_for_budget(L, n, pages, segment_pages, K)
    host = L * (n - R) * pb
    if host > host_budget and K > 2 and staging_sets is None and os.environ.get("OOMB_OFFLOAD_STAGING_SETS") is None:
        # More sets cost host pages: fall back to two (also where two do not fit either: the error then tells the
        # smallest host tier, the one to make room for).
        R = resident_pages_for_budget(L, n, pages, segment_pages, 2)
        K, host = 2, L * (n - R) * pb
    used = L * R + K * _staging(n, R, segment_pages)
    if host > host_budget:
        if gpu_page_budget is not None:  # the caller's pool sets the host tier: a larger one keeps more on the GPU
            return None, (f"the host tier needs {host / GiB:.2f} GiB of pinned memory but the budget is "
                          f"{host_budget / GiB:.2f} GiB; raise gpu_page_budget ({pages:,} pages keep {R:,} of {n:,} "
                          "pages per layer on the GPU), leave it out to use the largest pool that fits, shorten the "
                          "context or free host RAM")
        return None, (f"the host tier needs {host / GiB:.2f} GiB of pinned memory but the budget is "
                      f"{host_budget / GiB:.2f} GiB; shorten the context, free host "
                      f"RAM, or keep more pages on the GPU ({R:,} of {n:,} per layer now) with less GPU memory for "
                      "activations and weights: use LoRA, checkpoint_layers or a smaller chunk_size")
    return Tiering(R < n, used if R < n else None, R, K if R < n else 2), None


def plan(
    model: Any,
    seq_len: int,
    *,
    chunk_size: int = 4096,
    page_size: int = 128,
    dtype: torch.dtype | str = torch.bfloat16,
    lora_rank: int = 0,
    optimizer: str | None = "adamw",
    checkpoint_layers: bool = False,
    attention_backend: str = "triton",
    attention_block_size: int = 4096,
    loss_chunk_size: int = 1024,
    offload: bool | str = "auto",
    gpu_page_budget: int | None = None,
    offload_segment_pages: int | str | None = None,
    machine: Machine | None = None,
    gpu_reserve_bytes: int | None = None,
    host_fraction: float = HOST_FRACTION,
    sparse: Any | None = None,
    save_attention: str = "off",
    grad_accum_dtype: str = "param",
) -> MemoryPlan:
    """Predict GPU and host memory of training ``model`` on ``seq_len``-token sequences; nothing is allocated.

    Args:
        model: a preset name, a local model directory, a transformers config, or a :class:`ModelShape`.
        seq_len: tokens per sequence (T).
        chunk_size, page_size: tokens (as :class:`oomb.OOMBConfig`).
        dtype: parameter/activation dtype.
        lora_rank: LoRA rank on q/k/v/o (0: full fine-tune).
        optimizer: 'adamw' (two fp32 states per trainable parameter, 8 B) or None (no states).
        checkpoint_layers, attention_backend ('torch', 'triton' or 'sdpa'), attention_block_size, loss_chunk_size:
            as in :class:`oomb.OOMBConfig` ('auto' counts as 'sdpa', what it is on CUDA; with
            ``sparse`` 'auto' and 'sdpa' count as 'triton', the block-table kernels sparse attention runs).
        offload: True, False or 'auto' (offload only when every page does not fit on the GPU).
        gpu_page_budget: GPU pool in pages with offload (None: the largest that fits). Given, the largest contexts
            (``max_seq_len_gpu_only``, ``max_seq_len_offload``) are those of this pool.
        offload_segment_pages: offload staging segment in pages; None/'auto': 32K tokens' worth,
            'layer': whole-layer staging (GPU bytes then grow with the context).
        machine: the memory to fit into; default :meth:`Machine.detect`.
        gpu_reserve_bytes: GPU bytes kept free for the CUDA allocator's fragmentation and library
            workspaces; default max(2 GiB, 3% of the GPU).
        host_fraction: share of available host RAM the pinned host tier may take.
        sparse: None (dense), or a :class:`oomb.config.SparseConfig` (or an OOMBConfig with one): its page
            representatives and selections
            (:func:`sparse_state_bytes`) and the engine's extra headroom for sparse runs (:func:`sparse_headroom_bytes`) are
            counted, and offload stages whole layers, as the engine does.
        save_attention: 'off', 'gpu' or 'host' (:class:`oomb.OOMBConfig`): the Stage-1 attention outputs
            (:func:`oomb.engine.saved_attention.saved_attention_bytes`) on the GPU, or on the host plus two
            chunks' worth on the GPU. Where they do not fit (GPU or host budget), or offload would stage
            whole layers (sparse attention, where the engine does not use them), the run is planned without
            them (``plan.save_attention`` is then 'off' and the table says why).
        grad_accum_dtype: 'param' or 'float32' (:class:`oomb.OOMBConfig`): with 'float32' a full fine-tune's
            bf16/fp16 gradients are counted as the float32 sums the step keeps (4 bytes per parameter).

    Returns:
        :class:`MemoryPlan`; ``plan.fits`` / ``plan.check()`` say whether it fits.
    """
    kwargs = dict(locals())  # the arguments, to plan an alternative the verdict may suggest
    shape = model if isinstance(model, ModelShape) else ModelShape.from_config(model)
    name = model if isinstance(model, str) else shape.model_type
    dtype = _parse_dtype(dtype)
    if seq_len < 2 or chunk_size <= 0 or page_size <= 0 or chunk_size % page_size:
        raise ValueError(f"need seq_len >= 2 and chunk_size a positive multiple of page_size; got {seq_len}, {chunk_size}, {page_size}")
    kv_stash = 0
    machine = machine or Machine.detect()
    backend = {"auto": "sdpa"}.get(attention_backend, attention_backend)
    if sparse is not None and backend == "sdpa":
        backend = "triton"  # sparse attention reads its pages through the block-table kernels (paged_backend)
    reserve = gpu_reserve_bytes if gpu_reserve_bytes is not None else max(2 * GiB, int(0.03 * machine.gpu_total_bytes))
    if sparse is not None:
        from types import SimpleNamespace

        # sparse_state_bytes reads the settings plus ``sparse`` and this plan's page size.
        sparse_cfg = SimpleNamespace(sparse=_sparse_settings(sparse), page_size=page_size)
        # As choose_engine_tiering: more headroom without per-layer checkpointing (sparse_headroom_bytes), and
        # the sparse attention reads the past through one table, so offload stages whole layers.
        reserve += sparse_headroom_bytes(checkpoint_layers)
        offload_segment_pages = "layer"
        from .engine.offload import kv_stash_reserve_bytes

        # the K/V stash, when asked for (OOMB_OFFLOAD_KV_STASH_MIB; at most what the store would allocate)
        kv_stash = kv_stash_reserve_bytes(shape.num_layers, -(-seq_len // page_size), shape.num_kv_heads,
                                          shape.head_dim, page_size, dtype)
        reserve += kv_stash
    gpu_budget = max(machine.gpu_free_bytes - reserve, 0)
    host_budget = int(machine.host_available_bytes * host_fraction)
    L = shape.num_layers
    pb = _page_bytes(shape, page_size, dtype)
    wbuf = 2 * 2 * chunk_size * shape.kv_dim * _dtype_size(dtype)  # two K+V write buffers of one chunk
    from .engine.offload import resolve_segment_pages

    SP = resolve_segment_pages(offload_segment_pages, page_size)
    gsize = 8 if dtype == torch.float64 else 4
    own_max = 0 if SP is None else 2 * 2 * chunk_size * shape.kv_dim * gsize  # two dK+dV buffers of one chunk

    from .engine.saved_attention import saved_attention_bytes

    def saved_for(T: int, save: str) -> dict[str, int]:
        return saved_attention_bytes(L, shape.num_heads, shape.head_dim, T, chunk_size, _dtype_size(dtype), save)

    def fixed_for(T: int, save: str = "off") -> tuple:
        parts = _base_gpu(shape, T, chunk_size, dtype, lora_rank, optimizer, checkpoint_layers, backend,
                          attention_block_size, loss_chunk_size, grad_accum_dtype)
        n_params, trainable, weights, grads, optim, act = parts
        if sparse is not None:
            act = dict(act, sparse_state=sparse_state_bytes(shape, T, sparse_cfg, dtype))
            act["total"] += act["sparse_state"]
        if save != "off":
            act = dict(act, saved_attention=saved_for(T, save)["gpu"])
            act["total"] += act["saved_attention"]
        parts = (n_params, trainable, weights, grads, optim, act)
        return parts, weights + grads + optim + act["total"]

    def tier_for(T: int, off=offload, budget=gpu_page_budget, host=host_budget, save="off", sets=None):
        _, fixed = fixed_for(T, save)
        n = -(-T // page_size)
        pool_budget = gpu_budget - fixed
        saved_host = saved_for(T, save)["host"]
        if saved_host > host:  # the no-offload tiering never looks at the host budget
            return None, (f"saving them needs {saved_host / GiB:.2f} GiB of host memory but the host budget is "
                          f"{host / GiB:.2f} GiB")
        host = host - saved_host
        t, why = _tier(L, n, pb, pool_budget, host, off, budget, SP, sets, kv_stash)
        if (t is not None and t.offload) or (t is None and off is not False):
            # The offload layout leaves room for the write and own-gradient buffers; a failure is told
            # with that layout's numbers too (the ones the table shows).
            t2, why2 = _tier(L, n, pb, pool_budget - wbuf - own_max, host, off, budget, SP, sets, kv_stash)
            if t is not None or t2 is None:
                t, why = t2, why2
        return t, why

    def largest(off) -> int:
        """The longest context (whole chunks) that fits with offload (``off`` True) or with every page on the GPU;
        under a given ``gpu_page_budget`` the pool is that one: every page must fit in it, or offload through it."""
        def fits(T: int) -> bool:
            if gpu_page_budget is None:
                return tier_for(T, off, None)[0] is not None
            t = tier_for(T, True, gpu_page_budget)[0]  # a pool holding every page offloads nothing (R = n)
            return t is not None and (off or not t.offload)

        lo, hi = 0, 1 << 26  # pages per layer
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(mid * page_size):
                lo = mid
            else:
                hi = mid - 1
        return (lo * page_size) // chunk_size * chunk_size

    save, save_note = save_attention, ""
    if save == "off" and seq_len > chunk_size:  # a hint where keeping them would fit
        sa = saved_for(seq_len, "host")
        t_host = tier_for(seq_len, save="host")[0]
        if t_host is not None and not t_host.offload:
            save_note = (f"tip: --save-attention host skips the Stage-2 attention forward (the same gradients; 14% less "
                         f"time at 128K on an H200) for {sa['host'] / GiB:.2f} GiB of pinned host memory and "
                         f"{sa['gpu'] / GiB:.2f} GiB more on the GPU")
    elif save != "off" and seq_len > chunk_size:  # kept where they fit (the engine recomputes otherwise)
        t_save, why_save = tier_for(seq_len, save=save)
        t_plain = tier_for(seq_len)[0]
        # Sparse offload stages whole layers, where the engine does not use them: decided by the tiering the run
        # gets (with or without them), even when neither fits, so the table and verdict never count them then.
        whole_layers = SP is None and offload is not False and (
            t_save.offload if t_save is not None else (t_plain is None or t_plain.offload))
        if whole_layers or (t_save is None and t_plain is not None):
            sa = saved_for(seq_len, save)
            if whole_layers:
                reason = "offload stages whole layers with sparse attention, where they are not used yet"
            elif why_save.startswith("saving them needs"):
                reason = why_save
            else:
                reason = f"with their {sa['gpu'] / GiB:.2f} GiB on the GPU: {why_save}"
            save_note = (f"--save-attention {save} (save_attention={save!r}): not kept ({reason}); planned without "
                         "it, as the engine runs it")
            save = "off"
    elif save != "off":
        save = "off"  # one chunk: nothing to keep
    (n_params, trainable, weights, grads, optim, act), fixed = fixed_for(seq_len, save)
    n = -(-seq_len // page_size)
    problems: list[str] = []
    tiering, why = tier_for(seq_len, save=save)
    shown_note = ""  # how the table's layout relates to a refused --gpu-page-budget
    tiering_found = tiering is not None
    if tiering is None:
        problems.append(why)
        # Show the layout the verdict speaks of: where only the host tier is too small, the offload tiering
        # the GPU side would use (its host pages then exceed the host budget in the table too).
        # (two staging sets, as the verdict: with too little host memory the planner falls back to them)
        two = None if os.environ.get("OOMB_OFFLOAD_STAGING_SETS") is not None else 2
        attempt = tier_for(seq_len, host=float("inf"), sets=two)[0] if offload is not False else None
        tiering = attempt if attempt is not None and attempt.offload else Tiering(
            offload is True or gpu_page_budget is not None, gpu_page_budget, 0)
        if (attempt is None or not attempt.offload) and gpu_page_budget is not None and gpu_page_budget < L * n:
            # The caller's pool is refused (too big for the GPU): show the layout that pool would have.
            from .engine.offload import _staging, choose_staging_sets, resident_pages_for_budget

            try:
                K = choose_staging_sets(L, n, gpu_page_budget, SP)
                R = resident_pages_for_budget(L, n, gpu_page_budget, SP, K)
                tiering = Tiering(True, L * R + K * _staging(n, R, SP), R, K)
            except ValueError:  # below the minimum (that problem is in the list): show the minimum pool's layout
                from .engine.offload import min_gpu_pages

                need = min_gpu_pages(L, n, SP, two)
                K = need // n if SP is None else 2
                tiering = Tiering(True, need, 0, K)
                given = f"{gpu_page_budget:,} page" + ("s are" if gpu_page_budget != 1 else " is")
                shown_note = f"shown at the minimum pool; the given {given} below it"
        elif (attempt is None or not attempt.offload) and gpu_page_budget is not None:
            # A refused pool that holds every page (too big for the GPU): every page on the GPU, nothing staged.
            tiering = Tiering(True, L * n, n, 2)
    if (not shown_note and gpu_page_budget is not None and tiering.offload and tiering.gpu_pages is not None
            and tiering.gpu_pages < gpu_page_budget):
        # the pool uses whole resident pages per layer: the rest of a given budget stays unused
        shown_note = f"of the {gpu_page_budget:,} given, the rest is less than one more resident page per layer"
    if not tiering.offload and kv_stash:  # no offload, no stash: its reserve goes back to the budget
        reserve -= kv_stash
        gpu_budget = max(machine.gpu_free_bytes - reserve, 0)
        kv_stash = 0
    longest_gpu, longest_off = largest(False), largest(True)
    grown = _grown_with_context(act, fixed_for(min(seq_len, chunk_size), save), gpu_budget) if fixed > gpu_budget else []
    if machine.gpu_total_bytes == 0:
        problems = ["no CUDA GPU is visible: plan for one with plan(..., machine=Machine(...))"]
    elif grown:
        # One chunk's context would fit: what does not is what grows with the context (a fresh-user review was told
        # that the weights and states need 23842 GiB, the attention temporaries at 1e11 tokens, and to use LoRA).
        longest = max(longest_gpu, longest_off)
        fix = (f"shorten the context to {longest:,} tokens or fewer (the longest that fits"
               + (" with offload)" if longest_off > longest_gpu else ")") if longest else "shorten the context")
        if (backend == "sdpa" and "attention temporaries" in grown and L * n * pb <= gpu_budget + host_budget
                and kwargs["attention_backend"] != "triton"):  # (a whole plan only where the KV store could fit)
            if plan(**dict(kwargs, attention_backend="triton")).fits:
                fix += ", or use attention_backend='triton' (its attention temporaries do not grow with the context)"
        problems = [f"at {seq_len:,} tokens one chunk's {' and '.join(grown)} grow with the context: with the weights, "
                    f"gradients, optimizer states and activations they need {fixed / GiB:.2f} GiB but "
                    f"{gpu_budget / GiB:.2f} GiB of GPU memory is free (after a {reserve / GiB:.1f} GiB reserve), and the "
                    f"KV store needs {L * n * pb / GiB:,.2f} GiB on top (GPU and host); {fix}"]
    elif fixed > gpu_budget:
        problems.insert(0, f"weights, gradients, optimizer states and one chunk's activations need {fixed / GiB:.2f} GiB "
                           f"but {gpu_budget / GiB:.2f} GiB of GPU memory is free (after a {reserve / GiB:.1f} GiB reserve); "
                           "use LoRA, checkpoint_layers or a smaller chunk_size, or shorten the context")
    # The fixes the messages name: leave out what this plan already uses (a fresh-user review was told to use
    # checkpoint_layers with it given).
    fixes = [f for f, used in (("LoRA", lora_rank > 0), ("checkpoint_layers", checkpoint_layers)) if not used]
    fixes.append("a smaller chunk_size")
    phrase = "use " + (", ".join(fixes[:-1]) + " or " + fixes[-1] if len(fixes) > 1 else fixes[0])
    problems = [p.replace("use LoRA, checkpoint_layers or a smaller chunk_size", phrase) for p in problems]
    from .engine.offload import _staging

    own_b = 0
    if tiering.offload:
        R = tiering.resident_pages_per_layer
        gpu_pool = (L * R + tiering.staging_sets * _staging(n, R, SP)) * pb
        host_kv = L * (n - R) * pb
        wb = wbuf
        if SP is not None:
            own_b = 2 * min(chunk_size // page_size, n - R) * page_size * shape.kv_dim * 2 * gsize
    else:
        gpu_pool, host_kv, wb = L * n * pb, 0, 0
    gpu_peak = fixed + gpu_pool + wb + own_b
    return MemoryPlan(
        model=str(name), shape=shape, seq_len=seq_len, chunk_size=chunk_size, page_size=page_size, dtype=dtype,
        num_params=n_params, trainable_params=trainable, weights=weights, grads=grads, optimizer=optim,
        activations=act, page_bytes=pb, pages_per_layer=n, kv_total=L * n * pb, tiering=tiering,
        gpu_pool=gpu_pool, write_buffers=wb, host_kv=host_kv, gpu_peak=gpu_peak,
        host_peak=host_kv + saved_for(seq_len, save)["host"],
        gpu_budget=gpu_budget, host_budget=host_budget, machine=machine,
        max_seq_len_gpu_only=longest_gpu, max_seq_len_offload=longest_off, problems=problems,
        traffic=offload_traffic(shape, seq_len, chunk_size, page_size, tiering.resident_pages_per_layer, dtype,
                                segment_pages=SP, checkpoint_layers=checkpoint_layers,
                                saved_attention=save != "off" and SP is not None, staging_sets=tiering.staging_sets)
        if tiering.offload else {},
        segment_pages=SP if tiering.offload else None, own_buffers=own_b, host_fraction=host_fraction,
        save_attention=save, saved_attention_host=saved_for(seq_len, save)["host"], save_attention_note=save_note,
        grad_accum_dtype=grad_accum_dtype, kv_stash_reserved=kv_stash, layout_note=shown_note,
        gpu_page_budget=gpu_page_budget, tiering_found=tiering_found,
    )


def offload_traffic(
    shape: ModelShape, seq_len: int, chunk_size: int, page_size: int, resident_pages_per_layer: int,
    dtype: torch.dtype = torch.bfloat16, segment_pages: int | None = None, checkpoint_layers: bool = False,
    saved_attention: bool = False, stage1_shadow_pages: int | None = None, staging_sets: int | None = None,
) -> dict[str, int]:
    """Bytes one training step copies host->device and device->host with offload (the schedule of
    :mod:`oomb.engine.offload`).

    With segmented staging (``segment_pages`` an int) the staging copies come from running the
    store's own schedule (:func:`oomb.engine.offload.segment_traffic`) over the step's calls (it
    depends on ``checkpoint_layers``), plus the Stage-1 writes of new pages beyond R. Roughly:
    every segment use stages its K/V (the backward reuses the last two segments the forward
    left in the buffers), every backward its dK/dV, and writes them back. ``saved_attention``
    (segmented only): the Stage-2 forwards of chunks 0..N-2 read no past (``save_attention``).

    Whole-layer staging (``segment_pages`` None; the same with or without per-layer checkpointing),
    per layer and chunk c (P = c*C/S past pages, n = C/S own pages, R resident):
    Stage 1 (c < N-1) stages K/V of pages [R + Sh, P) and writes back the new pages beyond R (Sh: the pages
    per layer Stage 1 keeps in the pool's dK/dV bytes, ``stage1_shadow_pages``; None = the store's default,
    :func:`oomb.engine.offload.stage1_shadow_pages`); Stage 2
    stages K/V [R, P) for the forward, again for the backward of layers 0..L-K-1 (their staging set
    was reused by layer l+K; K = ``staging_sets``, the store's :attr:`~oomb.engine.offload.OffloadedKVStore.staging_sets`,
    None = :func:`oomb.engine.offload.staging_sets`: ``OOMB_OFFLOAD_STAGING_SETS`` or 2), dK/dV [R, P + n)
    (chunk N-1: zero-filled on the device, not copied), and writes back dK/dV [R, P).

    Returns:
        {"h2d_bytes": ..., "d2h_bytes": ...}.
    """
    L, S, C, R = shape.num_layers, page_size, chunk_size, resident_pages_per_layer
    e = _dtype_size(dtype)
    kvb = S * shape.kv_dim * 2 * e
    gb = S * shape.kv_dim * 2 * (8 if dtype == torch.float64 else 4)
    N = -(-seq_len // C)
    n = C // S
    h2d = d2h = 0
    if segment_pages is not None:
        from .engine.offload import segment_traffic

        for c in range(N - 1):  # Stage-1 writes of the new pages beyond R
            P = c * n
            d2h += L * max(P + n - max(P, R), 0) * kvb
        h2d_s, d2h_s = segment_traffic(L, seq_len, C, S, R, segment_pages, checkpoint_layers, kvb, gb,
                                       saved_attention=saved_attention)
        return {"h2d_bytes": h2d_s, "d2h_bytes": d2h + d2h_s}
    if stage1_shadow_pages is None and os.environ.get("OOMB_OFFLOAD_STAGE1_SHADOW") == "0":
        stage1_shadow_pages = 0  # as the store: the shadow turned off
    if stage1_shadow_pages is None:
        from .engine.offload import _staging, stage1_shadow_pages as shadow, staging_sets as min_sets

        npl = -(-seq_len // S)
        from .engine.offload import OffloadedKVStore

        k = min_sets(None) if staging_sets is None else staging_sets
        stage1_shadow_pages = shadow(L, npl, R, L * R + k * _staging(npl, R, None), dtype,
                                     torch.float64 if dtype == torch.float64 else torch.float32,
                                     OffloadedKVStore.stage1_shadow_partial)
    from .engine.offload import staging_sets as min_sets

    K = min_sets(None) if staging_sets is None else staging_sets
    for c in range(N):
        P = c * n
        kv = max(P - R, 0)
        if c < N - 1:  # Stage 1
            h2d += L * max(P - R - stage1_shadow_pages, 0) * kvb
            d2h += L * max(P + n - max(P, R), 0) * kvb
        own = n if c < N - 1 else 0
        h2d += L * kv * kvb + max(L - K, 0) * kv * kvb  # Stage-2 forward; backward of layers 0..L-K-1
        if c < N - 1:
            h2d += L * max(P + own - R, 0) * gb
        d2h += L * kv * gb
    return {"h2d_bytes": h2d, "d2h_bytes": d2h}


def choose_tiering(model: Any, seq_len: int, **kwargs) -> Tiering:
    """The tiering :func:`plan` picks (``offload='auto'`` unless given).

    Raises:
        MemoryPlanError: if the run does not fit at all.
    """
    return plan(model, seq_len, **kwargs).check().tiering


def sparse_state_bytes(shape: "ModelShape", seq_len: int, config: Any, dtype: torch.dtype) -> int:
    """GPU bytes of the sparse state of one step (an upper bound): page representatives plus selections.

    Representatives: ``L * ceil(T / page_size) * Hkv * D`` values in the accumulation dtype (fp32 for
    half inputs), twice for the 'quest' score (min and max). Selections: int32 ``[nb, Hkv, K]`` page ids
    plus ``[nb, Hkv]`` counts per (chunk, layer), ``nb = ceil(T / sparse_block_size)`` blocks in all,
    ``K = min(page_budget + sink_pages + local_pages, pages - 1)`` (a selection holds at most its past pages:
    :func:`oomb.ops.sparse.select_pages`). Returns 0 unless ``config.sparse``.
    """
    if not config.sparse:
        return 0
    from .ops.attention_ref import acc_dtype_for

    L, Hkv, D = shape.num_layers, shape.num_kv_heads, shape.head_dim
    n_pages = -(-seq_len // config.page_size)
    reps = L * n_pages * Hkv * D * torch.empty((), dtype=acc_dtype_for(dtype)).element_size()
    sp = config.sparse
    reps *= 2 if sp.score == "quest" else 1
    nb = -(-seq_len // sp.block_size)
    K = min(sp.page_budget + sp.sink_pages + sp.local_pages, max(n_pages - 1, 0))
    return reps + L * nb * Hkv * (K + 1) * 4


def sparse_headroom_bytes(checkpoint_layers: bool) -> int:
    """GPU bytes kept free for a sparse run on top of the allocator reserve: 4 GiB without per-layer checkpointing,
    0 with it.

    Without ``checkpoint_layers`` the first 1M-token sparse + offload step (2026-11-30) ran out of memory in Stage 2
    with the plain reserve. With it, three H200 steps (Qwen2.5-7B, chunk 4096; 64K, 256K, 1M tokens, 2026-12-02)
    measured 2.77-2.80 GiB of activations at the peak against 3.48 GiB estimated by :func:`activation_bytes`, and
    2.6-2.9 GiB of allocator cache above the allocated peak, within the 3% reserve (4.2 GiB) (benchmarks/NOTES.md,
    "thirteenth session").
    """
    return 0 if checkpoint_layers else 4 * GiB


def choose_engine_tiering(engine: Any, seq_len: int) -> tuple[bool, int | None, int | None]:
    """(offload, gpu_pages, staging_sets) for an :class:`oomb.Engine` about to allocate its store for ``seq_len``
    tokens (``staging_sets``: for :class:`~oomb.engine.offload.OffloadedKVStore`; None = picked from the pool).

    Explicit settings win: ``offload=False`` -> all on the device; a ``gpu_page_budget`` -> offload with it;
    on CPU ``offload=True`` means the minimum GPU tier (simulation) and 'auto' means no offload. On CUDA the
    budget comes from the memory free NOW (driver free + the allocator's cached bytes), less the gradients not
    yet allocated, one chunk's activations and a reserve. Optimizer states allocated later are not seen:
    callers that know the optimizer (the CLI) should plan with :func:`plan` and pass ``gpu_page_budget``.
    On CUDA the bytes it read are left in ``engine.tiering`` (for benchmarks and bug reports).

    Raises:
        MemoryPlanError: on CUDA, if not even the two staging buffers fit (two segments; two layers with
            sparse attention), or the host tier does not.
    """
    cfg = engine.config
    off = cfg.offload
    if off.mode == "off":
        return False, None, None
    if off.gpu_page_budget is not None:
        return True, off.gpu_page_budget, off.staging_sets
    device = engine.device
    if device.type != "cuda":
        return off.mode == "on", None, off.staging_sets
    shape = ModelShape.from_config(engine._base.config)
    dtype = engine.dtype
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    from .engine.grad_accum import LOW_PRECISION, extra_grad_bytes

    float32_sums = cfg.grad_accum_dtype == "float32"  # the step's float32 gradient sums (oomb.engine.grad_accum)
    params = list(engine.model.parameters())
    missing_grads = sum(p.numel() * p.element_size() for p in params
                        if p.requires_grad and p.grad is None and not (float32_sums and p.dtype in LOW_PRECISION))
    if float32_sums:
        missing_grads += extra_grad_bytes(params)
    # The backend the step will run (engine._backend is only set by step()/evaluate(): reserve() before the
    # first step read the CPU default 'torch', whose score-sized temporaries are 3.8 GiB more for Qwen2.5-7B at
    # chunk 4096, and sized the 1M pool of 2026-12-02 that much too small). Sparse attention reads its pages
    # through the block-table kernels (paged_backend).
    from .ops.paged_attention import step_backend

    backend = step_backend(cfg, device)
    act = activation_bytes(shape, min(cfg.chunk_size, seq_len), dtype, cfg.checkpoint_layers, backend,
                           cfg.attention_block_size, cfg.loss_chunk_size, max(seq_len - cfg.chunk_size, 0))["total"]
    reserve = max(2 * GiB, int(0.03 * total))
    stash = 0
    if cfg.sparse:
        # Page representatives and stored selections live on the GPU for the whole step, and the first
        # 1M-token sparse + offload step planned without them (and with the plain reserve) ran out of
        # memory in Stage 2 (benchmarks/NOTES.md, 2026-11-30): count them, and keep sparse_headroom_bytes free.
        reserve += sparse_state_bytes(shape, seq_len, cfg, dtype) + sparse_headroom_bytes(cfg.checkpoint_layers)
        from .engine.offload import kv_stash_reserve_bytes

        # the K/V stash, when asked for (OOMB_OFFLOAD_KV_STASH_MIB; at most what the store would allocate); only an
        # offloading store allocates it (_tier's stash_bytes)
        stash = kv_stash_reserve_bytes(shape.num_layers, -(-seq_len // cfg.page_size), shape.num_kv_heads,
                                       shape.head_dim, cfg.page_size, dtype)
        reserve += stash
    pool_budget = free + cached - reserve - missing_grads - act
    engine.tiering = dict(seq_len=seq_len, free_bytes=int(free), cached_bytes=int(cached),
                          allocated_bytes=int(torch.cuda.memory_allocated(device)), reserve_bytes=int(reserve),
                          missing_grad_bytes=int(missing_grads), activation_bytes=int(act), pool_budget_bytes=int(pool_budget))
    L, n = shape.num_layers, -(-seq_len // cfg.page_size)
    pb = _page_bytes(shape, cfg.page_size, dtype)
    host_budget = int(_host_memory()[0] * HOST_FRACTION)
    from .engine.offload import resolve_segment_pages

    SP = resolve_segment_pages(engine._segment_pages(), cfg.page_size)

    def tier(pool: int, host: int):
        t, why = _tier(L, n, pb, pool, host, off.enabled, None, SP, off.staging_sets, stash)
        if t is not None and t.offload:
            wbuf = 4 * cfg.chunk_size * shape.kv_dim * _dtype_size(dtype)
            if SP is not None:  # the own-gradient buffers
                wbuf += 4 * cfg.chunk_size * shape.kv_dim * (8 if dtype == torch.float64 else 4)
            t, why = _tier(L, n, pb, pool - wbuf, host, off.enabled, None, SP, off.staging_sets, stash)
        return t, why

    t = None
    if cfg.save_attention != "off":
        # Room for the kept attention outputs (save_attention): first with them; where they do not fit, or the
        # store would stage whole layers (sparse attention: the engine does not keep them then), without them.
        from .engine.saved_attention import saved_attention_bytes

        sa = saved_attention_bytes(L, shape.num_heads, shape.head_dim, seq_len, cfg.chunk_size, _dtype_size(dtype),
                                   cfg.save_attention)
        t, _ = tier(pool_budget - sa["gpu"], host_budget - sa["host"])
        if t is not None and t.offload and SP is None:
            t = None
    if t is None:
        t, why = tier(pool_budget, host_budget)
    if t is None:
        raise MemoryPlanError(f"{seq_len:,} tokens do not fit: {why}")
    if off.mode == "on" and not t.offload:
        return True, L * n, None  # asked for offload but everything fits: one tier, no host pages
    return t.offload, t.gpu_pages, (t.staging_sets if t.offload else None)


# ------------------------------------------------------------------------ CLI
def plan_for_train_args(args: Any, dtype: torch.dtype, machine: Machine | None = None) -> MemoryPlan:
    """The plan of an ``oomb train`` run from its parsed arguments (model, seq_len, chunk_size, page_size,
    attention_backend, checkpoint_layers, lora_rank, offload, gpu_page_budget, offload_segment_pages, sparse,
    save_attention, grad_accum_dtype), AdamW included. Sparse attention stages whole layers (as the engine does)."""
    return plan(
        args.model, args.seq_len, chunk_size=args.chunk_size, page_size=args.page_size, dtype=dtype,
        lora_rank=getattr(args, "lora_rank", 0), optimizer="adamw", checkpoint_layers=args.checkpoint_layers,
        attention_backend=args.attention_backend,
        offload={"auto": "auto", "on": True, "off": False}[getattr(args, "offload", "auto")],
        gpu_page_budget=getattr(args, "gpu_page_budget", None), machine=machine,
        offload_segment_pages="layer" if getattr(args, "sparse", False) else getattr(args, "offload_segment_pages", None),
        sparse=_sparse_settings(args) if getattr(args, "sparse", False) else None,
        save_attention=getattr(args, "save_attention", "off"),
        grad_accum_dtype=getattr(args, "grad_accum_dtype", "param"),
    )


def _sparse_settings(args: Any) -> Any:
    """The :class:`~oomb.config.SparseConfig` of ``args``: a SparseConfig, an OOMBConfig's ``sparse``, or parsed
    ``oomb train`` / ``oomb plan`` arguments (``page_budget``, ``sink_pages``, ``local_pages``, ``sparse_score``;
    the defaults for any they lack)."""
    from .config import OOMBConfig, SparseConfig

    if isinstance(args, SparseConfig):
        return args
    if isinstance(args, OOMBConfig):
        return args.sparse or SparseConfig()
    default = SparseConfig()
    return SparseConfig(page_budget=getattr(args, "page_budget", default.page_budget),
                        sink_pages=getattr(args, "sink_pages", default.sink_pages),
                        local_pages=getattr(args, "local_pages", default.local_pages),
                        score=getattr(args, "sparse_score", default.score))


def run_plan(args: Any) -> int:
    """Print the plan for parsed ``oomb plan`` arguments. Returns 0 if the run fits, 1 if not. A --seq-len
    beyond the model's max_position_embeddings is warned about on stderr (as ``oomb train`` does).

    Raises:
        ValueError: without a visible CUDA GPU and without ``--gpu-gib`` (there is no GPU to plan for: the
            table would be all zeros), before anything is printed.
    """
    import sys

    from .models.presets import load_config
    from .models.limits import context_length_warning, lora_rank_problem

    config = load_config(args.model)  # an unknown model is the first thing to say
    lora_problem = lora_rank_problem(config, args.lora_rank, args.model)
    if lora_problem:
        raise ValueError("; ".join(lora_problem))
    machine = Machine.detect()
    if args.gpu_gib is None and machine.gpu_total_bytes == 0:
        raise ValueError("no CUDA GPU is visible, so there is no GPU memory to plan for; pass --gpu-gib G and --host-gib H "
                         "(the free GPU memory and the available host RAM, in GiB, of the machine to plan for)")
    warning = context_length_warning(config, args.seq_len, args.model)
    if warning:
        print(warning, file=sys.stderr)
    if args.gpu_gib is not None or args.host_gib is not None:
        gpu = int(args.gpu_gib * GiB) if args.gpu_gib is not None else machine.gpu_free_bytes
        host = int(args.host_gib * GiB) if args.host_gib is not None else machine.host_available_bytes
        if args.host_gib is None and machine.gpu_total_bytes == 0:
            # planning for another machine (no GPU here): this one's RAM is most likely not that machine's
            print(f"oomb: note: --host-gib not given, so the host budget comes from this machine's available RAM "
                  f"({host / GiB:.1f} GiB); pass --host-gib H for the machine you plan for", file=sys.stderr)
        machine = Machine(gpu, max(gpu, machine.gpu_total_bytes if args.gpu_gib is None else gpu), host,
                          max(host, machine.host_total_bytes), "given" if args.gpu_gib is not None else machine.gpu_name)
    offload = {"auto": "auto", "on": True, "off": False}[args.offload]
    p = plan(
        # 'auto' is bfloat16 on a GPU, the machine a plan is for
        args.model, args.seq_len, chunk_size=args.chunk_size, page_size=args.page_size,
        dtype="bfloat16" if args.dtype == "auto" else args.dtype,
        lora_rank=args.lora_rank, optimizer=None if args.no_optimizer else "adamw",
        checkpoint_layers=args.checkpoint_layers,
        attention_backend=args.attention_backend,
        offload=offload, gpu_page_budget=args.gpu_page_budget, machine=machine,
        offload_segment_pages=args.offload_segment_pages,
        sparse=_sparse_settings(args) if args.sparse else None, save_attention=args.save_attention,
        grad_accum_dtype=args.grad_accum_dtype,
    )
    print(p.table())
    args._num_layers = p.shape.num_layers  # for the CLI's warnings about the flags (as oomb train's)
    args._plan_offloads = bool(p.tiering.offload)
    return 0 if p.fits else 1
