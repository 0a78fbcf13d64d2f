"""Triton paged attention launchers: forward, and backward with in-place paged KV-gradient accumulation.

Same contract as :mod:`oomb.ops.attention_ref` (the reference every test compares against).
One chunk of ``C`` queries attends to ``past_len`` earlier tokens whose K/V live in a page
pool addressed through an int32 ``block_table``, plus the chunk's own K/V, causally::

    keys:     past tokens (all visible)     | own tokens 0..C-1
    query 0:  1 1 1 ... 1                   | 1 0 0 0
    query 1:  1 1 1 ... 1                   | 1 1 0 0
    query 2:  1 1 1 ... 1                   | 1 1 1 0

Algorithm: FlashAttention-2 (Dao 2023, "FlashAttention-2: Faster Attention with Better
Parallelism and Work Partitioning", §3.1 forward with online softmax, §3.2 backward with
recomputation from the log-sum-exp and ``delta = rowsum(dout * out)``). Scores use ``exp2``
with ``softmax_scale * log2(e)`` folded into one multiplier.

Layout of the work (shape legend: C own-chunk tokens, Hq query heads, Hkv KV heads,
G = Hq // Hkv, D head dim, P pages in the pool, S = page_size tokens per page):

* Grouped-query attention inside the kernels. The rows of a forward or dq tile are the
  flattened (query, head-in-group) pairs of one KV head, query-major: row ``r`` is query
  ``r // G`` of query head ``hkv * G + r % G``. A tile of ``BLOCK_M`` rows therefore holds all
  G heads of ``BLOCK_M / G`` consecutive queries, and every K/V tile loaded is shared by the G
  heads of its group; nothing is expanded or copied. Query-major rows keep each tile's query
  positions contiguous, so the causal part of the own chunk is skipped tile by tile. (dk/dv
  walks the same rows head-major, below; its K/V tile is shared by the G heads as well.)
* ``BLOCK_N`` (keys per compute tile) is independent of ``page_size``: each key token
  ``t`` of a past tile is looked up as page ``block_table[t // S]``, slot ``t % S``, so a
  tile may span several pages or part of one, and a partial last page is masked.
* Forward (:mod:`.paged_fwd_kernel`): one program per (row tile, KV head) runs over all past
  tiles, then over its own chunk's causal tiles.
* Backward (:mod:`.paged_bwd_kernels`): ``delta`` in torch (one pass over dout and out), then two kernels:
  - dq: one program per (row tile, KV head), looping over past and own key tiles;
  - dk/dv: one program per (key tile, KV head), looping over every row tile that sees it.
    For past tiles it reads the fp32 gradient pages, adds its sum and writes them back;
    for the own chunk it writes ``dk``/``dv``. It walks the rows head-major -- all query tiles
    of head 0 of the group, then head 1, ... -- so a row tile is ``BLOCK_M`` consecutive queries
    of one head (strided 2-D q/dout tiles, contiguous lse/delta). A walk over the row-interleaved
    (query-major) rows of the other two kernels is 1.5x slower (dk/dv 8.7 against 13.1 ms at 32K
    past tokens on an H200).

  Why a deterministic schedule and not atomics: each past token's dK/dV row is owned by
  exactly one program, which sums the contributions of all queries (and all G heads of the
  group) in a fixed order in registers and then does ONE read-add-write per gradient-page
  row. Atomics (FlashAttention-2's dq trick, or splitting the query loop across programs
  and ``atomic_add``-ing into the pages) would make each step's gradients depend on
  scheduling, so two identical runs could differ in the last bits, and in a chunk-
  recurrent step those bits are re-accumulated over hundreds of chunks. With this schedule
  the backward is bitwise reproducible run to run, and it needs no zeroed scratch buffer
  and no fp32 atomics traffic (the pages are fp32 and touched once per token per call).
  The price: dq is a separate pass that recomputes the scores (7 matrix products per tile
  pair in total instead of 5). Measured on an H200 (docs/performance.md, "Attention kernels"),
  the FlashAttention-2 alternative -- the dk/dv kernel also adds
  ds @ k into an fp32 dq accumulator, 5 products -- is not faster: the backward drops from 383 to 306 TFLOP/s (128K past) with
  ``tl.atomic_add`` and to 347 with a tensor descriptor's bulk reduce-add, so determinism is kept. A ``block_table``
  must not list a page twice (two programs would then race on the same rows); the engine's
  allocator never does.

Parts of the past (a store that stages the past in segments, :mod:`oomb.ops.paged_attention`):
``past_start`` makes every past loop (and the past dK/dV grid) start at that token, tiles
counted from it, and the constexpr ``HAS_OWN=False`` leaves out the own chunk. With the
defaults (``past_start=0``, own included) the kernels run exactly the loops they always did.

Precision: bf16/fp16 inputs are multiplied in their own type with fp32 accumulation
(``p`` and ``ds`` are rounded to the input type before their products, as in
FlashAttention); fp32 inputs use exact fp32 products (``input_precision="ieee"``).
Under the Triton interpreter (``TRITON_INTERPRET=1`` before triton is imported, CPU tensors;
:mod:`.interpreter`) every product runs
in fp32, because the interpreter's bf16 ``tl.dot`` is wrong. Measured on an H200 against an
fp32 reference (benchmarks/results/triton_attention_kernels_h200.md): fp16 errors within 1.5x of
the reference run in fp16; bf16 out/dq/dk/dv 1.4x; bf16 past dK/dV 1.7e-3 relative, 7.6x the
reference-in-bf16 (whose products are TF32) but 0.58x SDPA flash's error on the same problem.

Speed on an H200 (Qwen2.5-7B attention, bf16, 4096 queries, 32K / 128K past tokens): forward
420 / 436 TFLOP/s with the full past tiles read through tensor descriptors (TMA; 380 / 384 with
the per-token gather in the same process, bitwise-equal outputs; 1.40x SDPA flash at 128K;
docs/performance.md, "Attention kernels"); backward 334 / 341 (1.06x / 1.06x SDPA flash; with
the row-interleaved dk/dv walk 262 / 267, 0.83x).

Settings (a :class:`oomb.config.KernelConfig`, the ``kernels`` argument): ``autotune`` ('full' or 'first',
:mod:`.autotune`), ``fwd_tma`` / ``bwd_tma`` (full past tiles of the forward / dq kernel through tensor
descriptors) and ``dkdv_tma`` (the dk/dv kernel's q/dout row tiles through descriptors; :mod:`.tma`).
"""

