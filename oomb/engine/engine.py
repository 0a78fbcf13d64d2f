"""The chunk-recurrent training step (docs/design.md §2.1; OOMB, arXiv 2602.02108).

For a sequence of T tokens and chunk size C (N = ceil(T / C) chunks):

Stage 1, no grad, c = 0 .. N-2:
    run chunk c through every layer; at layer l its queries attend to the stored
    K/V of chunks < c plus their own (causal); its post-RoPE K/V are written to
    the paged store. Nothing else is kept. (Chunk N-1's K/V are never read by
    another chunk, so Stage 2 computes them.)
Stage 2, c = N-1 .. 0:
    recompute chunk c with autograd, take its loss (sum of token losses divided
    by the valid tokens of the WHOLE sequence) and call backward. The attention
    backward adds dK/dV of the past pages into the gradient pages and returns,
    for the chunk's own K/V, its own contribution plus what later chunks stored
    there. Parameter gradients accumulate across chunks (in ``.grad``, the
    ``nn.Linear`` weights' inside the weight-gradient GEMM from the second chunk
    on, :mod:`oomb.engine.fused_wgrad`; or in float32 sums rounded once per step
    with ``config.grad_accum_dtype='float32'``, :mod:`oomb.engine.grad_accum`);
    then chunk c's pages go back to the free list.

A model sharded over ranks by :func:`oomb.engine.sharding.shard_model` (FSDP2) runs every chunk through its
root's registered forward, so that FSDP2 gathers and frees the layers around each use; its gradients are
reduce-scattered into the parameters' ``DTensor`` shards instead of staying in ``.grad`` (docs/design.md §8).

With ``config.keep_graphs='auto'`` the last Stage-1 chunks that fit in spare GPU memory run with autograd and keep
their graph, and Stage 2 back-propagates them without recomputing (:mod:`oomb.engine.kept_graphs`).

In dense mode this gives full-sequence gradients up to rounding. With ``config.sparse``
(docs/design.md §2.4, :mod:`oomb.ops.sparse_attention`) each chunk's Stage-1 write also summarises its pages,
and each (chunk, layer) selects its past pages once, before attending; Stage 2 reuses that
selection unchanged.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..config import OOMBConfig
from ..models.fused_glue import FusedGlue
from ..models.hf import check_model_supported, use_oomb_attention
from ..ops.paged_attention import resolve_backend, step_backend
from ..config.engine import HOST_FRACTION, check_config_type
from ..memory import (DeviceMemory, MemoryPlanError, ModelShape, activation_bytes, allocator_reserve_bytes,
                      choose_engine_tiering, host_memory, saved_attention_bytes, sparse_headroom_bytes)
from .kv_store import PagedKVStore
from .fused_wgrad import FusedWeightGradAccumulation
from .grad_accum import LOW_PRECISION, Float32GradAccumulator, extra_grad_bytes
from .offload import OffloadedKVStore
from .chunk_context import ChunkContext
from .kept_attention import KeptAttention
from .kept_graphs import GraphBudget
from .saved_attention import SavedAttention
from .sharding import sharding_of
from .sparse_state import SparseAttentionState
from .loss import IGNORE_INDEX, chunked_cross_entropy_sum, target_logprobs

# Integer dtypes accepted for input_ids and labels (both are copied to int64). Not bool, not floats:
# a float tensor would be silently truncated to token ids.
_TOKEN_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)

__all__ = ["NO_TARGETS", "Engine", "StepOutput"]

NO_TARGETS = "every label is -100 (ignored): the loss is undefined; give at least one target token"
"""The ValueError of a step or evaluation of a sequence without a target token."""


@dataclass
class StepOutput:
    """What one step returns.

    Attributes:
        loss: mean token cross-entropy over the whole sequence.
        num_tokens: tokens in the sequence (T).
        num_valid_tokens: tokens that carry a loss.
        seconds: wall time of the step (device synchronised).
        stage1_seconds, stage2_seconds: the two stages.
        tokens_per_s: num_tokens / seconds.
        peak_memory_bytes: peak CUDA memory allocated during the step, None on CPU.
        kv_store_bytes: bytes of the page pool (K, V, dK, dV).
        kept_graphs: chunks whose graph Stage 1 kept, so that Stage 2 did not recompute them (keep_graphs).
    """

    loss: float
    num_tokens: int
    num_valid_tokens: int
    seconds: float
    stage1_seconds: float
    stage2_seconds: float
    tokens_per_s: float
    peak_memory_bytes: int | None
    kv_store_bytes: int
    kept_graphs: int = 0


def _slice(x: torch.Tensor | None, start: int, n: int) -> torch.Tensor | None:
    return None if x is None else x[start : start + n]


def _doc_starts(cu_seqlens: torch.Tensor | list, T: int) -> torch.Tensor:
    """cu_seqlens [num_docs + 1] -> int64 [T]: the first token index of each token's document.

    Raises:
        ValueError: unless cu_seqlens starts at 0, ends at T and strictly increases.
    """
    cu = torch.as_tensor(cu_seqlens).to("cpu", torch.int64).flatten()
    if cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != T or bool((cu[1:] <= cu[:-1]).any()):
        raise ValueError(
            f"cu_seqlens must start at 0, end at the sequence length {T} and strictly increase "
            f"(document lengths >= 1); got {cu.tolist()[:8]}{'...' if cu.numel() > 8 else ''}"
        )
    lengths = cu[1:] - cu[:-1]
    return torch.repeat_interleave(cu[:-1], lengths)


@contextlib.contextmanager
def _rope_state_of_full_sequence(decoder: torch.nn.Module, T: int, device: torch.device, dtype: torch.dtype):
    """Make dynamic-NTK RoPE use the frequencies full-sequence training would use, in every chunk.

    transformers' dynamic RoPE recomputes its frequencies from the largest position id of each
    forward call. A full-sequence forward sees position T-1 in one call; chunk c only sees
    (c+1)*C-1, so each chunk would rotate its queries and keys with different frequencies. Here
    the rotary module is called once with position T-1 (the full-sequence state) and its
    update rule is disabled for the step. Other RoPE types are static and untouched.
    """
    frozen = []
    for m in decoder.modules():
        if "dynamic" in str(getattr(m, "rope_type", "")) and hasattr(m, "original_max_seq_len"):
            m(torch.zeros(1, device=device, dtype=dtype), torch.tensor([[T - 1]], device=device))
            frozen.append((m, m.original_max_seq_len))
            m.original_max_seq_len = -1  # no "reset" branch while chunks with smaller positions run
    try:
        yield
    finally:
        for m, original in frozen:
            m.original_max_seq_len = original


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Engine:
    """Chunk-recurrent trainer of one Hugging Face causal LM.

    Args:
        model: a transformers ``*ForCausalLM`` (Qwen2/2.5, Llama 2/3, Mistral, Qwen3), optionally
            wrapped by peft. Its attention implementation is switched to 'oomb' (which falls back to
            SDPA when called outside a step, so generation still works).
        config: :class:`OOMBConfig`; defaults to ``OOMBConfig()``.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``, or ``config`` is not an :class:`OOMBConfig` (a dict of
            its fields too: ``OOMBConfig(**fields)``); raised before the model is changed.
        UnsupportedModelError: for architectures oomb cannot train exactly (see
            :func:`oomb.models.hf.check_model_supported`).

    Example::

        engine = Engine(model, OOMBConfig(chunk_size=4096))
        out = engine.step(input_ids)          # gradients accumulate into model parameters
        optimizer.step(); optimizer.zero_grad()
    """

    def __init__(self, model: torch.nn.Module, config: OOMBConfig | None = None) -> None:
        check_config_type(config)  # before the model's attention is switched
        self.config = config if config is not None else OOMBConfig()
        self.model = model
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        check_model_supported(base)
        self._base = base
        self._decoder = base.get_decoder() if hasattr(base, "get_decoder") else base.model
        self._lm_head = base.get_output_embeddings()
        # A model sharded by oomb.engine.sharding.shard_model (FSDP2): every chunk runs through its root.
        self._sharding = sharding_of(base)
        use_oomb_attention(base)
        # Liger's fused RMSNorm / SwiGLU on this instance; its RoPE inside _glue_active (fused_glue='liger').
        self._glue = FusedGlue(base) if self.config.fused_glue == "liger" else None
        cfg = base.config
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.vocab_size = base.get_input_embeddings().num_embeddings
        if self.config.checkpoint_layers:
            # transformers >= 5.2x renamed it (the old name warns and will go in v6).
            if hasattr(base, "activation_checkpointing_enable"):
                base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self._store: PagedKVStore | None = None
        self._sparse: SparseAttentionState | None = None
        self._saved: SavedAttention | None = None
        self._saved_keep: SavedAttention | None = None  # the last step's buffers, reused by the next
        # Each Stage-2 chunk's attention outputs across its layer checkpoints (checkpoint_attention='keep').
        self._kept = KeptAttention() if self.config.checkpoint_layers and self.config.checkpoint_attention == "keep" else None
        self._warned_saved_offload = False
        self._graph_budget = GraphBudget()  # what kept chunk graphs need (keep_graphs='auto' on CUDA)
        self._warned_no_graphs = False
        self._backend = "torch"
        # What choose_engine_tiering read when it sized the GPU pool on CUDA (bytes: free, cached, allocated,
        # reserve, missing gradients, activations, pool budget); None until then (or on CPU).
        self.tiering: dict | None = None

    # ------------------------------------------------------------------ helpers
    @property
    def device(self) -> torch.device:
        return self._lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self._lm_head.weight.dtype

    @property
    def kv_store(self) -> PagedKVStore | None:
        """The page pool of the last step (None before the first)."""
        return self._store

    def _prepare(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None, cu_seqlens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Validate inputs -> (input_ids [T], targets [T], doc_start [T] or None, position_ids [T])."""
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
        ids_given = tuple(input_ids.shape)
        if input_ids.dim() == 2:
            if input_ids.shape[0] != 1:
                raise ValueError(
                    f"batch size {input_ids.shape[0]} is not supported: oomb trains one long sequence per step; "
                    "call step() once per sequence (gradients accumulate) or use torchrun for more sequences"
                )
            input_ids = input_ids[0]
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be [T] or [1, T], got shape {tuple(input_ids.shape)}")
        T = input_ids.shape[0]
        if T < 2:
            raise ValueError(f"the sequence has {T} token(s); a training step needs at least 2 (one input, one target)")
        if input_ids.dtype not in _TOKEN_DTYPES:
            raise ValueError(
                f"input_ids must be integer token ids (int64), got {input_ids.dtype}; pass tokenizer output or ids.long()"
            )
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= self.vocab_size:
            raise ValueError(
                f"token id {hi if hi >= self.vocab_size else lo} is outside the model's vocabulary [0, {self.vocab_size}); "
                "use the tokenizer that matches the model, or a model with a larger vocab_size"
            )
        if labels is None:
            labels = input_ids
        else:
            if not isinstance(labels, torch.Tensor):
                raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
            given = tuple(labels.shape)
            if labels.dim() == 2 and labels.shape[0] == 1:
                labels = labels[0]
            if labels.shape != input_ids.shape:
                raise ValueError(f"labels shape {given} must match input_ids shape {ids_given} (one label per token)")
            if labels.dtype not in _TOKEN_DTYPES:
                raise ValueError(
                    f"labels must be integer token ids (int64; -100 = ignored), got {labels.dtype}; "
                    "pass the target token ids, e.g. labels.long() if they hold whole numbers"
                )
            # One host sync: the smallest and largest label that is not the ignore index.
            lo, hi = torch.stack(torch.aminmax(labels.masked_fill(labels == IGNORE_INDEX, 0))).tolist()
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(
                    f"label {hi if hi >= self.vocab_size else lo} is outside the model's vocabulary [0, {self.vocab_size}) "
                    f"and is not {IGNORE_INDEX} (the ignore index); mark ignored positions with {IGNORE_INDEX}, "
                    "and use the tokenizer that matches the model"
                )
        targets = torch.full_like(labels, IGNORE_INDEX, dtype=torch.int64)
        targets[:-1] = labels[1:]
        doc_start = None
        positions = torch.arange(T)
        if cu_seqlens is not None:
            doc_start = _doc_starts(cu_seqlens, T)
            positions = positions - doc_start
            # The last token of a document predicts nothing: the next token starts another document.
            targets[:-1][doc_start[1:] != doc_start[:-1]] = IGNORE_INDEX
            doc_start = doc_start.to(self.device, torch.int32)
        return input_ids.to(self.device, torch.int64), targets.to(self.device), doc_start, positions.to(self.device)

    def count_valid_tokens(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None
    ) -> int:
        """Tokens of one sequence that carry a loss, as :meth:`step` counts them.

        Sum this over the sequences of a gradient-accumulation step (and over data-parallel
        ranks) to get ``loss_normalizer``. Same arguments and input checks as :meth:`step`.
        """
        targets = self._prepare(input_ids, labels, cu_seqlens)[1]
        return int((targets != IGNORE_INDEX).sum())

    def reserve(self, seq_len: int) -> PagedKVStore:
        """Allocate (or reuse) the KV page store for sequences of ``seq_len`` tokens now.

        Call it before the first step to learn at once whether the store fits: it raises
        ``torch.OutOfMemoryError`` (GPU) or ``RuntimeError`` (host) here instead of mid-step.

        Raises:
            ValueError: if ``seq_len`` < 2; on CUDA, where the store is sized from the free memory, for
                ``attention_backend='triton'`` without the Triton kernels (as :meth:`step` would).
        """
        if not isinstance(seq_len, int) or seq_len < 2:
            raise ValueError(f"seq_len must be an integer number of tokens >= 2, got {seq_len!r}")
        return self._ensure_store(seq_len)

    def _ensure_store(self, T: int) -> PagedKVStore:
        S = self.config.page_size
        store = self._store
        reuse = store is not None and store.fits(T) and store.dtype == self.dtype and store.device == self.device
        if reuse and self.config.offload.mode != "auto":
            reuse = isinstance(store, OffloadedKVStore) == (self.config.offload.mode == "on")
        if not reuse:
            self._store = None  # drop the old pool before allocating the new one
            tiering = self._choose_tiering(T)
            if tiering.offload:
                store = self._offloaded_store(T, tiering.gpu_pages, tiering.staging_sets)
            else:
                store = PagedKVStore(
                    self.num_layers,
                    self.num_kv_heads,
                    self.head_dim,
                    S,
                    PagedKVStore.pages_needed(self.num_layers, T, S),
                    self.dtype,
                    self.device,
                )
            self._store = store
        store.reset()
        if isinstance(store, OffloadedKVStore):
            store.begin_step(T)
        return store

    def _choose_tiering(self, T: int):
        """Where the pages of a T-token store go (:func:`oomb.memory.choose_engine_tiering`), from the memory free
        now on CUDA; what it read is left in :attr:`tiering`."""
        memory, missing = None, 0
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            allocated = torch.cuda.memory_allocated(self.device)
            memory = DeviceMemory(int(free), int(total), torch.cuda.memory_reserved(self.device) - allocated,
                                  allocated, host_memory()[0])
            missing = self._missing_grad_bytes()
        try:
            tiering = choose_engine_tiering(
                ModelShape.from_config(self._base.config), self.config, T, self.dtype,
                segment_pages=self._segment_pages(), backend=step_backend(self.config, self.device), memory=memory,
                missing_grad_bytes=missing)
        except MemoryPlanError as exc:
            self.tiering = getattr(exc, "budget", self.tiering)
            raise
        if tiering.budget is not None:
            self.tiering = tiering.budget
        return tiering

    def _missing_grad_bytes(self) -> int:
        """GPU bytes of the parameter gradients a step will allocate that do not exist yet (with
        ``grad_accum_dtype='float32'``: the float32 sums instead of the low-precision ``.grad``)."""
        float32_sums = self.config.grad_accum_dtype == "float32"  # the step's float32 gradient sums (grad_accum)
        if self._sharding is not None:
            return self._sharding.gradient_bytes(float32_sums)
        params = list(self.model.parameters())
        missing = sum(p.numel() * p.element_size() for p in params
                      if p.requires_grad and p.grad is None and not (float32_sums and p.dtype in LOW_PRECISION))
        if float32_sums:
            missing += extra_grad_bytes(params)
        return missing

    def _offloaded_store(self, T: int, gpu_pages: int | None, staging_sets: int | None) -> OffloadedKVStore:
        """The two-tier store for T tokens, with the offload and copy-kernel settings of :attr:`config`."""
        off, kern = self.config.offload, self.config.kernels
        return OffloadedKVStore(
            self.num_layers, self.num_kv_heads, self.head_dim, self.config.page_size, T, self.dtype, self.device,
            chunk_size=self.config.chunk_size, gpu_pages=gpu_pages,
            segment_pages=self._segment_pages(), checkpoint_layers=self.config.reruns_attention,
            staging_sets=staging_sets, stage_grain=off.stage_grain, stage1_shadow=off.stage1_shadow,
            copy_streams=off.copy_streams, kv_stash_mib=off.kv_stash_mib,
            page_gather_programs=kern.page_gather_programs, page_gather_warps=kern.page_gather_warps,
            page_gather_elems=kern.page_gather_elems,
        )

    def _segment_pages(self) -> int | str:
        """The offload staging segment: whole layers for sparse attention (one block table), else the config's."""
        if self.config.sparse:
            return "layer"
        return self.config.offload.segment_pages or "auto"

    def _ensure_sparse(self, T: int, stage2: bool = True) -> None:
        """Fresh page representatives and selections for a sequence of T tokens (config.sparse), else None.

        With an offloaded store that stages whole layers (``stage2``: a training step follows), the
        store gets the selections as its ``needed_heads`` hook (and their page unions as ``needed_pages``),
        so that Stage 2 stages only the (page, KV head) tiles, or pages, a (chunk, layer)'s selection reads;
        otherwise the hooks are None (whole layers).
        """
        self._sparse = None
        if self.config.sparse:
            self._sparse = SparseAttentionState(
                self.config, self.num_layers, self.num_kv_heads, self.head_dim, T, self.dtype, self.device
            )
        store = self._store
        if isinstance(store, OffloadedKVStore):
            track = stage2 and self._sparse is not None and not store.segmented
            store.needed_pages = self._sparse.needed_pages if track else None
            store.needed_heads = self._sparse.needed_heads if track else None
            if track:
                self._sparse.track_pages = True
                # Head grain: the last chunk's selection (made in its Stage-2 forward, before the view) is given to
                # the store too (note_tiles), so its backward stages and writes back only the tiles it reads. Not with
                # page grain, whose needed_pages would have to wait on the device for a selection just made.
                self._sparse.track_last = store.stage_grain == "head"

    def _ensure_saved(self, T: int, store: PagedKVStore) -> None:
        """The Stage-1 attention outputs' keeper of this step (config.save_attention), else None.

        Not with an offloaded store that stages whole layers (sparse attention): it stages in the view, for the
        forward and again for the backward, and skipping the forward is not supported there yet (a warning says
        so, once per engine). Segmented offload (dense) is supported: its Stage-2 forwards then read no past.
        """
        where = self.config.save_attention
        N = -(-T // self.config.chunk_size)
        self._saved = None
        if where == "off" or N < 2:
            return
        if isinstance(store, OffloadedKVStore) and not store.supports_saved_attention:
            if not self._warned_saved_offload:
                # Worded for both readers: the CLI's flags, with the OOMBConfig fields they set.
                warnings.warn(
                    f"--save-attention {where} (OOMBConfig.save_attention={where!r}) is not used with an offloaded KV "
                    "store that stages whole layers (--sparse under offload; not supported yet): this step recomputes "
                    "the attention forward in Stage 2. Turn offload off (--offload off, offload=False) if the pages fit "
                    "on the GPU, or pass --save-attention off (save_attention='off') to silence this", stacklevel=3)
                self._warned_saved_offload = True
            return
        keep = self._saved_keep
        if keep is not None and (keep.num_chunks != N or keep.where != where):
            keep = self._saved_keep = None  # free the old buffers before checking for new ones
        if keep is None and self.device.type == "cuda":
            problem = self._saved_memory_problem(where, T)
            if problem is not None:
                warnings.warn(f"{problem}; this step recomputes the attention forward instead", stacklevel=3)
                return
        self._saved = keep if keep is not None else SavedAttention(where, self.num_layers, N, self.device)
        self._saved.begin_step()

    def _saved_memory_problem(self, where: str, T: int) -> str | None:
        """Why save_attention=``where`` does not fit now (CUDA; the KV store allocated), or None.

        Host: its bytes against 75% of the free RAM. GPU: its bytes against the free memory (allocator cache
        included) less one chunk's activations and the allocator's reserve, as :func:`choose_engine_tiering` plans
        (sparse: activations with the block-table kernels it runs, and :func:`~oomb.memory.sparse_headroom_bytes`
        kept free; its state is allocated by now).
        """
        sizes = saved_attention_bytes(self.num_layers, self._base.config.num_attention_heads, self.head_dim, T,
                                      self.config.chunk_size, self.dtype.itemsize, where)
        host_free = int(host_memory()[0] * HOST_FRACTION)
        if sizes["host"] > host_free:
            return (f"--save-attention host (OOMBConfig.save_attention='host') needs {sizes['host'] / 2**30:.1f} GiB of "
                    f"host memory for {T:,} tokens but {host_free / 2**30:.1f} GiB is available ({HOST_FRACTION:.0%} of the free RAM)")
        free, total = torch.cuda.mem_get_info(self.device)
        free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        # the backend the step runs (sparse attention reads its pages through the block-table kernels)
        backend = step_backend(self.config, self.device)
        act = activation_bytes(ModelShape.from_config(self._base.config), min(self.config.chunk_size, T), self.dtype,
                               self.config.checkpoint_layers, backend, self.config.attention_block_size,
                               self.config.loss_chunk_size, max(T - self.config.chunk_size, 0),
                               keep_attention=self.config.checkpoint_attention == "keep")["total"]
        reserve = allocator_reserve_bytes(total)
        if self.config.sparse:
            reserve += sparse_headroom_bytes(self.config.checkpoint_layers)
        spare = free - act - reserve
        if sizes["gpu"] > spare:
            return (f"--save-attention {where} (OOMBConfig.save_attention={where!r}) needs {sizes['gpu'] / 2**30:.1f} GiB "
                    f"of GPU memory for {T:,} tokens but {max(spare, 0) / 2**30:.1f} GiB is free after the KV store and "
                    "one chunk's activations" + (" (--save-attention host keeps them in host memory)" if where == "gpu" else ""))
        return None

    @property
    def sparse_state(self) -> SparseAttentionState | None:
        """Page representatives and stored selections of the last step (config.sparse), else None."""
        return self._sparse

    def _glue_active(self):
        """The context in which the model runs: the fused glue's RoPE swap, or nothing."""
        return self._glue.active() if self._glue is not None else contextlib.nullcontext()

    def _in_root(self, fn, *args):
        """``fn(*args)``; on a sharded model as a forward of its FSDP2 root (oomb.engine.sharding), so that the root's
        parameters (embeddings, final norm, output head) are gathered and the backward of its result is hooked."""
        return fn(*args) if self._sharding is None else self._sharding.run(lambda: fn(*args))

    def _chunk_loss(self, input_ids, positions, ctx: ChunkContext, targets: torch.Tensor) -> torch.Tensor:
        """Stage 2's forward of one chunk: its summed token loss (``targets``: the chunk's)."""
        return self._loss_sum(self._run_chunk(input_ids, positions, ctx), targets)

    def _chunk_scored(self, input_ids, positions, ctx: ChunkContext, targets: torch.Tensor, per_chunk) -> None:
        per_chunk(self._run_chunk(input_ids, positions, ctx), targets)

    def _run_chunk(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ChunkContext) -> torch.Tensor:
        s, n = ctx.start, ctx.length
        pos = positions[s : s + n].unsqueeze(0)
        with self._glue_active():
            out = self._decoder(input_ids=input_ids[s : s + n].unsqueeze(0), position_ids=pos, use_cache=False,
                                oomb_ctx=ctx)
        return out.last_hidden_state[0]

    def _loss_sum(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The training loss sum of one chunk: the fused linear cross-entropy where the glue has one, else the
        chunked cross-entropy."""
        if self._glue is not None and bool((targets != IGNORE_INDEX).any()):
            loss_sum = self._glue.cross_entropy_sum(hidden, self._lm_head, targets, self.config.loss_chunk_size)
            if loss_sum is not None:
                return loss_sum
        return chunked_cross_entropy_sum(hidden, self._lm_head, targets, self.config.loss_chunk_size)

    # --------------------------------------------------------------------- API
    def step(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        progress: bool = False,
        loss_normalizer: int | None = None,
        cu_seqlens: torch.Tensor | None = None,
        sync_gradients: bool = True,
    ) -> StepOutput:
        """One chunk-recurrent forward + backward over one sequence.

        Gradients are ACCUMULATED into the parameters' ``.grad`` (call ``optimizer.zero_grad()``
        yourself). The model is put in training mode.

        Args:
            input_ids: int64 [T] or [1, T] token ids (batch size 1).
            labels: same shape; defaults to ``input_ids``. Shifted by one over the whole sequence
                (labels[t+1] is the target of position t); -100 is ignored.
            progress: show tqdm bars over the chunks of each stage.
            loss_normalizer: divide the summed token losses by this many tokens instead of this
                sequence's valid tokens -- the total over all sequences of a gradient-accumulation
                step or over all data-parallel ranks, so the summed gradients are the global mean.
            cu_seqlens: int [num_docs + 1] boundaries of documents packed into this sequence
                (0 first, T last, increasing; flash-attention's convention). Attention never
                crosses a boundary, positions restart at 0 in each document, and the last token
                of a document predicts nothing. None = one document.
            sync_gradients: only for a model sharded with ``shard_model(..., "grads-optim")``
                (:mod:`oomb.engine.sharding`): True reduce-scatters the gradients summed since the last reduction
                after this sequence's last backward; False keeps summing them unsharded (a gradient-accumulation
                step whose last sequence passes True). Ignored otherwise (``"params"`` reduce-scatters after
                every chunk; an unsharded model keeps its gradients in ``.grad``).

        Returns:
            :class:`StepOutput`; ``loss`` is the mean over this sequence's valid tokens either way.

        Raises:
            ValueError: batch size > 1, fewer than 2 tokens, non-integer or out-of-vocabulary token ids,
                mismatched or non-integer labels, a label neither -100 nor in the vocabulary,
                malformed cu_seqlens, no valid label in the whole sequence, or (step only) a model
                with no trainable parameter.
        """
        if not any(p.requires_grad for p in self.model.parameters()):
            raise ValueError(
                "the model has no trainable parameters (every parameter has requires_grad=False), so a training step "
                "has nothing to compute gradients for; unfreeze some or use evaluate() for a forward only"
            )
        input_ids, targets, doc_start, positions = self._prepare(input_ids, labels, cu_seqlens)
        T = input_ids.shape[0]
        n_valid = int((targets != IGNORE_INDEX).sum())
        if n_valid == 0:
            raise ValueError(NO_TARGETS)
        if loss_normalizer is not None and loss_normalizer < n_valid:
            raise ValueError(f"loss_normalizer ({loss_normalizer}) must count at least this sequence's {n_valid} valid tokens")
        denom = loss_normalizer if loss_normalizer is not None else n_valid
        device = self.device
        self._backend = resolve_backend(self.config.attention_backend, device)
        self.model.train()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        store = self._ensure_store(T)
        self._ensure_sparse(T)
        self._ensure_saved(T, store)
        if isinstance(store, OffloadedKVStore) and store.supports_saved_attention:
            store.set_saved_attention(self._saved is not None)  # its prefetch follows the forwards that read the past

        try:
            with _rope_state_of_full_sequence(self._decoder, T, device, self.dtype):
                t0, t1, t2, total, kept = self._stages(input_ids, targets, doc_start, positions, denom, progress,
                                                       store, sync_gradients)
        finally:
            if self._kept is not None:
                self._kept.clear()
            saved, self._saved = self._saved, None  # evaluate() and plain forwards never save
            self._saved_keep = saved
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        return StepOutput(
            loss=float(total) / n_valid,
            num_tokens=T,
            num_valid_tokens=n_valid,
            seconds=t2 - t0,
            stage1_seconds=t1 - t0,
            stage2_seconds=t2 - t1,
            tokens_per_s=T / max(t2 - t0, 1e-9),
            peak_memory_bytes=peak,
            kv_store_bytes=store.nbytes,
            kept_graphs=kept,
        )

    def _stages(self, input_ids, targets, doc_start, positions, denom, progress, store, sync=True):
        """Stage 1 and Stage 2 of one step -> (t0, t1, t2, summed token loss, chunks kept) with t* host times."""
        T = input_ids.shape[0]
        C = self.config.chunk_size
        N = -(-T // C)
        device = self.device
        cuda = device.type == "cuda"
        keep = self._graphs_to_keep(T, N, store)
        graphs: dict[int, torch.Tensor] = {}  # chunk -> its loss sum, with the graph Stage 1 kept
        sharding = self._sharding
        if self.config.grad_accum_dtype == "float32" and (sharding is None or sharding.reduces_every_chunk):
            # (sharded: the float32 sums are of each chunk's reduce-scattered shard; with grads-optim FSDP2 sums
            # the unsharded gradients in float32 itself)
            accumulate = Float32GradAccumulator(self.model.parameters() if sharding is None else sharding.parameters)
        else:  # weight gradients added into .grad inside the GEMM from the second chunk on
            accumulate = FusedWeightGradAccumulation(self.model, enabled=self.config.kernels.fused_wgrad)
        _sync(device)
        start = torch.cuda.memory_allocated(device) if cuda else 0
        t0 = time.perf_counter()
        first_kept = N - 1 - keep  # after an out-of-memory in a kept forward, the chunks left are not kept
        with accumulate:  # from Stage 1 on: the forwards of kept graphs run inside it
            for c in tqdm(range(N - 1), desc="stage 1 (K/V; not the last chunk)", unit="chunk", disable=not progress, leave=False):
                s = c * C
                if c >= first_kept:
                    loss_sum = self._kept_forward(input_ids, positions, targets, doc_start, s, C)
                    if loss_sum is not None:
                        graphs[c] = loss_sum
                        continue
                    first_kept = N
                with torch.no_grad():
                    ctx = ChunkContext(self, 1, s, C, False, _slice(doc_start, s, C))
                    self._in_root(self._run_chunk, input_ids, positions, ctx)
            _sync(device)
            t1 = time.perf_counter()
            total = torch.zeros((), dtype=torch.float64, device=device)
            kept = len(graphs)
            self._stage2(input_ids, targets, doc_start, positions, denom, progress, store, total, sync, graphs)
        _sync(device)
        t2 = time.perf_counter()
        if cuda and self.config.keep_graphs == "auto":
            self._graph_budget.note_step(T, torch.cuda.max_memory_allocated(device), start, kept, C)
        return t0, t1, t2, total, kept

    def _graphs_to_keep(self, T: int, N: int, store: PagedKVStore) -> int:
        """How many of Stage 1's last chunks keep their graph this step (config.keep_graphs; see
        :mod:`oomb.engine.kept_graphs`)."""
        cfg = self.config
        if cfg.keep_graphs != "auto" or N < 2:
            return 0
        cpu = self.device.type != "cuda"
        why = ("sparse attention (--sparse)" if self._sparse is not None else
               "--checkpoint-layers (the rerun of a layer would write its K/V again)" if cfg.checkpoint_layers else
               "an offloaded KV store (--offload)" if isinstance(store, OffloadedKVStore) else
               "a sharded model" if self._sharding is not None else
               "no --keep-graphs-max on the CPU (there is no free GPU memory to read)"
               if cpu and cfg.keep_graphs_max is None else None)
        if why is not None:
            if not self._warned_no_graphs:
                warnings.warn(f"--keep-graphs auto (OOMBConfig.keep_graphs='auto') keeps no chunk graph with {why}: "
                              "Stage 2 recomputes every chunk", stacklevel=4)
                self._warned_no_graphs = True
            return 0
        most = N - 1 if cfg.keep_graphs_max is None else min(cfg.keep_graphs_max, N - 1)
        if cpu:
            return most
        free, total = torch.cuda.mem_get_info(self.device)
        free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        return self._graph_budget.chunks(T, cfg.chunk_size, int(free), int(total), most)

    def _kept_forward(self, input_ids, positions, targets, doc_start, s: int, C: int) -> torch.Tensor | None:
        """Stage 1 of the chunk at token ``s`` with autograd: its loss sum, holding the graph for Stage 2; None if
        the GPU ran out of memory on the way (the pages the chunk wrote are released, and Stage 1 runs it again
        without autograd)."""
        ctx = ChunkContext(self, 1, s, C, False, _slice(doc_start, s, C), keep_graph=True)
        try:
            return self._chunk_loss(input_ids, positions, ctx, targets[s : s + C])
        except torch.OutOfMemoryError:
            pass  # (outside the handler: the traceback's frames hold the partial graph)
        for layer in range(self.num_layers):
            self._store.release_from(layer, s)
        warnings.warn(f"keep_graphs: the GPU ran out of memory keeping the graph of the chunk at token {s:,}; it and "
                      "the chunks after it are recomputed in Stage 2 instead", stacklevel=4)
        return None

    def _stage2(self, input_ids, targets, doc_start, positions, denom, progress, store, total, sync=True,
                graphs: dict | None = None) -> None:
        """Stage 2: chunks N-1 .. 0 recomputed with autograd (those in ``graphs``, chunk -> loss sum with the graph
        Stage 1 kept, are not) and back-propagated; their loss sums added to ``total`` (``sync``: see
        :meth:`step`'s ``sync_gradients``)."""
        graphs = {} if graphs is None else graphs
        measure = self.device.type == "cuda" and self.config.keep_graphs == "auto"
        T = input_ids.shape[0]
        C = self.config.chunk_size
        N = -(-T // C)
        for c in tqdm(range(N - 1, -1, -1), desc="stage 2 (recompute + backward)", unit="chunk", disable=not progress, leave=False):
            s = c * C
            n = min(C, T - s)
            if self._saved is not None:  # host: this chunk's and the next one's saved outputs on their way
                for chunk in (c, c - 1):
                    if chunk not in graphs:
                        self._saved.prefetch(chunk)
            loss_sum = graphs.pop(c, None)
            if loss_sum is None:
                before = torch.cuda.memory_allocated(self.device) if measure and c == N - 1 else None
                ctx = ChunkContext(self, 2, s, n, c == N - 1, _slice(doc_start, s, n))
                loss_sum = self._in_root(self._chunk_loss, input_ids, positions, ctx, targets[s : s + n])
                if before is not None:  # the graph one chunk holds (the last: every step runs it here)
                    self._graph_budget.note_graph(n, torch.cuda.memory_allocated(self.device) - before)
            if self._sharding is not None:
                self._sharding.before_backward(last_chunk=c == 0, sync=sync)
            with self._glue_active():  # layer checkpoints rerun their forward inside backward
                (loss_sum / denom).backward()
            total += loss_sum.detach()
            del loss_sum
            if self._kept is not None:  # a layer whose rerun did not take its outputs
                self._kept.clear()
            if c < N - 1:
                for layer in range(self.num_layers):
                    store.release_from(layer, s)
            if self._sparse is not None:
                self._sparse.release(s)

    def _no_grad_pass(self, input_ids, labels, cu_seqlens, per_chunk) -> int:
        """The no-grad chunked forward of :meth:`evaluate` and :meth:`score_targets`: every chunk runs once in
        order (Stage 1's memory bound) and ``per_chunk(hidden [n, hidden_size], targets [n])`` sees its final
        hidden states. Returns the sequence's valid target count (> 0)."""
        input_ids, targets, doc_start, positions = self._prepare(input_ids, labels, cu_seqlens)
        T = input_ids.shape[0]
        n_valid = int((targets != IGNORE_INDEX).sum())
        if n_valid == 0:
            raise ValueError(NO_TARGETS)
        C = self.config.chunk_size
        self._backend = resolve_backend(self.config.attention_backend, self.device)
        self._ensure_store(T)
        self._ensure_sparse(T, stage2=False)
        with _rope_state_of_full_sequence(self._decoder, T, self.device, self.dtype):
            for s in range(0, T, C):
                n = min(C, T - s)
                ctx = ChunkContext(self, 1, s, n, False, _slice(doc_start, s, n))
                self._in_root(self._chunk_scored, input_ids, positions, ctx, targets[s : s + n], per_chunk)
                if self._sparse is not None:
                    self._sparse.release(s)
        self._store.reset()
        return n_valid

    @torch.no_grad()
    def evaluate(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None
    ) -> float:
        """Mean token cross-entropy of one sequence, chunk by chunk, without gradients.

        Same arguments and errors as :meth:`step` (a fully frozen model is fine here); memory is bounded like Stage 1's.
        """
        total = [0.0]

        def add(hidden, targets):
            total[0] += float(chunked_cross_entropy_sum(hidden, self._lm_head, targets, self.config.loss_chunk_size))

        n_valid = self._no_grad_pass(input_ids, labels, cu_seqlens, add)
        return total[0] / n_valid

    @torch.no_grad()
    def score_targets(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced log-probability of every valid target of one sequence, and whether it is the argmax.

        The same no-grad chunked pass as :meth:`evaluate` (same arguments, errors and memory bound); logits are
        formed only at the positions whose target is not -100, so scoring a short answer at the end of a long
        prompt costs one forward.

        Returns:
            ``(logprobs, greedy)``: float32 ``[n_valid]`` (float64 for a float64 model) ``log softmax(logits)[target]``
            and bool ``[n_valid]`` ``argmax(logits) == target`` (the first maximum on ties), on the model's device,
            in position order; position ``t`` predicts ``labels[t + 1]``.
        """
        logprobs, greedy = [], []

        def score(hidden, targets):
            lp, hit = target_logprobs(hidden, self._lm_head, targets, self.config.loss_chunk_size)
            logprobs.append(lp)
            greedy.append(hit)

        self._no_grad_pass(input_ids, labels, cu_seqlens, score)
        return torch.cat(logprobs), torch.cat(greedy)
