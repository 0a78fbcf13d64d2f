"""Triton paged attention: forward, and backward with in-place paged KV-gradient accumulation.

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
* Forward: one program per (row tile, KV head) runs over all past tiles, then over its own
  chunk's causal tiles.
* Backward: ``delta`` in torch (one pass over dout and out), then two kernels:
  - dq: one program per (row tile, KV head), looping over past and own key tiles;
  - dk/dv: one program per (key tile, KV head), looping over every row tile that sees it.
    For past tiles it reads the fp32 gradient pages, adds its sum and writes them back;
    for the own chunk it writes ``dk``/``dv``. It walks the rows head-major -- all query tiles
    of head 0 of the group, then head 1, ... -- so a row tile is ``BLOCK_M`` consecutive queries
    of one head (strided 2-D q/dout tiles, contiguous lse/delta). This head-major walk replaced
    an earlier walk over the row-interleaved (query-major) rows of the other two kernels, which
    was 1.5x slower (dk/dv 13.1 -> 8.7 ms at 32K past tokens on an H200).

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
  pair in total instead of 5). Measured on an H200 (benchmarks/NOTES.md, "Kernels" v2 and the
  seventh 2026-12-01 session), the FlashAttention-2 alternative -- the dk/dv kernel also adds
  ds @ k into an fp32 dq accumulator, 5 products -- is not faster: 1-3% with the first kernels;
  with the current ones the backward drops from 383 to 306 TFLOP/s (128K past) with
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
Under the Triton interpreter (``TRITON_INTERPRET=1``, CPU tensors) every product runs
in fp32, because the interpreter's bf16 ``tl.dot`` is wrong. Measured on an H200 against an
fp32 reference (benchmarks/results/kernels_h200_2026-11-29.md): fp16 errors within 1.5x of
the reference run in fp16; bf16 out/dq/dk/dv 1.4x; bf16 past dK/dV 1.7e-3 relative, 7.6x the
reference-in-bf16 (whose products are TF32) but 0.58x SDPA flash's error on the same problem.

Speed on an H200 (Qwen2.5-7B attention, bf16, 4096 queries, 32K / 128K past tokens): forward
420 / 436 TFLOP/s with the full past tiles read through tensor descriptors (TMA; 380 / 384 with
the per-token gather in the same process, bitwise-equal outputs; 1.40x SDPA flash at 128K;
benchmarks/NOTES.md, fourth 2026-12-01 session); backward 334 / 341 (1.06x / 1.06x SDPA flash;
"Kernels" run v5, in which the earlier row-interleaved dk/dv walk gave 262 / 267, 0.83x).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

__all__ = ["paged_attention_fwd", "paged_attention_bwd"]

_LOG2E = 1.4426950408889634
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256


# fp32 inputs on a GPU get their own small tile: fp32 dots run without tensor cores, and the
# bf16-sized tiles (e.g. dk/dv's 64 x 128 x 128 with two fp32 accumulators) took LLVM minutes to
# compile per shape on the H200 (2026-12-01: the kernel test file, all fp32, did not get past its
# second test in 400 s). Autotuning never measures them against the bf16/fp16 configs:
# ``_prune_by_dtype`` keeps only them for fp32 q and drops them otherwise.
_FP32_TILE = (32, 32, 4, 2)
_FP32_ONLY: list[triton.Config] = []


def _gpu_configs(gpu: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    """The GPU configs (BLOCK_M, BLOCK_N, num_warps, num_stages) of ``gpu`` plus the fp32-only tile."""
    if os.environ.get("OOMB_TRITON_CONFIGS", "all") == "first":
        gpu = gpu[:1]
    fp32 = triton.Config({"BLOCK_M": _FP32_TILE[0], "BLOCK_N": _FP32_TILE[1]}, num_warps=_FP32_TILE[2], num_stages=_FP32_TILE[3])
    _FP32_ONLY.append(fp32)
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in gpu] + [fp32]


def _configs(gpu: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    """Autotune configs (BLOCK_M, BLOCK_N, num_warps, num_stages); one small config when interpreting.

    On a GPU: the ``gpu`` list plus an fp32-only tile (see ``_prune_by_dtype``).
    ``OOMB_TRITON_CONFIGS=first`` (read at import) keeps only the first entry of ``gpu``: the
    test files compile dozens of small shapes, and autotuning each over every config (seconds per
    compile) did not fit a 300 s call. Benchmarks and training keep the full lists.
    """
    if _INTERPRET:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=1, num_stages=1)]
    return _gpu_configs(gpu)


def _prune_by_dtype(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Autotuner ``early_config_prune``: the fp32-only tile for fp32 q, every other config otherwise.

    The launchers pass every argument by keyword, and Triton's autotuner hands positional arguments in
    ``named_args`` and keyword arguments in ``kwargs``; q is looked up in both (reading only
    ``named_args`` kept every config for fp32, and the bf16 128 x 128 dq tile then asked the H200 for
    320 KiB of shared memory at head dim 80/96: 2026-12-01, sixth session).
    """
    q = named_args["q_ptr"] if "q_ptr" in named_args else kwargs.get("q_ptr")
    fp32 = getattr(q, "dtype", None) == torch.float32
    keep = [c for c in configs if any(c is f for f in _FP32_ONLY) == fp32]
    return keep or list(configs)


_PRUNE = {"early_config_prune": _prune_by_dtype}


_FWD_CONFIGS = _configs([(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3)])
_DQ_CONFIGS = _configs([(128, 128, 8, 2), (128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3)])
_AUTOTUNE_KEY = ["G", "HEAD_DIM", "PAGE_SIZE", "HAS_DOC", "HAS_OWN"]


class _RestoreRows:
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


def _dkdv5_rows(nargs: dict):
    """Pool pages a dense dK/dV launch writes: those of keys [key_start, n_keys) through the block table (past), or
    None (the whole, one-chunk own-gradient tensor)."""
    if not nargs["IS_PAST"]:
        return None
    S = nargs["PAGE_SIZE"]
    lo, hi = int(nargs["key_start"]) // S, -(-int(nargs["n_keys"]) // S)
    return nargs["block_table_ptr"][lo:hi].long().unique()


_DKDV5_RESTORE = _RestoreRows(("dk_ptr", "dv_ptr"), _dkdv5_rows)



# --------------------------------------------------------------------------------------
# Kernels (private). They check nothing: the launchers below validate every input.
# --------------------------------------------------------------------------------------


@triton.jit
def _load_rows(ptr, row_off, r_mask, offs_d, d_mask, stride_d):
    """[BLOCK_M, BLOCK_D] tile at ptr + row_off[r] + d * stride_d (masked rows/dims read 0)."""
    return tl.load(ptr + row_off[:, None] + offs_d[None, :] * stride_d, mask=r_mask[:, None] & d_mask[None, :], other=0.0)


