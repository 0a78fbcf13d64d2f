"""Test helper: an :class:`oomb.OOMBConfig` from the flat keywords the tests pass around.

Tests build many engine configurations from small dicts (``dict(chunk_size=8, page_size=4, sparse=True,
page_budget=2)``) that they combine and override; this maps those keywords onto the sections of the config
(``sparse_score`` -> ``sparse.score``, ``offload_segment_pages`` -> ``offload.segment_pages``, ...). Sectioned
values (a SparseConfig, an OffloadConfig) pass through.
"""

from __future__ import annotations

from oomb.config import KernelConfig, OffloadConfig, OOMBConfig, SparseConfig

_SPARSE = {"page_budget": "page_budget", "sink_pages": "sink_pages", "local_pages": "local_pages",
           "sparse_score": "score", "sparse_block_size": "block_size"}
_OFFLOAD = {"gpu_page_budget": "gpu_page_budget", "offload_staging_sets": "staging_sets",
            "offload_segment_pages": "segment_pages", "offload_stage_grain": "stage_grain",
            "offload_stage1_shadow": "stage1_shadow", "offload_copy_streams": "copy_streams",
            "offload_kv_stash_mib": "kv_stash_mib"}
_KERNELS = {f.name for f in KernelConfig.__dataclass_fields__.values()}


def engine_config(**kw) -> OOMBConfig:
    """``OOMBConfig`` of flat keywords: ``sparse`` True/False/SparseConfig with the sparse options beside it,
    ``offload`` True/False/'auto'/OffloadConfig with the offload options beside it, kernel fields beside them."""
    sparse = kw.pop("sparse", None)
    sp = {_SPARSE[k]: kw.pop(k) for k in list(kw) if k in _SPARSE}
    if isinstance(sparse, SparseConfig):
        sparse = SparseConfig(**{**sparse.__dict__, **sp})
    elif sparse:
        sparse = SparseConfig(**sp)
    elif sp:
        raise ValueError(f"sparse options {sorted(sp)} without sparse=True")
    else:
        sparse = None
    offload = kw.pop("offload", "auto")
    off = {_OFFLOAD[k]: kw.pop(k) for k in list(kw) if k in _OFFLOAD}
    if isinstance(offload, OffloadConfig):
        offload = OffloadConfig(**{**offload.__dict__, **off})
    else:
        mode = {True: "on", False: "off"}.get(offload, offload)
        offload = OffloadConfig(mode=mode, **off)
    kernels = kw.pop("kernels", None) or KernelConfig(**{k: kw.pop(k) for k in list(kw) if k in _KERNELS})
    return OOMBConfig(sparse=sparse, offload=offload, kernels=kernels, **kw)
