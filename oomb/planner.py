"""``oomb plan``: the predicted memory of a training run, computed before anything is allocated, as a report.

:func:`plan` adds up the parts of one step that :mod:`oomb.memory` computes (weights, gradients, optimizer
states, one chunk's activations, the KV pool and host tier, sparse state, saved attention outputs), chooses the
tiering as the engine would (all pages on the GPU, or a GPU pool of resident pages + staging with the rest in
pinned host memory; docs/design.md §2.3), finds the largest context that fits the machine, and says what to
change when a run does not fit. :class:`MemoryPlan` holds the result; :meth:`MemoryPlan.table` prints it.
:func:`plan_for_config` plans the run of an :class:`~oomb.config.OOMBConfig`: ``oomb plan`` prints it and
``oomb train`` checks it before it loads a model, so both plan the same run from the same settings. The formulas and their calibration are in :mod:`oomb.memory.step`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from .config import OOMBConfig, SparseConfig
from .config.engine import HOST_FRACTION
from .memory import (
    LORA_TARGETS,
    GiB,
    Machine,
    MemoryPlanError,
    ModelShape,
    Tiering,
    allocator_reserve_bytes,
    base_gpu_bytes,
    choose_staging_sets,
    dtype_size,
    fit_tiering,
    gpu_page_budget_problem,
    kv_stash_reserve_bytes,
    min_gpu_pages,
    offload_traffic,
    optimizer_bytes,
    page_bytes,
    parse_dtype,
    resident_pages_for_budget,
    resolve_segment_pages,
    saved_attention_bytes,
    shard_bytes,
    shard_traffic,
    sparse_headroom_bytes,
    sparse_state_bytes,
    staging_pages,
)

__all__ = [
    "MemoryPlan",
    "choose_tiering",
    "plan",
    "plan_for_config",
]

_LINK_BYTES_PER_S = 55e9  # pinned host<->H200 copies, each way (docs/design.md §2.3)


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
    kv_stash_reserved: int = 0  # GPU bytes kept free for the K/V stash (kv_stash_mib; in the reserve)
    layout_note: str = ""  # how the table's layout relates to a refused gpu_page_budget
    gpu_page_budget: int | None = None  # as given; the largest contexts (max_seq_len_*) are then under this pool
    tiering_found: bool = True  # False: no tiering fits (the table shows the layout the verdict speaks of)
    optimizer_name: str | None = "adamw"  # the optimizer planned for (None: no states)
    optimizer_host: int = 0  # host bytes of the optimizer (adamw-cpu), in the host budget before the KV pages
    optimizer_pinned: int = 0  # the pinned part of optimizer_host
    shard: str = "none"  # train.shard: the weights, grads and optimizer rows are one rank's of nproc
    nproc: int = 1
    shard_detail: Any = None  # oomb.memory.ShardBytes of a sharded plan (gathered weights, unsharded grads)
    collectives: dict = field(default_factory=dict)  # bytes per optimizer step: all_gather, reduce_scatter, all_reduce
    bad_setting: str = ""  # why the settings fit no machine (a gpu_page_budget below the smallest pool); fits: False

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def staging(self) -> int:
        """GPU bytes of the staging buffers (K, V, dK, dV): two segments, or ``tiering.staging_sets`` layers with
        whole-layer staging."""
        t = self.tiering
        if not t.offload:
            return 0
        return t.staging_sets * staging_pages(self.pages_per_layer, t.resident_pages_per_layer, self.segment_pages) * self.page_bytes

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
            *([f"one rank of {self.nproc}, " + ("shard='none' (data parallel: every rank holds the whole model)"
                                                 if self.shard == "none" else f"shard={self.shard!r} (FSDP2)")]
              if self.nproc > 1 else []),
            f"{'GPU':<42}{'GiB':>9}",
            f"  {self._weights_label():<40}{g(self.weights)}",
            f"  {self._grads_label():<40}{g(self.grads)}",
            f"  {self._optimizer_label():<40}{g(self.optimizer)}",
            f"  {'activations: saved':<40}{g(act['saved'])}",
            *([f"  {'activations: kept attention out + lse':<40}{g(act['kept_attention'])}"]
              if act.get("kept_attention") else []),
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
            *([f"  {'  reserve incl. K/V stash':<40}{g(self.kv_stash_reserved)}"] if self.kv_stash_reserved else []),
            f"{'host':<42}",
            f"  {'KV pages in pinned memory':<40}{g(self.host_kv)}",
            *([f"  {'attention outputs (save_attention=host)':<40}{g(self.saved_attention_host)}"]
              if self.saved_attention_host else []),
            *([f"  {'optimizer: states + pinned copies':<40}{g(self.optimizer_host)}"] if self.optimizer_host else []),
            f"  {f'budget ({self.host_fraction:.0%} of {self.machine.host_name})':<40}{g(self.host_budget)}",
            "",
            f"tiering: {self._tiering_label()}",
        ]
        if self.save_attention_note:
            rows.append(self.save_attention_note)
        if self.collectives:
            c = self.collectives
            parts = [f"{c[k] / GiB:,.{1 if c[k] >= 10 * GiB else 2}f} GiB {k.replace('_', '-')}"
                     for k in ("all_gather", "reduce_scatter", "all_reduce") if c[k]]
            rows.append(f"collectives per optimizer step (one sequence per rank; unsharded bytes, a rank moves (N-1)/N "
                        f"of each): {', '.join(parts) or 'none'}")
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


    def _weights_label(self) -> str:
        d = self.shard_detail
        if d is None or self.nproc == 1 or self.shard == "none":
            return "weights"
        if self.shard == "grads-optim":
            return "weights (shard + all gathered)"
        return f"weights (shard + {d.gathered / GiB:.2f} gathered)"

    def _grads_label(self) -> str:
        label = "gradients" + (" (float32 sums)" if self.grad_accum_dtype == "float32" else "")
        if self.shard_detail is None or self.nproc == 1 or self.shard == "none":
            return label
        return label + (" (the step's sums)" if self.shard == "grads-optim" else " (shard + buffers)")

    def _optimizer_label(self) -> str:
        if self.optimizer_name is None:
            return "optimizer states (none)"
        return f"optimizer states ({self.optimizer_name})"

    def _temporaries_label(self) -> str:
        act = self.activations
        attn, loss = act["attention_temp"], act["loss_temp"]
        if attn >= loss:
            return f"temporaries: attention (loss {loss / GiB:.2f})"
        return f"temporaries: loss (attention {attn / GiB:.2f})"

    def _tiering_label(self) -> str:
        t = self.tiering
        if not t.offload:
            # a refused plan shows the pages on the GPU but does not claim they fit there (next to a KV row of
            # many times the GPU)
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



def _need_and_free(need: int, free: int) -> tuple[str, str]:
    """``need`` and ``free`` bytes as GiB with as many decimals (2 to 6) as it takes for them to read differently
    where they differ (0.50 and 0.50 read as enough memory); in bytes past that."""
    for digits in range(2, 7):
        a, b = f"{need / GiB:.{digits}f}", f"{free / GiB:.{digits}f}"
        if a != b or need == free:
            return f"{a} GiB", f"{b} GiB"
    return f"{need:,} bytes", f"{free:,} bytes"


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



def plan(
    model: Any,
    seq_len: int,
    *,
    chunk_size: int = 4096,
    page_size: int = 128,
    dtype: torch.dtype | str = torch.bfloat16,
    lora_rank: int = 0,
    lora_targets: Any = LORA_TARGETS,
    train_embeddings_norms: bool = False,
    optimizer: str | None = "adamw",
    checkpoint_layers: bool = False,
    checkpoint_attention: str = "keep",
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
    staging_sets: int | None = None,
    stage1_shadow: bool = True,
    kv_stash_mib: int = 0,
    suggest_optimizer: bool = True,
    shard: str = "none",
    nproc: int = 1,
) -> MemoryPlan:
    """Predict GPU and host memory of training ``model`` on ``seq_len``-token sequences; nothing is allocated.

    Args:
        model: a preset name, a local model directory, a transformers config, or a :class:`ModelShape`.
        seq_len: tokens per sequence (T).
        chunk_size, page_size: tokens (as :class:`oomb.OOMBConfig`).
        dtype: parameter/activation dtype.
        lora_rank: LoRA rank (0: full fine-tune) on the layers ``lora_targets`` names ('all-linear' or names, as
            :class:`~oomb.config.ModelConfig`'s lora_targets); ``train_embeddings_norms``: also a trained copy of
            the embeddings and norms.
        optimizer: one of :data:`oomb.memory.optimizer.OPTIMIZER_NAMES` or None (no states): its GPU and host
            bytes (:func:`oomb.memory.optimizer.optimizer_bytes`); its host bytes come out of the host budget
            before the pinned KV pages.
        checkpoint_layers, attention_backend ('torch', 'triton' or 'sdpa'), attention_block_size, loss_chunk_size:
            as in :class:`oomb.OOMBConfig` ('auto' counts as 'sdpa', what it is on CUDA; with
            ``sparse`` 'auto' and 'sdpa' count as 'triton', the block-table kernels sparse attention runs).
        checkpoint_attention: 'keep' or 'recompute' (:class:`oomb.OOMBConfig`): with ``checkpoint_layers``, 'keep'
            counts each layer's attention output and lse among the activations, and offload traffic without the
            rerun's reads of the past.
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
            (:func:`oomb.memory.saved_attention_bytes`) on the GPU, or on the host plus two
            chunks' worth on the GPU. Where they do not fit (GPU or host budget), or offload would stage
            whole layers (sparse attention, where the engine does not use them), the run is planned without
            them (``plan.save_attention`` is then 'off' and the table says why).
        grad_accum_dtype: 'param' or 'float32' (:class:`oomb.OOMBConfig`): with 'float32' a full fine-tune's
            bf16/fp16 gradients are counted as the float32 sums the step keeps (4 bytes per parameter).
        staging_sets, stage1_shadow, kv_stash_mib: as in :class:`oomb.config.OffloadConfig`: whole-layer staging
            sets (None: picked from the pool, 2 where more would overflow the host budget), the Stage-1 shadow
            (traffic only) and the MiB kept free for the K/V stash of a sparse offloaded store.
        suggest_optimizer: where the run does not fit, plan it with the other optimizers ('adamw8bit', then
            'adamw-cpu'; unsharded) or, over several ranks, the other shard modes, and name the first that fits in
            the problems.
        shard, nproc: ``train.shard`` ('none', 'params', 'grads-optim') over ``nproc`` ranks (torchrun): the plan is
            one rank's, its weights, gradients and optimizer states as :func:`oomb.memory.shard_bytes` counts them,
            and ``collectives`` the bytes of one optimizer step's collectives (:func:`oomb.memory.shard_traffic`,
            one sequence per rank). One rank: as 'none'.

    Returns:
        :class:`MemoryPlan`; ``plan.fits`` / ``plan.check()`` say whether it fits.

    Raises:
        oomb.UnsupportedModelError: ``model`` (not a :class:`ModelShape`) is one :class:`oomb.Engine` refuses
            (:func:`oomb.models.hf.check_model_config`).
    """
    kwargs = dict(locals())  # the arguments, to plan an alternative the verdict may suggest
    if isinstance(model, ModelShape):
        shape = model
    else:
        from .models.hf import check_model_config
        from .models.presets import load_config

        config = load_config(model) if isinstance(model, str) else model
        check_model_config(config)  # a model the engine refuses has no plan
        shape = ModelShape.from_config(config)
    name = model if isinstance(model, str) else shape.model_type
    dtype = parse_dtype(dtype)
    if seq_len < 2 or chunk_size <= 0 or page_size <= 0 or chunk_size % page_size:
        raise ValueError(f"need seq_len >= 2 and chunk_size a positive multiple of page_size; got {seq_len}, {chunk_size}, {page_size}")
    kv_stash = 0
    machine = machine or Machine.detect()
    backend = {"auto": "sdpa"}.get(attention_backend, attention_backend)
    if sparse is not None and backend == "sdpa":
        backend = "triton"  # sparse attention reads its pages through the block-table kernels (paged_backend)
    reserve = gpu_reserve_bytes if gpu_reserve_bytes is not None else allocator_reserve_bytes(machine.gpu_total_bytes)
    if sparse is not None:
        # sparse_state_bytes reads the settings plus ``sparse`` and this plan's page size.
        sparse_cfg = SimpleNamespace(sparse=_sparse_settings(sparse), page_size=page_size)
        # As choose_engine_tiering: more headroom without per-layer checkpointing (sparse_headroom_bytes), and
        # the sparse attention reads the past through one table, so offload stages whole layers.
        reserve += sparse_headroom_bytes(checkpoint_layers)
        offload_segment_pages = "layer"
        # the K/V stash, when asked for (kv_stash_mib; at most what the store would allocate)
        kv_stash = kv_stash_reserve_bytes(shape.num_layers, -(-seq_len // page_size), shape.num_kv_heads,
                                          shape.head_dim, page_size, dtype, kv_stash_mib)
        reserve += kv_stash
    gpu_budget = max(machine.gpu_free_bytes - reserve, 0)
    host_budget = int(machine.host_available_bytes * host_fraction)
    opt = optimizer_bytes(shape, dtype, lora_rank, optimizer, lora_targets, train_embeddings_norms)
    kv_host_budget = max(host_budget - opt.host, 0)  # the optimizer's host memory first, the pinned KV pages after
    L = shape.num_layers
    pb = page_bytes(shape, page_size, dtype)
    wbuf = 2 * 2 * chunk_size * shape.kv_dim * dtype_size(dtype)  # two K+V write buffers of one chunk
    SP = resolve_segment_pages(offload_segment_pages, page_size)
    gsize = 8 if dtype == torch.float64 else 4
    own_max = 0 if SP is None else 2 * 2 * chunk_size * shape.kv_dim * gsize  # two dK+dV buffers of one chunk
    bad_setting = (gpu_page_budget_problem(L, -(-seq_len // page_size), gpu_page_budget, SP, staging_sets)
                   if gpu_page_budget is not None and offload is not False else None) or ""

    def saved_for(T: int, save: str) -> dict[str, int]:
        return saved_attention_bytes(L, shape.num_heads, shape.head_dim, T, chunk_size, dtype_size(dtype), save)

    def fixed_for(T: int, save: str = "off") -> tuple:
        parts = base_gpu_bytes(shape, T, chunk_size, dtype, lora_rank, optimizer, checkpoint_layers, backend,
                          attention_block_size, loss_chunk_size, grad_accum_dtype, lora_targets, train_embeddings_norms,
                          checkpoint_attention == "keep", shard, nproc)
        n_params, trainable, weights, grads, optim, act = parts
        if sparse is not None:
            act = dict(act, sparse_state=sparse_state_bytes(shape, T, sparse_cfg, dtype))
            act["total"] += act["sparse_state"]
        if save != "off":
            act = dict(act, saved_attention=saved_for(T, save)["gpu"])
            act["total"] += act["saved_attention"]
        parts = (n_params, trainable, weights, grads, optim, act)
        return parts, weights + grads + optim + act["total"]

    def tier_for(T: int, off=offload, budget=gpu_page_budget, host=kv_host_budget, save="off", sets=staging_sets):
        _, fixed = fixed_for(T, save)
        n = -(-T // page_size)
        pool_budget = gpu_budget - fixed
        saved_host = saved_for(T, save)["host"]
        if saved_host > host:  # the no-offload tiering never looks at the host budget
            return None, (f"saving them needs {saved_host / GiB:.2f} GiB of host memory but the host budget is "
                          f"{host / GiB:.2f} GiB")
        host = host - saved_host
        t, why = fit_tiering(L, n, pb, pool_budget, host, off, budget, SP, sets, kv_stash)
        if (t is not None and t.offload) or (t is None and off is not False):
            # The offload layout leaves room for the write and own-gradient buffers; a failure is told
            # with that layout's numbers too (the ones the table shows).
            t2, why2 = fit_tiering(L, n, pb, pool_budget - wbuf - own_max, host, off, budget, SP, sets, kv_stash)
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
        two = staging_sets if staging_sets is not None else 2
        attempt = tier_for(seq_len, host=float("inf"), sets=two)[0] if offload is not False else None
        tiering = attempt if attempt is not None and attempt.offload else Tiering(
            offload is True or gpu_page_budget is not None, gpu_page_budget, 0)
        if (attempt is None or not attempt.offload) and gpu_page_budget is not None and gpu_page_budget < L * n:
            # The caller's pool is refused (too big for the GPU): show the layout that pool would have.
            try:
                K = choose_staging_sets(L, n, gpu_page_budget, SP, staging_sets)
                R = resident_pages_for_budget(L, n, gpu_page_budget, SP, K)
                tiering = Tiering(True, L * R + K * staging_pages(n, R, SP), R, K)
            except ValueError:  # below the minimum (that problem is in the list): show the minimum pool's layout
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
    elif gpu_budget == 0:
        # The reserve alone takes all the free memory: no setting of the run fits, only a GPU with more memory.
        problems = [f"the GPU's {machine.gpu_free_bytes / GiB:.2f} GiB of free memory is no more than the "
                    f"{reserve / GiB:.2f} GiB reserve a plan keeps free (for the CUDA allocator and libraries: 2 GiB "
                    f"or 3% of the GPU{', more with sparse attention' if sparse is not None else ''}), so nothing is "
                    f"left for the run and no setting fits; use a GPU with more than {reserve / GiB:.2f} GiB free"]
    elif grown:
        # One chunk's context would fit: what does not is what grows with the context (not the weights and states,
        # which LoRA would shrink).
        longest = max(longest_gpu, longest_off)
        fix = (f"shorten the context to {longest:,} tokens or fewer (the longest that fits"
               + (" with offload)" if longest_off > longest_gpu else ")") if longest else "shorten the context")
        if (backend == "sdpa" and "attention temporaries" in grown and L * n * pb <= gpu_budget + host_budget
                and kwargs["attention_backend"] != "triton"):  # (a whole plan only where the KV store could fit)
            if plan(**dict(kwargs, attention_backend="triton")).fits:
                fix += ", or use attention_backend='triton' (its attention temporaries do not grow with the context)"
        need, free = _need_and_free(fixed, gpu_budget)
        problems = [f"at {seq_len:,} tokens one chunk's {' and '.join(grown)} grow with the context: with the weights, "
                    f"gradients, optimizer states and activations they need {need} but "
                    f"{free} of GPU memory is free (after a {reserve / GiB:.1f} GiB reserve), and the "
                    f"KV store needs {L * n * pb / GiB:,.2f} GiB on top (GPU and host); {fix}"]
    elif fixed > gpu_budget:
        need, free = _need_and_free(fixed, gpu_budget)
        # A shorter context helps only where one fits (a shorter one-chunk run has smaller activations; the
        # weights and states stay).
        longest = max(longest_gpu, longest_off)
        shorter = f", or shorten the context to {longest:,} tokens or fewer" if 0 < longest < seq_len else ""
        problems.insert(0, f"weights, gradients, optimizer states and one chunk's activations need {need} "
                           f"but {free} of GPU memory is free (after a {reserve / GiB:.1f} GiB reserve); "
                           f"use LoRA, checkpoint_layers or a smaller chunk_size{shorter}")
    longest = max(longest_gpu, longest_off)
    if 0 < longest < seq_len:  # a message that says to shorten the context says to how much
        where = " with offload" if longest_off > longest_gpu else ""
        problems = [p.replace("; shorten the context, ", f"; shorten the context to {longest:,} tokens or fewer (the "
                              f"longest that fits{where}), ") for p in problems]
    # The fixes the messages name: leave out what this plan already uses.
    fixes = [f for f, used in (("LoRA", lora_rank > 0), ("checkpoint_layers", checkpoint_layers)) if not used]
    fixes.append("a smaller chunk_size")
    phrase = "use " + (", ".join(fixes[:-1]) + " or " + fixes[-1] if len(fixes) > 1 else fixes[0])
    problems = [p.replace("use LoRA, checkpoint_layers or a smaller chunk_size", phrase) for p in problems]
    if opt.host:  # the pinned KV budget a tiering message names is what the optimizer leaves of the host budget
        problems = [m.replace("of pinned memory but the budget is", "of pinned memory but the budget left after the "
                              f"optimizer's {opt.host / GiB:.2f} GiB is") for m in problems]
    if opt.host > host_budget and machine.gpu_total_bytes:
        problems.insert(0, f"optimizer={optimizer!r} keeps {opt.host / GiB:.2f} GiB in host memory but the host budget is "
                           f"{host_budget / GiB:.2f} GiB; use another optimizer or free host RAM")
    if problems and suggest_optimizer and machine.gpu_total_bytes:
        # unsharded: another optimizer; over several ranks: another shard mode (they shard adamw's states only)
        alts = ([("shard", m) for m in ("grads-optim", "params") if m != shard] if nproc > 1 else
                [("optimizer", o) for o in ("adamw8bit", "adamw-cpu") if o != optimizer and optimizer is not None])
        if nproc > 1 and shard == "none" and optimizer not in (None, "adamw"):
            alts = []  # the shard modes need adamw; the optimizer was chosen
        for key, alt in alts:
            change = {key: alt}
            if key == "optimizer" and shard != "none":  # one process plans a shard mode as none; the optimizers
                change["shard"] = "none"  # other than adamw are refused with a shard mode, so name both
            q = plan(**dict(kwargs, **change, suggest_optimizer=False))
            if q.fits:
                named = " and ".join(f"{k}={v!r}" for k, v in change.items())
                problems.append(f"with {named} it fits (GPU {q.gpu_peak / GiB:.2f} of "
                                f"{q.gpu_budget / GiB:.2f} GiB, host {q.host_peak / GiB:.2f} of "
                                f"{q.host_budget / GiB:.2f} GiB)")
                break
    own_b = 0
    if tiering.offload:
        R = tiering.resident_pages_per_layer
        gpu_pool = (L * R + tiering.staging_sets * staging_pages(n, R, SP)) * pb
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
        host_peak=host_kv + saved_for(seq_len, save)["host"] + opt.host,
        gpu_budget=gpu_budget, host_budget=host_budget, machine=machine,
        max_seq_len_gpu_only=longest_gpu, max_seq_len_offload=longest_off, problems=problems,
        traffic=offload_traffic(shape, seq_len, chunk_size, page_size, tiering.resident_pages_per_layer, dtype,
                                segment_pages=SP,
                                checkpoint_layers=checkpoint_layers and checkpoint_attention == "recompute",
                                saved_attention=save != "off" and SP is not None, staging_sets=tiering.staging_sets,
                                stage1_shadow=stage1_shadow)
        if tiering.offload and host_kv <= kv_host_budget else {},  # (no copies to count for a host tier that cannot be)
        segment_pages=SP if tiering.offload else None, own_buffers=own_b, host_fraction=host_fraction,
        save_attention=save, saved_attention_host=saved_for(seq_len, save)["host"], save_attention_note=save_note,
        grad_accum_dtype=grad_accum_dtype, kv_stash_reserved=kv_stash, layout_note=shown_note,
        gpu_page_budget=gpu_page_budget, tiering_found=tiering_found, optimizer_name=optimizer,
        optimizer_host=opt.host, optimizer_pinned=opt.pinned, shard=shard, nproc=nproc,
        shard_detail=shard_bytes(shape, dtype, shard, nproc, lora_rank, lora_targets, train_embeddings_norms,
                                 optimizer, grad_accum_dtype) if nproc > 1 and shard != "none" else None,
        collectives=shard_traffic(shape, dtype, shard, nproc, seq_len, chunk_size, 1, lora_rank, lora_targets,
                                  train_embeddings_norms, grad_accum_dtype) if nproc > 1 else {},
        bad_setting=bad_setting,
    )


def choose_tiering(model: Any, seq_len: int, **kwargs) -> Tiering:
    """The tiering :func:`plan` picks (``offload='auto'`` unless given).

    Raises:
        MemoryPlanError: if the run does not fit at all.
    """
    return plan(model, seq_len, **kwargs).check().tiering

_PLAN_FIELDS = ("chunk_size", "page_size", "checkpoint_layers", "checkpoint_attention", "attention_backend",
                "attention_block_size", "loss_chunk_size", "save_attention", "grad_accum_dtype")


def plan_for_config(model: Any, seq_len: int, config: OOMBConfig, **kwargs) -> MemoryPlan:
    """:func:`plan` of an engine with ``config`` (:class:`~oomb.config.OOMBConfig`): its chunking, attention,
    sparse and offload settings; ``kwargs`` give the rest (``dtype``, ``lora_rank``, ``lora_targets``, ``train_embeddings_norms``, ``optimizer``, ``machine``,
    ``gpu_reserve_bytes``, ``host_fraction``)."""
    off = config.offload
    engine = {name: getattr(config, name) for name in _PLAN_FIELDS}
    return plan(model, seq_len, **engine, offload=off.enabled, gpu_page_budget=off.gpu_page_budget,
                offload_segment_pages=off.segment_pages, sparse=config.sparse, staging_sets=off.staging_sets,
                stage1_shadow=off.stage1_shadow, kv_stash_mib=off.kv_stash_mib, **kwargs)


def _sparse_settings(sparse: Any) -> SparseConfig:
    """The :class:`~oomb.config.SparseConfig` of ``sparse``: itself, an OOMBConfig's (its defaults if none), or
    the defaults for True."""
    if isinstance(sparse, OOMBConfig):
        return sparse.sparse or SparseConfig()
    return SparseConfig() if sparse is True else sparse