from __future__ import annotations

import torch
import triton

from ...config.engine import KernelConfig
from .inputs import (LOG2E, _alloc, _alloc_like, _cache_args, _check_doc, _check_inputs, _check_part, _delta,
                     _dot_precision, _drain_streams_before_first_tune)
from .interpreter import INTERPRET
from .paged_bwd_kernels import _paged_attn_bwd_dkdv5_kernel, _paged_attn_bwd_dq_kernel
from .paged_fwd_kernel import _paged_attn_fwd_kernel
from .tma import qo_tma, use_tma

__all__ = ["paged_attention_bwd", "paged_attention_fwd"]

def paged_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor | None,
    v_cache: torch.Tensor | None,
    block_table: torch.Tensor | None,
    past_len: int,
    softmax_scale: float | None = None,
    q_doc_start: torch.Tensor | None = None,
    past_start: int = 0,
    include_own: bool = True,
    out_dtype: torch.dtype | None = None,
    *,
    kernels: KernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one chunk over paged past K/V plus its own K/V (causal), or one part of it, in one kernel.

    Args:
        q: [C, Hq, D] queries of the chunk, bf16/fp16/fp32. Any strides (e.g. a transposed
            view of Hugging Face's [1, Hq, C, D]); the innermost stride 1 is fastest.
        k, v: [C, Hkv, D] the chunk's own keys/values, q's dtype, any strides.
        k_cache, v_cache: [P, S, Hkv, D] page pools in q's dtype (S = page_size tokens per
            page); may be None when past_len == 0.
        block_table: int32 [>= ceil(past_len / S)] page ids of the past in token order; no
            page may appear twice.
        past_len: number of past tokens (a partial last page is allowed).
        softmax_scale: defaults to 1/sqrt(D).
        q_doc_start: optional int32 [C], non-decreasing: for packed documents, the absolute
            token index (past tokens 0..past_len-1, own token i at past_len + i) where each
            query's document starts; earlier keys are masked and wholly earlier key tiles
            skipped. None = one document.
        past_start: first past token read (0 <= past_start <= past_len; any value, a multiple
            of 128 keeps the key tiles page-aligned on a GPU): only past tokens
            [past_start, past_len) are attended, through ``block_table[t // S]`` (entries of
            earlier pages are never read). Own token i stays at absolute index past_len + i.
        include_own: False = a past-only part (needs past_start < past_len); parts are merged
            by the caller with the log-sum-exp rule.
        out_dtype: dtype of ``out``: q's (default) or float32 (a part output kept unrounded
            for the merge).
        kernels: kernel settings; reads ``autotune`` and ``fwd_tma``. None: ``KernelConfig()``.

    Returns:
        out: [C, Hq, D] in ``out_dtype``, with q's memory layout. With include_own=False a row
            that sees no key (packed documents) is 0.
        lse: [Hq, C] float32, natural-log log-sum-exp of the scaled scores; -inf for a row
            that sees no key.

    Raises:
        ValueError: on inconsistent shapes, unsupported dtype or device, Hq not a multiple of
            Hkv, head dim > 256, a block_table too short / not int32, or a bad part
            (past_start outside [0, past_len], or equal to past_len with include_own=False), or
            ``kernels.autotune`` not 'full' or 'first'.
    """
    kernels = KernelConfig() if kernels is None else kernels
    kernel = _paged_attn_fwd_kernel[kernels.autotune]
    C, Hq, Hkv, D, page_size, scale = _check_inputs(q, k, v, k_cache, v_cache, block_table, past_len, softmax_scale)
    _check_part(past_start, past_len, include_own)
    if out_dtype not in (None, q.dtype, torch.float32):
        raise ValueError(f"out_dtype must be None, q's dtype or torch.float32; got {out_dtype}")
    doc = _check_doc(q_doc_start, C, past_len, q.device)
    out = _alloc_like(q, out_dtype)
    lse = _alloc((Hq, C), torch.float32, q.device)
    if C == 0:
        return out, lse
    G = Hq // Hkv
    kc, vc, bt, skc, svc = _cache_args(k_cache, v_cache, block_table, past_len, k)
    # A part's tiles start at past_start: page-aligned tiles need it on a page boundary.
    tma = (past_len > 0 and doc is None and past_start % page_size == 0
           and use_tma(kc, vc, D, page_size, kernel.configs, kernels.fwd_tma))

    def grid(meta):
        return (triton.cdiv(C * G, meta["BLOCK_M"]), Hkv)

    kernel[grid](
        q_ptr=q, k_ptr=k, v_ptr=v, k_cache_ptr=kc, v_cache_ptr=vc, block_table_ptr=bt, out_ptr=out, lse_ptr=lse,
        C=C, past_start=past_start, past_len=past_len, qk_scale=scale * LOG2E,
        stride_q_c=q.stride(0), stride_q_h=q.stride(1), stride_q_d=q.stride(2),
        stride_k_c=k.stride(0), stride_k_h=k.stride(1), stride_k_d=k.stride(2),
        stride_v_c=v.stride(0), stride_v_h=v.stride(1), stride_v_d=v.stride(2),
        stride_kc_p=skc[0], stride_kc_t=skc[1], stride_kc_h=skc[2], stride_kc_d=skc[3],
        stride_vc_p=svc[0], stride_vc_t=svc[1], stride_vc_h=svc[2], stride_vc_d=svc[3],
        stride_o_c=out.stride(0), stride_o_h=out.stride(1), stride_o_d=out.stride(2),
        stride_lse_h=lse.stride(0), doc_ptr=doc if doc is not None else bt,
        G=G, HEAD_DIM=D, PAGE_SIZE=page_size, BLOCK_D=max(16, triton.next_power_of_2(D)),
        UPCAST=INTERPRET, DOT_PREC=_dot_precision(q.dtype), HAS_DOC=doc is not None, HAS_OWN=bool(include_own),
        PART=past_start > 0, USE_TMA=tma, n_rows=kc.shape[0] * kc.shape[1] if tma else 0,
        n_cols=kc.shape[2] * kc.shape[3] if tma else 0,
    )
    return out, lse


def paged_attention_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    k_cache: torch.Tensor | None,
    v_cache: torch.Tensor | None,
    block_table: torch.Tensor | None,
    past_len: int,
    dk_cache: torch.Tensor | None,
    dv_cache: torch.Tensor | None,
    softmax_scale: float | None = None,
    q_doc_start: torch.Tensor | None = None,
    past_start: int = 0,
    include_own: bool = True,
    delta: torch.Tensor | None = None,
    dq_dtype: torch.dtype | None = None,
    *,
    with_dq: bool = True,
    kernels: KernelConfig | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Backward of :func:`paged_attention_fwd` (or of one part of it); adds the past pages' dK/dV in place.

    Args:
        dout: [C, Hq, D] gradient of ``out``, q's dtype, any strides.
        q, k, v, out, lse: as given to / returned by the forward (lse: float32 [Hq, C]).
        k_cache, v_cache, block_table, past_len: as in the forward.
        dk_cache, dv_cache: float32 [P, S, Hkv, D] gradient page pools, same shape as
            k_cache. The past tokens' dK/dV are ADDED here in place (deterministically, no
            atomics); rows of pages outside ``block_table[:ceil(past_len / S)]`` and the tail
            of a partial last page are not touched. May be None when past_len == 0.
        q_doc_start: as in the forward.
        past_start, include_own: the part, as in the forward. ``out`` and ``lse`` must then be
            the FINAL output and log-sum-exp over all parts, so that this call returns this
            part's exact share: dq of its keys, and dK/dV added for past tokens
            [past_start, past_len) only.
        delta: optional float32 [Hq, C] contiguous ``rowsum(dout * out)`` (computed here when
            None); callers running several parts compute it once.
        dq_dtype: dtype of ``dq``: q's (default) or float32 (a part kept unrounded for the sum).
        with_dq: False skips the dq kernel and returns None for dq (a caller that computes dq itself, e.g. the
            sparse dq kernel with its own-chunk loop).
        kernels: kernel settings; reads ``autotune``, ``bwd_tma`` and ``dkdv_tma``. None: ``KernelConfig()``.

    Returns:
        dq: [C, Hq, D] in ``dq_dtype``, with q's memory layout (this part's contribution); None without ``with_dq``.
        dk, dv: [C, Hkv, D] in k's dtype -- the own chunk's contribution only; None when
            include_own=False.

    Raises:
        ValueError: as the forward, plus mismatched dout/out/lse/delta shapes or dtypes, and
            past_len > 0 without float32 gradient pools shaped like k_cache.
    """
    kernels = KernelConfig() if kernels is None else kernels
    dq_kernel = _paged_attn_bwd_dq_kernel[kernels.autotune]
    dkdv_kernel = _paged_attn_bwd_dkdv5_kernel[kernels.autotune]
    C, Hq, Hkv, D, page_size, scale = _check_inputs(q, k, v, k_cache, v_cache, block_table, past_len, softmax_scale)
    _check_part(past_start, past_len, include_own)
    if dq_dtype not in (None, q.dtype, torch.float32):
        raise ValueError(f"dq_dtype must be None, q's dtype or torch.float32; got {dq_dtype}")
    if dout.shape != q.shape or out.shape != q.shape:
        raise ValueError(f"dout and out must be [C, Hq, D] = {tuple(q.shape)}; got {tuple(dout.shape)}, {tuple(out.shape)}")
    if dout.dtype != q.dtype or out.dtype != q.dtype:
        raise ValueError(f"dout and out must have q's dtype ({q.dtype}); got {dout.dtype}, {out.dtype}")
    if lse.shape != (Hq, C) or lse.dtype != torch.float32:
        raise ValueError(f"lse must be float32 [Hq={Hq}, C={C}]; got {lse.dtype} {tuple(lse.shape)}")
    for name, t in (("dout", dout), ("out", out), ("lse", lse)):
        if t.device != q.device:
            raise ValueError(f"{name} must be on {q.device}; got {t.device}")
    if past_len > 0:
        for name, t in (("dk_cache", dk_cache), ("dv_cache", dv_cache)):
            if t is None or t.shape != k_cache.shape or t.dtype != torch.float32 or t.device != q.device:
                raise ValueError(
                    f"past_len > 0 needs {name} float32 {tuple(k_cache.shape)} on {q.device}; "
                    f"got {None if t is None else (t.dtype, tuple(t.shape), t.device)}"
                )
    doc = _check_doc(q_doc_start, C, past_len, q.device)
    dq = _alloc_like(q, dq_dtype) if with_dq else None
    dk = _alloc(tuple(k.shape), k.dtype, k.device) if include_own else None
    dv = _alloc(tuple(v.shape), v.dtype, v.device) if include_own else None
    if C == 0:
        return dq, dk, dv
    G = Hq // Hkv
    BLOCK_D = max(16, triton.next_power_of_2(D))
    common = dict(G=G, HEAD_DIM=D, PAGE_SIZE=page_size, BLOCK_D=BLOCK_D, UPCAST=INTERPRET, DOT_PREC=_dot_precision(q.dtype),
                  HAS_DOC=doc is not None)

    # delta = rowsum(dout * out) in fp32, [Hq, C] like lse (FlashAttention-2, Algorithm 2 line 4).
    if delta is None:
        delta = _delta(dout, out)
    elif delta.shape != (Hq, C) or delta.dtype != torch.float32 or delta.device != q.device or not delta.is_contiguous():
        raise ValueError(f"delta must be contiguous float32 [Hq={Hq}, C={C}] on {q.device}; got {delta.dtype} {tuple(delta.shape)}")
    kc, vc, bt, skc, svc = _cache_args(k_cache, v_cache, block_table, past_len, k)
    doc_arg = doc if doc is not None else bt  # never read without HAS_DOC
    tma = (past_len > 0 and doc is None and past_start % page_size == 0
           and use_tma(kc, vc, D, page_size, dq_kernel.configs, kernels.bwd_tma))
    q_tma = qo_tma(q, dout, D, kernels.dkdv_tma)

    def grid_rows(meta):
        return (triton.cdiv(C * G, meta["BLOCK_M"]), Hkv)

    if with_dq:
        dq_kernel[grid_rows](
            q_ptr=q, k_ptr=k, v_ptr=v, k_cache_ptr=kc, v_cache_ptr=vc, block_table_ptr=bt,
            dout_ptr=dout, lse_ptr=lse, delta_ptr=delta, dq_ptr=dq, doc_ptr=doc_arg,
            C=C, past_start=past_start, past_len=past_len, qk_scale=scale * LOG2E, softmax_scale=scale,
            stride_q_c=q.stride(0), stride_q_h=q.stride(1), stride_q_d=q.stride(2),
            stride_k_c=k.stride(0), stride_k_h=k.stride(1), stride_k_d=k.stride(2),
            stride_v_c=v.stride(0), stride_v_h=v.stride(1), stride_v_d=v.stride(2),
            stride_kc_p=skc[0], stride_kc_t=skc[1], stride_kc_h=skc[2], stride_kc_d=skc[3],
            stride_vc_p=svc[0], stride_vc_t=svc[1], stride_vc_h=svc[2], stride_vc_d=svc[3],
            stride_do_c=dout.stride(0), stride_do_h=dout.stride(1), stride_do_d=dout.stride(2),
            stride_dq_c=dq.stride(0), stride_dq_h=dq.stride(1), stride_dq_d=dq.stride(2),
            stride_lse_h=lse.stride(0), stride_delta_h=delta.stride(0), HAS_OWN=bool(include_own),
            PART=past_start > 0, USE_TMA=tma, n_rows=kc.shape[0] * kc.shape[1] if tma else 0,
            n_cols=kc.shape[2] * kc.shape[3] if tma else 0,
            **common,
        )

    def launch_dkdv(is_past, kk, vv, dkk, dvv, key_start, n_keys, key_off):
        def grid_keys(meta):
            return (triton.cdiv(n_keys - key_start, meta["BLOCK_N"]), Hkv)

        sk = kk.stride() if is_past else (0, *kk.stride())
        sv = vv.stride() if is_past else (0, *vv.stride())
        sdk = dkk.stride() if is_past else (0, *dkk.stride())
        sdv = dvv.stride() if is_past else (0, *dvv.stride())
        _drain_streams_before_first_tune("paged_dkdv5", q, dict(common, IS_PAST=is_past, QO_TMA=q_tma, autotune=kernels.autotune))
        dkdv_kernel[grid_keys](
            q_ptr=q, k_ptr=kk, v_ptr=vv, block_table_ptr=bt, dout_ptr=dout, lse_ptr=lse, delta_ptr=delta,
            dk_ptr=dkk, dv_ptr=dvv, doc_ptr=doc_arg,
            C=C, key_start=key_start, n_keys=n_keys, key_off=key_off, qk_scale=scale * LOG2E, softmax_scale=scale,
            stride_q_c=q.stride(0), stride_q_h=q.stride(1), stride_q_d=q.stride(2),
            stride_k_p=sk[0], stride_k_t=sk[1], stride_k_h=sk[2], stride_k_d=sk[3],
            stride_v_p=sv[0], stride_v_t=sv[1], stride_v_h=sv[2], stride_v_d=sv[3],
            stride_do_c=dout.stride(0), stride_do_h=dout.stride(1), stride_do_d=dout.stride(2),
            stride_dk_p=sdk[0], stride_dk_t=sdk[1], stride_dk_h=sdk[2], stride_dk_d=sdk[3],
            stride_dv_p=sdv[0], stride_dv_t=sdv[1], stride_dv_h=sdv[2], stride_dv_d=sdv[3],
            stride_lse_h=lse.stride(0), stride_delta_h=delta.stride(0),
            IS_PAST=is_past,
            PART=key_start > 0, QO_TMA=q_tma, Hq=Hq,
            **common,
        )

    if past_len > past_start:
        launch_dkdv(True, k_cache, v_cache, dk_cache, dv_cache, past_start, past_len, 0)
    if include_own:
        launch_dkdv(False, k, v, dk, dv, 0, C, past_len)
    return dq, dk, dv