@triton.jit
def _past_token_offsets(block_table_ptr, tok, tok_mask, stride_p, stride_t, PAGE_SIZE: tl.constexpr):
    """Element offsets (int64) of past tokens ``tok`` in a [P, S, Hkv, D] pool, through the block table."""
    page = tl.load(block_table_ptr + tok // PAGE_SIZE, mask=tok_mask, other=0).to(tl.int64)
    return page * stride_p + (tok % PAGE_SIZE).to(tl.int64) * stride_t


@triton.jit
def _past_from(past_start, PART: tl.constexpr):
    """The first past token of a launch: ``past_start`` for a part (PART), else the literal 0.

    Measured (H200, ``benchmarks/ab_forward.py``, 2026-12-01, 4096 queries, Qwen2.5-7B heads):
    with the past loops starting at the runtime ``past_start`` the forward ran at 327 / 320
    TFLOP/s at 32K / 128K past against 384 / 384 for the same kernel before parts existed
    (bitwise-equal outputs, same autotuned config); a ``tl.multiple_of`` hint on the tile start
    did not change that. With the start a literal 0 for whole-past launches (the dense path) the
    loops compile as before and the forward is back at 383 / 383. Only parts (offload segments)
    pay for the runtime start."""
    if PART:
        start = past_start
    else:
        start = 0
    return start


@triton.jit
def _fwd_tile(acc, m_i, l_i, q, k, v, s_mask, qk_scale, MASKED: tl.constexpr, DOT_PREC: tl.constexpr):
    """One online-softmax step (log2 domain): scores of q [M, D] against k [N, D], update acc/m_i/l_i."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [M, N], log2 units
    if MASKED:
        s = tl.where(s_mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:
        # A row with no visible key yet (packed documents) keeps m = -inf: exponentiate against 0
        # instead, so p and alpha are 0 rather than NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.autotune(configs=_FWD_CONFIGS, key=_AUTOTUNE_KEY, prune_configs_by=_PRUNE, cache_results=True)
@triton.jit
def _paged_attn_fwd_kernel(
    q_ptr,  # [C, Hq, D]
    k_ptr,  # [C, Hkv, D] own keys
    v_ptr,  # [C, Hkv, D] own values
    k_cache_ptr,  # [P, S, Hkv, D]
    v_cache_ptr,  # [P, S, Hkv, D]
    block_table_ptr,  # int32 [>= ceil(past_len / S)]
    out_ptr,  # [C, Hq, D]
    lse_ptr,  # fp32 [Hq, C]
    doc_ptr,  # int32 [C] absolute first token of each query's document (HAS_DOC only)
    C,
    past_start,  # first past token read (the part's start; 0 = the whole past)
    past_len,
    qk_scale,  # softmax_scale * log2(e)
    n_rows, n_cols,  # USE_TMA: the pools seen as [n_rows, n_cols] = [P * S, Hkv * D]
    stride_q_c, stride_q_h, stride_q_d,
    stride_k_c, stride_k_h, stride_k_d,
    stride_v_c, stride_v_h, stride_v_d,
    stride_kc_p, stride_kc_t, stride_kc_h, stride_kc_d,
    stride_vc_p, stride_vc_t, stride_vc_h, stride_vc_d,
    stride_o_c, stride_o_h, stride_o_d,
    stride_lse_h,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    HAS_DOC: tl.constexpr,
    HAS_OWN: tl.constexpr,  # False: a past-only part (the chunk's own keys are left out)
    PART: tl.constexpr,  # past_start > 0 (see _past_from below)
    USE_TMA: tl.constexpr,  # full past tiles through tensor descriptors (see _use_tma)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    hkv = tl.program_id(1).to(tl.int64)
    row0 = pid_m * BLOCK_M
    offs_r = row0 + tl.arange(0, BLOCK_M)  # flattened (query, head-in-group) rows
    r_mask = offs_r < C * G
    i_q = offs_r // G  # query position in the chunk
    head = hkv * G + offs_r % G  # query head (int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)

    q = _load_rows(q_ptr, i_q.to(tl.int64) * stride_q_c + head * stride_q_h, r_mask, offs_d, d_mask, stride_q_d)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    kc = k_cache_ptr + hkv * stride_kc_h
    vc = v_cache_ptr + hkv * stride_vc_h
    past_start = _past_from(past_start, PART)
    n_full = past_start + ((past_len - past_start) // BLOCK_N) * BLOCK_N
    if HAS_DOC:
        # Packed documents: key t is visible to query i iff doc[i] <= t. Document starts grow
        # with i, so the tile's first query bounds where any of its rows starts; tiles before
        # that are skipped, the rest masked.
        doc = tl.load(doc_ptr + i_q, mask=r_mask, other=0)
        doc_lo = tl.load(doc_ptr + row0 // G)
        doc_first = tl.minimum(tl.maximum(doc_lo, past_start), past_len)
        for start in range(past_start + ((doc_first - past_start) // BLOCK_N) * BLOCK_N, past_len, BLOCK_N):
            tok = start + offs_n
            tok_mask = tok < past_len
            k = _load_rows(kc, _past_token_offsets(block_table_ptr, tok, tok_mask, stride_kc_p, stride_kc_t, PAGE_SIZE), tok_mask, offs_d, d_mask, stride_kc_d)
            v = _load_rows(vc, _past_token_offsets(block_table_ptr, tok, tok_mask, stride_vc_p, stride_vc_t, PAGE_SIZE), tok_mask, offs_d, d_mask, stride_vc_d)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s_mask = tok_mask[None, :] & (tok[None, :] >= doc[:, None])
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k, v, s_mask, qk_scale, True, DOT_PREC)
        n_full = 0  # the loops below see no past
        past_end = 0
    else:
        past_end = past_len

    # (a) Past tokens through the block table: full tiles unmasked, then the tail tile.
    if USE_TMA:
        # A full tile lies inside one page (PAGE_SIZE % BLOCK_N == 0): one page lookup, then one
        # [BLOCK_N, HEAD_DIM] box of the pool seen as [pages * PAGE_SIZE, Hkv * HEAD_DIM] rows.
        k_desc = tl.make_tensor_descriptor(k_cache_ptr, shape=[n_rows, n_cols], strides=[n_cols, 1], block_shape=[BLOCK_N, BLOCK_D])
        v_desc = tl.make_tensor_descriptor(v_cache_ptr, shape=[n_rows, n_cols], strides=[n_cols, 1], block_shape=[BLOCK_N, BLOCK_D])
        col = (hkv * HEAD_DIM).to(tl.int32)
        for start in range(past_start, n_full, BLOCK_N):
            slot = tl.load(block_table_ptr + start // PAGE_SIZE)
            row = slot * PAGE_SIZE + start % PAGE_SIZE
            k = k_desc.load([row, col])
            v = v_desc.load([row, col])
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k, v, None, qk_scale, False, DOT_PREC)
    else:
        for start in range(past_start, n_full, BLOCK_N):
            tok = start + offs_n
            tok_mask = tok < past_len
            k = _load_rows(kc, _past_token_offsets(block_table_ptr, tok, tok_mask, stride_kc_p, stride_kc_t, PAGE_SIZE), tok_mask, offs_d, d_mask, stride_kc_d)
            v = _load_rows(vc, _past_token_offsets(block_table_ptr, tok, tok_mask, stride_vc_p, stride_vc_t, PAGE_SIZE), tok_mask, offs_d, d_mask, stride_vc_d)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k, v, None, qk_scale, False, DOT_PREC)
    if n_full < past_end:
        tok = n_full + offs_n
        tok_mask = tok < past_len
        k = _load_rows(kc, _past_token_offsets(block_table_ptr, tok, tok_mask, stride_kc_p, stride_kc_t, PAGE_SIZE), tok_mask, offs_d, d_mask, stride_kc_d)
        v = _load_rows(vc, _past_token_offsets(block_table_ptr, tok, tok_mask, stride_vc_p, stride_vc_t, PAGE_SIZE), tok_mask, offs_d, d_mask, stride_vc_d)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k, v, tok_mask[None, :], qk_scale, True, DOT_PREC)

    if HAS_OWN:
        # (b) Own chunk, causal (key j visible to query i iff j <= i). Tiles entirely at or
        # below the tile's first query need no mask; the diagonal tiles do.
        i_lo = row0 // G
        i_hi = tl.minimum((row0 + BLOCK_M - 1) // G, C - 1)
        own_full = ((i_lo + 1) // BLOCK_N) * BLOCK_N
        ko = k_ptr + hkv * stride_k_h
        vo = v_ptr + hkv * stride_v_h
        own_masked_start = own_full
        if HAS_DOC:
            # Own key j sits at absolute token past_len + j: tiles before the tile's first
            # document start are skipped, every other own tile is masked by document.
            own_masked_start = ((tl.maximum(doc_lo - past_len, 0)) // BLOCK_N) * BLOCK_N
            own_full = 0
        for j0 in range(0, own_full, BLOCK_N):
            j = j0 + offs_n
            j_mask = j < C
            k = _load_rows(ko, j.to(tl.int64) * stride_k_c, j_mask, offs_d, d_mask, stride_k_d)
            v = _load_rows(vo, j.to(tl.int64) * stride_v_c, j_mask, offs_d, d_mask, stride_v_d)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k, v, None, qk_scale, False, DOT_PREC)
        for j0 in range(own_masked_start, i_hi + 1, BLOCK_N):
            j = j0 + offs_n
            j_mask = j < C
            k = _load_rows(ko, j.to(tl.int64) * stride_k_c, j_mask, offs_d, d_mask, stride_k_d)
            v = _load_rows(vo, j.to(tl.int64) * stride_v_c, j_mask, offs_d, d_mask, stride_v_d)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s_mask = (j[None, :] <= i_q[:, None]) & j_mask[None, :]
            if HAS_DOC:
                s_mask = s_mask & ((past_len + j)[None, :] >= doc[:, None])
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k, v, s_mask, qk_scale, True, DOT_PREC)

    if HAS_OWN:
        # Every real row saw at least own key 0, so l_i > 0.
        acc = acc / l_i[:, None]
    else:
        # A past-only part may leave a row with no visible key (packed documents): its m_i is
        # -inf and l_i 0; dividing by 1 instead gives out 0 and lse -inf.
        l_i = tl.where(l_i > 0, l_i, 1.0)
        acc = acc / l_i[:, None]
    o_off = i_q.to(tl.int64) * stride_o_c + head * stride_o_h
    tl.store(out_ptr + o_off[:, None] + offs_d[None, :] * stride_o_d, acc.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453  # natural-log units
    tl.store(lse_ptr + head * stride_lse_h + i_q, lse, mask=r_mask)


@triton.jit
def _dq_tile(dq, q, do, k, v, lse2, delta, s_mask, qk_scale, MASKED: tl.constexpr, DOT_PREC: tl.constexpr):
    """dq += ds @ k for one key tile, with p recomputed from lse (log2 units)."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
    p = tl.exp2(s - lse2[:, None])
    if MASKED:
        p = tl.where(s_mask, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
    ds = p * (dp - delta[:, None])
    return dq + tl.dot(ds.to(k.dtype), k, input_precision=DOT_PREC)


@triton.autotune(configs=_DQ_CONFIGS, key=_AUTOTUNE_KEY + ["USE_TMA"], prune_configs_by=_PRUNE, cache_results=True)
@triton.jit
def _paged_attn_bwd_dq_kernel(
    q_ptr,  # [C, Hq, D]
    k_ptr,  # [C, Hkv, D]
    v_ptr,  # [C, Hkv, D]
    k_cache_ptr,  # [P, S, Hkv, D]
    v_cache_ptr,  # [P, S, Hkv, D]
    block_table_ptr,  # int32
    dout_ptr,  # [C, Hq, D]
    lse_ptr,  # fp32 [Hq, C]
    delta_ptr,  # fp32 [Hq, C]
    dq_ptr,  # [C, Hq, D]
    doc_ptr,  # int32 [C] (HAS_DOC only)
    C,
    past_start,
    past_len,
    qk_scale,  # softmax_scale * log2(e)
    softmax_scale,
    n_rows, n_cols,  # USE_TMA: the pools seen as [n_rows, n_cols] = [P * S, Hkv * D]
    stride_q_c, stride_q_h, stride_q_d,
    stride_k_c, stride_k_h, stride_k_d,
    stride_v_c, stride_v_h, stride_v_d,
    stride_kc_p, stride_kc_t, stride_kc_h, stride_kc_d,
    stride_vc_p, stride_vc_t, stride_vc_h, stride_vc_d,
    stride_do_c, stride_do_h, stride_do_d,
    stride_dq_c, stride_dq_h, stride_dq_d,
    stride_lse_h,
    stride_delta_h,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    HAS_DOC: tl.constexpr,
    HAS_OWN: tl.constexpr,  # False: a past-only part (the chunk's own keys are left out)
    PART: tl.constexpr,  # past_start > 0 (see _past_from below)
    USE_TMA: tl.constexpr,  # full past tiles through tensor descriptors (see _use_tma)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    hkv = tl.program_id(1).to(tl.int64)
    row0 = pid_m * BLOCK_M
    offs_r = row0 + tl.arange(0, BLOCK_M)
    r_mask = offs_r < C * G
    i_q = offs_r // G
    head = hkv * G + offs_r % G
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)

    q = _load_rows(q_ptr, i_q.to(tl.int64) * stride_q_c + head * stride_q_h, r_mask, offs_d, d_mask, stride_q_d)
    do = _load_rows(dout_ptr, i_q.to(tl.int64) * stride_do_c + head * stride_do_h, r_mask, offs_d, d_mask, stride_do_d)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse2 = tl.load(lse_ptr + head * stride_lse_h + i_q, mask=r_mask, other=0.0) * 1.4426950408889634
    delta = tl.load(delta_ptr + head * stride_delta_h + i_q, mask=r_mask, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    kc = k_cache_ptr + hkv * stride_kc_h
    vc = v_cache_ptr + hkv * stride_vc_h
    past_start = _past_from(past_start, PART)
    n_full = past_start + ((past_len - past_start) // BLOCK_N) * BLOCK_N
    past_end = past_len
    if HAS_DOC:
        doc = tl.load(doc_ptr + i_q, mask=r_mask, other=0)
        doc_lo = tl.load(doc_ptr + row0 // G)
        doc_first = tl.minimum(tl.maximum(doc_lo, past_start), past_len)
        for start in range(past_start + ((doc_first - past_start) // BLOCK_N) * BLOCK_N, past_len, BLOCK_N):
            tok = start + offs_n
            tok_mask = tok < past_len
            k = _load_rows(kc, _past_token_offsets(block_table_ptr, tok, tok_mask, stride_kc_p, stride_kc_t, PAGE_SIZE), tok_mask, offs_d, d_mask, stride_kc_d)
            v = _load_rows(vc, _past_token_offsets(block_table_ptr, tok, tok_mask, stride_vc_p, stride_vc_t, PAGE_SIZE), tok_mask, offs_d, d_mask, stride_vc_d)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s_mask = tok_mask[None, :] & (tok[None, :] >= doc[:, None])
            dq = _dq_tile(dq, q, do, k, v, lse2, delta, s_mask, qk_scale, True, DOT_PREC)
        n_full = 0
        past_end = 0
    if USE_TMA:
        # As in the forward: one page lookup and one box per full tile.
        k_desc = tl.make_tensor_descriptor(k_cache_ptr, shape=[n_rows, n_cols], strides=[n_cols, 1], block_shape=[BLOCK_N, BLOCK_D])
        v_desc = tl.make_tensor_descriptor(v_cache_ptr, shape=[n_rows, n_cols], strides=[n_cols, 1], block_shape=[BLOCK_N, BLOCK_D])
        col = (hkv * HEAD_DIM).to(tl.int32)
        for start in range(past_start, n_full, BLOCK_N):
            slot = tl.load(block_table_ptr + start // PAGE_SIZE)
            row = slot * PAGE_SIZE + start % PAGE_SIZE
            k = k_desc.load([row, col])
            v = v_desc.load([row, col])
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            dq = _dq_tile(dq, q, do, k, v, lse2, delta, None, qk_scale, False, DOT_PREC)
    else:
        for start in range(past_start, n_full, BLOCK_N):
            tok = start + offs_n
            tok_mask = tok < past_len
            k = _load_rows(kc, _past_token_offsets(block_table_ptr, tok, tok_mask, stride_kc_p, stride_kc_t, PAGE_SIZE), tok_mask, offs_d, d_mask, stride_kc_d)
            v = _load_rows(vc, _past_token_offsets(block_table_ptr, tok, tok_mask, stride_vc_p, stride_vc_t, PAGE_SIZE), tok_mask, offs_d, d_mask, stride_vc_d)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            dq = _dq_tile(dq, q, do, k, v, lse2, delta, None, qk_scale, False, DOT_PREC)
    if n_full < past_end:
        tok = n_full + offs_n
        tok_mask = tok < past_len
        k = _load_rows(kc, _past_token_offsets(block_table_ptr, tok, tok_mask, stride_kc_p, stride_kc_t, PAGE_SIZE), tok_mask, offs_d, d_mask, stride_kc_d)
        v = _load_rows(vc, _past_token_offsets(block_table_ptr, tok, tok_mask, stride_vc_p, stride_vc_t, PAGE_SIZE), tok_mask, offs_d, d_mask, stride_vc_d)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        dq = _dq_tile(dq, q, do, k, v, lse2, delta, tok_mask[None, :], qk_scale, True, DOT_PREC)

    if HAS_OWN:
        i_lo = row0 // G
        i_hi = tl.minimum((row0 + BLOCK_M - 1) // G, C - 1)
        own_full = ((i_lo + 1) // BLOCK_N) * BLOCK_N
        ko = k_ptr + hkv * stride_k_h
        vo = v_ptr + hkv * stride_v_h
        own_masked_start = own_full
        if HAS_DOC:
            own_masked_start = ((tl.maximum(doc_lo - past_len, 0)) // BLOCK_N) * BLOCK_N
            own_full = 0
        for j0 in range(0, own_full, BLOCK_N):
            j = j0 + offs_n
            j_mask = j < C
            k = _load_rows(ko, j.to(tl.int64) * stride_k_c, j_mask, offs_d, d_mask, stride_k_d)
            v = _load_rows(vo, j.to(tl.int64) * stride_v_c, j_mask, offs_d, d_mask, stride_v_d)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            dq = _dq_tile(dq, q, do, k, v, lse2, delta, None, qk_scale, False, DOT_PREC)
        for j0 in range(own_masked_start, i_hi + 1, BLOCK_N):
            j = j0 + offs_n
            j_mask = j < C
            k = _load_rows(ko, j.to(tl.int64) * stride_k_c, j_mask, offs_d, d_mask, stride_k_d)
            v = _load_rows(vo, j.to(tl.int64) * stride_v_c, j_mask, offs_d, d_mask, stride_v_d)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s_mask = (j[None, :] <= i_q[:, None]) & j_mask[None, :]
            if HAS_DOC:
                s_mask = s_mask & ((past_len + j)[None, :] >= doc[:, None])
            dq = _dq_tile(dq, q, do, k, v, lse2, delta, s_mask, qk_scale, True, DOT_PREC)

    dq = dq * softmax_scale
    dq_off = i_q.to(tl.int64) * stride_dq_c + head * stride_dq_h
    tl.store(dq_ptr + dq_off[:, None] + offs_d[None, :] * stride_dq_d, dq.to(dq_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


# dk/dv: rows walked head-major (all query tiles of head 0 of the group, then head 1, ...).
# A row tile is then BLOCK_M consecutive queries of ONE head: q/dout are plain strided 2-D tiles
# (one base pointer per tile, no per-row div/mod by G and no per-row int64 head offsets), and
# lse/delta, stored [Hq, C], are one contiguous vector load each. It replaced a walk over the
# row-interleaved (query-major) rows of the forward and dq kernels with the same per-tile arithmetic
# (only the fp32 summation order over the rows differed), which was 1.5x slower: H200, Qwen2.5-7B
# shape, 13.1 -> 8.7 ms at 32K past (benchmarks/NOTES.md "Kernels" v5 -- hence the "5" in the names
# below, the names that run's results and profiles show).
# It holds two fp32 [BLOCK_N, D] accumulators plus its K/V tile, so 8 warps. Only BLOCK_M=64,
# BLOCK_N=128 is kept: 32x128x4 warps and 128x128x8 warps were 2.7x / 3.2x slower there.
_DKDV5_CONFIGS = _configs([(64, 128, 8, 3), (64, 128, 8, 4), (64, 128, 8, 2)])


@triton.jit
def _dkdv5_tile(dk, dv, k, v, q_ptr, do_ptr, q_desc, do_desc, head, lse_ptr, delta_ptr, doc_ptr, key_off, i0, C, j, offs_m, offs_d,
                d_mask, qk_scale, stride_q_c, stride_q_d, stride_do_c, stride_do_d,
                CAUSAL: tl.constexpr, HAS_DOC: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
                QO_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """dk/dv [N, D] += contributions of queries [i0, i0 + BLOCK_M) of one head (pointers already at that head;
    with QO_TMA q/dout come from the [Hq, C, D] descriptors at ``head`` instead)."""
    i = i0 + offs_m
    i_mask = i < C
    # Rows past C read q = dout = lse = delta = 0 and so contribute exactly 0 (the descriptors
    # zero-fill rows outside [0, C) too).
    if QO_TMA:
        q = q_desc.load([head, i0, 0]).reshape([BLOCK_M, BLOCK_D])
        do = do_desc.load([head, i0, 0]).reshape([BLOCK_M, BLOCK_D])
    else:
        q = _load_rows(q_ptr, i.to(tl.int64) * stride_q_c, i_mask, offs_d, d_mask, stride_q_d)
        do = _load_rows(do_ptr, i.to(tl.int64) * stride_do_c, i_mask, offs_d, d_mask, stride_do_d)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse2 = tl.load(lse_ptr + i, mask=i_mask, other=0.0) * 1.4426950408889634
    delta = tl.load(delta_ptr + i, mask=i_mask, other=0.0)
    s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * qk_scale  # [N, M] (transposed scores)
    p_t = tl.exp2(s_t - lse2[None, :])
    if CAUSAL:
        p_t = tl.where(j[:, None] <= i[None, :], p_t, 0.0)
    if HAS_DOC:
        doc = tl.load(doc_ptr + i, mask=i_mask, other=0)
        p_t = tl.where((key_off + j)[:, None] >= doc[None, :], p_t, 0.0)
    dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PREC)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
    ds_t = p_t * (dp_t - delta[None, :])
    dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PREC)
    return dk, dv


@triton.jit
def _dkdv5_loop(dk, dv, k, v, q_ptr, do_ptr, q_desc, do_desc, lse_ptr, delta_ptr, doc_ptr, key_off, i_lo, n_t, C, j, hkv, offs_m,
                offs_d, d_mask, qk_scale, stride_q_c, stride_q_h, stride_q_d, stride_do_c, stride_do_h, stride_do_d, stride_lse_h,
                stride_delta_h, G: tl.constexpr, CAUSAL: tl.constexpr, HAS_DOC: tl.constexpr, UPCAST: tl.constexpr,
                DOT_PREC: tl.constexpr, QO_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Query tiles [i_lo + t * BLOCK_M) for t < n_t, of each of the G heads in turn: one flat loop (pipelines as one)."""
    for t in range(0, G * n_t):
        g = t // n_t
        i0 = i_lo + (t - g * n_t) * BLOCK_M
        head = hkv * G + g  # int64
        dk, dv = _dkdv5_tile(dk, dv, k, v, q_ptr + head * stride_q_h, do_ptr + head * stride_do_h, q_desc, do_desc,
                             head.to(tl.int32), lse_ptr + head * stride_lse_h, delta_ptr + head * stride_delta_h, doc_ptr,
                             key_off, i0, C, j, offs_m, offs_d, d_mask, qk_scale, stride_q_c, stride_q_d, stride_do_c,
                             stride_do_d, CAUSAL, HAS_DOC, UPCAST, DOT_PREC, QO_TMA, BLOCK_M, BLOCK_D)
    return dk, dv


# restore_value: autotuning runs the kernel once per config; the gradient pages must not keep those sums.
@triton.autotune(configs=_DKDV5_CONFIGS, key=[k for k in _AUTOTUNE_KEY if k != "HAS_OWN"] + ["IS_PAST", "QO_TMA"], pre_hook=_DKDV5_RESTORE.pre_hook, post_hook=_DKDV5_RESTORE.post_hook, prune_configs_by=_PRUNE, cache_results=True)
@triton.jit
def _paged_attn_bwd_dkdv5_kernel(
    q_ptr,  # [C, Hq, D]
    k_ptr,  # IS_PAST: k_cache [P, S, Hkv, D]; else own k [C, Hkv, D]
    v_ptr,  # same layout as k_ptr
    block_table_ptr,  # int32 (IS_PAST only)
    dout_ptr,  # [C, Hq, D]
    lse_ptr,  # fp32 [Hq, C]
    delta_ptr,  # fp32 [Hq, C]
    dk_ptr,  # IS_PAST: fp32 dk_cache [P, S, Hkv, D] (read-add-write); else dk [C, Hkv, D] (write)
    dv_ptr,  # same layout as dk_ptr
    doc_ptr,  # int32 [C] (HAS_DOC only)
    C,
    key_start,  # first key of this launch: past_start (IS_PAST) or 0
    n_keys,  # end of the keys: past_len (IS_PAST) or C
    key_off,  # absolute token of key 0: 0 (IS_PAST) or past_len
    qk_scale,  # softmax_scale * log2(e)
    softmax_scale,
    Hq,
    stride_q_c, stride_q_h, stride_q_d,
    stride_k_p, stride_k_t, stride_k_h, stride_k_d,  # own k: stride_k_p unused, stride_k_t = token stride
    stride_v_p, stride_v_t, stride_v_h, stride_v_d,
    stride_do_c, stride_do_h, stride_do_d,
    stride_dk_p, stride_dk_t, stride_dk_h, stride_dk_d,
    stride_dv_p, stride_dv_t, stride_dv_h, stride_dv_d,
    stride_lse_h,
    stride_delta_h,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_PAST: tl.constexpr,
    PART: tl.constexpr,  # key_start > 0
    QO_TMA: tl.constexpr,  # q/dout row tiles through [Hq, C, D] tensor descriptors (see _qo_tma)
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    HAS_DOC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    hkv = tl.program_id(1).to(tl.int64)
    j0 = _past_from(key_start, PART) + pid_n * BLOCK_N
    j = j0 + tl.arange(0, BLOCK_N)  # key tokens owned by this program
    j_mask = j < n_keys
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    offs_m = tl.arange(0, BLOCK_M)
    if IS_PAST:
        k_off = _past_token_offsets(block_table_ptr, j, j_mask, stride_k_p, stride_k_t, PAGE_SIZE)
        v_off = _past_token_offsets(block_table_ptr, j, j_mask, stride_v_p, stride_v_t, PAGE_SIZE)
    else:
        k_off = j.to(tl.int64) * stride_k_t
        v_off = j.to(tl.int64) * stride_v_t
    # Keys past n_keys read 0; their rows are never stored.
    k = _load_rows(k_ptr + hkv * stride_k_h, k_off, j_mask, offs_d, d_mask, stride_k_d)
    v = _load_rows(v_ptr + hkv * stride_v_h, v_off, j_mask, offs_d, d_mask, stride_v_d)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    n_tiles = tl.cdiv(C, BLOCK_M)
    if QO_TMA:
        q_desc = tl.make_tensor_descriptor(q_ptr, shape=[Hq, C, HEAD_DIM], strides=[stride_q_h, stride_q_c, 1],
                                           block_shape=[1, BLOCK_M, BLOCK_D])
        do_desc = tl.make_tensor_descriptor(dout_ptr, shape=[Hq, C, HEAD_DIM], strides=[stride_do_h, stride_do_c, 1],
                                            block_shape=[1, BLOCK_M, BLOCK_D])
    else:
        q_desc = q_ptr
        do_desc = dout_ptr
    if IS_PAST:
        # Every query of the chunk sees every past token (without packed documents): no causal mask.
        dk, dv = _dkdv5_loop(dk, dv, k, v, q_ptr, dout_ptr, q_desc, do_desc, lse_ptr, delta_ptr, doc_ptr, key_off, 0, n_tiles, C, j, hkv,
                             offs_m, offs_d, d_mask, qk_scale, stride_q_c, stride_q_h, stride_q_d,
                             stride_do_c, stride_do_h, stride_do_d, stride_lse_h, stride_delta_h,
                             G, False, HAS_DOC, UPCAST, DOT_PREC, QO_TMA, BLOCK_M, BLOCK_D)
    else:
        # Queries i >= j0 see this tile; query tiles starting at or after its last key need no mask.
        t_lo = j0 // BLOCK_M
        t_mid = tl.minimum(tl.cdiv(j0 + BLOCK_N - 1, BLOCK_M), n_tiles)
        dk, dv = _dkdv5_loop(dk, dv, k, v, q_ptr, dout_ptr, q_desc, do_desc, lse_ptr, delta_ptr, doc_ptr, key_off, t_lo * BLOCK_M, t_mid - t_lo, C, j,
                             hkv, offs_m, offs_d, d_mask, qk_scale, stride_q_c, stride_q_h, stride_q_d,
                             stride_do_c, stride_do_h, stride_do_d, stride_lse_h, stride_delta_h,
                             G, True, HAS_DOC, UPCAST, DOT_PREC, QO_TMA, BLOCK_M, BLOCK_D)
        dk, dv = _dkdv5_loop(dk, dv, k, v, q_ptr, dout_ptr, q_desc, do_desc, lse_ptr, delta_ptr, doc_ptr, key_off, t_mid * BLOCK_M, n_tiles - t_mid, C, j,
                             hkv, offs_m, offs_d, d_mask, qk_scale, stride_q_c, stride_q_h, stride_q_d,
                             stride_do_c, stride_do_h, stride_do_d, stride_lse_h, stride_delta_h,
                             G, False, HAS_DOC, UPCAST, DOT_PREC, QO_TMA, BLOCK_M, BLOCK_D)

    dk = dk * softmax_scale
    if IS_PAST:
        dk_off = _past_token_offsets(block_table_ptr, j, j_mask, stride_dk_p, stride_dk_t, PAGE_SIZE)
        dv_off = _past_token_offsets(block_table_ptr, j, j_mask, stride_dv_p, stride_dv_t, PAGE_SIZE)
    else:
        dk_off = j.to(tl.int64) * stride_dk_t
        dv_off = j.to(tl.int64) * stride_dv_t
    st_mask = j_mask[:, None] & d_mask[None, :]
    dk_ptrs = dk_ptr + hkv * stride_dk_h + dk_off[:, None] + offs_d[None, :] * stride_dk_d
    dv_ptrs = dv_ptr + hkv * stride_dv_h + dv_off[:, None] + offs_d[None, :] * stride_dv_d
    if IS_PAST:
        # This program owns these gradient-page rows: one read-add-write, no atomics.
        dk += tl.load(dk_ptrs, mask=st_mask, other=0.0)
        dv += tl.load(dv_ptrs, mask=st_mask, other=0.0)
    tl.store(dk_ptrs, dk.to(dk_ptr.dtype.element_ty), mask=st_mask)
    tl.store(dv_ptrs, dv.to(dv_ptr.dtype.element_ty), mask=st_mask)


# --------------------------------------------------------------------------------------
# Launchers: every check, allocation, grid and stride lives here.
# --------------------------------------------------------------------------------------


def _alloc_like(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Uninitialised output with x's shape and memory layout (tests patch this to poison outputs)."""
    return torch.empty_like(x, dtype=dtype)


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialised contiguous output (tests patch this to poison outputs)."""
    return torch.empty(shape, dtype=dtype, device=device)


_TUNE_KEYS_SEEN: set = set()


def _drain_streams_before_first_tune(name: str, q: torch.Tensor, key: dict) -> None:
    """Wait for every stream before the first launch, in this process, of an autotuned kernel that has
    ``restore_value`` (it adds into dK/dV) for this autotune ``key``.

    Autotuning such a kernel clones its output tensors (here the whole dK/dV page pool), runs every
    config, then copies the clones back, on the current stream. A copy stream writing into the pool
    meanwhile (the offload store's prefetch of the next layer's dK/dV) would have its writes undone
    by that restore. Draining first makes the pool quiet: autotuning blocks the host until it ends,
    so nothing new is enqueued during it. Later launches (a tuned key) do not wait. No-op off CUDA.
    """
    if not q.is_cuda:
        return
    k = (name, q.dtype, tuple(sorted(key.items())))
    if k not in _TUNE_KEYS_SEEN:
        torch.cuda.synchronize(q.device)
        _TUNE_KEYS_SEEN.add(k)


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 or _INTERPRET else "tf32"


def _check_inputs(q, k, v, k_cache, v_cache, block_table, past_len, softmax_scale):
    """Validate the forward inputs; returns (C, Hq, Hkv, D, page_size, scale)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor [C, H, D]; got {getattr(t, 'shape', type(t))}")
    C, Hq, D = q.shape
    if k.shape != v.shape or k.shape[0] != C or k.shape[2] != D:
        raise ValueError(f"k and v must be [C={C}, Hkv, D={D}]; got {tuple(k.shape)} and {tuple(v.shape)}")
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    if q.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"q dtype must be one of {_SUPPORTED_DTYPES}; got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not 1 <= D <= _MAX_HEAD_DIM:
        raise ValueError(f"head dim must be in [1, {_MAX_HEAD_DIM}]; got {D}")
    dev = q.device
    if k.device != dev or v.device != dev:
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    if dev.type != "cuda" and not (_INTERPRET and dev.type == "cpu"):
        raise ValueError(f"the Triton kernels need CUDA tensors (or CPU tensors with TRITON_INTERPRET=1); got {dev}")
    if not isinstance(past_len, int) or past_len < 0:
        raise ValueError(f"past_len must be an int >= 0; got {past_len!r}")
    page_size = 1
    if past_len > 0:
        if k_cache is None or v_cache is None or block_table is None:
            raise ValueError("past_len > 0 needs k_cache, v_cache and block_table")
        if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[2] != Hkv or k_cache.shape[3] != D:
            raise ValueError(
                f"k_cache/v_cache must be [P, page_size, Hkv={Hkv}, D={D}]; got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
            )
        if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
            raise ValueError(f"k_cache/v_cache dtype must equal q's ({q.dtype}); got {k_cache.dtype}, {v_cache.dtype}")
        if k_cache.device != dev or v_cache.device != dev or block_table.device != dev:
            raise ValueError(f"k_cache, v_cache and block_table must be on {dev}")
        page_size = k_cache.shape[1]
        need = -(-past_len // page_size)
        if block_table.dim() != 1 or block_table.dtype != torch.int32 or block_table.numel() < need:
            raise ValueError(
                f"block_table must be 1-D int32 with >= {need} pages for past_len={past_len} and page_size={page_size}; "
                f"got {block_table.dtype} {tuple(block_table.shape)}"
            )
        if block_table.stride(0) != 1:
            raise ValueError("block_table must be contiguous")
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(D)
    return C, Hq, Hkv, D, page_size, scale


def _check_part(past_start, past_len, include_own):
    if not isinstance(past_start, int) or isinstance(past_start, bool) or not 0 <= past_start <= past_len:
        raise ValueError(f"past_start must be an int in [0, past_len={past_len}]; got {past_start!r}")
    if not include_own and past_start == past_len:
        raise ValueError("include_own=False needs at least one past token (past_start < past_len)")


def _delta(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """rowsum(dout * out) in fp32 -> contiguous [Hq, C] (the layout of lse)."""
    return (dout.float() * out.float()).sum(-1).t().contiguous()


def _check_doc(q_doc_start, C, past_len, device):
    """Validate q_doc_start -> contiguous int32 [C] on ``device``, or None."""
    if q_doc_start is None:
        return None
    if not isinstance(q_doc_start, torch.Tensor) or q_doc_start.shape != (C,):
        raise ValueError(f"q_doc_start must be an int tensor [C={C}]; got {getattr(q_doc_start, 'shape', type(q_doc_start))}")
    if q_doc_start.dtype not in (torch.int32, torch.int64) or q_doc_start.device != device:
        raise ValueError(f"q_doc_start must be int32/int64 on {device}; got {q_doc_start.dtype} on {q_doc_start.device}")
    return q_doc_start.to(torch.int32).contiguous()


def _cache_args(k_cache, v_cache, block_table, past_len, like):
    """Pool pointers and strides; with no past, dummies that the kernels never read."""
    if past_len > 0:
        return k_cache, v_cache, block_table, k_cache.stride(), v_cache.stride()
    dummy_bt = torch.zeros(1, dtype=torch.int32, device=like.device)
    return like, like, dummy_bt, (0, 0, 0, 0), (0, 0, 0, 0)




def _tma_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global scratch for the descriptors a kernel builds on the device (``triton.set_allocator``)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _use_tma(k_cache: torch.Tensor, v_cache: torch.Tensor, head_dim: int, page_size: int,
             configs: list | None = None, env: str = "OOMB_FWD_TMA", default: str = "1") -> bool:
    """Whether a kernel reads its full past tiles through tensor descriptors (TMA on Hopper).

    Needs: pools laid out [P, S, Hkv, D] densely (so a page's rows of one head are a box of the
    pool seen as [P * S, Hkv * D]), a power-of-two head dim (the box is HEAD_DIM wide), pages a
    multiple of every autotuned BLOCK_N of ``configs`` (the forward's by default; a full tile never
    straddles two pages), 16-byte aligned bases and fewer than 2**31 rows; the launcher adds a
    page-aligned ``past_start``. The environment variable ``env`` set to 0/1 turns it off/on
    (A/B runs): ``OOMB_FWD_TMA`` for the forward (default on), ``OOMB_BWD_TMA`` for the dq kernel.
    Packed documents keep the gather path (their tiles are masked).
    """
    if os.environ.get(env, default) == "0":
        return False
    P, S, Hkv, D = k_cache.shape
    dense = (S * Hkv * D, Hkv * D, D, 1)
    block_n = max(c.kwargs["BLOCK_N"] for c in (configs or _FWD_CONFIGS))
    ok = (
        k_cache.stride() == dense and v_cache.stride() == dense and tuple(v_cache.shape) == (P, S, Hkv, D)
        and head_dim == triton.next_power_of_2(head_dim) and head_dim >= 16 and page_size % block_n == 0
        and k_cache.data_ptr() % 16 == 0 and v_cache.data_ptr() % 16 == 0 and P * S < 2**31
        and _tma_capable(k_cache.device)
    )
    if ok:
        _set_tma_allocator()
    return ok


def _tma_capable(device: torch.device) -> bool:
    """Tensor descriptors: the interpreter, or a CUDA device of compute capability 9.0 (Hopper) or newer."""
    return _INTERPRET or (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9)


def _set_tma_allocator() -> None:
    """Give this thread's context the scratch allocator that descriptors built on the device need.

    Triton keeps the allocator in a ContextVar, i.e. per thread: setting it once on the main thread
    is not enough, since autograd runs the backward on its own device thread (a backward with
    descriptors failed there with "no allocator was set" on the H200). So it is checked on every
    launch that uses descriptors, and set where this context has none (an allocator the caller set
    is kept).
    """
    try:
        from triton.runtime import _allocation

        current = _allocation._allocator.get()
        if not isinstance(current, _allocation.NullAllocator):
            return
    except (ImportError, AttributeError):  # another triton layout: set it unconditionally
        pass
    triton.set_allocator(_tma_scratch)


def _qo_tma(q: torch.Tensor, dout: torch.Tensor, head_dim: int) -> bool:
    """Whether the dk/dv kernel loads its q/dout row tiles through [Hq, C, D] tensor descriptors.

    A row tile of the dk/dv kernel is BLOCK_M consecutive queries of one head, i.e. a box of q
    seen as [Hq, C, D] with strides (stride_h, stride_c, 1), for both layouts the engine passes
    ([C, Hq, D] contiguous and HF's transposed [Hq, C, D]). Needs a unit innermost stride, 16-byte
    aligned outer strides and bases, and a power-of-two head dim (the box is HEAD_DIM wide); rows
    past C are zero-filled by the descriptor as the masked gather fills them. ``OOMB_DKDV_TMA=0``
    turns it off.
    """
    if os.environ.get("OOMB_DKDV_TMA", "1") == "0":
        return False
    ok = head_dim == triton.next_power_of_2(head_dim) and head_dim >= 16 and _tma_capable(q.device)
    for t in (q, dout):
        e = t.element_size()
        ok = ok and t.stride(2) == 1 and (t.stride(0) * e) % 16 == 0 and (t.stride(1) * e) % 16 == 0 and t.data_ptr() % 16 == 0
    if ok:
        _set_tma_allocator()
    return ok


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

    Returns:
        out: [C, Hq, D] in ``out_dtype``, with q's memory layout. With include_own=False a row
            that sees no key (packed documents) is 0.
        lse: [Hq, C] float32, natural-log log-sum-exp of the scaled scores; -inf for a row
            that sees no key.

    Raises:
        ValueError: on inconsistent shapes, unsupported dtype or device, Hq not a multiple of
            Hkv, head dim > 256, a block_table too short / not int32, or a bad part
            (past_start outside [0, past_len], or equal to past_len with include_own=False).
    """
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
    use_tma = past_len > 0 and doc is None and past_start % page_size == 0 and _use_tma(kc, vc, D, page_size)

    def grid(meta):
        return (triton.cdiv(C * G, meta["BLOCK_M"]), Hkv)

    _paged_attn_fwd_kernel[grid](
        q_ptr=q, k_ptr=k, v_ptr=v, k_cache_ptr=kc, v_cache_ptr=vc, block_table_ptr=bt, out_ptr=out, lse_ptr=lse,
        C=C, past_start=past_start, past_len=past_len, qk_scale=scale * _LOG2E,
        stride_q_c=q.stride(0), stride_q_h=q.stride(1), stride_q_d=q.stride(2),
        stride_k_c=k.stride(0), stride_k_h=k.stride(1), stride_k_d=k.stride(2),
        stride_v_c=v.stride(0), stride_v_h=v.stride(1), stride_v_d=v.stride(2),
        stride_kc_p=skc[0], stride_kc_t=skc[1], stride_kc_h=skc[2], stride_kc_d=skc[3],
        stride_vc_p=svc[0], stride_vc_t=svc[1], stride_vc_h=svc[2], stride_vc_d=svc[3],
        stride_o_c=out.stride(0), stride_o_h=out.stride(1), stride_o_d=out.stride(2),
        stride_lse_h=lse.stride(0), doc_ptr=doc if doc is not None else bt,
        G=G, HEAD_DIM=D, PAGE_SIZE=page_size, BLOCK_D=max(16, triton.next_power_of_2(D)),
        UPCAST=_INTERPRET, DOT_PREC=_dot_precision(q.dtype), HAS_DOC=doc is not None, HAS_OWN=bool(include_own),
        PART=past_start > 0, USE_TMA=use_tma, n_rows=kc.shape[0] * kc.shape[1] if use_tma else 0,
        n_cols=kc.shape[2] * kc.shape[3] if use_tma else 0,
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
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
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

    Returns:
        dq: [C, Hq, D] in ``dq_dtype``, with q's memory layout (this part's contribution).
        dk, dv: [C, Hkv, D] in k's dtype -- the own chunk's contribution only; None when
            include_own=False.

    Raises:
        ValueError: as the forward, plus mismatched dout/out/lse/delta shapes or dtypes, and
            past_len > 0 without float32 gradient pools shaped like k_cache.
    """
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
    dq = _alloc_like(q, dq_dtype)
    dk = _alloc(tuple(k.shape), k.dtype, k.device) if include_own else None
    dv = _alloc(tuple(v.shape), v.dtype, v.device) if include_own else None
    if C == 0:
        return dq, dk, dv
    G = Hq // Hkv
    BLOCK_D = max(16, triton.next_power_of_2(D))
    common = dict(G=G, HEAD_DIM=D, PAGE_SIZE=page_size, BLOCK_D=BLOCK_D, UPCAST=_INTERPRET, DOT_PREC=_dot_precision(q.dtype),
                  HAS_DOC=doc is not None)

    # delta = rowsum(dout * out) in fp32, [Hq, C] like lse (FlashAttention-2, Algorithm 2 line 4).
    if delta is None:
        delta = _delta(dout, out)
    elif delta.shape != (Hq, C) or delta.dtype != torch.float32 or delta.device != q.device or not delta.is_contiguous():
        raise ValueError(f"delta must be contiguous float32 [Hq={Hq}, C={C}] on {q.device}; got {delta.dtype} {tuple(delta.shape)}")
    kc, vc, bt, skc, svc = _cache_args(k_cache, v_cache, block_table, past_len, k)
    doc_arg = doc if doc is not None else bt  # never read without HAS_DOC
    use_tma = (past_len > 0 and doc is None and past_start % page_size == 0
               and _use_tma(kc, vc, D, page_size, _DQ_CONFIGS, "OOMB_BWD_TMA"))
    qo_tma = _qo_tma(q, dout, D)

    def grid_rows(meta):
        return (triton.cdiv(C * G, meta["BLOCK_M"]), Hkv)

    _paged_attn_bwd_dq_kernel[grid_rows](
        q_ptr=q, k_ptr=k, v_ptr=v, k_cache_ptr=kc, v_cache_ptr=vc, block_table_ptr=bt,
        dout_ptr=dout, lse_ptr=lse, delta_ptr=delta, dq_ptr=dq, doc_ptr=doc_arg,
        C=C, past_start=past_start, past_len=past_len, qk_scale=scale * _LOG2E, softmax_scale=scale,
        stride_q_c=q.stride(0), stride_q_h=q.stride(1), stride_q_d=q.stride(2),
        stride_k_c=k.stride(0), stride_k_h=k.stride(1), stride_k_d=k.stride(2),
        stride_v_c=v.stride(0), stride_v_h=v.stride(1), stride_v_d=v.stride(2),
        stride_kc_p=skc[0], stride_kc_t=skc[1], stride_kc_h=skc[2], stride_kc_d=skc[3],
        stride_vc_p=svc[0], stride_vc_t=svc[1], stride_vc_h=svc[2], stride_vc_d=svc[3],
        stride_do_c=dout.stride(0), stride_do_h=dout.stride(1), stride_do_d=dout.stride(2),
        stride_dq_c=dq.stride(0), stride_dq_h=dq.stride(1), stride_dq_d=dq.stride(2),
        stride_lse_h=lse.stride(0), stride_delta_h=delta.stride(0), HAS_OWN=bool(include_own),
        PART=past_start > 0, USE_TMA=use_tma, n_rows=kc.shape[0] * kc.shape[1] if use_tma else 0,
        n_cols=kc.shape[2] * kc.shape[3] if use_tma else 0,
        **common,
    )

    def launch_dkdv(is_past, kk, vv, dkk, dvv, key_start, n_keys, key_off):
        def grid_keys(meta):
            return (triton.cdiv(n_keys - key_start, meta["BLOCK_N"]), Hkv)

        sk = kk.stride() if is_past else (0, *kk.stride())
        sv = vv.stride() if is_past else (0, *vv.stride())
        sdk = dkk.stride() if is_past else (0, *dkk.stride())
        sdv = dvv.stride() if is_past else (0, *dvv.stride())
        _drain_streams_before_first_tune("paged_dkdv5", q, dict(common, IS_PAST=is_past, QO_TMA=qo_tma))
        _paged_attn_bwd_dkdv5_kernel[grid_keys](
            q_ptr=q, k_ptr=kk, v_ptr=vv, block_table_ptr=bt, dout_ptr=dout, lse_ptr=lse, delta_ptr=delta,
            dk_ptr=dkk, dv_ptr=dvv, doc_ptr=doc_arg,
            C=C, key_start=key_start, n_keys=n_keys, key_off=key_off, qk_scale=scale * _LOG2E, softmax_scale=scale,
            stride_q_c=q.stride(0), stride_q_h=q.stride(1), stride_q_d=q.stride(2),
            stride_k_p=sk[0], stride_k_t=sk[1], stride_k_h=sk[2], stride_k_d=sk[3],
            stride_v_p=sv[0], stride_v_t=sv[1], stride_v_h=sv[2], stride_v_d=sv[3],
            stride_do_c=dout.stride(0), stride_do_h=dout.stride(1), stride_do_d=dout.stride(2),
            stride_dk_p=sdk[0], stride_dk_t=sdk[1], stride_dk_h=sdk[2], stride_dk_d=sdk[3],
            stride_dv_p=sdv[0], stride_dv_t=sdv[1], stride_dv_h=sdv[2], stride_dv_d=sdv[3],
            stride_lse_h=lse.stride(0), stride_delta_h=delta.stride(0),
            IS_PAST=is_past,
            PART=key_start > 0, QO_TMA=qo_tma, Hq=Hq,
            **common,
        )

    if past_len > past_start:
        launch_dkdv(True, k_cache, v_cache, dk_cache, dv_cache, past_start, past_len, 0)
    if include_own:
        launch_dkdv(False, k, v, dk, dv, 0, C, past_len)
    return dq, dk, dv
