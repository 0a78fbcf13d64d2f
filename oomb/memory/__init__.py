"""The memory model of a chunk-recurrent training step: the bytes of each of its parts on the GPU and the host,
and where the KV pages live (GPU, or a GPU pool plus pinned host memory).

One computation for every caller: :class:`oomb.Engine` sizes its KV store with :func:`choose_engine_tiering`,
:class:`~oomb.engine.offload.OffloadedKVStore` takes its layout from :mod:`oomb.memory.tiering` and its segment
schedule from :mod:`oomb.memory.schedule`, and ``oomb plan`` (:mod:`oomb.planner`) adds the parts up into a
report. This package imports nothing above it (no engine, planner or CLI).

* :mod:`~oomb.memory.shape`: :class:`ModelShape`, :class:`Machine`, dtype sizes, host RAM.
* :mod:`~oomb.memory.step`: activations, weights/gradients/optimizer states, KV pages, sparse state and
  headroom, saved attention outputs.
* :mod:`~oomb.memory.optimizer`: each optimizer's state bytes on the GPU and on the host.
* :mod:`~oomb.memory.sharding`: one rank's weights, gradients and states under FSDP2 sharding, and its
  collectives' bytes per step.
* :mod:`~oomb.memory.tiering`: segments, staging sets, resident pages, Stage-1 shadow, K/V stash, the tiering.
* :mod:`~oomb.memory.schedule` and :mod:`~oomb.memory.traffic`: the segment schedule and the bytes it copies.
"""

from .optimizer import OPTIMIZER_NAMES, OptimizerBytes, optimizer_bytes, trainable_numels
from .schedule import BufTag, SegmentSchedule, SegUse
from .shape import GiB, Machine, ModelShape, dtype_size, host_memory, is_out_of_memory, parse_dtype
from .sharding import SHARD_MODES, ShardBytes, collective_counts, shard_bytes, shard_traffic, unit_bytes
from .step import (LORA_TARGETS, activation_bytes, base_gpu_bytes, page_bytes, saved_attention_bytes,
                   sparse_headroom_bytes, sparse_state_bytes)
from .tiering import (DEFAULT_SEGMENT_TOKENS, DeviceMemory, EngineTiering, MemoryPlanError, Tiering,
                      allocator_reserve_bytes, choose_engine_tiering, choose_staging_sets, default_segment_pages, fit_tiering,
                      gpu_page_budget_problem, kv_stash_request_bytes, kv_stash_reserve_bytes, kv_stash_tiles,
                      min_gpu_pages, resident_pages_for_budget, resolve_segment_pages, stage1_shadow_pages, staging_pages)
from .traffic import offload_traffic, segment_traffic

__all__ = [
    "BufTag", "DEFAULT_SEGMENT_TOKENS", "DeviceMemory", "EngineTiering", "GiB", "LORA_TARGETS", "Machine",
    "MemoryPlanError", "ModelShape", "OPTIMIZER_NAMES", "OptimizerBytes", "SHARD_MODES", "SegUse", "SegmentSchedule",
    "ShardBytes", "Tiering", "activation_bytes", "allocator_reserve_bytes", "base_gpu_bytes", "collective_counts",
    "choose_engine_tiering", "choose_staging_sets", "default_segment_pages", "dtype_size", "fit_tiering",
    "gpu_page_budget_problem",
    "host_memory", "is_out_of_memory", "kv_stash_request_bytes", "kv_stash_reserve_bytes", "kv_stash_tiles", "min_gpu_pages",
    "offload_traffic", "optimizer_bytes", "page_bytes", "parse_dtype", "resident_pages_for_budget", "resolve_segment_pages",
    "saved_attention_bytes", "segment_traffic", "shard_bytes", "shard_traffic", "sparse_headroom_bytes",
    "sparse_state_bytes", "unit_bytes",
    "stage1_shadow_pages", "staging_pages", "trainable_numels",
]
