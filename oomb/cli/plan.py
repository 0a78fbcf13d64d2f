"""``oomb plan``: the memory plan of a run, without running it."""

from __future__ import annotations

import argparse
import sys

from .checks import (
    _check_offload_flags,
    _flag_names,
    _usage_from,
    _warn_if_offload_moves_nothing,
    _warn_if_offload_on_keeps_every_page,
    _warn_if_offload_segments_are_small,
    _warn_if_sparse_is_dense,
)


def _plan(args: argparse.Namespace) -> int:
    """``oomb plan``: print the predicted memory of a run; 0 if it fits, 1 if not, 2 on bad input."""
    _check_offload_flags(args)
    import contextlib
    import io

    report = io.StringIO()
    try:
        with contextlib.redirect_stdout(report):  # the planner's advice names Python parameters; print flags
            from ..planner import run_plan

            status = run_plan(args)
    except ValueError as exc:  # MemoryPlanError, UnknownModelError, UnsupportedModelError, config errors
        raise _usage_from(exc, "see 'oomb plan --help'") from exc
    finally:
        sys.stdout.write(_flag_names(report.getvalue()))
    if status == 0:  # a refused plan has said what is wrong with the budget already
        _warn_if_offload_moves_nothing(args, args._num_layers)
        _warn_if_offload_on_keeps_every_page(args, args._plan_offloads, args._num_layers)
        _warn_if_offload_segments_are_small(args, args._plan_offloads)
    _warn_if_sparse_is_dense(args)
    return status
