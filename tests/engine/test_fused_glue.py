"""fused_glue='liger': the engine routes RMSNorm, SwiGLU, RoPE and the training cross-entropy through the fused
functions, and refuses where they cannot run.

Liger-Kernel's Triton kernels need CUDA (the interpreter cannot run them), so on the CPU the wiring is checked
with exact PyTorch stand-ins of Liger's functional API: every stand-in must be called, the gradients must equal
full-sequence training (fp64, to rounding), and the module-level RoPE must be transformers' own again after the
step. The GPU comparison of the real kernels is benchmarks/check_fused_glue.py.
"""

from __future__ import annotations

import builtins
import collections
import types

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3

import oomb.models.fused_glue as fg
from oomb import Engine, OOMBConfig
from oomb.config import ConfigError
from tests.engine.test_engine import run_parity, tiny


def _stand_in(calls: collections.Counter) -> types.SimpleNamespace:
    """Liger's functional API (the functions oomb calls) in exact PyTorch, counting calls."""
    rope = modeling_qwen2.apply_rotary_pos_emb

    def rms_norm(x, w, eps, offset, casting_mode, in_place):
        assert (offset, casting_mode, in_place) == (0.0, "llama", False)
        calls["rms_norm"] += 1
        h = x.to(torch.float32) if x.dtype != torch.float64 else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return w * h.to(x.dtype)

    def swiglu(a, b):
        calls["swiglu"] += 1
        return F.silu(a) * b

    def liger_rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        calls["rope"] += 1
        return rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

    def flce(x, weight, target, bias=None, ignore_index=-100, reduction="mean", accum_dtype=None, chunk_mem_const=1):
        assert (ignore_index, reduction, accum_dtype) == (-100, "sum", torch.float32)
        assert isinstance(chunk_mem_const, int) and chunk_mem_const >= 1
        calls["cross_entropy"] += 1
        logits = F.linear(x, weight, bias)
        return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), target,
                               ignore_index=ignore_index, reduction="sum")

    return types.SimpleNamespace(liger_rms_norm=rms_norm, liger_swiglu=swiglu, liger_rope=liger_rope,
                                 liger_fused_linear_cross_entropy=flce)


@pytest.fixture
def calls(monkeypatch):
    counter: collections.Counter = collections.Counter()
    monkeypatch.setattr(fg, "_functional", lambda: _stand_in(counter))
    monkeypatch.setattr(fg, "check_fused_glue", lambda kind, device: None)
    return counter


@pytest.mark.parametrize("family,modeling", [("qwen2", modeling_qwen2), ("qwen3", modeling_qwen3)])
@pytest.mark.parametrize("checkpoint_layers", [False, True])
def test_fused_glue_gradients_equal_full_sequence_training(calls, family, modeling, checkpoint_layers):
    original = modeling.apply_rotary_pos_emb
    model = tiny(family, layers=2)
    run_parity(model, T=24, chunk=8, page=4, fused_glue="liger", checkpoint_layers=checkpoint_layers)
    chunks, layers = 3, 2
    norms_per_layer = 4 if family == "qwen3" else 2  # + q_norm, k_norm
    # Stage 1 runs chunks 0..N-2, Stage 2 all N (and checkpointed layers rerun their forward in backward).
    passes = (chunks - 1) + chunks * (2 if checkpoint_layers else 1)
    assert calls["swiglu"] == passes * layers
    assert calls["rope"] == passes * layers
    assert calls["rms_norm"] >= passes * layers * norms_per_layer
    assert calls["cross_entropy"] == chunks
    assert modeling.apply_rotary_pos_emb is original


def test_fused_glue_patches_norms_and_mlps_of_that_instance_only(calls):
    model, other = tiny("qwen2", layers=2).double(), tiny("qwen2", layers=2).double()
    glue = fg.FusedGlue(model)
    assert (glue.norms, glue.mlps, glue.fuses_rope) == (2 * 2 + 1, 2, True)
    assert all("forward" not in vars(m) for m in other.modules())
    with glue.active():
        with glue.active():
            assert modeling_qwen2.apply_rotary_pos_emb is not glue._original_rope
        assert modeling_qwen2.apply_rotary_pos_emb is not glue._original_rope
    assert glue._original_rope is None


