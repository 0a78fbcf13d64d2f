"""Chunked cross-entropy: logits never exist for more than ``block`` tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["IGNORE_INDEX", "chunked_cross_entropy_sum", "target_logprobs"]

IGNORE_INDEX = -100


def _block_loss(lm_head: torch.nn.Module, h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    logits = lm_head(h)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits, t, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy_sum(
    hidden: torch.Tensor, lm_head: torch.nn.Module, targets: torch.Tensor, block: int
) -> torch.Tensor:
    """Sum of token cross-entropies, computed ``block`` tokens at a time.

    Each block's logits are recomputed in backward (activation checkpointing), so at most
    one block of logits ([block, vocab] float32) is alive at any time.

    Args:
        hidden: [n, hidden_size] final hidden states (after the final norm).
        lm_head: the output projection.
        targets: int64 [n] next-token ids, IGNORE_INDEX (-100) where no loss is taken.
        block: tokens per logits block.

    Returns:
        A 0-dim float32 tensor (float64 for a float64 model) (sum over valid tokens, 0 when none are valid), connected to
        ``hidden``'s graph in either case.
    """
    total = hidden.new_zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32))
    if not bool((targets != IGNORE_INDEX).any()):
        # No label here: still connect to the graph so backward reaches the attention, whose
        # backward injects the K/V gradient later chunks stored for this chunk.
        return total + hidden.sum().float() * 0.0
    for s in range(0, hidden.shape[0], block):
        t = targets[s : s + block]
        if not bool((t != IGNORE_INDEX).any()):
            continue
        h = hidden[s : s + block]
        if torch.is_grad_enabled() and h.requires_grad:
            total = total + checkpoint(_block_loss, lm_head, h, t, use_reentrant=False)
        else:
            total = total + _block_loss(lm_head, h, t)
    return total


def target_logprobs(
    hidden: torch.Tensor, lm_head: torch.nn.Module, targets: torch.Tensor, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each valid target and whether it is the most likely token, ``block`` rows at a time.

    Only the rows whose target is not IGNORE_INDEX go through ``lm_head`` (no gradients are kept).

    Args:
        hidden: [n, hidden_size] final hidden states (after the final norm).
        lm_head: the output projection.
        targets: int64 [n] next-token ids, IGNORE_INDEX (-100) where nothing is scored.
        block: rows per logits block.

    Returns:
        ``(logprobs, greedy)``: float32 (float64 for a float64 model) ``[k]`` ``log_softmax(logits)[target]`` and
        bool ``[k]`` ``argmax(logits) == target`` (the first maximum on ties) for the k valid rows, in row order.
    """
    rows = (targets != IGNORE_INDEX).nonzero().view(-1)
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    logprobs, greedy = [hidden.new_zeros(0, dtype=dtype)], [torch.zeros(0, dtype=torch.bool, device=hidden.device)]
    with torch.no_grad():
        for s in range(0, rows.numel(), block):
            r = rows[s : s + block]
            logits = lm_head(hidden[r]).to(dtype)
            t = targets[r]
            logprobs.append(torch.log_softmax(logits, dim=-1).gather(1, t.view(-1, 1)).view(-1))
            greedy.append(logits.argmax(dim=-1) == t)
    return torch.cat(logprobs), torch.cat(greedy)
