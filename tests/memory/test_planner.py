"""Memory planner: formulas, the H200 calibration point, monotonicity, refusals, the `oomb plan` helper."""

from __future__ import annotations

import re

from dataclasses import replace

import pytest
import torch
from oomb.config import OffloadConfig, SparseConfig
from transformers import AutoModelForCausalLM

from oomb.models.presets import preset_config, preset_names
from oomb.memory import GiB, Machine, MemoryPlanError, ModelShape, activation_bytes, offload_traffic
from oomb.planner import choose_tiering, plan


def plan_for_train_args(args, dtype, machine=None):
    """The plan `oomb train` checks for the parsed arguments ``args`` (with AdamW)."""
    from oomb.cli.plan import job_plan

    return job_plan(args, dtype, machine=machine)


def run_plan(args):
    """`oomb plan` with the parsed arguments ``args``: its exit status."""
    from oomb.cli.plan import _plan

    return _plan(args)


def _parsed(argv):
    """The namespace the subcommand handlers get for ``argv`` (flat flags and the job config)."""
    from oomb.cli.parser import _job_config, _namespace

    job, _ = _job_config(argv[0], argv, None)
    return _namespace(argv[0], job)

H200 = Machine(gpu_free_bytes=int(139.3 * GiB), gpu_total_bytes=int(139.8 * GiB), host_available_bytes=120 * GiB,
               host_total_bytes=125 * GiB, gpu_name="H200")
MEASURED_7B = {  # benchmarks/results/dense_step_torch_reference_h200.md: peak, KV store (GiB)
    32768: (63.6, 5.25),
    131072: (79.4, 21.00),
}


@pytest.mark.parametrize("name", preset_names())
def test_parameter_count_matches_the_model(name):
    config = preset_config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert ModelShape.from_config(config).num_params() == sum(p.numel() for p in model.parameters())


def test_kv_bytes_per_token_7b():
    p = plan("qwen2.5-7b", 4096, machine=H200, optimizer=None)
    per_token = p.page_bytes * p.shape.num_layers / p.page_size
    assert per_token == 168 * 1024  # 56 KiB K/V (bf16) + 112 KiB dK/dV (fp32)


def test_activation_formula_7b():
    shape = ModelShape.from_config("qwen2.5-7b")
    act = activation_bytes(shape, 4096, torch.bfloat16, attention_backend="torch", max_past=131072 - 4096)
    # 12h + 8q + 8kv + 8i bytes per token per layer
    assert act["saved"] == 4096 * 28 * (12 * 3584 + 8 * 3584 + 8 * 512 + 8 * 18944)
    assert act["attention_temp"] == 3 * 28 * 4096 * 4096 * 4 + 6 * 4096 * 3584 * 4


@pytest.mark.parametrize("T", sorted(MEASURED_7B))
def test_7b_h200_calibration_within_5_percent(T):
    """Qwen2.5-7B, bf16, chunk 4096, torch reference attention, no per-layer checkpointing, no optimizer."""
    peak, kv = MEASURED_7B[T]
    p = plan("qwen2.5-7b", T, chunk_size=4096, attention_backend="torch", optimizer=None, offload=False, machine=H200)
    assert abs(p.gpu_pool / GiB - kv) < 0.01
    assert abs(p.weights / GiB - 14.2) < 0.05 and abs(p.grads / GiB - 14.2) < 0.05
    assert abs((p.gpu_peak - p.gpu_pool) / GiB - 58.36) <= 0.05 * 58.36
    assert abs(p.gpu_peak / GiB - peak) <= 0.05 * peak


def test_monotone_in_length_chunk_and_options():
    kw = dict(machine=H200, optimizer=None)
    peaks = [plan("qwen2.5-7b", T, offload=False, **kw).gpu_peak for T in (8192, 32768, 131072, 262144)]
    assert peaks == sorted(peaks) and len(set(peaks)) == 4
    hosts = [plan("qwen2.5-7b", T, offload=True, checkpoint_layers=True, **kw).host_kv for T in (262144, 524288, 786432)]
    assert hosts == sorted(hosts)
    acts = [plan("qwen2.5-7b", 65536, chunk_size=c, **kw).activations["total"] for c in (1024, 2048, 4096, 8192)]
    assert acts == sorted(acts)
    full = plan("qwen2.5-7b", 65536, **kw)
    ckpt = plan("qwen2.5-7b", 65536, checkpoint_layers=True, **kw)
    assert ckpt.activations["saved"] < full.activations["saved"] / 10
    adam = plan("qwen2.5-7b", 65536, machine=H200, optimizer="adamw")
    lora = plan("qwen2.5-7b", 65536, machine=H200, optimizer="adamw", lora_rank=16)
    # torch's AdamW keeps its two states like the parameter (zeros_like): 2 x 2 B for bf16 weights
    assert adam.optimizer == 4 * adam.num_params and lora.optimizer < adam.optimizer / 100
    assert lora.grads < adam.grads / 100 and lora.trainable_params == 28 * 16 * ((3584 + 3584) * 2 + 2 * (3584 + 512))


