"""save_attention: Stage 1's attention outputs reused by the Stage-2 recompute give bitwise the same
step (loss and every gradient) as recomputing them, and the Stage-2 attention forward really is skipped."""

import warnings

import pytest
import torch

import oomb.ops.paged_attention as pa
import oomb.ops.sparse_attention as sp
from oomb import Engine, OOMBConfig
from oomb.config import SparseConfig
from configs import engine_config
from oomb.engine.saved_attention import SavedAttention
from oomb.memory import saved_attention_bytes
from test_engine import VOCAB, clone_model, tiny


def _step(model, ids, cu=None, steps=1, **cfg):
    cfg.setdefault("attention_backend", "torch")
    engine = Engine(model, engine_config(**cfg))
    out = None
    for i in range(steps):
        model.zero_grad(set_to_none=True)
        out = engine.step(ids[i] if steps > 1 else ids, cu_seqlens=cu)
    return out, engine


def _assert_same_step(a, model_a, b, model_b):
    assert a.loss == b.loss, (a.loss, b.loss)
    for (name, p), q in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(p.grad, q.grad), f"{name}: max diff {(p.grad - q.grad).abs().max().item():.3e}"


def _count_forwards(monkeypatch):
    """Count the attention forward kernels run (dense and sparse paths)."""
    calls = {"dense": 0, "sparse": 0}
    fwd, sfwd = pa._fwd, sp._sparse_fwd

    def counted(*a, **k):
        calls["dense"] += 1
        return fwd(*a, **k)

    def scounted(*a, **k):
        calls["sparse"] += 1
        return sfwd(*a, **k)

    monkeypatch.setattr(pa, "_fwd", counted)
    monkeypatch.setattr(sp, "_sparse_fwd", scounted)
    return calls


CASES = [
    # id, family, heads, kv_heads, T, chunk, page, extra config, packed
    pytest.param("qwen2", 4, 2, 45, 12, 4, {}, False, id="gqa2-partial-last-chunk"),
    pytest.param("llama", 7, 1, 40, 8, 4, {"checkpoint_layers": True}, False, id="gqa7-checkpoint-layers"),
    pytest.param("qwen3", 4, 4, 36, 12, 4, {}, True, id="packed-documents"),
    pytest.param("qwen2", 4, 2, 52, 12, 4, dict(sparse=True, page_budget=1, sink_pages=1, local_pages=1,
                                                sparse_block_size=4), False, id="sparse-small-budget"),
]


