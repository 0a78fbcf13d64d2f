"""FSDP2 sharding (oomb.engine.sharding) on the CPU with 2 gloo processes: the gathered gradients equal one process
trained on every rank's sequences, the clip takes the norm over all shards, and FSDP2 all-gathers and
reduce-scatters exactly as often as the memory model (oomb.memory.sharding) says."""

from __future__ import annotations

import functools
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from configs import engine_config

from oomb import Engine
from oomb.memory import ModelShape, collective_counts, shard_traffic, unit_bytes

VOCAB = 102  # even: FSDP2 pads a dimension 0 to a multiple of the ranks, which would change the gathered bytes
SCENARIOS = [("params", "plain"), ("grads-optim", "plain"), ("params", "lora-sparse-ckpt"),
             ("grads-optim", "lora-sparse-ckpt"), ("params", "bf16-f32"), ("grads-optim", "bf16-f32")]
"""fp64 (exact), LoRA with sparse attention and per-layer checkpointing (fp64, exact), and bfloat16 weights with
grad_accum_dtype float32 (float32 sums and reductions; bf16 rounding)."""
LORA_TARGETS = "q_proj,v_proj"


def _config():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       tie_word_embeddings=True)


def _model(variant: str):
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(_config()).double()
    if "bf16" in variant:
        model = model.to(torch.bfloat16)
    if "lora" in variant:
        from oomb.models.lora import apply_lora

        model = apply_lora(model, 4, 8, LORA_TARGETS, False)
        torch.manual_seed(5)
        for name, p in model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero: a gradient of A would be zero
                p.data.normal_()
    return model


def _engine(model, variant: str) -> Engine:
    kw = dict(chunk_size=8, page_size=4, attention_backend="torch")
    if "sparse" in variant:  # 10 pages of 4 tokens: chunk 4 keeps 3 of its 8 past pages
        kw.update(sparse=True, page_budget=1, local_pages=1, sink_pages=1)
    if "ckpt" in variant:
        kw.update(checkpoint_layers=True)
    if "f32" in variant:
        kw.update(grad_accum_dtype="float32")
    return Engine(model, engine_config(**kw))