def test_offload_grows_gpu_memory_only_by_staging():
    kw = dict(machine=H200, optimizer=None, checkpoint_layers=True, offload=True, gpu_page_budget=None)
    a = plan("qwen2.5-7b", 262144, **kw)
    # Whole-layer staging, minimum GPU tier (two staging layers): the GPU grows by 2 layers' pages per token.
    layer = [plan("qwen2.5-7b", T, **{**kw, "gpu_page_budget": 2 * T // 128, "offload_segment_pages": "layer"})
             for T in (262144, 524288)]
    per_token = (layer[1].gpu_peak - layer[0].gpu_peak) / 262144
    assert per_token == pytest.approx(2 * 168 * 1024 / 28, rel=1e-6)
    assert layer[0].tiering.resident_pages_per_layer == 0 and layer[0].host_kv == layer[0].kv_total
    assert a.tiering.offload is False  # 256K fits on the H200 with checkpointing: no offload needed


def test_segmented_offload_gpu_memory_is_flat_in_context_length():
    """Segmented staging (the default): the minimum GPU tier is two 32K-token segments, so the predicted GPU
    peak is the same at 256K..2M tokens, and a budget buys resident pages on top of it."""
    kw = dict(machine=H200, optimizer=None, checkpoint_layers=True, offload=True)
    pb = 168 * 1024 // 28 * 128  # one page of one layer: K, V (bf16) + dK, dV (fp32)
    mins = [plan("qwen2.5-7b", T, gpu_page_budget=512, **kw) for T in (262144, 524288, 1 << 20, 1 << 21)]
    assert len({p.gpu_peak for p in mins}) == 1
    p = mins[0]
    assert p.segment_pages == 256 and p.tiering.resident_pages_per_layer == 0
    assert p.gpu_pool == p.staging == 512 * pb
    assert p.own_buffers == 2 * 4096 * 512 * 2 * 4 and p.write_buffers == 2 * 4096 * 512 * 2 * 2
    assert "KV staging (2 x 32K tok) + buffers" in p.table()
    # a buffer holds at most a layer's host pages: one page here (the label said 32K)
    nearly = plan("qwen2.5-7b", 131072, gpu_page_budget=28 * 1023 + 2, **kw)
    assert nearly.tiering.resident_pages_per_layer == 1023 and nearly.staging == 2 * pb
    assert "KV staging (2 x 128 tok) + buffers" in nearly.table()
    res = plan("qwen2.5-7b", 1 << 19, gpu_page_budget=512 + 28 * 100, **kw)
    assert res.tiering.resident_pages_per_layer == 100 and res.gpu_pool == (512 + 28 * 100) * pb
    # The planner's default offload plan at 1M tokens keeps resident pages as the free memory allows.
    auto = plan("qwen2.5-7b", 1 << 20, machine=H200, optimizer=None, checkpoint_layers=True)
    assert auto.tiering.offload and auto.tiering.resident_pages_per_layer > 0 and auto.segment_pages == 256


def test_largest_context_is_consistent():
    p = plan("qwen2.5-7b", 131072, machine=H200, optimizer=None, checkpoint_layers=True)
    assert p.max_seq_len_gpu_only < p.max_seq_len_offload
    assert plan("qwen2.5-7b", p.max_seq_len_offload, machine=H200, optimizer=None, checkpoint_layers=True).fits
    over = plan("qwen2.5-7b", p.max_seq_len_offload + 2 * 4096, machine=H200, optimizer=None, checkpoint_layers=True)
    assert not over.fits and "host tier" in over.problems[0]
    assert p.max_seq_len_offload >= 1_000_000  # the aim on this box (see docs/design.md §4)
    g = plan("qwen2.5-7b", p.max_seq_len_gpu_only, machine=H200, optimizer=None, checkpoint_layers=True, offload=False)
    assert g.fits


def test_largest_context_is_that_of_a_given_gpu_page_budget():
    """`oomb plan --gpu-page-budget 20000` at 1M tokens printed 'largest context: 638,976 tokens with every page on the
    GPU, 1,196,032 with offload' (the largest pool's) beside a verdict that 1M does not fit that pool's host tier: with
    a given pool, the largest contexts are those of that pool, and the line says so."""
    kw = dict(machine=H200, optimizer=None, checkpoint_layers=True, gpu_page_budget=20_000)
    p = plan("qwen2.5-7b", 1 << 20, **kw)
    free = plan("qwen2.5-7b", 1 << 20, machine=H200, optimizer=None, checkpoint_layers=True)
    assert not p.fits and p.max_seq_len_offload < 1 << 20 < free.max_seq_len_offload
    assert plan("qwen2.5-7b", p.max_seq_len_offload, **kw).fits
    assert not plan("qwen2.5-7b", p.max_seq_len_offload + 2 * 4096, **kw).fits
    # every page in the 20,000-page pool: 714 per layer (28 layers), in whole chunks
    assert p.max_seq_len_gpu_only == 714 * 128 // 4096 * 4096 < free.max_seq_len_gpu_only
    inside = plan("qwen2.5-7b", p.max_seq_len_gpu_only, **kw)
    assert inside.fits and not inside.tiering.offload
    assert plan("qwen2.5-7b", p.max_seq_len_gpu_only + 4096, **kw).tiering.offload
    assert (f"largest context with the given 20,000-page GPU pool: {p.max_seq_len_gpu_only:,} tokens with every page "
            f"in it, {p.max_seq_len_offload:,} with offload") in p.table()
    assert "largest context: " in free.table() and "given" not in free.table().splitlines()[-2]


def test_impossible_runs_are_refused_clearly():
    small = Machine(gpu_free_bytes=24 * GiB, gpu_total_bytes=24 * GiB, host_available_bytes=64 * GiB, host_total_bytes=64 * GiB)
    with pytest.raises(MemoryPlanError, match=r"weights, gradients, optimizer states .* need .* GiB .* use LoRA"):
        plan("qwen2.5-7b", 32768, machine=small).check()
    with pytest.raises(MemoryPlanError, match="turn offload on"):
        plan("qwen2.5-7b", 1 << 20, machine=H200, optimizer=None, checkpoint_layers=True, offload=False).check()
    with pytest.raises(MemoryPlanError, match="host tier needs .* GiB of pinned memory"):
        plan("qwen2.5-7b", 1 << 21, machine=H200, optimizer=None, checkpoint_layers=True).check()
    # The 1M sparse step on a 128 GiB host failed this way without per-layer checkpointing:
    # the message names the GPU-side remedies too, with the resident pages it found.
    small_host = Machine(gpu_free_bytes=int(139.3 * GiB), gpu_total_bytes=int(139.8 * GiB), host_available_bytes=100 * GiB,
                         host_total_bytes=128 * GiB, gpu_name="H200")
    with pytest.raises(MemoryPlanError, match=r"keep more pages on the GPU \([\d,]+ of 8,192 per layer now\).*checkpoint_layers"):
        plan("qwen2.5-7b", 1 << 20, machine=small_host, optimizer=None).check()
    # A plan refused for its host tier shows the offload layout the verdict speaks of: the GPU pool and the
    # host pages over the budget (the table showed "every page on the GPU" / "no GPU pool fits" next to a
    # verdict about the host tier), with the verdict's resident pages.
    for sparse in (None, {}):
        refused = plan("qwen2.5-7b", 1 << 20, machine=small_host, offload=True, sparse=sparse)
        R = refused.tiering.resident_pages_per_layer
        assert not refused.fits and refused.tiering.offload and refused.tiering.gpu_pages and refused.host_kv > refused.host_budget
        table = refused.table()
        assert f"offload, GPU pool {refused.tiering.gpu_pages:,} pages" in table and "DOES NOT FIT" in table
        assert f"({R:,} of 8,192 per layer now)" in refused.problems[0]
    auto = plan("qwen2.5-7b", 1 << 20, machine=small_host, optimizer=None)
    assert auto.tiering.offload and "tiering: every page on the GPU" not in auto.table()
    # A given GPU page budget below the minimum is the budget's fault, not the GPU's ...
    with pytest.raises(MemoryPlanError, match=r"gpu_page_budget 100 pages is below the 512 pages offload needs .*"
                                              r"raise gpu_page_budget to 512 or more") as exc:
        plan("qwen2.5-7b", 1 << 20, machine=H200, optimizer=None, checkpoint_layers=True, gpu_page_budget=100).check()
    assert "GPU memory" not in str(exc.value)
    # ... while a GPU whose memory left after the weights, states and activations cannot hold the minimum
    # pool is the GPU's (it used to say only "0.01 GiB is left" and advise a shorter context)
    base = plan("tiny", 1 << 16, chunk_size=512, machine=H200, offload=True)
    fixed = base.gpu_peak - base.gpu_pool - base.write_buffers - base.own_buffers
    tight = Machine(gpu_free_bytes=2 * GiB + fixed + 1024, gpu_total_bytes=8 * GiB, host_available_bytes=64 * GiB,
                    host_total_bytes=64 * GiB)
    p = plan("tiny", 1 << 16, chunk_size=512, machine=tight, offload=True)
    assert len(p.problems) == 1, p.problems
    # ... and still prints (table() crashed formatting the missing pool size)
    assert p.tiering.gpu_pages is None and "offload, no GPU pool fits" in p.table() and "DOES NOT FIT" in p.table()
    assert re.match(r"offload needs at least [\d,]+ GPU pages .* but only 0\.00 GiB of GPU memory is left for KV pages "
                    r"after the weights, gradients, optimizer states and activations; .*"
                    r"use LoRA, checkpoint_layers or a smaller chunk_size, or use a GPU with more memory$", p.problems[0]), p.problems
    no_gpu = Machine(gpu_free_bytes=0, gpu_total_bytes=0, host_available_bytes=64 * GiB, host_total_bytes=64 * GiB)
    with pytest.raises(MemoryPlanError, match="no CUDA GPU is visible"):
        plan("tiny", 4096, machine=no_gpu).check()
    with pytest.raises(ValueError, match="chunk_size a positive multiple"):
        plan("qwen2.5-7b", 4096, chunk_size=100, machine=H200)


def test_table_prints_parameter_counts_in_millions_below_a_billion():
    """The tiny preset's plan read 'parameters 0.00 B, trainable 0.005 B'."""
    from oomb.planner import _count

    assert [_count(n) for n in (0, 5_240_000, 999_994_999, 1_000_000_000, 7_615_616_512)] == [
        "0.00 M", "5.24 M", "999.99 M", "1.00 B", "7.62 B"]
    tiny = plan("tiny", 4096, chunk_size=512, machine=H200)
    assert f"parameters {tiny.num_params / 1e6:.2f} M, trainable {tiny.trainable_params / 1e6:.2f} M;" in tiny.table()
    lora = plan("qwen2.5-7b", 4096, lora_rank=8, machine=H200)
    assert f"parameters {lora.num_params / 1e9:.2f} B, trainable {lora.trainable_params / 1e6:.2f} M;" in lora.table()
    assert "0.00 B" not in tiny.table()


def test_table_says_the_host_budget_is_a_share_of_available_ram():
    """The host 'budget' line gave a number only; it is 75% (host_fraction) of the available RAM."""
    p = plan("qwen2.5-7b", 1 << 20, machine=H200, optimizer=None, checkpoint_layers=True)
    line = next(l for l in p.table().splitlines() if l.strip().startswith("budget (75% of available RAM)"))
    assert line.split()[-1] == f"{0.75 * 120:.2f}"
    half = plan("qwen2.5-7b", 1 << 20, machine=H200, optimizer=None, checkpoint_layers=True, host_fraction=0.5)
    assert "budget (50% of available RAM)" in half.table() and half.host_budget == 60 * GiB


def test_choose_tiering():
    kw = dict(machine=H200, optimizer=None, checkpoint_layers=True)
    assert choose_tiering("qwen2.5-7b", 131072, **kw).offload is False
    t = choose_tiering("qwen2.5-7b", 1 << 20, **kw)
    assert t.offload and 0 < t.resident_pages_per_layer < (1 << 20) // 128 and t.gpu_pages >= 2 * (1 << 20) // 128
    with pytest.raises(MemoryPlanError):
        choose_tiering("qwen2.5-7b", 1 << 22, **kw)


def test_plan_subcommand(capsys):
    args = _parsed(["plan", "--model", "qwen2.5-7b", "--seq-len", "1048576", "--checkpoint-layers",
                    "--no-optimizer", "--gpu-gib", "139.3", "--host-gib", "120"])
    assert run_plan(args) == 0
    out = capsys.readouterr().out
    assert "predicted peak" in out and "offload, GPU pool" in out and "largest context" in out
    args = _parsed(["plan", "--model", "qwen2.5-7b", "--seq-len", "4194304", "--gpu-gib", "139.3", "--host-gib", "120"])
    assert run_plan(args) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_a_gpu_no_larger_than_the_reserve_fits_no_setting_and_need_and_free_read_differently(capsys):
    """--gpu-gib 1 said '0.00 GiB ... free (after a 2.0 GiB reserve); use --lora-rank, ...', a fix that cannot help;
    --gpu-gib 2.5 said 'need 0.50 GiB but 0.50 GiB ... is free'."""
    base = ["plan", "--model", "tiny", "--seq-len", "4096", "--host-gib", "1"]
    for gib in ("1", "2"):
        assert run_plan(_parsed([*base, "--gpu-gib", gib])) == 1
        verdict = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("DOES NOT FIT"))
        assert verdict == (f"DOES NOT FIT: the GPU's {float(gib):.2f} GiB of free memory is no more than the 2.00 GiB "
                           "reserve a plan keeps free (for the CUDA allocator and libraries: 2 GiB or 3% of the GPU), "
                           "so nothing is left for the run and no setting fits; pass a --gpu-gib above 2.00 (a GPU "
                           "with more free memory)"), verdict
    assert run_plan(_parsed([*base, "--gpu-gib", "2.5"])) == 1
    verdict = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("DOES NOT FIT"))
    need, free = re.search(r"need ([\d.]+) GiB but ([\d.]+) GiB of GPU memory is free", verdict).groups()
    assert float(need) > float(free) == 0.5, verdict
    from oomb.planner import _need_and_free

    assert _need_and_free(GiB // 2 + 1, GiB // 2) == (f"{GiB // 2 + 1:,} bytes", f"{GiB // 2:,} bytes")
    assert _need_and_free(GiB, GiB) == ("1.00 GiB", "1.00 GiB")
    assert _need_and_free(3 * GiB, GiB) == ("3.00 GiB", "1.00 GiB")
    p = plan("tiny", 4096, machine=Machine(gpu_free_bytes=GiB, gpu_total_bytes=GiB, host_available_bytes=GiB,
                                           host_total_bytes=GiB))  # the library says it in its own words
    assert p.problems[0].endswith("no setting fits; use a GPU with more than 2.00 GiB free"), p.problems


def test_train_arguments_map_to_a_plan_and_engine_settings():
    base = ["train", "--output-dir", "unused", "--model", "qwen2.5-7b", "--seq-len", str(1 << 20), "--chunk-size", "4096",
            "--lora-rank", "16"]

    def parse(*extra):
        return _parsed([*base, *extra])

    args = parse("--checkpoint-layers")
    p = plan_for_train_args(args, torch.bfloat16, machine=H200).check()
    settings = p.engine_settings()
    assert settings["mode"] == "on" and settings["gpu_page_budget"] == p.tiering.gpu_pages
    assert settings["staging_sets"] is None  # segments: always two buffers
    assert p.optimizer == 8 * p.trainable_params
    assert p.segment_pages == 256
    seg = plan_for_train_args(parse("--checkpoint-layers", "--offload-segment-pages", "64"), torch.bfloat16,
                              machine=H200)
    assert seg.segment_pages == 64 and seg.staging == 2 * 64 * seg.page_bytes
    args = parse("--checkpoint-layers", "--sparse")  # the engine stages whole layers for sparse attention: so does its plan
    assert plan_for_train_args(args, torch.bfloat16, machine=H200).segment_pages is None
    args = parse("--seq-len", "65536", "--offload", "off")
    assert plan_for_train_args(args, torch.bfloat16, machine=H200).engine_settings() == {
        "mode": "off", "gpu_page_budget": None, "staging_sets": None}
    args = parse("--offload", "off", "--checkpoint-layers")
    with pytest.raises(MemoryPlanError, match="turn offload on"):
        plan_for_train_args(args, torch.bfloat16, machine=H200).check()


def test_sparse_plan_counts_the_sparse_state_and_stages_whole_layers(capsys):
    """`oomb plan --sparse`: the page summaries and selections the
    engine keeps, the engine's extra headroom for sparse runs (4 GiB without per-layer checkpointing), and whole-layer
    staging with offload."""
    from oomb import OOMBConfig
    from oomb.memory import sparse_state_bytes

    kw = dict(machine=H200, optimizer=None, checkpoint_layers=True)
    T = 1 << 20
    dense = plan("qwen2.5-7b", T, **kw)
    cfg = OOMBConfig(chunk_size=4096, page_size=128, sparse=SparseConfig(page_budget=64))
    sp = plan("qwen2.5-7b", T, sparse=cfg, **kw)
    state = sparse_state_bytes(ModelShape.from_config(preset_config("qwen2.5-7b")), T, cfg, torch.bfloat16)
    assert state > 0 and sp.activations["sparse_state"] == state
    assert sp.activations["total"] == dense.activations["total"] + state
    # extra headroom only without per-layer checkpointing (sparse_headroom_bytes; measured on the H200 with it)
    assert sp.gpu_budget == dense.gpu_budget
    kw_nockpt = dict(kw, checkpoint_layers=False)
    assert (plan("qwen2.5-7b", T, sparse=cfg, **kw_nockpt).gpu_budget
            == plan("qwen2.5-7b", T, **kw_nockpt).gpu_budget - 4 * GiB)
    assert sp.tiering.offload and sp.segment_pages is None and dense.segment_pages is not None
    assert "sparse: page summaries + selections" in sp.table()
    args = _parsed(["plan", "--model", "qwen2.5-7b", "--seq-len", str(T), "--sparse", "--checkpoint-layers",
                    "--no-optimizer", "--gpu-gib", "139.3", "--host-gib", "120"])
    run_plan(args)
    assert "sparse: page summaries + selections" in capsys.readouterr().out


def test_a_sequence_shorter_than_the_chunk_counts_its_own_tokens_only():
    """The engine runs a sequence shorter than --chunk-size as one chunk of seq_len tokens: the plan counted the
    activations of a whole chunk (4096 tokens for a 1024-token run)."""
    short = plan("qwen2.5-7b", 1024, chunk_size=4096, machine=H200, optimizer=None)
    exact = plan("qwen2.5-7b", 1024, chunk_size=1024, machine=H200, optimizer=None)
    assert short.activations == exact.activations
    assert short.activations == activation_bytes(short.shape, 1024, torch.bfloat16, attention_backend="triton",
                                                 max_past=0)
    assert short.gpu_peak < plan("qwen2.5-7b", 4096, chunk_size=4096, machine=H200, optimizer=None).gpu_peak


def test_plan_warns_when_the_length_exceeds_the_model_s_positions(tmp_path, capsys):
    """`oomb plan` ignored max_position_embeddings; it warns (exit status unchanged) as `oomb train` does."""
    from transformers import Qwen2Config

    from oomb.cli import main
    from oomb.models.limits import context_length_warning

    d = tmp_path / "short-model"
    Qwen2Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=2048).save_pretrained(d)
    base = ["plan", "--model", str(d), "--chunk-size", "1024", "--gpu-gib", "80", "--host-gib", "64"]
    assert main([*base, "--seq-len", "8192"]) == 0
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "oomb: warning: --seq-len 8,192 exceeds the 2,048 positions" in captured.err
    assert "predicted peak" in captured.out
    assert main([*base, "--seq-len", "2048"]) == 0
    assert capsys.readouterr().err == ""
    # a RoPE scaling that covers the length (original x factor) is no reason to warn
    cfg = Qwen2Config(max_position_embeddings=2048, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                                     "original_max_position_embeddings": 2048})
    assert context_length_warning(cfg, 8192, "m") is None and context_length_warning(cfg, 8193, "m") is not None


