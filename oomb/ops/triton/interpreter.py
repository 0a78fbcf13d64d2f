"""Whether oomb's kernels run in Triton's interpreter (on CPU tensors) or compiled for a GPU.

Triton decides when it decorates a function: under ``TRITON_INTERPRET=1`` (which must be set before
``triton`` is first imported) ``@triton.jit`` returns an interpreted function, else a compiled one. This
module asks Triton how it decorated a probe, so it agrees with the kernels defined next to it (the
interpreter runs programs on CPU tensors, with every product in fp32: its bf16 ``tl.dot`` is wrong).
"""

from __future__ import annotations

import triton
from triton.runtime.interpreter import InterpretedFunction

__all__ = ["INTERPRET"]


@triton.jit
def _probe():
    pass


INTERPRET: bool = isinstance(_probe, InterpretedFunction)
"""True when ``@triton.jit`` builds interpreted functions (the kernels then take CPU tensors)."""
