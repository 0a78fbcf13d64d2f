"""GPU and host bytes of the parts of one chunk-recurrent training step, computed before anything is allocated.

From the model shape, the context length and the engine settings these functions give the parts of the peak
GPU memory of one step (what ``torch.cuda.max_memory_allocated`` reports); :mod:`oomb.memory.tiering` places the
KV pages (docs/design.md §2.3) and :mod:`oomb.planner` adds the parts up into a plan.

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
recomputed; with ``checkpoint_attention='keep'`` (the default) also each layer's
attention output and lse (e q + 4 Hq per token; :mod:`oomb.engine.kept_attention`):
Qwen2.5-7B, bf16, chunk 4096: 0.77 GiB of layer inputs + 0.78 GiB of attention
outputs + 0.87 GiB for the layer being recomputed.

**Attention temporaries.** The PyTorch reference backward holds three fp32
score-sized tensors (s, p, ds) of ``Hq x C x W`` (W = max(C, min(block, past)))
plus ~6 fp32 ``C x q`` copies: 5.25 + 0.33 GiB at C = 4096, Hq = 28. The Triton
kernels keep only an fp32 ``dq`` and ``delta`` (2 x C x q x 4 B; to be
measured). The fused (cuDNN) path adds, per call over up to ``MAX_RUN_TOKENS`` past
tokens, ``2 e (kv + q)`` bytes per past token (measured: 4 (q + kv) B in bf16 for three
GQA shapes, ``benchmarks/results/sdpa_backward_memory_h200.jsonl``): 2.0 GiB for
Qwen2.5-7B. **Loss temporaries:** one block of logits, ``loss_chunk x V x (2e + 8)``.

Calibration (H200, Qwen2.5-7B, bf16, chunk 4096, torch reference, no per-layer
checkpointing): measured peak minus KV store 58.36 GiB at 32K and 128K;
predicted 14.19 + 14.19 (weights, grads) + 24.28 + 5.25 + 0.33 + 0.10 = 58.3 GiB.

Offload GPU tier: ``L x R`` resident pages + two staging buffers of ``min(SP, n - R)`` pages (SP =
``offload_segment_pages``, 32K tokens by default; with whole-layer staging ``K`` = 2 to 4 buffers of ``n - R``,
:func:`oomb.memory.tiering.choose_staging_sets`, 2 where more would overflow the host budget) + two one-chunk
own-gradient (dK, dV) and two one-chunk K/V write buffers: flat in the context length with segments.
Segmented attention adds ~3 fp32 ``C x q`` temporaries (part output, merge, dq parts; ~170 MiB for
Qwen2.5-7B at C = 4096), not counted below (the GPU reserve covers them).

Host tier: ``L x (n - R)`` pages in pinned memory, where ``n`` pages per
layer and ``R`` resident (:mod:`oomb.engine.offload`). The host budget is a
fraction (default 0.75) of available RAM: 96 GiB could be pinned on the H200
host with 125 GiB (docs/design.md §2.3).
"""

from __future__ import annotations

from typing import Any

import torch

from ..ops.attention_ref import acc_dtype_for
from ..ops.sdpa_attention import MAX_RUN_TOKENS
from .shape import LORA_TARGETS, GiB, ModelShape, dtype_size
from .optimizer import optimizer_bytes
from .sharding import shard_bytes