@pytest.mark.parametrize("config", [
    dict(model_type="gpt2", n_layer=2, n_embd=64, n_head=2),
    dict(model_type="mistral", vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
         num_attention_heads=4, num_key_value_heads=2, sliding_window=128),
], ids=["gpt2", "sliding-window"])
def test_plan_refuses_a_model_the_engine_refuses(config):
    """plan() of a model :class:`oomb.Engine` refuses raises its UnsupportedModelError (GPT-2 was an AttributeError
    on intermediate_size, a sliding-window Mistral a plan that fits)."""
    from transformers import AutoConfig

    from oomb import UnsupportedModelError

    cfg = AutoConfig.for_model(**config)
    with pytest.raises(UnsupportedModelError, match="model type 'gpt2'|sliding-window"):
        plan(cfg, 4096, machine=H200)


def test_sparse_offload_never_counts_saved_attention():
    """Sparse offload stages whole layers, where the engine does not use saved attention outputs: the plan drops them
    with that reason, also when the run does not fit either way (it used to count 198 GiB of them then) and when
    only memory would have dropped them."""
    from oomb import OOMBConfig

    cfg = OOMBConfig(chunk_size=4096, page_size=128, sparse=SparseConfig(page_budget=64))
    small_host = Machine(gpu_free_bytes=int(139.3 * GiB), gpu_total_bytes=int(139.8 * GiB), host_available_bytes=100 * GiB,
                         host_total_bytes=100 * GiB)
    for kw in (dict(machine=small_host, offload=True), dict(machine=H200, optimizer=None, checkpoint_layers=True)):
        p = plan("qwen2.5-7b", 1 << 20, sparse=cfg, save_attention="gpu", **kw)
        assert p.save_attention == "off" and "sparse attention, where they are not used" in p.save_attention_note
        assert "attention outputs" not in p.table()
    # Everything on the GPU (256K): kept.
    p = plan("qwen2.5-7b", 1 << 18, sparse=cfg, save_attention="gpu", machine=H200, optimizer=None, checkpoint_layers=True)
    assert p.save_attention == "gpu" and not p.tiering.offload