@pytest.mark.parametrize("where", ["gpu", "host"])
@pytest.mark.parametrize("family,heads,kv_heads,T,chunk,page,extra,packed", CASES)
def test_saved_outputs_give_bitwise_the_same_step(monkeypatch, where, family, heads, kv_heads, T, chunk, page, extra, packed):
    torch.manual_seed(T)
    model = tiny(family, heads, kv_heads).double()
    twin = clone_model(model)
    ids = torch.randint(0, VOCAB, (1, T))
    cu = torch.tensor([0, 5, 17, 30, T]) if packed else None
    cfg = dict(chunk_size=chunk, page_size=page, **extra)
    ref, _ = _step(twin, ids, cu, **cfg)
    calls = _count_forwards(monkeypatch)
    out, engine = _step(model, ids, cu, save_attention=where, **cfg)
    _assert_same_step(out, model, ref, twin)

    # Forwards run: Stage 1 for chunks 0..N-2 and Stage 2 for the last chunk only (once per layer, also with
    # per-layer checkpointing, whose rerun of the layer reuses the kept outputs); a sparse step whose selections
    # cover the past takes the dense path.
    N, L = -(-T // chunk), model.config.num_hidden_layers
    assert calls["dense"] + calls["sparse"] == (N - 1) * L + L, calls
    if extra.get("sparse"):
        assert calls["sparse"] > 0


def test_saved_outputs_reused_over_steps_and_a_new_length():
    """Buffers kept from one step serve the next (same length), a new length gets new ones; each step
    equals the recomputing engine's."""
    torch.manual_seed(3)
    model = tiny("qwen2", 4, 2).double()
    twin = clone_model(model)
    e_save = Engine(model, engine_config(chunk_size=8, page_size=4, attention_backend="torch", save_attention="host"))
    e_ref = Engine(twin, engine_config(chunk_size=8, page_size=4, attention_backend="torch"))
    kept = []
    for T in (40, 40, 24):
        ids = torch.randint(0, VOCAB, (1, T))
        model.zero_grad(set_to_none=True)
        twin.zero_grad(set_to_none=True)
        _assert_same_step(e_save.step(ids), model, e_ref.step(ids), twin)
        kept.append(e_save._saved_keep)
    assert kept[0] is kept[1] and kept[2] is not kept[1]
    assert kept[2].nbytes["host"] == saved_attention_bytes(2, 4, 8, 24, 8, 8, "host")["host"]
    # evaluate() after a step neither saves nor reads saved outputs
    assert e_save._saved is None
    e_save.evaluate(torch.randint(0, VOCAB, (1, 24)))


def test_single_chunk_and_sparse_offloaded_store_recompute(monkeypatch):
    """Where nothing is kept: sparse attention under offload (whole-layer staging; a warning) and one chunk."""
    torch.manual_seed(4)
    model = tiny("llama", 4, 2).double()
    twin = clone_model(model)
    ids = torch.randint(0, VOCAB, (1, 40))
    cfg = dict(chunk_size=8, page_size=4, sparse=True, page_budget=1, sparse_block_size=4)
    ref, _ = _step(twin, ids, **cfg)
    with pytest.warns(UserWarning, match="stages whole layers"):
        out, engine = _step(model, ids, offload=True, save_attention="gpu", **cfg)
    assert engine._saved_keep is None
    _assert_same_step(out, model, ref, twin)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, engine = _step(model, ids[:, :8], chunk_size=8, page_size=4, save_attention="gpu")  # one chunk: nothing to save
    assert engine._saved_keep is None


def test_host_memory_shortage_recomputes_with_a_warning(monkeypatch):
    """On CUDA the engine checks the free host RAM for 'host' before pinning it (simulated here)."""
    import oomb.engine.engine as eng_mod

    model = tiny("qwen2").double()
    engine = Engine(model, engine_config(chunk_size=8, page_size=4, attention_backend="torch", save_attention="host"))
    monkeypatch.setattr(type(engine), "device", property(lambda self: torch.device("cuda")))
    monkeypatch.setattr(eng_mod, "host_memory", lambda: (1000, 2000))
    store = type("S", (), {})()
    with pytest.warns(UserWarning, match=r"--save-attention host \(OOMBConfig.save_attention='host'\) needs .* GiB of host memory"):
        engine._ensure_saved(40, store)
    assert engine._saved is None


def test_bad_setting_and_missing_chunk_raise():
    with pytest.raises(ValueError, match="save_attention is 'cpu'; pass one of 'off', 'gpu', 'host'"):
        engine_config(save_attention="cpu")
    saved = SavedAttention("gpu", 2, 3, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="no saved attention output for chunk 0"):
        saved.load(0, 0)
    out, lse = torch.randn(4, 2, 8), torch.randn(2, 4)
    saved.save(1, 1, out, lse)
    with pytest.raises(RuntimeError, match="chunk 2"):
        saved.load(2, 0)
    o, l = saved.load(1, 1)
    assert torch.equal(o, out) and torch.equal(l, lse) and o.stride() == out.stride()
    # the transposed layout HF's attention hands over is kept as it is
    out_t = torch.randn(2, 4, 8).transpose(0, 1)
    saved2 = SavedAttention("host", 1, 2, torch.device("cpu"))
    saved2.save(0, 0, out_t, lse)
    o, _ = saved2.load(0, 0)
    assert torch.equal(o, out_t) and o.stride() == out_t.stride()
    with pytest.raises(ValueError, match="dense"):
        SavedAttention("gpu", 1, 2, torch.device("cpu")).save(0, 0, torch.randn(4, 2, 16)[..., ::2], lse)


def test_saved_attention_bytes():
    # Qwen2.5-7B shape in bf16: 28 heads x (128 x 2 + 4) bytes = 7,280 per token and layer
    b = saved_attention_bytes(28, 28, 128, 131072, 4096, 2, "gpu")
    assert b == {"gpu": 31 * 4096 * 28 * 7280, "host": 0}
    h = saved_attention_bytes(28, 28, 128, 131072, 4096, 2, "host")
    assert h == {"gpu": 2 * 4096 * 28 * 7280, "host": b["gpu"]}
    assert saved_attention_bytes(28, 28, 128, 4096, 4096, 2, "gpu") == {"gpu": 0, "host": 0}
    assert saved_attention_bytes(28, 28, 128, 131072, 4096, 2, "off") == {"gpu": 0, "host": 0}


def test_plan_counts_saved_outputs_and_drops_them_with_offload():
    from oomb.planner import GiB, Machine, plan

    m = Machine(139 * GiB, 141 * GiB, 120 * GiB, 128 * GiB, "given")
    T = 131072
    base = plan("qwen2.5-7b", T, optimizer=None, machine=m)
    assert "tip: --save-attention host" in base.table()  # room for them: the plan says so
    assert "tip:" not in plan("qwen2.5-7b", 4096, optimizer=None, machine=m).table()  # one chunk: nothing to keep
    want = {w: saved_attention_bytes(28, 28, 128, T, 4096, 2, w) for w in ("gpu", "host")}
    for where in ("gpu", "host"):
        p = plan("qwen2.5-7b", T, optimizer=None, machine=m, save_attention=where)
        assert p.fits and p.save_attention == where and not p.tiering.offload
        assert p.gpu_peak - base.gpu_peak == want[where]["gpu"]
        assert p.host_peak - base.host_peak == want[where]["host"]
        assert f"attention outputs (save_attention={where})" in p.table()
    # With AdamW states (28 GiB for bf16 weights) on a 100 GiB GPU the outputs no longer fit beside every page:
    # planned without them, and said so
    m100 = Machine(100 * GiB, 141 * GiB, 120 * GiB, 128 * GiB, "given")
    assert plan("qwen2.5-7b", T, optimizer=None, machine=m100, save_attention="gpu").save_attention == "gpu"
    p = plan("qwen2.5-7b", T, machine=m100, save_attention="gpu")
    assert p.save_attention == "off" and "--save-attention gpu (save_attention='gpu'): not kept" in p.table()
    assert p.gpu_peak == plan("qwen2.5-7b", T, machine=m100).gpu_peak
    # Too little host memory for 'host': not kept, and the host budget is named
    small = Machine(139 * GiB, 141 * GiB, 20 * GiB, 24 * GiB, "given")
    p = plan("qwen2.5-7b", T, optimizer=None, machine=small, save_attention="host")
    assert p.fits and p.save_attention == "off" and p.host_peak == 0
    assert "needs 24.11 GiB of host memory but the host budget is 15.00 GiB" in p.table()
    # Dense offload keeps them (its Stage-2 forwards then stage nothing: less traffic); sparse offload does not
    T = 262144
    off = plan("qwen2.5-7b", T, machine=m100, offload=True)
    kept = plan("qwen2.5-7b", T, machine=m100, offload=True, save_attention="host")
    assert kept.tiering.offload and kept.save_attention == "host"
    assert kept.traffic["h2d_bytes"] < off.traffic["h2d_bytes"]
    sparse = OOMBConfig(sparse=SparseConfig())
    p = plan("qwen2.5-7b", T, machine=m100, offload=True, save_attention="host", sparse=sparse)
    assert p.save_attention == "off" and "stages whole layers" in p.table()


def test_cli_save_attention_flag(tmp_path, capsys):
    from cli_helpers import run_cli

    assert run_cli(["plan", "--seq-len", "65536", "--gpu-gib", "139", "--host-gib", "120", "--no-optimizer",
                    "--save-attention", "host"]) == 0, capsys.readouterr().err
    assert "attention outputs (save_attention=host)" in capsys.readouterr().out
    assert run_cli(["train", "--save-attention", "cpu", "--output-dir", tmp_path / "run"]) == 2
    assert "--save-attention" in capsys.readouterr().err and not (tmp_path / "run").exists()


@pytest.mark.cuda(reason="the Triton kernels in bf16 and the host copy streams need CUDA")
@pytest.mark.parametrize("where", ["gpu", "host"])
def test_saved_outputs_bitwise_on_cuda_with_triton(where):
    torch.manual_seed(7)
    model = tiny("qwen2", 4, 2, head_dim=64).to("cuda", torch.bfloat16)
    twin = clone_model(model).to("cuda")
    ids = torch.randint(0, VOCAB, (1, 1000), device="cuda")
    cfg = dict(chunk_size=256, page_size=64, attention_backend="triton")
    ref, _ = _step(twin, ids, **cfg)
    out, engine = _step(model, ids, save_attention=where, **cfg)
    assert engine._saved_keep is not None
    _assert_same_step(out, model, ref, twin)


def test_cli_train_with_saved_outputs_logs_the_same_losses_and_weights(tmp_path):
    """`oomb train --save-attention gpu|host` on the CPU: the same losses and weights as without (2 steps of AdamW)."""
    import json

    from safetensors.torch import load_file

    from oomb.cli import main

    text = tmp_path / "text.txt"
    text.write_text("It is a truth universally acknowledged, that a single man in possession of a good fortune, "
                    "must be in want of a wife.\n" * 40)
    runs = {}
    for where in ("off", "gpu", "host"):
        out = tmp_path / where
        args = ["train", "--data", str(text), "--output-dir", str(out), "--seq-len", "192", "--chunk-size", "64",
                "--page-size", "32", "--steps", "2", "--no-progress", "--save-attention", where]
        assert main(args) == 0
        losses = [json.loads(line)["loss"] for line in open(out / "log.jsonl") if '"loss"' in line]
        runs[where] = (losses, load_file(out / "model.safetensors"))
    assert len(runs["off"][0]) == 2
    for where in ("gpu", "host"):
        assert runs[where][0] == runs["off"][0], where
        for k, v in runs["off"][1].items():
            assert torch.equal(runs[where][1][k], v), (where, k)
