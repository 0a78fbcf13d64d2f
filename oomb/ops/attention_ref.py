"""Plain-PyTorch paged attention: the reference every kernel is tested against.

One chunk of ``C`` queries attends to (a) ``past_len`` earlier tokens whose K/V
live in a page pool addressed through an int32 ``block_table`` and (b) the
chunk's own K/V, causally::

    keys:     past tokens (all visible)     | own tokens 0..C-1
    query 0:  1 1 1 ... 1                   | 1 0 0 0
    query 1:  1 1 1 ... 1                   | 1 1 0 0
    query 2:  1 1 1 ... 1                   | 1 1 1 0

The past is processed ``block_size`` tokens at a time and merged through the
log-sum-exp (as in FlashAttention, Dao et al. 2022, §3.1), so memory is bounded
by the block, not by ``past_len``. Grouped-query attention is handled by
viewing the ``Hq`` query heads as ``Hkv`` groups of ``G = Hq // Hkv``; K/V are
never expanded. Query head ``h`` reads KV head ``h // G`` (Hugging Face's
``repeat_kv`` layout).

Shape legend: C own-chunk tokens, Hq query heads, Hkv KV heads, G = Hq // Hkv,
D head dim, P pages in the pool, S page_size (tokens per page).

Arithmetic runs in float32 for half-precision inputs and in the input dtype
for float32/float64 inputs. For bf16/fp16 inputs on CUDA the float32 matrix
products use TF32 tensor cores: bf16 values are exact in TF32 and products
accumulate in float32, so q·k is as exact as FlashAttention's and p·v is
rounded to 10 mantissa bits instead of FlashAttention's 7 (bf16).
"""

from __future__ import annotations

import contextlib
import math

import torch

__all__ = ["paged_attention_fwd_ref", "paged_attention_bwd_ref", "acc_dtype_for"]