def test_offload_traffic_honours_the_stage1_shadow_switch():
    shape = ModelShape.from_config(preset_config("qwen2.5-7b"))
    on = offload_traffic(shape, 1 << 20, 4096, 128, 4000)
    off = offload_traffic(shape, 1 << 20, 4096, 128, 4000, stage1_shadow=False)
    assert off["d2h_bytes"] == on["d2h_bytes"] and off["h2d_bytes"] > on["h2d_bytes"]
    assert off == offload_traffic(shape, 1 << 20, 4096, 128, 4000, stage1_shadow_pages=0)


def test_kv_stash_is_kept_free_and_shown():
    """kv_stash_mib: the sparse plan keeps that much GPU memory free (budget lower by exactly it, so the
    pool shrinks) and the table says so; dense plans do not (no stash is allocated for them)."""
    from oomb import OOMBConfig

    cfg = OOMBConfig(chunk_size=4096, page_size=128, sparse=SparseConfig(page_budget=64))
    kw = dict(machine=H200, checkpoint_layers=True, optimizer=None, offload=True)
    base = plan("qwen2.5-7b", 1 << 20, sparse=cfg, **kw)
    dense = plan("qwen2.5-7b", 1 << 20, **kw)
    stash = plan("qwen2.5-7b", 1 << 20, sparse=cfg, kv_stash_mib=3072, **kw)
    # the request (a store allocates at most that much: C = 3 GiB // ((L - K) layers x 64 KiB) tiles per layer)
    assert stash.kv_stash_reserved == 3072 << 20 and stash.gpu_budget == base.gpu_budget - stash.kv_stash_reserved
    assert stash.tiering.resident_pages_per_layer < base.tiering.resident_pages_per_layer
    assert "reserve incl. K/V stash" in stash.table() and "K/V stash" not in base.table()
    assert plan("qwen2.5-7b", 1 << 20, kv_stash_mib=3072, **kw).gpu_budget == dense.gpu_budget
    with pytest.raises(ValueError, match="kv_stash_mib must be an integer >= 0"):
        plan("qwen2.5-7b", 1 << 20, sparse=cfg, kv_stash_mib=-1, **kw)