__all__ = [
    "activation_bytes",
    "base_gpu_bytes",
    "page_bytes",
    "saved_attention_bytes",
    "sparse_headroom_bytes",
    "sparse_state_bytes",
]

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
    lora_targets: Any = LORA_TARGETS,
    keep_attention: bool = True,
) -> dict[str, int]:
    """Peak bytes of one Stage-2 chunk's activations and temporaries (see the module docstring).

    Args:
        max_past: longest past in tokens (T - chunk); None = at least one attention block.
        lora_targets: the layers LoRA adapts ('all-linear' or names; :meth:`ModelShape.lora_targets`).
        keep_attention: with ``checkpoint_layers``, the attention outputs and lse of every layer are kept across
            the layer checkpoints (``checkpoint_attention='keep'``): "kept_attention". Unused without.

    Returns:
        {"saved": ..., "kept_attention": ..., "attention_temp": ..., "loss_temp": ..., "other": ..., "total": ...}
        in bytes.
    """
    e, a = dtype_size(dtype), 4
    acc = 8 if dtype == torch.float64 else 4
    h, i, q, kv = shape.hidden_size, shape.intermediate_size, shape.q_dim, shape.kv_dim
    C, L = chunk_size, shape.num_layers
    per_layer = 2 * (a + e) * h + 4 * e * q + 4 * e * kv + 4 * e * i
    if shape.qk_norm:
        per_layer += (a + e) * (q + kv)
    if lora_rank:
        per_layer += len(shape.lora_targets(lora_targets)) * 4 * lora_rank  # fp32 adapter activations (A outputs)
    kept = 0
    if checkpoint_layers:
        saved = L * C * e * h + C * per_layer
        if keep_attention:  # out [C, Hq, D] and an fp32 (fp64) lse [Hq, C] per layer
            kept = L * C * (e * q + acc * shape.num_heads)
    else:
        saved = L * C * per_layer
    if attention_backend == "torch":
        past = attention_block_size if max_past is None else max_past
        width = max(C, min(attention_block_size, past))
        attn = 3 * shape.num_heads * C * width * acc + 6 * C * q * acc
    else:
        attn = 2 * C * q * acc
        if attention_backend == "sdpa":
            # One call's backward over at most MAX_RUN_TOKENS past tokens holds the past's dK/dV in the model dtype
            # (before they are added into the float32 pages) and, with GQA, dK/dV of every query head: 2 e (kv + q)
            # per past token, measured (oomb.ops.sdpa_attention.MAX_RUN_TOKENS); each part's out/dq in the model
            # dtype before the merge.
            attn += 2 * min(max_past or 0, MAX_RUN_TOKENS) * (kv + q) * e + 2 * C * q * e
    loss = min(loss_chunk_size, C) * shape.vocab_size * (2 * e + 8)
    other = C * h * (a + 2 * e)  # final norm and the hidden state's gradient
    total = saved + kept + max(attn, loss) + other
    return {"saved": saved, "kept_attention": kept, "attention_temp": attn, "loss_temp": loss, "other": other,
            "total": total}



def page_bytes(shape: ModelShape, page_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV page of one layer: K and V in ``dtype``, dK and dV in float32 (float64 for a float64 model)."""
    g = 8 if dtype == torch.float64 else 4
    return page_size * shape.kv_dim * 2 * (dtype_size(dtype) + g)


def base_gpu_bytes(shape, seq_len, chunk_size, dtype, lora_rank, optimizer, checkpoint_layers, attention_backend,
                   attention_block_size, loss_chunk_size, grad_accum_dtype="param", lora_targets=LORA_TARGETS,
                   train_embeddings_norms=False, keep_attention=True, shard="none", nproc=1):
    """``(num_params, trainable, weights, grads, optimizer, activations)`` of a step: parameter counts, bytes of the
    weights, gradients and the optimizer's GPU states (:func:`oomb.memory.optimizer.optimizer_bytes`; ``optimizer``
    None: 0), and the :func:`activation_bytes` dict of one chunk. With LoRA, ``lora_targets`` are the adapted
    layers and ``train_embeddings_norms`` adds a trained copy (in ``dtype``) of the embeddings and norms;
    ``keep_attention`` as :func:`activation_bytes`'s. ``shard`` ('none', 'params', 'grads-optim') over ``nproc``
    ranks: the weights, gradients and states are one rank's (:func:`oomb.memory.sharding.shard_bytes`)."""
    n_params = shape.num_params()
    e = dtype_size(dtype)
    if lora_rank:
        adapter = shape.lora_params(lora_rank, lora_targets)
        copies = shape.embedding_norm_params() if train_embeddings_norms else 0
        trainable = adapter + copies
        weights = n_params * e + adapter * 4 + copies * e  # peft keeps bf16/fp16 adapters in float32
        grads = adapter * 4 + copies * e
    else:
        trainable = n_params
        weights = n_params * e
        # grad_accum_dtype='float32': bf16/fp16 gradients are summed in float32 during the step (4 B each).
        grads = n_params * (4 if grad_accum_dtype == "float32" and e < 4 else e)
    optim = optimizer_bytes(shape, dtype, lora_rank, optimizer, lora_targets, train_embeddings_norms).gpu
    if shard != "none" and nproc > 1:
        per_rank = shard_bytes(shape, dtype, shard, nproc, lora_rank, lora_targets, train_embeddings_norms, optimizer,
                               grad_accum_dtype)
        weights, grads, optim = per_rank.weights, per_rank.grads, per_rank.optimizer
    # A sequence shorter than the chunk is one chunk of seq_len tokens: activations for those only.
    act = activation_bytes(shape, min(chunk_size, seq_len), dtype, checkpoint_layers, attention_backend,
                           attention_block_size, loss_chunk_size, max(seq_len - chunk_size, 0), lora_rank, lora_targets,
                           keep_attention)
    return n_params, trainable, weights, grads, optim, act



