"""What the training data holds once packed: examples, tokens, trained tokens, padding, what was dropped."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["DataStats", "counted"]


def counted(n: int, noun: str) -> str:
    """``n`` with its noun in the number it needs: "1 example", "1,200 examples"."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


@dataclass(frozen=True)
class DataStats:
    """Counts of one training set (tokens are token ids).

    ``examples``: documents (text) or rows (chat, prompt/completion) read. ``tokens``: tokens of those
    examples. ``sequences``: training sequences of ``seq_len`` tokens. ``trained_tokens``: positions of all the
    sequences that are a loss target (as :meth:`oomb.Engine.count_valid_tokens` counts them: a label that is
    not -100 and not the first token of a document). ``padding``: filler tokens at the end of the sequences
    (no loss). ``split_examples``: examples longer than ``seq_len`` cut over several sequences.
    ``dropped_examples`` / ``dropped_tokens``: examples left out (longer than ``seq_len`` with
    ``long_examples`` drop, or no trained token) and their tokens, plus the tail of a text stream shorter than
    one sequence. ``split_unused_tokens``: tokens of the pieces of split examples left out because none of their
    tokens is trained (e.g. the prompt-only start of a long chat), not counted in ``dropped_tokens``.
    """

    format: str
    examples: int
    tokens: int
    sequences: int
    seq_len: int
    trained_tokens: int
    padding: int
    split_examples: int
    dropped_examples: int
    dropped_tokens: int
    split_unused_tokens: int = 0

    @property
    def trained_share(self) -> float:
        """Trained tokens / all sequence positions (0..1)."""
        return self.trained_tokens / max(1, self.sequences * self.seq_len)

    def as_dict(self) -> dict:
        return {**asdict(self), "trained_share": round(self.trained_share, 6)}

    def summary(self) -> str:
        """One line for the start of a run."""
        what = "document" if self.format == "text" else "example"
        parts = [f"data: {counted(self.examples, what)} ({self.format}), {self.tokens:,} tokens -> "
                 f"{counted(self.sequences, 'sequence')} of {self.seq_len:,}",
                 f"{self.trained_tokens:,} trained tokens ({100 * self.trained_share:.1f}%)",
                 f"{self.padding:,} padding"]
        if self.split_examples:
            unused = (f" ({self.split_unused_tokens:,} tokens of their pieces without a trained token left out)"
                      if self.split_unused_tokens else "")
            parts.append(f"{counted(self.split_examples, what)} split over sequences{unused}")
        if self.dropped_examples:
            parts.append(f"{counted(self.dropped_examples, what)} dropped ({self.dropped_tokens:,} tokens)")
        elif self.dropped_tokens:
            parts.append(f"{self.dropped_tokens:,} tokens of the tail unused")
        return "; ".join(parts)