def test_kv_stash_reserve_is_capped_at_what_the_store_allocates():
    """A stash request larger than every tile of every layer reserves only those tiles' bytes."""
    from oomb import OOMBConfig

    cfg = OOMBConfig(chunk_size=4096, page_size=128, sparse=SparseConfig(page_budget=64))
    p = plan("qwen2.5-7b", 1 << 17, sparse=cfg, machine=H200, checkpoint_layers=True, optimizer=None, offload=True,
             gpu_page_budget=2 * 1024, kv_stash_mib=200000)  # every page on the host (a stash is allocated only then)
    assert p.kv_stash_reserved == 26 * 1024 * 4 * 65536  # (L - 2) layers x 1,024 pages x 4 heads x 64 KiB
    assert p.fits


def test_kv_stash_is_not_kept_free_when_nothing_is_offloaded():
    """Only an offloading store allocates the K/V stash: a plan (or the engine's tiering) that keeps every page on
    the GPU gives its reserve back, so the stash request cannot push a run that fits on the GPU into offload."""
    from oomb import OOMBConfig

    cfg = OOMBConfig(chunk_size=4096, page_size=128, sparse=SparseConfig(page_budget=64))
    kw = dict(machine=H200, checkpoint_layers=True, optimizer=None)
    base = plan("qwen2.5-7b", 1 << 17, sparse=cfg, **kw)
    longest = base.max_seq_len_gpu_only  # the longest context with every page on the GPU, no stash asked for
    kw["kv_stash_mib"] = 3072
    at_limit = plan("qwen2.5-7b", longest, sparse=cfg, **kw)
    assert not at_limit.tiering.offload and at_limit.fits
    assert at_limit.kv_stash_reserved == 0 and "K/V stash" not in at_limit.table()
    assert at_limit.gpu_budget == plan("qwen2.5-7b", longest, sparse=cfg, machine=H200, checkpoint_layers=True,
                                       optimizer=None, gpu_reserve_bytes=None).gpu_budget
    assert at_limit.max_seq_len_gpu_only == longest
    # offloading plans still keep it free
    off = plan("qwen2.5-7b", 1 << 20, sparse=cfg, **kw)
    assert off.tiering.offload and off.kv_stash_reserved == 3072 << 20
    # explicit offload=False: every page on the GPU, nothing reserved for a stash
    assert plan("qwen2.5-7b", longest, sparse=cfg, offload=False, **kw).kv_stash_reserved == 0


def test_sparse_plan_staging_sets_match_the_store(monkeypatch):
    """Whole-layer staging (sparse): the plan's pool and table use the sets the store will pick for that pool."""
    from oomb.memory import choose_staging_sets

    p = plan("qwen2.5-7b", 1 << 20, machine=H200, optimizer=None, checkpoint_layers=True, sparse=True)
    t, n, L = p.tiering, p.pages_per_layer, p.shape.num_layers
    assert t.offload and p.segment_pages is None
    K = choose_staging_sets(L, n, t.gpu_pages, None)
    assert t.staging_sets == K and K >= 3
    R = t.resident_pages_per_layer
    assert p.gpu_pool == (L * R + K * (n - R)) * p.page_bytes and p.staging == K * (n - R) * p.page_bytes
    assert f"KV staging ({K} layers)" in p.table()
    two = plan("qwen2.5-7b", 1 << 20, machine=H200, optimizer=None, checkpoint_layers=True, sparse=True, staging_sets=2)
    assert two.tiering.staging_sets == 2 and two.tiering.resident_pages_per_layer > R
    assert two.traffic["h2d_bytes"] != p.traffic["h2d_bytes"]