def acc_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for an input dtype: float64 stays float64, everything else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@contextlib.contextmanager
def _matmul_precision(dtype: torch.dtype, device: torch.device):
    """TF32 float32 products for half-precision inputs on CUDA (see module docstring); else unchanged."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        yield
        return
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def _to_groups(x_CHD: torch.Tensor, num_kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """[C, Hq, D] -> [Hkv, G*C, D] (row r of group g is query r % C of head g*G + r // C)."""
    C, Hq, D = x_CHD.shape
    G = Hq // num_kv_heads
    return x_CHD.to(dtype).view(C, num_kv_heads, G, D).permute(1, 2, 0, 3).reshape(num_kv_heads, G * C, D)


def _from_groups(x_KRD: torch.Tensor, C: int) -> torch.Tensor:
    """[Hkv, G*C, D] -> [C, Hq, D]."""
    Hkv, R, D = x_KRD.shape
    G = R // C
    return x_KRD.view(Hkv, G, C, D).permute(2, 0, 1, 3).reshape(C, Hkv * G, D)


def _gather_past(cache: torch.Tensor, block_table: torch.Tensor, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
    """Past tokens [start, end) gathered through the block table -> [Hkv, end-start, D]."""
    S = cache.shape[1]
    p0, p1 = start // S, -(-end // S)
    pages = cache.index_select(0, block_table[p0:p1].long())  # [n, S, Hkv, D]
    toks = pages.reshape(-1, cache.shape[2], cache.shape[3])[start - p0 * S : end - p0 * S]
    return toks.to(dtype).permute(1, 0, 2)


class _Masks:
    """Masks over rows r of the grouped layout (query r % C) for causal + packed-document attention."""

    def __init__(self, C: int, G: int, past_len: int, q_doc_start: torch.Tensor | None, device):
        self.C, self.past_len = C, past_len
        self.qi = torch.arange(C, device=device).repeat(G)  # [G*C] query index of each row
        self.doc = None if q_doc_start is None else q_doc_start.to(device=device, dtype=torch.int64).repeat(G)

    def own(self) -> torch.Tensor:
        j = torch.arange(self.C, device=self.qi.device)[None, :]
        mask = j > self.qi[:, None]
        if self.doc is not None:
            mask |= (self.past_len + j) < self.doc[:, None]
        return mask

    def past(self, start: int, end: int) -> torch.Tensor | None:
        if self.doc is None:
            return None
        kabs = torch.arange(start, end, device=self.qi.device)[None, :]
        return kabs < self.doc[:, None]

    def first_past_token(self, block_size: int, past_start: int = 0) -> int:
        """First past block read: blocks start at ``past_start`` + multiples of ``block_size``; those
        wholly before every query's document are skipped."""
        if self.doc is None:
            return past_start
        first = min(max(int(self.doc.min()), past_start), self.past_len)
        return past_start + ((first - past_start) // block_size) * block_size


def _check_part(past_start, past_len, include_own):
    if not isinstance(past_start, int) or not 0 <= past_start <= past_len:
        raise ValueError(f"past_start must be an int in [0, past_len={past_len}]; got {past_start!r}")
    if not include_own and past_start == past_len:
        raise ValueError("include_own=False needs at least one past token (past_start < past_len)")


def _merge(out, lse, out_b, lse_b):
    """Log-sum-exp merge of two normalised parts; rows with lse = -inf (nothing visible) weigh 0, no NaN."""
    new_lse = torch.logaddexp(lse, lse_b)
    ref = torch.where(torch.isinf(new_lse), 0.0, new_lse)
    return out * torch.exp(lse - ref)[..., None] + out_b * torch.exp(lse_b - ref)[..., None], new_lse


def _check(q, k, v, k_cache, v_cache, block_table, past_len):
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [C, H, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    C, Hq, D = q.shape
    if k.shape != v.shape or k.shape[0] != C or k.shape[2] != D:
        raise ValueError(f"k and v must be [C={C}, Hkv, D={D}]; got {tuple(k.shape)} and {tuple(v.shape)}")
    Hkv = k.shape[1]
    if Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    if past_len < 0:
        raise ValueError(f"past_len must be >= 0, got {past_len}")
    if past_len > 0:
        if k_cache is None or v_cache is None or block_table is None:
            raise ValueError("past_len > 0 needs k_cache, v_cache and block_table")
        if k_cache.dim() != 4 or k_cache.shape[2] != Hkv or k_cache.shape[3] != D or k_cache.shape != v_cache.shape:
            raise ValueError(
                f"k_cache/v_cache must be [P, page_size, Hkv={Hkv}, D={D}]; got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
            )
        need = -(-past_len // k_cache.shape[1])
        if block_table.dim() != 1 or block_table.numel() < need:
            raise ValueError(f"block_table must be 1-D with >= {need} pages for past_len={past_len}; got {tuple(block_table.shape)}")


def _fwd_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor | None,
    v_cache: torch.Tensor | None,
    block_table: torch.Tensor | None,
    past_len: int,
    softmax_scale: float | None = None,
    block_size: int = 4096,
    q_doc_start: torch.Tensor | None = None,
    past_start: int = 0,
    include_own: bool = True,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one chunk over paged past K/V plus its own K/V (causal), or over one part of them.

    Args:
        q: [C, Hq, D] queries of the chunk (any float dtype).
        k, v: [C, Hkv, D] the chunk's own keys/values.
        k_cache, v_cache: [P, S, Hkv, D] page pools (may be None when past_len == 0).
        block_table: int32 [>= ceil(past_len / S)] page ids of the past, in token order.
        past_len: number of past tokens (a partial last page is allowed).
        softmax_scale: defaults to 1/sqrt(D).
        block_size: past tokens per processing block (memory bound), in tokens.
        q_doc_start: optional int [C]: for packed documents, the absolute token index where each
            query's document starts (past tokens are 0..past_len-1, own token i is past_len+i);
            keys before it are masked out and past pages wholly before every query's document
            are skipped. None = one document.
        past_start: first past token attended (tokens, 0 <= past_start <= past_len): only past
            tokens [past_start, past_len) are read, through ``block_table[t // S]`` (entries for
            earlier pages are never read). Own tokens stay at absolute index past_len + i.
        include_own: False = leave out the chunk's own keys (a past-only part; needs
            past_start < past_len). Parts are merged by the caller with the log-sum-exp rule.
        out_dtype: dtype of ``out`` (default q's); a float32/float64 part output avoids a
            rounding before the merge.

    Returns:
        out: [C, Hq, D] in ``out_dtype``. A row that sees no key (possible only with
            include_own=False and packed documents) is 0.
        lse: [Hq, C] log-sum-exp of the scaled scores, float32 (float64 for float64 q); -inf
            for a row that sees no key.

    Raises:
        ValueError: on inconsistent shapes, Hq not a multiple of Hkv, a block_table too short,
            or past_start outside [0, past_len] (or equal to past_len with include_own=False).
    """
    _check(q, k, v, k_cache, v_cache, block_table, past_len)
    _check_part(past_start, past_len, include_own)
    C, Hq, D = q.shape
    Hkv = k.shape[1]
    acc = acc_dtype_for(q.dtype)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    qg = _to_groups(q, Hkv, acc)  # [Hkv, G*C, D]
    masks = _Masks(C, qg.shape[1] // C, past_len, q_doc_start, q.device)

    if include_own:
        # Own chunk, causal: row r (query r % C) sees own keys j <= r % C.
        ko = k.to(acc).permute(1, 0, 2)
        vo = v.to(acc).permute(1, 0, 2)
        s = torch.matmul(qg, ko.transpose(1, 2)) * scale  # [Hkv, G*C, C]
        s.masked_fill_(masks.own(), float("-inf"))
        lse = torch.logsumexp(s, dim=-1)  # [Hkv, G*C]
        out = torch.matmul(torch.exp(s - lse[..., None]), vo)
        del s
    else:
        lse = torch.full(qg.shape[:2], float("-inf"), dtype=acc, device=q.device)
        out = torch.zeros_like(qg)

    for start in range(masks.first_past_token(block_size, past_start), past_len, block_size):
        end = min(past_len, start + block_size)
        kb = _gather_past(k_cache, block_table, start, end, acc)
        vb = _gather_past(v_cache, block_table, start, end, acc)
        s = torch.matmul(qg, kb.transpose(1, 2)) * scale
        mask = masks.past(start, end)
        if mask is not None:
            s.masked_fill_(mask, float("-inf"))
        lse_b = torch.logsumexp(s, dim=-1)
        # A row with every key masked has lse_b = -inf: give it zero weight, not NaN.
        out_b = torch.matmul(torch.exp(s - torch.where(torch.isinf(lse_b), 0.0, lse_b)[..., None]), vb)
        del s
        if include_own:
            new_lse = torch.logaddexp(lse, lse_b)
            out = out * torch.exp(lse - new_lse)[..., None] + out_b * torch.exp(lse_b - new_lse)[..., None]
            lse = new_lse
        else:  # lse may still be -inf here
            out, lse = _merge(out, lse, out_b, lse_b)

    out_CHD = _from_groups(out, C).to(out_dtype or q.dtype)
    lse_HC = lse.view(Hkv, Hq // Hkv, C).reshape(Hq, C)
    return out_CHD, lse_HC


def _bwd_impl(
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
    block_size: int = 4096,
    q_doc_start: torch.Tensor | None = None,
    past_start: int = 0,
    include_own: bool = True,
    dq_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Backward of :func:`paged_attention_fwd_ref`, or of one part of it.

    Args:
        dout: [C, Hq, D] gradient of ``out``.
        q, k, v, out, lse: as given to / returned by the forward.
        k_cache, v_cache, block_table, past_len: as in the forward.
        dk_cache, dv_cache: [P, S, Hkv, D] gradient page pools (float32 or float64). The past
            pages' dK/dV are ADDED here in place, outside autograd.
        q_doc_start: as in the forward.
        past_start, include_own: the part (as in the forward). ``out`` and ``lse`` must be the
            FINAL output and log-sum-exp over all parts (delta = rowsum(dout * out) and
            p = exp(s - lse) then give this part's exact share); only the dK/dV of past tokens
            [past_start, past_len) are added, and dq is this part's contribution (the caller
            sums the parts).
        dq_dtype: dtype of ``dq`` (default q's); float32/float64 keeps a part unrounded for the sum.

    Returns:
        dq: [C, Hq, D] in ``dq_dtype``.
        dk, dv: [C, Hkv, D] in k's dtype -- the own chunk's contribution only (the caller adds
            whatever later chunks already stored in the chunk's own gradient pages); None
            when include_own=False.

    Raises:
        ValueError: on inconsistent shapes, past_len > 0 without gradient pools, or a bad part.
    """
    _check(q, k, v, k_cache, v_cache, block_table, past_len)
    _check_part(past_start, past_len, include_own)
    if past_len > 0 and (dk_cache is None or dv_cache is None or dk_cache.shape != k_cache.shape):
        raise ValueError("past_len > 0 needs dk_cache/dv_cache with the same shape as k_cache")
    C, Hq, D = q.shape
    Hkv = k.shape[1]
    acc = acc_dtype_for(q.dtype)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    qg = _to_groups(q, Hkv, acc)
    dog = _to_groups(dout, Hkv, acc)
    delta = (dog * _to_groups(out, Hkv, acc)).sum(-1)  # [Hkv, G*C]
    lse_g = lse.to(acc).reshape(Hkv, -1)  # [Hkv, G*C] (head-major rows, matches _to_groups)

    def block_grads(kb, vb, mask=None):
        s = torch.matmul(qg, kb.transpose(1, 2)) * scale
        if mask is not None:
            s.masked_fill_(mask, float("-inf"))
        p = torch.exp(s - lse_g[..., None])
        del s
        dvb = torch.matmul(p.transpose(1, 2), dog)  # [Hkv, n, D] (sums over the query group)
        ds = p * (torch.matmul(dog, vb.transpose(1, 2)) - delta[..., None])
        del p
        dqb = torch.matmul(ds, kb) * scale
        dkb = torch.matmul(ds.transpose(1, 2), qg) * scale
        return dqb, dkb, dvb

    ko = k.to(acc).permute(1, 0, 2)
    vo = v.to(acc).permute(1, 0, 2)
    masks = _Masks(C, qg.shape[1] // C, past_len, q_doc_start, q.device)
    if include_own:
        dq, dk_own, dv_own = block_grads(ko, vo, masks.own())
    else:
        dq = torch.zeros_like(qg)
        dk_own = dv_own = None

    S = k_cache.shape[1] if past_len > 0 else 1
    for start in range(masks.first_past_token(block_size, past_start), past_len, block_size):
        end = min(past_len, start + block_size)
        kb = _gather_past(k_cache, block_table, start, end, acc)
        vb = _gather_past(v_cache, block_table, start, end, acc)
        dqb, dkb, dvb = block_grads(kb, vb, masks.past(start, end))
        dq += dqb
        # Scatter [Hkv, n, D] back into whole pages and add in place.
        p0, p1 = start // S, -(-end // S)
        pages = block_table[p0:p1].long()
        for src, dst in ((dkb, dk_cache), (dvb, dv_cache)):
            buf = torch.zeros((p1 - p0) * S, Hkv, D, dtype=dst.dtype, device=dst.device)
            buf[start - p0 * S : end - p0 * S] = src.permute(1, 0, 2).to(dst.dtype)
            dst.index_add_(0, pages, buf.view(p1 - p0, S, Hkv, D))

    if not include_own:
        return _from_groups(dq, C).to(dq_dtype or q.dtype), None, None
    return (
        _from_groups(dq, C).to(dq_dtype or q.dtype),
        dk_own.permute(1, 0, 2).to(k.dtype),
        dv_own.permute(1, 0, 2).to(v.dtype),
    )


def paged_attention_fwd_ref(
    q, k, v, k_cache, v_cache, block_table, past_len, softmax_scale=None, block_size=4096, q_doc_start=None,
    past_start=0, include_own=True, out_dtype=None,
):
    with _matmul_precision(q.dtype, q.device):
        return _fwd_impl(
            q, k, v, k_cache, v_cache, block_table, past_len, softmax_scale, block_size, q_doc_start, past_start,
            include_own, out_dtype,
        )


def paged_attention_bwd_ref(
    dout, q, k, v, out, lse, k_cache, v_cache, block_table, past_len, dk_cache, dv_cache, softmax_scale=None,
    block_size=4096, q_doc_start=None, past_start=0, include_own=True, dq_dtype=None,
):
    with _matmul_precision(q.dtype, q.device):
        return _bwd_impl(
            dout, q, k, v, out, lse, k_cache, v_cache, block_table, past_len, dk_cache, dv_cache, softmax_scale,
            block_size, q_doc_start, past_start, include_own, dq_dtype,
        )


paged_attention_fwd_ref.__doc__ = _fwd_impl.__doc__
paged_attention_bwd_ref.__doc__ = _bwd_impl.__doc__
