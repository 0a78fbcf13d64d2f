"""``oomb plan``: the memory plan of a run, without running it, and the plan ``oomb train`` checks first.

Both build it with :func:`oomb.planner.plan_for_config` from the same :class:`oomb.config.OOMBConfig`, so a
plan and a training run given the same flags or the same ``--config`` file describe the same run.
"""

from __future__ import annotations

import argparse
import re
import sys

from .checks import (
    _check_lora_targets,
    _flag_names,
    _usage_from,
    _warn_if_offload_moves_nothing,
    _warn_if_offload_on_keeps_every_page,
    _warn_if_offload_segments_are_small,
    _warn_if_segment_pages_unused,
    _warn_if_sparse_is_dense,
)

GiB = 1024**3


def job_plan(args: argparse.Namespace, dtype, optimizer: str | None = "job", machine=None, nproc: int | None = None):
    """The :class:`oomb.planner.MemoryPlan` of the job ``args.job`` (model, sequence length, LoRA rank, engine
    settings, ``train.shard``) with ``optimizer`` ('job': the job's ``train.optimizer``; None: no optimizer
    states), for ``machine`` (None: this one), per rank of ``nproc`` (None: the job's ``plan.nproc``)."""
    from ..planner import plan_for_config

    job = args.job
    if optimizer == "job":
        optimizer = job.train.optimizer
    m = job.model
    return plan_for_config(m.name, job.data.seq_len, job.engine, dtype=dtype, lora_rank=m.lora_rank,
                           lora_targets=m.lora_targets, train_embeddings_norms=m.train_embeddings_norms,
                           optimizer=optimizer, machine=machine, shard=job.train.shard,
                           nproc=job.plan.nproc if nproc is None else nproc)


def _refuse_bad_setting(p) -> None:
    """Refuse the plan ``p`` as bad input (exit status 2) where its settings fit no machine
    (:attr:`oomb.planner.MemoryPlan.bad_setting`: a --gpu-page-budget below the smallest pool the run stages
    through): ``oomb plan`` and ``oomb train`` alike, where a run too large for the machine is plan's exit 1."""
    if p.bad_setting:
        raise _usage_from(ValueError(p.bad_setting), "see 'oomb plan --help'")


def _machine(args: argparse.Namespace):
    """(the machine to plan for, a note or None): this one, or the GPU memory and host RAM of --gpu-gib /
    --host-gib; the note says where the host RAM comes from when it is this machine's and there is no GPU here.

    Raises:
        ValueError: without a visible CUDA GPU and without --gpu-gib (there is no GPU to plan for).
    """
    from ..memory import Machine

    machine = Machine.detect()
    if args.gpu_gib is None and machine.gpu_total_bytes == 0:
        raise ValueError("no CUDA GPU is visible, so there is no GPU memory to plan for; pass --gpu-gib G and --host-gib H "
                         "(the free GPU memory and the available host RAM, in GiB, of the machine to plan for)")
    if args.gpu_gib is None and args.host_gib is None:
        return machine, None
    gpu = int(args.gpu_gib * GiB) if args.gpu_gib is not None else machine.gpu_free_bytes
    host = int(args.host_gib * GiB) if args.host_gib is not None else machine.host_available_bytes
    note = None
    if args.host_gib is None and machine.gpu_total_bytes == 0:
        # planning for another machine (no GPU here): this one's RAM is most likely not that machine's
        note = (f"oomb: note: --host-gib not given, so the host budget comes from this machine's available RAM "
                f"({host / GiB:.1f} GiB); pass --host-gib H for the machine you plan for")
    return Machine(gpu, max(gpu, machine.gpu_total_bytes if args.gpu_gib is None else gpu), host,
                   max(host, machine.host_total_bytes), "given" if args.gpu_gib is not None else machine.gpu_name,
                   f"--host-gib {args.host_gib:g}" if args.host_gib is not None else machine.host_name), note


def _plan(args: argparse.Namespace) -> int:
    """``oomb plan``: print the predicted memory of a run on a GPU (``--device`` is cuda unless the file or the flag
    says cpu, which is refused: a CPU run has no GPU memory or pinned tier to plan); 0 if it fits, 1 if not, 2 on
    bad input (a model ``oomb train`` refuses and a setting that fits no machine included: one line, no table, no
    note or warning). A --seq-len beyond the model's max_position_embeddings is warned about on stderr (as
    ``oomb train`` does)."""
    try:
        from ..config import resolve_dtype
        from ..models.limits import context_length_warning, lora_rank_problem
        from .inputs import _model_config

        config = _model_config(args, "plan")  # an unknown model, or one oomb train refuses, is the first thing to say
        lora_problem = lora_rank_problem(config, args.lora_rank, args.model)
        if lora_problem:
            raise ValueError("; ".join(lora_problem))
        if args.lora_rank:
            _check_lora_targets(config, args)
        if args.device != "cuda":
            raise ValueError("oomb plan plans a run on a GPU (its GPU memory and pinned host tier), and this run's "
                             "device is cpu; pass --device cuda, or set model.device: cuda in the --config file "
                             "(a plan needs no GPU on this machine)")
        machine, note = _machine(args)
        shard_note = None
        if args.shard != "none" and args.nproc == 1:
            shard_note = (f"oomb: note: --shard {args.shard} shards over ranks but --nproc is 1: planned as one "
                          "process (as --shard none); pass --nproc N for one rank of N")
        warning = context_length_warning(config, args.seq_len, args.model)
        p = job_plan(args, resolve_dtype(args.dtype, args.device), optimizer=None if args.no_optimizer else "job",
                     machine=machine)
    except ValueError as exc:  # MemoryPlanError, UnknownModelError, UnsupportedModelError
        raise _usage_from(exc, "see 'oomb plan --help'") from exc
    _refuse_bad_setting(p)
    # every refusal is behind: a note or warning never comes with an error line
    _warn_if_segment_pages_unused(args)
    for line in (note, shard_note, warning):
        if line:
            print(line, file=sys.stderr)
    text = _flag_names(p.table())  # the planner speaks in config fields; the command line in flags
    if args.gpu_gib is not None:  # the GPU is the one --gpu-gib describes
        text = re.sub(r"use a GPU with more than ([\d.]+) GiB free", r"pass a --gpu-gib above \1 (a GPU with more free "
                      r"memory)", text)
    print(text)
    if p.fits:  # a refused plan has said what is wrong with the budget already
        offloads = bool(p.tiering.offload)
        _warn_if_offload_moves_nothing(args, p.shape.num_layers)
        _warn_if_offload_on_keeps_every_page(args, offloads, p.shape.num_layers)
        _warn_if_offload_segments_are_small(args, offloads)
    _warn_if_sparse_is_dense(args)
    return 0 if p.fits else 1