def test_the_store_builds_the_staging_the_plan_chose(monkeypatch):
    """The plan's pool is L*R + K*W pages; a store given that pool and the plan's K (engine_settings) builds the
    same R and K. Without K the store would pick again from the smaller pool and could differ (planned K=3, R=4 at
    24 layers x 64 pages and a 282-page budget; the store would pick K=4, R=1)."""
    from oomb.engine.offload import OffloadedKVStore
    from oomb.memory import choose_staging_sets, resident_pages_for_budget
    from oomb.memory import fit_tiering as _tier

    t, _ = _tier(24, 64, 1, 282, 10**9, True, None, None)
    assert (t.staging_sets, t.resident_pages_per_layer, t.gpu_pages) == (3, 4, 276)
    assert choose_staging_sets(24, 64, 276, None) == 4  # the trap: picking again from the used pool
    st = OffloadedKVStore(24, 1, 4, 4, 64 * 4, torch.float32, "cpu", chunk_size=8, gpu_pages=t.gpu_pages,
                          segment_pages="layer", staging_sets=t.staging_sets)
    assert (st.staging_sets, st.resident_pages_per_layer, st.gpu_pool_pages) == (3, 4, 276)
    for L in (12, 24, 28):
        for n in (40, 64, 97):
            for pool in range(2 * n, L * n, 13):
                t, _ = _tier(L, n, 1, pool, 10**9, True, None, None)
                if not t.offload:
                    continue
                K = choose_staging_sets(L, n, t.gpu_pages, None, t.staging_sets)
                assert K == t.staging_sets
                assert resident_pages_for_budget(L, n, t.gpu_pages, None, K) == t.resident_pages_per_layer


def test_more_staging_sets_give_way_to_the_host_budget(monkeypatch):
    """Extra staging sets cost resident pages, so host pages: where 4 sets would overflow the host budget and 2 fit,
    the plan takes 2 (a run that fitted before still fits); an explicit request is kept (and refused if too big)."""
    from oomb.memory import fit_tiering as _tier

    L, n, pool = 28, 8192, 128_600
    four, _ = _tier(L, n, 1, pool, 10**12, True, None, None)
    two, _ = _tier(L, n, 1, pool, 10**12, True, None, None, 2)
    assert four.staging_sets == 4 and two.staging_sets == 2
    host2 = L * (n - two.resident_pages_per_layer)
    assert L * (n - four.resident_pages_per_layer) > host2
    tight, why = _tier(L, n, 1, pool, host2, True, None, None)
    assert why is None and tight.staging_sets == 2 and tight.resident_pages_per_layer == two.resident_pages_per_layer
    refused, why = _tier(L, n, 1, pool, host2, True, None, None, 4)
    assert refused is None and "host tier" in why
    plan_tight = plan("qwen2.5-7b", 1 << 20, machine=H200, optimizer=None, checkpoint_layers=True, sparse=True)
    assert plan_tight.engine_settings()["staging_sets"] == plan_tight.tiering.staging_sets


def test_offload_staging_sets_config():
    from oomb import OOMBConfig

    assert OOMBConfig(sparse=SparseConfig(), offload=OffloadConfig(staging_sets=3)).offload.staging_sets == 3
    for bad in (1, 0):
        with pytest.raises(ValueError, match="staging_sets is .*; pass an integer of 2 or more"):
            OOMBConfig(sparse=SparseConfig(), offload=OffloadConfig(staging_sets=bad))
    for bad in (2.5, True, "4"):
        with pytest.raises(ValueError, match="staging_sets is .*; it takes an integer, or leave it out"):
            OOMBConfig(sparse=SparseConfig(), offload=OffloadConfig(staging_sets=bad))
    with pytest.raises(ValueError, match="staging_sets sizes the staging of offload but mode is off"):
        OOMBConfig(sparse=SparseConfig(), offload=OffloadConfig(mode="off", staging_sets=3))
    with pytest.raises(ValueError, match="only sparse attention uses"):
        OOMBConfig(offload=OffloadConfig(mode="on", staging_sets=3))


def test_staging_sets_not_below_the_layers_are_refused(monkeypatch):
    """K whole-layer staging buffers for L <= K layers cost every page of the GPU: refused with the fix named
    (not silently every page kept on the GPU), from the store's argument and from a requested K."""
    from oomb.engine.offload import OffloadedKVStore
    from oomb.memory import choose_staging_sets, resident_pages_for_budget

    with pytest.raises(ValueError, match="staging_sets=5 whole-layer staging buffers for a model of 4 "
                                         "layers cost as much as keeping every page on the GPU; use 2 to 3"):
        OffloadedKVStore(4, 1, 4, 4, 64, torch.float32, "cpu", chunk_size=8, segment_pages="layer", staging_sets=5)
    assert choose_staging_sets(4, 16, 64, 4, 5) == 2  # segments: not concerned
    with pytest.raises(ValueError, match="staging_sets=6 whole-layer staging buffers for a model of 6 layers"):
        resident_pages_for_budget(6, 10, 59, None, 6)
    with pytest.raises(ValueError, match=r"raise gpu_page_budget to 30 or more, lower staging_sets "
                                         r"\(2 needs 20\), use a shorter seq_len"):
        resident_pages_for_budget(6, 10, 25, None, 3)


def test_host_error_tells_the_two_set_layout(monkeypatch):
    """Where neither 4 nor 2 sets fit the host budget, the error gives the two-set host tier (the smallest)."""
    from oomb.memory import fit_tiering as _tier

    L, n, pool = 28, 8192, 128_600
    two, _ = _tier(L, n, 1, pool, 10**12, True, None, None, 2)
    host2 = L * (n - two.resident_pages_per_layer)
    t, why = _tier(L, n, 1, pool, host2 - 1, True, None, None)
    assert t is None and f"({two.resident_pages_per_layer:,} of {n:,} per layer now)" in why


def test_a_refused_pool_shows_the_layout_it_would_have(monkeypatch):
    """A --gpu-page-budget too big for the GPU is refused; the table shows what that pool would hold (before: 0
    resident pages, two staging layers and every page on the host, unlike anything the store would build)."""
    from oomb import OOMBConfig
    from oomb.memory import resident_pages_for_budget

    cfg = OOMBConfig(chunk_size=4096, page_size=128, sparse=SparseConfig(page_budget=64))
    p = plan("qwen2.5-7b", 1 << 20, machine=H200, optimizer=None, checkpoint_layers=True, sparse=cfg, gpu_page_budget=200_000)
    assert not p.fits and "lower gpu_page_budget" in p.problems[0]
    t = p.tiering
    assert t.offload and t.resident_pages_per_layer == resident_pages_for_budget(28, 8192, 200_000, None)
    assert t.gpu_pages == 28 * t.resident_pages_per_layer + t.staging_sets * (8192 - t.resident_pages_per_layer)
    assert p.host_kv == 28 * (8192 - t.resident_pages_per_layer) * p.page_bytes