def sparse_state_bytes(shape: "ModelShape", seq_len: int, config: Any, dtype: torch.dtype) -> int:
    """GPU bytes of the sparse state of one step (an upper bound): page representatives plus selections.

    Representatives: ``L * ceil(T / page_size) * Hkv * D`` values in the accumulation dtype (fp32 for
    half inputs), twice for the 'quest' score (min and max). Selections: int32 ``[nb, Hkv, K]`` page ids
    plus ``[nb, Hkv]`` counts per (chunk, layer), ``nb = ceil(T / sparse_block_size)`` blocks in all,
    ``K = min(page_budget + sink_pages + local_pages, pages - 1)`` (a selection holds at most its past pages:
    :func:`oomb.ops.sparse_select.select_pages`). Returns 0 unless ``config.sparse``.
    """
    if not config.sparse:
        return 0
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

    Without ``checkpoint_layers`` a 1M-token sparse + offload step on an H200 ran out of memory in Stage 2 with the
    plain reserve. With it, H200 steps (Qwen2.5-7B, chunk 4096; 64K, 256K, 1M tokens) measured 2.77-2.80 GiB of
    activations at the peak against 3.48 GiB estimated by :func:`activation_bytes` (the attention recomputed in
    each layer's rerun: ``checkpoint_attention='recompute'``), and 2.6-2.9 GiB of allocator
    cache above the allocated peak, within the 3% reserve (4.2 GiB).
    """
    return 0 if checkpoint_layers else 4 * GiB



def saved_attention_bytes(num_layers: int, num_heads: int, head_dim: int, seq_len: int, chunk_size: int,
                          dtype_bytes: int, where: str) -> dict[str, int]:
    """Bytes kept by ``save_attention=where`` for one step of ``seq_len`` tokens.

    Returns:
        ``{"gpu": device bytes, "host": host bytes}``: every chunk but the last, all layers, one
        ``[C, Hq, D]`` out (``dtype_bytes`` each) and one float32 ``[Hq, C]`` lse (float64 for a
        float64 model, ``dtype_bytes`` 8); "host" keeps
        them on the host and two chunks' worth on the device. Zeros for "off" or a single chunk.
    """
    if where == "off":
        return {"gpu": 0, "host": 0}
    chunks = -(-seq_len // chunk_size) - 1
    per_chunk = num_layers * chunk_size * num_heads * (head_dim * dtype_bytes + max(4, dtype_bytes))
    if where == "gpu":
        return {"gpu": chunks * per_chunk, "host": 0}
    return {"gpu": min(2, chunks) * per_chunk, "host": chunks * per_chunk}
