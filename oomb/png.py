"""Which picture a PNG file is: oomb writes its pictures with a ``Software`` and a ``Title`` text chunk, so that a
later command replaces only the kind of picture it writes itself (a run's loss curve is never taken for a heatmap,
nor a user's photo for a histogram).

:func:`png_metadata` gives the chunks to pass to matplotlib's ``savefig(metadata=...)``; :func:`png_kind` reads
them back with Pillow (a dependency of matplotlib).
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

__all__ = ["KINDS", "SOFTWARE", "missing_glyphs_drawn_as_boxes", "png_kind", "png_metadata"]

SOFTWARE = "oomb"
"""The ``Software`` text chunk of every PNG oomb writes."""

KINDS = {
    "histogram": "oomb example-length histogram",
    "heatmap": "oomb retrieval heatmap",
    "loss": "oomb loss curve",
}
"""Picture kind -> its ``Title`` text chunk."""


def png_metadata(kind: str) -> dict[str, str]:
    """The PNG text chunks of an oomb picture of ``kind`` (a key of :data:`KINDS`), for ``savefig(metadata=...)``.

    Raises:
        KeyError: ``kind`` is not one of :data:`KINDS`.
    """
    return {"Software": SOFTWARE, "Title": KINDS[kind]}


@contextlib.contextmanager
def missing_glyphs_drawn_as_boxes():
    """Within it, matplotlib draws a character its font lacks (a title naming a folder in CJK script) as a box
    without its warning, one per character and draw, which the commands would print as warnings of theirs."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Glyph \d+ .*missing from font", category=UserWarning)
        yield


def png_kind(path: str | Path) -> str | None:
    """The kind (a key of :data:`KINDS`) of the oomb picture at ``path``, or None when the file is not a PNG that
    oomb wrote (another program's image, an unreadable or damaged PNG, or a picture without oomb's chunks)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            chunks = dict(getattr(image, "text", {}) or {})
    except (OSError, UnidentifiedImageError, ValueError, SyntaxError):
        return None
    if chunks.get("Software") != SOFTWARE:
        return None
    return next((kind for kind, title in KINDS.items() if chunks.get("Title") == title), None)