@pytest.fixture
def fake_h200_tiering(monkeypatch):
    """choose_engine_tiering on a pretend H200 (124.5 of 139.8 GiB free, 125 GiB host RAM, Triton importable) for a
    Qwen2.5-7B-shaped engine whose gradients exist: ``tier(cfg, T) -> ((offload, gpu_pages, sets), engine.tiering)``."""
    import oomb.ops.paged_attention as pa
    from oomb.memory import DeviceMemory, choose_engine_tiering
    from oomb.ops.paged_attention import step_backend

    monkeypatch.setattr(pa, "_triton_available", lambda: True)
    shape = ModelShape.from_config(preset_config("qwen2.5-7b"))
    memory = DeviceMemory(free_bytes=int(124.5 * GiB), total_bytes=int(139.8 * GiB), cached_bytes=0, allocated_bytes=0,
                          host_available_bytes=125 * GiB)

    def tier(cfg, T):
        t = choose_engine_tiering(shape, cfg, T, torch.bfloat16, segment_pages="layer",
                                  backend=step_backend(cfg, torch.device("cuda")), memory=memory,
                                  missing_grad_bytes=0)  # every gradient exists: nothing left to allocate
        return (t.offload, t.gpu_pages, t.staging_sets), t.budget

    return tier


def test_engine_tiering_sizes_activations_with_the_backend_the_step_runs(fake_h200_tiering):
    """``Engine.reserve()`` before the first step sized the pool with the CPU default backend ('torch', score-sized
    temporaries: 7.32 GiB of activations for Qwen2.5-7B at chunk 4096 against 3.48 with the Triton kernels), so the
    1M sparse step got a pool 3.8 GiB smaller than planned. The estimate now follows the config's
    backend, and sparse attention counts as the block-table kernels."""
    from oomb import OOMBConfig

    shape = ModelShape.from_config(preset_config("qwen2.5-7b"))
    T = 1 << 20

    def tier(cfg):
        return fake_h200_tiering(cfg, T)

    sparse = OOMBConfig(chunk_size=4096, checkpoint_layers=True, sparse=SparseConfig(page_budget=64), offload=OffloadConfig(mode="on"))
    (offload, pages, sets), info = tier(sparse)
    expected = activation_bytes(shape, 4096, torch.bfloat16, True, "triton", 4096, sparse.loss_chunk_size, T - 4096)
    assert info["activation_bytes"] == expected["total"] < 4.5 * GiB  # 3.48 + 0.78 kept attention outputs
    assert info["activation_bytes"] < activation_bytes(shape, 4096, torch.bfloat16, True, "torch", 4096,
                                                       sparse.loss_chunk_size, T - 4096)["total"] - 3 * GiB
    assert offload and sets == 4 and pages > 0
    # the budget the pool was cut from adds up
    assert info["pool_budget_bytes"] == (info["free_bytes"] + info["cached_bytes"] - info["reserve_bytes"]
                                         - info["missing_grad_bytes"] - info["activation_bytes"])
    # dense 'auto' is sdpa on CUDA: its past dK/dV temporaries are counted
    dense = OOMBConfig(chunk_size=4096, checkpoint_layers=True, offload=OffloadConfig(mode="on"))
    info_dense = tier(dense)[1]
    assert info_dense["activation_bytes"] == activation_bytes(shape, 4096, torch.bfloat16, True, "sdpa", 4096,
                                                              dense.loss_chunk_size, T - 4096)["total"]


def test_sparse_plan_counts_auto_and_sdpa_as_the_block_table_kernels():
    """`oomb plan --sparse` with the default --attention-backend auto (or sdpa) sizes the activations the step has:
    sparse attention runs the block-table (Triton) kernels, without sdpa's model-dtype past dK/dV; dense 'auto' stays
    'sdpa'."""
    from oomb import OOMBConfig

    kw = dict(machine=H200, optimizer=None, checkpoint_layers=True)
    T = 1 << 20
    cfg = OOMBConfig(chunk_size=4096, page_size=128, sparse=SparseConfig(page_budget=64))
    triton = plan("qwen2.5-7b", T, sparse=cfg, attention_backend="triton", **kw)
    for name in ("auto", "sdpa"):
        sp = plan("qwen2.5-7b", T, sparse=cfg, attention_backend=name, **kw)
        assert sp.activations == triton.activations and sp.gpu_peak == triton.gpu_peak
    dense_auto = plan("qwen2.5-7b", T, attention_backend="auto", **kw)
    dense_sdpa = plan("qwen2.5-7b", T, attention_backend="sdpa", **kw)
    dense_triton = plan("qwen2.5-7b", T, attention_backend="triton", **kw)
    assert dense_auto.activations == dense_sdpa.activations
    assert dense_auto.activations["total"] > dense_triton.activations["total"]  # the sdpa temporaries are counted


