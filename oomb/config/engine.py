"""Settings of the chunk-recurrent engine: chunking and attention, sparse attention, offload, kernels.

:class:`OOMBConfig` is what :class:`oomb.Engine` takes; its sections :class:`SparseConfig`,
:class:`OffloadConfig` and :class:`KernelConfig` hold one concern each. Every field is declared once, here,
with its default and its check; the ``oomb`` flags are generated from these fields
(:mod:`oomb.config.flags`) and ``oomb train --config FILE`` reads them from YAML (:mod:`oomb.config.io`).
A bad value raises :class:`~oomb.config.errors.ConfigError` (a ``ValueError``) naming the field and the fix.

Design reference: docs/design.md §2.1 (chunks), §2.2 (pages), §2.3 (offload), §2.4 (sparse).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, Optional

from . import _checks as check
from .errors import ConfigError, literal
from .meta import flag

__all__ = ["KernelConfig", "OOMBConfig", "OffloadConfig", "SparseConfig", "check_config_type"]

AttentionBackend = Literal["auto", "torch", "triton", "sdpa"]
SaveAttention = Literal["off", "gpu", "host"]
CheckpointAttention = Literal["keep", "recompute"]
GradAccumDtype = Literal["param", "float32"]
SparseScore = Literal["mean", "quest"]
OffloadMode = Literal["auto", "on", "off"]
StageGrain = Literal["head", "page"]
Autotune = Literal["full", "first"]
FusedGlue = Literal["none", "liger"]
KeepGraphs = Literal["off", "auto"]

HOST_FRACTION = 0.75
"""Share of the available host RAM the pinned KV host tier may take (the planner's and the engine's budget)."""

SMALL_SEGMENT_TOKENS = 4096
"""An ``offload.segment_pages`` below this many tokens' worth (an eighth of the default 32K segment) is warned
about: each segment costs its own host-to-device copies, attention call and merge, whose fixed cost then
outweighs the segment's copy and compute time (an estimate from the 32K segment's ~6 ms of copies, not a
measured cut-off)."""


def _raise_in(section: str, exc: ConfigError) -> None:
    exc.section = exc.section or section
    raise exc


@dataclass
class SparseConfig:
    """Page-level top-K sparse attention (docs/design.md §2.4): each block of ``block_size`` queries attends, per
    KV head, to ``page_budget`` selected past pages plus ``sink_pages`` first and ``local_pages`` latest past
    pages and its own chunk. Selected in Stage 1, reused unchanged in Stage 2. Exactly dense while the past fits
    in the kept pages."""

    page_budget: int = 64
    """Past pages chosen by score per query block and KV head, beyond the sink and local pages."""

    sink_pages: int = 1
    """First pages of the sequence always attended (attention sink); 0 allowed."""

    local_pages: int = 8
    """Latest past pages always attended (a local window before the chunk); 0 allowed."""

    score: SparseScore = field(default="mean", metadata=flag("--sparse-score"))
    """Page score: 'mean' (q_sum . mean of the page's keys; MoBA, OOMB) or 'quest' (upper bound of q_sum . k
    from the page's element-wise key min/max; Quest)."""

    block_size: int = field(default=128, metadata=flag(None))
    """Queries per selection block (tokens); every block of a chunk makes its own selection."""

    def __post_init__(self) -> None:
        try:
            check.types(self)
            for key in ("page_budget", "sink_pages", "local_pages"):
                check.nonnegative_int(key, getattr(self, key), "pages")
            check.choice("score", self.score, ("mean", "quest"))
            check.positive_int("block_size", self.block_size, "queries")
            if self.page_budget + self.sink_pages + self.local_pages == 0:
                raise ConfigError(
                    "page_budget", "sparse attention with {page_budget} 0, {sink_pages} 0 and {local_pages} 0 attends "
                    "to no past page (every chunk would see only itself)",
                    "give at least one of them a positive number of pages")
        except ConfigError as exc:
            _raise_in("engine.sparse", exc)


@dataclass
class OffloadConfig:
    """KV pages in pinned host memory with a GPU tier (docs/design.md §2.3): the earliest pages of every layer
    stay on the GPU, the rest are staged in on side streams while the previous segment computes."""

    mode: OffloadMode = field(default="auto", metadata=flag("--offload"))
    """'on', 'off', or 'auto' (on CUDA: offload only when the planner finds that not every page fits in free
    GPU memory; on the CPU: never)."""

    gpu_page_budget: Optional[int] = field(default=None, metadata=flag("--gpu-page-budget"))
    """GPU page-pool size in pages (a page = page_size tokens of one layer's K, V, dK and dV), the staging
    buffers included. None: on CUDA the largest that fits, on the CPU (a simulation) the minimum. One that holds
    every page of every layer offloads nothing."""

    segment_pages: Optional[int] = None
    """Pages per staging segment: the attention reads a layer's non-resident past one segment at a time through
    two segment buffers, so the GPU tier does not grow with the context. None: 32,768 tokens' worth. Not used by
    sparse attention, which stages whole layers."""

    staging_sets: Optional[int] = None
    """With sparse attention (whole-layer staging): staging buffers of a whole layer in the GPU pool, an
    integer >= 2 below the number of layers. None: picked from the pool (2 to 4)."""

    stage_grain: StageGrain = "head"
    """With sparse attention: Stage 2 moves only the (page, KV head) tiles each selection reads ('head') or
    whole pages ('page')."""

    stage1_shadow: bool = True
    """With whole-layer staging: Stage 1 keeps offloaded pages' K/V in the GPU pool's gradient bytes, which are
    idle until Stage 2, so fewer host-to-device copies are made."""

    copy_streams: Literal[1, 2] = 2
    """CUDA streams for the host<->GPU copies: 2 runs both directions at once (PCIe is duplex), 1 serialises
    them."""

    kv_stash_mib: int = 0
    """With tile-grain staging: MiB of the tiles each Stage-2 forward staged kept on the GPU for that layer's
    backward, instead of reading them over PCIe twice (the memory comes out of the GPU page pool); 0: off."""

    def __post_init__(self) -> None:
        try:
            if self.mode is True or self.mode is False:  # the Python spelling of on/off
                self.mode = "on" if self.mode else "off"
            check.types(self)
            check.choice("mode", self.mode, ("auto", "on", "off"))
            check.optional_positive_int("gpu_page_budget", self.gpu_page_budget, "pages")
            check.optional_positive_int("segment_pages", self.segment_pages, "pages")
            if self.staging_sets is not None and (not check.is_int(self.staging_sets) or self.staging_sets < 2):
                raise ConfigError("staging_sets", f"{{staging_sets}} is {literal(self.staging_sets)}",
                                  "pass an integer of 2 or more, or leave it out to let oomb pick")
            check.choice("stage_grain", self.stage_grain, ("head", "page"))
            check.boolean("stage1_shadow", self.stage1_shadow)
            check.choice("copy_streams", self.copy_streams, (1, 2))
            check.nonnegative_int("kv_stash_mib", self.kv_stash_mib, "MiB", zero="0 (off)")
            if self.mode == "off":
                for key, what in (("gpu_page_budget", "the GPU tier"), ("segment_pages", "the staging"),
                                  ("staging_sets", "the staging")):
                    if getattr(self, key) is not None:
                        raise ConfigError(key, f"{{{key}}} sizes {what} of offload but {{mode}} is off",
                                          f"set {{mode}} on (or auto), or leave {{{key}}} out")
        except ConfigError as exc:
            _raise_in("engine.offload", exc)

    @property
    def enabled(self) -> bool | str:
        """True, False or 'auto' (``mode`` as the engine and the planner take it)."""
        return {"auto": "auto", "on": True, "off": False}[self.mode]


@dataclass
class KernelConfig:
    """Choices inside oomb's Triton kernels and copy kernels. The defaults are the measured best on an H200;
    the others exist for A/B measurements and for machines where a feature misbehaves (docs/tuning.md)."""

    autotune: Autotune = "full"
    """Triton autotuning: 'full' measures every tile config once per shape (cached on disk), 'first' takes the
    first config (fast compiles, e.g. for GPU test runs over many small shapes)."""

    fwd_tma: bool = True
    """The paged and sparse attention forwards read full past tiles through tensor descriptors (TMA; Hopper or
    newer)."""

    bwd_tma: bool = True
    """The paged and sparse dq kernels read full past tiles through tensor descriptors (TMA; Hopper or newer)."""

    dkdv_tma: bool = True
    """The paged and sparse dk/dv kernels load their q/dout row tiles through tensor descriptors (TMA; Hopper or
    newer)."""

    fused_wgrad: bool = True
    """From the second chunk of a step on, ``nn.Linear`` weight gradients are added into ``.grad`` inside the
    weight-gradient GEMM (Megatron's gradient-accumulation fusion; one write and one rounding less)."""

    page_gather_programs: int = 8
    """Programs (SMs) of the zero-copy Triton kernels that move (page, KV head) tiles between host and GPU."""

    page_gather_warps: Optional[int] = None
    """Warps per program of those copy kernels, a power of two from 1 to 32; None: the kernel's default."""

    page_gather_elems: Optional[int] = None
    """Elements per load of those copy kernels, a power of two from 128 to 65,536; None: the kernel's default."""

    def __post_init__(self) -> None:
        try:
            check.types(self)
            check.choice("autotune", self.autotune, ("full", "first"))
            for key in ("fwd_tma", "bwd_tma", "dkdv_tma", "fused_wgrad"):
                check.boolean(key, getattr(self, key))
            check.positive_int("page_gather_programs", self.page_gather_programs, "programs")
            check.power_of_two("page_gather_warps", self.page_gather_warps, 1, 32)
            check.power_of_two("page_gather_elems", self.page_gather_elems, 128, 65536)
        except ConfigError as exc:
            _raise_in("engine.kernels", exc)


@dataclass
class OOMBConfig:
    """Settings of one chunk-recurrent training step (docs/design.md §2.1-§2.2), with its sparse, offload and
    kernel sections.

    Example::

        OOMBConfig(chunk_size=4096, sparse=SparseConfig(page_budget=64), offload=OffloadConfig(mode="on"))

    Raises:
        ConfigError (a ValueError): a value out of range or not among the choices, a chunk size that is not
            whole pages, or a setting that the others make meaningless (``offload.staging_sets`` without sparse
            attention). The message names the field and the fix.
    """

    chunk_size: int = 4096
    """Tokens per chunk. Activation memory scales with this, not with the sequence length; a multiple of
    page_size."""

    page_size: int = 128
    """Tokens per KV page (one layer, all KV heads)."""

    attention_backend: AttentionBackend = "auto"
    """Attention over the paged KV cache: 'torch' (PyTorch reference), 'triton' (the paged Triton kernels for
    every call), 'sdpa' (PyTorch's fused attention -- cuDNN on CUDA, the flash kernel on the CPU -- over each
    contiguous run of a layer's past in the page pool, offloaded segments included; for sparse, packed-document
    and scattered-page calls the paged Triton kernels on CUDA, the reference on the CPU; on CUDA not bitwise
    reproducible), or 'auto' (sdpa on CUDA, torch on the CPU)."""

    checkpoint_layers: bool = False
    """Per-layer activation checkpointing inside each chunk's Stage-2 recompute."""

    checkpoint_attention: CheckpointAttention = "keep"
    """With checkpoint_layers, what the rerun of a checkpointed layer does for its attention: 'keep' reuses the
    outputs of the chunk's first forward of that layer (kept for all layers of the chunk: Hq x head_dim values
    + Hq float32 per token and layer, 0.78 GiB for Qwen2.5-7B at chunk 4096 in bf16; the attention forward then
    runs once per chunk in Stage 2, not twice; same gradients) or 'recompute' (runs it again: the least memory)."""

    save_attention: SaveAttention = "off"
    """Keep Stage 1's attention outputs (out and lse of every chunk and layer) so the Stage-2 recompute skips its
    attention forward (same gradients, ~22% less attention work): 'off', 'gpu' (Hq x head_dim values + Hq
    float32 per token and layer; 7,280 bytes for Qwen2.5-7B in bf16) or 'host' (pinned host memory, fetched a
    chunk ahead). On the CPU both keep them in ordinary memory. Not used where offload stages whole layers
    (sparse attention)."""

    grad_accum_dtype: GradAccumDtype = "param"
    """Dtype in which each chunk's parameter gradients are summed during a step: 'param' (autograd adds them into
    .grad in the parameter dtype, one rounding per chunk) or 'float32' (a float32 sum rounded into .grad once per
    step, as full-sequence training rounds once; 4 instead of 2 bytes per bf16 trainable parameter)."""

    keep_graphs: KeepGraphs = "off"
    """Skip the Stage-2 recompute of the chunks whose autograd graph fits in spare GPU memory: 'off' (every chunk
    but the last is recomputed: the least memory) or 'auto' (the last Stage-1 chunks run their forward with
    autograd and keep its graph until their backward, as many as fit in the GPU memory the step leaves free, read
    on the step before, so the first step of a length keeps none; same gradients, one chunk forward less per kept
    chunk). Dense attention without checkpoint_layers, pages on the GPU, an unsharded model: elsewhere it keeps
    none (a warning says why, once per engine)."""

    keep_graphs_max: Optional[int] = None
    """With keep_graphs 'auto' (refused without it): keep at most this many chunks' graphs (0 or more; never more
    than the chunks before the last). None: as many as fit on CUDA, and none on the CPU, which has no free GPU
    memory to read."""

    fused_glue: FusedGlue = "none"
    """The memory-bound work around the GEMMs: 'none' (the model's own PyTorch code: the exact reference path) or
    'liger' (RMSNorm, RoPE, SwiGLU and the training cross-entropy through Liger-Kernel's fused Triton kernels;
    CUDA only, needs Liger-Kernel 0.8 (``pip install 'oomb[liger]'``); the same math, bf16 rounding in other places)."""

    loss_chunk_size: int = field(default=1024, metadata=flag(None))
    """Tokens per logits block in the chunked cross-entropy; logits exist for at most this many tokens."""

    attention_block_size: int = field(default=4096, metadata=flag(None))
    """Past tokens per block in the memory-bounded PyTorch reference attention (rounded up to whole pages)."""

    sparse: Optional[SparseConfig] = field(default=None, metadata=flag(
        "--sparse", help="Page-level top-K sparse attention, set up by the sparse attention options (their defaults "
                         "where not given); without it: dense attention. --no-sparse: dense attention whatever the "
                         "--config file's engine.sparse section says."))
    """Page-level top-K sparse attention (a :class:`SparseConfig`), or None for dense attention."""

    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """Where the KV pages live: GPU, or a GPU tier plus pinned host memory."""

    kernels: KernelConfig = field(default_factory=KernelConfig)
    """Choices inside the Triton and copy kernels."""

    def __post_init__(self) -> None:
        try:
            check.types(self)
            for key in ("chunk_size", "page_size", "loss_chunk_size", "attention_block_size"):
                check.positive_int(key, getattr(self, key), "tokens")
            if self.chunk_size % self.page_size != 0:
                near = max(1, round(self.chunk_size / self.page_size)) * self.page_size
                raise ConfigError(
                    "chunk_size",
                    f"{{chunk_size}} {self.chunk_size} is not a multiple of {{page_size}} {self.page_size} "
                    "(a chunk is whole KV pages)",
                    # no article before the setting, which a --config file names engine.page_size ("a engine...")
                    f"pass e.g. {{chunk_size}} {near}, or a divisor of {self.chunk_size} as {{page_size}}")
            check.choice("attention_backend", self.attention_backend, ("auto", "torch", "triton", "sdpa"))
            check.boolean("checkpoint_layers", self.checkpoint_layers)
            check.choice("checkpoint_attention", self.checkpoint_attention, ("keep", "recompute"))
            check.choice("save_attention", self.save_attention, ("off", "gpu", "host"))
            check.choice("grad_accum_dtype", self.grad_accum_dtype, ("param", "float32"))
            check.choice("fused_glue", self.fused_glue, ("none", "liger"))
            check.choice("keep_graphs", self.keep_graphs, ("off", "auto"))
            if self.keep_graphs_max is not None:
                check.nonnegative_int("keep_graphs_max", self.keep_graphs_max, "chunks")
            if self.sparse is True:
                self.sparse = SparseConfig()
            elif self.sparse is False:
                self.sparse = None
            if self.sparse is not None and not isinstance(self.sparse, SparseConfig):
                raise ConfigError("sparse", f"{{sparse}} is {literal(self.sparse)}", "pass a SparseConfig, or None for dense attention")
            if not isinstance(self.offload, OffloadConfig):
                raise ConfigError("offload", f"{{offload}} is {literal(self.offload)}", "pass an OffloadConfig")
            if not isinstance(self.kernels, KernelConfig):
                raise ConfigError("kernels", f"{{kernels}} is {literal(self.kernels)}", "pass a KernelConfig")
        except ConfigError as exc:
            _raise_in("engine", exc)
        if self.offload.staging_sets is not None and self.sparse is None:
            raise ConfigError(
                "staging_sets", "{staging_sets} sizes whole-layer staging, which only sparse attention uses (dense "
                "offload stages segments: see {segment_pages})", "enable {sparse}, or leave {staging_sets} out",
                section="engine.offload")
        if self.checkpoint_attention != "keep" and not self.checkpoint_layers:
            raise ConfigError(
                "checkpoint_attention", "{checkpoint_attention} chooses what the rerun of a checkpointed layer does, "
                "and without {checkpoint_layers} no layer is checkpointed", "enable {checkpoint_layers}, or leave "
                "{checkpoint_attention} out", section="engine")
        if self.keep_graphs_max is not None and self.keep_graphs != "auto":
            raise ConfigError(
                "keep_graphs_max", "{keep_graphs_max} caps the chunk graphs {keep_graphs} auto keeps, and "
                f"{{keep_graphs}} is {literal(self.keep_graphs)}, which keeps none", "pass {keep_graphs} auto, or "
                "leave {keep_graphs_max} out", section="engine")
        if self.attention_block_size % self.page_size != 0:  # reference blocks are whole pages
            self.attention_block_size = -(-self.attention_block_size // self.page_size) * self.page_size

    @property
    def reruns_attention(self) -> bool:
        """Whether the rerun of each checkpointed layer runs its attention forward again (checkpoint_layers with
        checkpoint_attention 'recompute'): what the offload staging schedule predicts."""
        return self.checkpoint_layers and self.checkpoint_attention == "recompute"

    def dense(self) -> "OOMBConfig":
        """This configuration with dense attention (``sparse`` None) and no whole-layer staging setting."""
        return replace(self, sparse=None, offload=replace(self.offload, staging_sets=None))


def check_config_type(config, name: str = "config") -> None:
    """Raise the TypeError of an engine ``config`` (the argument ``name``) that is not an :class:`OOMBConfig`
    (None: the defaults), naming what was passed and what to pass."""
    if config is None or isinstance(config, OOMBConfig):
        return
    if config is OOMBConfig:
        raise TypeError(f"{name} must be an OOMBConfig, got the class OOMBConfig itself; pass OOMBConfig() (or "
                        f"OOMBConfig(chunk_size=...)), or leave {name} out for the defaults")
    if isinstance(config, dict):
        fields = ", ".join(f"{k}={v!r}" if isinstance(k, str) and k.isidentifier() else "..."
                           for k, v in config.items())
        shown = f"OOMBConfig({fields})" if len(fields) <= 60 else "OOMBConfig(**that_dict)"
        fix = f"pass {shown} (from oomb import OOMBConfig)"
    else:
        fix = f"pass OOMBConfig(chunk_size=..., page_size=...) (from oomb import OOMBConfig), or leave {name} out " \
              "for the defaults"
    raise TypeError(f"{name} must be an OOMBConfig, got {type(config).__name__}; {fix}")