def _sequences():
    """Two sequences per rank (rank r trains 2r, 2r + 1), 40 tokens = 5 chunks each, with unequal valid tokens."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(4):
        ids = torch.randint(0, VOCAB, (1, 40), generator=g)
        labels = ids.clone()
        if i % 2:
            labels[0, 3:20] = -100
        out.append((ids, labels))
    return out


def _valid(labels) -> int:
    return int((labels[0, 1:] != -100).sum())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, port, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    import oomb.engine.fused_wgrad as fused_wgrad
    from oomb.distributed import clip_grad_norm, init_from_env
    from oomb.engine.sharding import shard_model

    ctx = init_from_env("cpu", timeout_s=120)
    counts = {}
    all_gather, reduce_scatter = dist.all_gather_single, dist.reduce_scatter_single

    def counted_all_gather(output, input, *args, **kwargs):
        counts.setdefault("all_gather", []).append(output.numel() * output.element_size())
        return all_gather(output, input, *args, **kwargs)

    def counted_reduce_scatter(output, input, **kwargs):
        counts.setdefault("reduce_scatter", []).append(input.numel() * input.element_size())
        return reduce_scatter(output=output, input=input, **kwargs)

    fusable = fused_wgrad._fusable

    def counted_fusable(weight):  # a weight gradient added into .grad inside the GEMM
        fused = fusable(weight)
        counts["fused"] = counts.get("fused", 0) + fused
        return fused

    dist.all_gather_single, dist.reduce_scatter_single = counted_all_gather, counted_reduce_scatter
    fused_wgrad._fusable = counted_fusable
    results = {}
    try:
        seqs = _sequences()
        total = sum(_valid(lab) for _, lab in seqs)
        for mode, variant in SCENARIOS:
            counts.clear()
            model = _model(variant)
            sharding = shard_model(model, mode, reduce_dtype=torch.float32 if "f32" in variant else None)
            engine = _engine(model, variant)
            mine = seqs[2 * rank: 2 * rank + 2]
            for i, (ids, labels) in enumerate(mine):
                engine.step(ids, labels, loss_normalizer=total, sync_gradients=i == len(mine) - 1)
            sharding.end_step()
            collectives = {k: v if isinstance(v, int) else list(v) for k, v in counts.items()}
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
            norm = clip_grad_norm(sharding.parameters, 1e-3)
            clipped = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
            results[(mode, variant)] = dict(grads=grads, norm=norm, clipped=clipped, collectives=collectives)
    finally:
        dist.all_gather_single, dist.reduce_scatter_single = all_gather, reduce_scatter
        fused_wgrad._fusable = fusable
        ctx.close()
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))


@functools.cache
def _reference(variant: str) -> dict:
    """One process trains the four sequences of both ranks, each normalised by the valid tokens of all."""
    model = _model(variant)
    engine = _engine(model, variant)
    seqs = _sequences()
    total = sum(_valid(lab) for _, lab in seqs)
    for ids, labels in seqs:
        engine.step(ids, labels, loss_normalizer=total)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _sharded_run(out) -> dict:
    """Every scenario on 2 gloo ranks (one spawn: starting the processes is most of the time)."""
    procs = mp.start_processes(_worker, args=(_free_port(), str(out)), nprocs=2, join=False, start_method="spawn")
    for p in procs.processes:
        p.join(300)
        assert not p.is_alive(), "a rank hung"
    assert all(p.exitcode == 0 for p in procs.processes), [p.exitcode for p in procs.processes]
    return torch.load(out / "results.pt", weights_only=False)


def _check_gradients(got: dict, want: dict, what) -> None:
    assert set(got) == set(want) and len(want) > 10, what
    for name, g in want.items():
        if g.dtype == torch.bfloat16:  # the sums differ by bf16 roundings: 0.9% at most, measured
            err = float((got[name].double() - g.double()).norm() / g.double().norm())
            assert got[name].dtype == torch.bfloat16 and err < 2e-2, (what, name, err)
        else:
            torch.testing.assert_close(got[name], g, rtol=1e-10, atol=1e-13, msg=f"{what}: {name}")


def _check_clip(r: dict) -> None:
    grads = list(r["grads"].values())
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
    assert abs(r["norm"] - norm) <= 1e-12 * norm
    for name, g in r["grads"].items():  # clipped to 1e-3: every shard scaled by the global factor
        torch.testing.assert_close(r["clipped"][name], g * (1e-3 / (norm + 1e-6)), rtol=1e-10, atol=1e-15, msg=name)


def _check_collectives(got: dict, mode: str, variant: str) -> None:
    """Per unit and step: the gathers of the root, first, middle and last layer and the reduce-scatters that
    oomb.memory.collective_counts gives (2 sequences of 5 chunks per rank, 3 layers); the plain model's bytes
    also equal oomb.memory.shard_traffic's."""
    n = collective_counts(mode, num_layers=3, chunks=5, sequences=2)
    assert len(got["all_gather"]) == n["root"] + n["first"] + n["middle"] + n["last"], (mode, variant)
    units = 3 + ("lora" not in variant)  # the layers, and the root where it trains (not under LoRA)
    assert len(got["reduce_scatter"]) == units * n["reduce_scatter"], (mode, variant)
    # The fused weight-gradient GEMM adds into the gathered weight's .grad where the step's sums stay unsharded
    # (grads-optim); with params every chunk's .grad goes to its reduce-scatter, and the next chunk writes anew.
    assert (got.get("fused", 0) > 0) == (mode == "grads-optim" and variant != "bf16-f32"), (mode, variant, got.get("fused"))
    if variant in ("plain", "bf16-f32"):
        shape = ModelShape.from_config(_config())
        dtype, accum = (torch.bfloat16, "float32") if "bf16" in variant else (torch.float64, "param")
        traffic = shard_traffic(shape, dtype, mode, 2, seq_len=40, chunk_size=8, sequences=2, grad_accum_dtype=accum)
        assert sum(got["all_gather"]) == traffic["all_gather"], mode
        assert sum(got["reduce_scatter"]) == traffic["reduce_scatter"], mode
        u = unit_bytes(shape, dtype)
        assert sorted(set(got["all_gather"])) == sorted({u.root_weights, u.layer_weights}), mode


@pytest.mark.slow  # two gloo processes
def test_sharded_gradients_clip_and_collectives_on_two_ranks(tmp_path):
    """For params and grads-optim, dense and LoRA + sparse + per-layer checkpointing: the gathered fp64 gradients
    equal one process over every rank's sequences (bf16 with float32 sums: within bf16 rounding, reduced in
    float32); the clip's norm is the whole gradient's; FSDP2's collectives are those the memory model counts.
    (One test: a module fixture would be run by each pytest-xdist worker.)"""
    sharded = _sharded_run(tmp_path)
    for mode, variant in SCENARIOS:
        _check_gradients(sharded[(mode, variant)]["grads"], _reference(variant), (mode, variant))
        _check_collectives(sharded[(mode, variant)]["collectives"], mode, variant)
    _check_clip(sharded[("params", "plain")])