@pytest.mark.parametrize("checkpoint_layers", [True, False])
def test_saved_attention_check_sizes_sparse_steps_as_the_tiering_does(monkeypatch, checkpoint_layers):
    """Engine._saved_memory_problem (save_attention on the GPU, CUDA) sized a sparse step's activations with 'sdpa'
    (past dK/dV temporaries the block-table kernels do not have) and without the sparse headroom that
    choose_engine_tiering keeps free: both now as the tiering plans."""
    from types import SimpleNamespace

    import oomb.engine.engine as engine_mod
    import oomb.ops.paged_attention as pa
    from oomb import OOMBConfig
    from oomb.memory import saved_attention_bytes
    from oomb.memory import sparse_headroom_bytes

    monkeypatch.setattr(pa, "_triton_available", lambda: True)
    monkeypatch.setattr(engine_mod, "host_memory", lambda: (125 * GiB, 125 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    config = preset_config("qwen2.5-7b")
    shape = ModelShape.from_config(config)
    T, total = 1 << 20, int(139.8 * GiB)
    cfg = OOMBConfig(chunk_size=4096, checkpoint_layers=checkpoint_layers, save_attention="gpu", sparse=SparseConfig(page_budget=64))
    fake = SimpleNamespace(config=cfg, device=torch.device("cuda"), dtype=torch.bfloat16, _base=SimpleNamespace(config=config),
                           num_layers=shape.num_layers, head_dim=shape.head_dim, _backend="sdpa")
    sa = saved_attention_bytes(shape.num_layers, config.num_attention_heads, shape.head_dim, T, 4096, 2, "gpu")["gpu"]
    act = activation_bytes(shape, 4096, torch.bfloat16, checkpoint_layers, "triton", cfg.attention_block_size,
                           cfg.loss_chunk_size, T - 4096)["total"]
    assert act < activation_bytes(shape, 4096, torch.bfloat16, checkpoint_layers, "sdpa", cfg.attention_block_size,
                                  cfg.loss_chunk_size, T - 4096)["total"]
    need = sa + act + max(2 * GiB, int(0.03 * total)) + sparse_headroom_bytes(checkpoint_layers)
    for free, fits in ((need, True), (need - 1, False)):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None, free=free: (free, total))
        problem = engine_mod.Engine._saved_memory_problem(fake, "gpu", T)
        assert (problem is None) == fits, problem


@pytest.mark.parametrize("kw", [
    dict(seq_len=1 << 20, checkpoint_layers=True, optimizer=None),
    dict(seq_len=1 << 18, attention_backend="sdpa"),
    dict(seq_len=1 << 17, attention_backend="torch", offload=False),
    dict(seq_len=1 << 20, checkpoint_layers=True, optimizer=None, sparse="sparse"),
    dict(seq_len=1 << 17, save_attention="gpu", checkpoint_layers=True),
])
def test_the_plan_table_s_gpu_rows_add_up_to_the_predicted_peak(kw):
    """The table showed both the attention and the loss temporaries (the peak holds only the larger) and left out
    the 'other' term, so its rows did not add up to the predicted peak (136.46 against 134.82)."""
    from oomb import OOMBConfig

    kw = dict(kw)
    if kw.get("sparse") == "sparse":
        kw["sparse"] = OOMBConfig(chunk_size=4096, page_size=128, sparse=SparseConfig(page_budget=64))
    p = plan("qwen2.5-7b", kw.pop("seq_len"), machine=H200, **kw)
    rows = p.table().split("\n")
    start = rows.index(next(r for r in rows if r.startswith("GPU")))
    end = rows.index(next(r for r in rows if "predicted peak" in r))
    values = [float(r.split()[-1]) for r in rows[start + 1:end]]
    assert abs(sum(values) - p.gpu_peak / GiB) < 0.01 * len(values), (rows[start:end + 1], p.gpu_peak / GiB)


def test_a_refused_gpu_page_budget_shows_a_layout_that_exists():
    """A --gpu-page-budget below the minimum showed 'GPU pool 1 pages' beside 12 GiB of staging, and one holding
    every page showed that pool with 0 resident pages and every page on the host. Now: below
    the minimum, the minimum pool's layout, said so; every page or more, every page on the GPU."""
    from oomb import OOMBConfig

    cfg = OOMBConfig(chunk_size=4096, page_size=128, sparse=SparseConfig(page_budget=64))
    kw = dict(machine=H200, checkpoint_layers=True, optimizer=None, sparse=cfg)
    T, L, n = 1 << 20, 28, 8192
    small = plan("qwen2.5-7b", T, gpu_page_budget=1, **kw)
    assert not small.fits and small.tiering.gpu_pages == 2 * n and small.tiering.resident_pages_per_layer == 0
    assert "GPU pool 16,384 pages (shown at the minimum pool; the given 1 page is below it)" in small.table()
    for budget in (L * n, L * n + 5000):
        big = plan("qwen2.5-7b", T, gpu_page_budget=budget, **kw)
        assert not big.fits and big.tiering.resident_pages_per_layer == n and big.host_kv == 0
        assert big.gpu_pool == L * n * big.page_bytes and big.gpu_peak > big.gpu_budget
    # an accepted budget that makes a whole layout is shown as given, with no note (4 sets: 24 R + 4 n pages)
    ok = plan("qwen2.5-7b", T, gpu_page_budget=24 * 4200 + 4 * n, **kw)
    assert ok.fits and ok.tiering.gpu_pages == 133568 and ok.layout_note == "" and "(shown at" not in ok.table()
    # one that does not: the pages it leaves unused are explained (19,998 of 20,000, say)
    odd = plan("qwen2.5-7b", T, gpu_page_budget=120000, **kw)
    assert odd.fits and 120000 - 28 < odd.tiering.gpu_pages < 120000
    assert (f"GPU pool {odd.tiering.gpu_pages:,} pages (of the 120,000 given, the rest is less than one more resident "
            "page per layer)") in odd.table()


def test_engine_tiering_gives_the_stash_reserve_back_when_every_page_fits(fake_h200_tiering, monkeypatch):
    """choose_engine_tiering keeps offload.kv_stash_mib free only for an offloading store: a length whose pages
    fit on the GPU only without that reserve runs with every page on the GPU."""
    from oomb import OOMBConfig
    from oomb.memory import page_bytes as _page_bytes

    cfg = OOMBConfig(chunk_size=4096, checkpoint_layers=True, sparse=SparseConfig(page_budget=64))  # offload 'auto'

    def tier(T):
        return fake_h200_tiering(cfg, T)

    L, pb = 28, _page_bytes(ModelShape.from_config(preset_config("qwen2.5-7b")), 128, torch.bfloat16)
    _, info = tier(1 << 19)
    T = info["pool_budget_bytes"] // (L * pb) * 128 - 4096  # every page fits, with < 3 GiB to spare
    (offload, _, _), info = tier(T)
    assert not offload and info["pool_budget_bytes"] - L * (T // 128) * pb < 3 * GiB
    cfg = replace(cfg, offload=replace(cfg.offload, kv_stash_mib=3072))
    (offload, pages, _), info = tier(T)
    assert L * (T // 128) * pb > info["pool_budget_bytes"]  # without the reserve given back it would offload
    assert not offload and pages is None


def test_a_plan_no_context_fits_does_not_say_to_shorten_it():
    """Weights, gradients and optimizer states over the GPU at a one-chunk context: no shorter context fits either,
    so the fix names what shrinks them, not the context."""
    from oomb.planner import plan

    gpu = Machine(gpu_free_bytes=80 * GiB, gpu_total_bytes=80 * GiB, host_available_bytes=200 * GiB,
                  host_total_bytes=200 * GiB)
    p = plan("qwen2.5-7b", 4096, chunk_size=4096, machine=gpu)
    assert not p.fits and max(p.max_seq_len_gpu_only, p.max_seq_len_offload) == 0
    told = " ".join(p.problems)
    assert "weights, gradients, optimizer states and one chunk's activations need" in told, told
    assert "shorten the context" not in told, told