def test_fused_glue_rope_is_restored_after_an_error(calls):
    original = modeling_qwen2.apply_rotary_pos_emb
    glue = fg.FusedGlue(tiny("qwen2", layers=1))
    with pytest.raises(RuntimeError):
        with glue.active():
            raise RuntimeError("boom")
    assert modeling_qwen2.apply_rotary_pos_emb is original


def test_fused_glue_is_refused_on_the_cpu():
    with pytest.raises(fg.FusedGlueError, match="CUDA.*use fused_glue 'none' on the CPU"):
        Engine(tiny("qwen2", layers=1), OOMBConfig(fused_glue="liger"))


def test_fused_glue_without_liger_names_the_install(monkeypatch):
    real_import = builtins.__import__

    def no_liger(name, *a, **k):
        if name.startswith("liger_kernel"):
            raise ImportError("No module named 'liger_kernel'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_liger)
    monkeypatch.setattr(fg.importlib, "import_module", lambda name: no_liger(name))
    with pytest.raises(fg.FusedGlueError, match=r"pip install 'liger-kernel>=0\.8\.5,<0\.9'"):
        fg.check_fused_glue("liger", torch.device("cuda"))
    fg.check_fused_glue("none", torch.device("cpu"))


def test_fused_glue_choice_is_checked():
    with pytest.raises(ConfigError, match="fused_glue"):
        OOMBConfig(fused_glue="apex")


def test_cli_refuses_fused_glue_on_the_cpu_in_one_line(tmp_path, capsys):
    from oomb.cli.main import main

    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--fused-glue", "liger", "--steps", "1", "--output-dir", str(out)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["oomb: error: --fused-glue 'liger' runs Triton kernels on CUDA, and the model is on cpu; "
                   "use --fused-glue 'none' on the CPU"]
    assert not out.exists()


@pytest.mark.parametrize("rows,hidden,vocab,block,mem_const,per_block", [
    (4096, 3584, 152064, 1024, 14, 1024),  # Qwen2.5-7B shape, loss_chunk_size 1024: 4 blocks (Liger's default: 32 of 128 rows)
    (4096, 3584, 152064, 4096, 43, 4096),  # one block of every row
    (4096, 3584, 152064, 100, 1, 128),  # below Liger's smallest block: its default
    (4096, 896, 151936, 1024, 56, 1024),  # Qwen2.5-0.5B shape
    (300, 64, 1000, 1024, 16, 300),  # fewer rows than a block
])
def test_liger_blocks_are_the_largest_within_loss_chunk_size(rows, hidden, vocab, block, mem_const, per_block):
    c = fg.liger_chunk_mem_const(rows, hidden, vocab, block)
    assert (c, fg._liger_rows_per_block(rows, hidden, vocab, c)) == (mem_const, per_block)
    if c < -(-vocab // hidden):
        assert fg._liger_rows_per_block(rows, hidden, vocab, c + 1) > block  # one more would exceed the block


def test_bench_hf_baseline_runs_the_same_glue(calls):
    """oomb bench with fused_glue='liger' compares glue for glue: the HF step runs the fused functions too (its
    loss equals the unfused HF step's on the same tokens, the stand-ins being exact)."""
    from oomb.bench import bench_rows, hf_step

    original = modeling_qwen2.apply_rotary_pos_emb
    model = tiny("qwen2", layers=2).double()
    cfg = OOMBConfig(chunk_size=8, page_size=4, attention_backend="torch", fused_glue="liger", loss_chunk_size=8)
    rows = bench_rows(model, [32], cfg, systems=["hf"], steps=1, seed=0)
    # per layer one forward and one checkpoint rerun; one fused cross-entropy over the whole sequence
    assert calls["cross_entropy"] == 1 and calls["swiglu"] == 2 * 2 and calls["rope"] == 2 * 2
    assert calls["rms_norm"] >= 2 * 2 * 2
    assert modeling_qwen2.apply_rotary_pos_emb is original
    ids = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(32))
    unfused = tiny("qwen2", layers=2).double()
    unfused.load_state_dict(model.state_dict())
    assert rows[0]["loss"] == pytest.approx(hf_step(unfused, ids, 8), rel=1e-6)  # the fused loss is float32
