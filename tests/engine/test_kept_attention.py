"""checkpoint_attention: the rerun of a checkpointed layer reuses the attention outputs of the chunk's first forward.

Counted: how many attention forwards run per chunk and stage (dense on each backend, sparse; with and without
per-layer checkpointing and save_attention). Checked: the gradients equal full-sequence training (fp64, to
rounding), and bitwise those of rerunning the attention; the kept bytes are what the memory model counts.
"""

from __future__ import annotations

import collections
import re

import pytest
import torch
from configs import engine_config

from oomb.engine.chunk_context import ChunkContext
import oomb.ops.paged_attention as pa
import oomb.ops.sparse_attention as sp
from oomb import Engine
from oomb.config import ConfigError
from oomb.engine.kept_attention import KeptAttention
from oomb.engine.sparse_state import SparseAttentionState
from oomb.memory import ModelShape, activation_bytes
from oomb.models.presets import preset_config
from tests.engine.test_engine import VOCAB, clone_model, run_parity, tiny
from tests.engine.test_sparse_engine import masked_reference

SPARSE = {"sparse": True, "page_budget": 1, "sink_pages": 0, "local_pages": 1, "sparse_block_size": 4}


class _ForwardCounter:
    """Attention forward kernels run (dense and sparse paths), per (stage, chunk): ``counts[(stage, chunk)]``."""

    def __init__(self, monkeypatch, chunk_size: int) -> None:
        self.counts: collections.Counter = collections.Counter()
        self.sparse_calls = 0  # of them, the sparse kernel's (a selection that drops pages)
        self._now = None
        fwd, sfwd, attend = pa._fwd, sp._sparse_fwd, ChunkContext.attend

        def counted(f, sparse=False):
            def run(*a, **k):
                self.counts[self._now] += 1
                self.sparse_calls += sparse
                return f(*a, **k)
            return run

        def attend_noted(ctx, *a, **k):
            self._now = (ctx.stage, ctx.start // chunk_size)
            return attend(ctx, *a, **k)

        monkeypatch.setattr(pa, "_fwd", counted(fwd))
        monkeypatch.setattr(sp, "_sparse_fwd", counted(sfwd, sparse=True))
        monkeypatch.setattr(ChunkContext, "attend", attend_noted)


def _expected(N: int, L: int, ckpt: str, save: str) -> dict:
    """Attention forwards per (stage, chunk): the table of docs/design.md, "Attention across layer checkpoints".
    Per layer: Stage 1 for chunks 0..N-2; in Stage 2 the forward unless save_attention gives Stage 1's outputs
    (chunks 0..N-2), and the layer rerun only with checkpoint_attention 'recompute' where those are not given."""
    counts = {(1, c): L for c in range(N - 1)}
    for c in range(N):
        reused = save != "off" and c < N - 1
        n = (0 if reused else 1) + (1 if ckpt == "recompute" and not reused else 0)
        if n:
            counts[(2, c)] = n * L
    return counts


_SETTINGS = [(ckpt, save) for ckpt in ("off", "keep", "recompute") for save in ("off", "gpu")]


# Every (checkpoint_attention, save_attention) pair on the PyTorch backends; on Triton (the interpreter: slow) the
# two pairs whose counts differ most from the plain step, for the dense and the sparse kernels' routes.
@pytest.mark.parametrize("backend,sparse,ckpt,save", [
    *[(b, sp, c, s) for b, sp in (("torch", False), ("sdpa", False), ("torch", True)) for c, s in _SETTINGS],
    *[("triton", sp, c, s) for sp in (False, True) for c, s in (("recompute", "off"), ("keep", "gpu"))]])
def test_attention_forwards_per_chunk(monkeypatch, backend, sparse, ckpt, save):
    torch.manual_seed(0)
    # 5 chunks; 3 under the Triton interpreter (still a chunk of each kind: the first, one between, the last, whose
    # past of 4 pages is more than the sparse selection's 2)
    L, T, C = 3, 24 if backend == "triton" else 40, 8
    model = tiny("qwen2", 4, 2, layers=L).to(torch.float32 if backend == "triton" else torch.float64)
    cfg = dict(chunk_size=C, page_size=4, attention_backend=backend, checkpoint_layers=ckpt != "off",
               save_attention=save, **(SPARSE if sparse else {}))
    if ckpt != "off":
        cfg["checkpoint_attention"] = ckpt
    engine = Engine(model, engine_config(**cfg))
    count = _ForwardCounter(monkeypatch, C)
    engine.step(torch.randint(0, VOCAB, (1, T)))
    assert dict(count.counts) == _expected(T // C, L, ckpt, save)
    assert (count.sparse_calls > 0) == sparse  # the sparse kernels' route really ran: pages were dropped
    if ckpt == "keep":  # 2 per chunk and layer (the last chunk: 1), 1 with save_attention: as without checkpoints
        assert dict(count.counts) == _expected(T // C, L, "off", save)
        assert engine._kept.nbytes == 0  # every layer's pair taken by its rerun, or cleared


def _step(model, ids, **cfg):
    cfg.setdefault("attention_backend", "torch")
    engine = Engine(model, engine_config(**cfg))
    return engine.step(ids), engine


@pytest.mark.parametrize("backend", ["torch", "sdpa"])
@pytest.mark.parametrize("family,heads,kv_heads,layers,T,chunk,page", [
    ("qwen2", 4, 2, 4, 45, 8, 4),  # several layers, 6 chunks, partial last chunk
    ("llama", 7, 1, 3, 40, 8, 4),  # GQA 7:1
    ("qwen3", 4, 2, 3, 33, 12, 4),  # q/k norms
])
def test_kept_outputs_train_like_the_full_sequence_dense(backend, family, heads, kv_heads, layers, T, chunk, page):
    model = tiny(family, heads, kv_heads, layers=layers)
    out, ref_loss, (err, where), engine = run_parity(model, T, chunk, page, checkpoint_layers=True,
                                                     attention_backend=backend)
    assert engine._kept is not None
    assert abs(out.loss - ref_loss) <= 1e-10 * abs(ref_loss)
    assert err <= 1e-10, f"worst gradient {where}: rel err {err:.3e}"


@pytest.mark.parametrize("layers,T,chunk", [(3, 52, 12), (4, 64, 8)])
def test_kept_outputs_train_like_the_full_sequence_sparse(monkeypatch, layers, T, chunk):
    """Full-sequence training of the dense model masked by the selections the sparse step made."""
    monkeypatch.setattr(SparseAttentionState, "release", lambda self, start: None)  # keep every selection
    torch.manual_seed(2)
    page = 4
    model = tiny("qwen2", 4, 2, layers=layers).double()
    ref = clone_model(model)
    ids = torch.randint(0, VOCAB, (1, T))
    out, engine = _step(model, ids, chunk_size=chunk, page_size=page, checkpoint_layers=True, **SPARSE)
    selections = engine.sparse_state.selections
    assert any(not sel.dense for sel in selections.values())
    ref_loss = masked_reference(ref, ids, selections, chunk, page)
    assert abs(out.loss - ref_loss) <= 1e-12 * ref_loss, (out.loss, ref_loss)
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        err = (p.grad - r.grad).norm() / r.grad.norm()
        assert err <= 1e-10, f"{name}: rel err {err:.3e}"


@pytest.mark.parametrize("extra", [
    pytest.param({}, id="dense"),
    pytest.param({"attention_backend": "sdpa"}, id="dense-sdpa"),
    pytest.param(SPARSE, id="sparse"),
    pytest.param({"save_attention": "host"}, id="save-attention"),
    pytest.param({"offload": True, "offload_segment_pages": 1}, id="segmented-offload"),
    pytest.param(dict(offload=True, **SPARSE), id="sparse-whole-layer-offload"),
])
def test_kept_outputs_give_bitwise_the_step_of_rerunning_the_attention(extra):
    torch.manual_seed(5)
    model = tiny("qwen2", 4, 2, layers=3).double()
    twin = clone_model(model)
    ids = torch.randint(0, VOCAB, (1, 44))
    cfg = dict(chunk_size=8, page_size=4, checkpoint_layers=True, **extra)
    out, _ = _step(model, ids, **cfg)
    ref, _ = _step(twin, ids, checkpoint_attention="recompute", **cfg)
    assert out.loss == ref.loss
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad), f"{name}: max diff {(p.grad - q.grad).abs().max().item():.3e}"


def test_kept_bytes_peak_at_one_chunk_of_all_layers(monkeypatch):
    """At most one chunk's out and lse of every layer are kept, and the memory model counts exactly that."""
    torch.manual_seed(1)
    L, heads, head_dim, C = 3, 4, 8, 8
    model = tiny("qwen2", heads, 2, head_dim, layers=L).double()
    peak = [0]
    keep = KeptAttention.keep

    def tracked(self, *a):
        keep(self, *a)
        peak[0] = max(peak[0], self.nbytes)

    monkeypatch.setattr(KeptAttention, "keep", tracked)
    _step(model, torch.randint(0, VOCAB, (1, 40)), chunk_size=C, page_size=4, checkpoint_layers=True)
    per_layer = C * heads * (head_dim + 1) * 8  # fp64 out [C, Hq, D] and lse [Hq, C]
    assert peak[0] == L * per_layer
    shape = ModelShape.from_config(model.config)
    args = (shape, C, torch.float64, True, "triton")
    kept = activation_bytes(*args)["kept_attention"]
    assert activation_bytes(*args)["total"] - activation_bytes(*args, keep_attention=False)["total"] == kept
    assert kept == L * per_layer
    assert activation_bytes(shape, C, torch.float64, False, "triton", keep_attention=True) == \
        activation_bytes(shape, C, torch.float64, False, "triton", keep_attention=False)  # no checkpoints: nothing


def test_kept_bytes_of_the_7b_shape():
    """Qwen2.5-7B, chunk 4096, bf16: 28 x 4096 x (3584 x 2 B + 28 x 4 B) = 0.78 GiB."""
    shape = ModelShape.from_config(preset_config("qwen2.5-7b"))
    args = (shape, 4096, torch.bfloat16, True, "triton")
    kept = activation_bytes(*args)["kept_attention"]
    assert activation_bytes(*args)["total"] - activation_bytes(*args, keep_attention=False)["total"] == kept
    assert kept == 28 * 4096 * (3584 * 2 + 28 * 4)
    assert round(kept / 2**30, 2) == 0.78


def test_keeper_takes_each_pair_once():
    kept = KeptAttention()
    out, lse = torch.randn(4, 2, 8, requires_grad=True), torch.randn(2, 4)
    kept.keep(8, 1, out, lse)
    assert kept.take(8, 0) is None and kept.take(0, 1) is None
    o, l = kept.take(8, 1)
    assert torch.equal(o, out) and not o.requires_grad and torch.equal(l, lse)
    assert kept.take(8, 1) is None and kept.nbytes == 0
    kept.keep(0, 0, out, lse)
    kept.clear()
    assert kept.nbytes == 0


def test_bad_settings():
    with pytest.raises(ConfigError, match="checkpoint_attention is 'drop'; pass one of 'keep', 'recompute'"):
        engine_config(checkpoint_layers=True, checkpoint_attention="drop")
    with pytest.raises(ConfigError, match="without checkpoint_layers no layer is checkpointed"):
        engine_config(checkpoint_attention="recompute")
    assert Engine(tiny("qwen2"), engine_config())._kept is None  # no checkpoints: nothing kept
    assert engine_config(checkpoint_layers=True).reruns_attention is False
    assert engine_config(checkpoint_layers=True, checkpoint_attention="recompute").reruns_attention is True


@pytest.mark.cuda(reason="the Triton kernels in bf16 and the copy streams need CUDA")
@pytest.mark.parametrize("extra", [
    pytest.param({"attention_backend": "triton"}, id="triton"),
    pytest.param({"attention_backend": "triton", "sparse": True, "page_budget": 2, "sparse_block_size": 64},
                 id="sparse"),
    pytest.param({"attention_backend": "triton", "offload": True}, id="segmented-offload"),
])
def test_kept_outputs_bitwise_on_cuda_in_bf16(extra):
    """The kept outputs are bitwise what the rerun computes on the GPU too (deterministic forwards), so the step
    equals the rerunning one; the forward count halves in Stage 2 as on the CPU."""
    torch.manual_seed(7)
    model = tiny("qwen2", 4, 2, head_dim=64, layers=3).to("cuda", torch.bfloat16)
    twin = clone_model(model).to("cuda")
    ids = torch.randint(0, VOCAB, (1, 1000), device="cuda")
    cfg = dict(chunk_size=256, page_size=64, checkpoint_layers=True, **extra)
    out, engine = _step(model, ids, **cfg)
    ref, _ = _step(twin, ids, checkpoint_attention="recompute", **cfg)
    assert engine._kept is not None and out.loss == ref.loss
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad), f"{name}: max diff {(p.grad - q.grad).abs().max().item():.3e}"


@pytest.mark.cuda(reason="cuDNN's attention needs CUDA")
def test_kept_outputs_on_cuda_with_sdpa_match_to_bf16_rounding():
    """cuDNN's attention backward is not deterministic, so the step equals the rerunning one in its loss (the
    forwards are) and in its gradients to bf16 rounding only."""
    torch.manual_seed(7)
    model = tiny("qwen2", 4, 2, head_dim=64, layers=3).to("cuda", torch.bfloat16)
    twin = clone_model(model).to("cuda")
    ids = torch.randint(0, VOCAB, (1, 1000), device="cuda")
    cfg = {"chunk_size": 256, "page_size": 64, "checkpoint_layers": True, "attention_backend": "sdpa"}
    out, _ = _step(model, ids, **cfg)
    ref, _ = _step(twin, ids, checkpoint_attention="recompute", **cfg)
    assert out.loss == ref.loss
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        err = (p.grad.float() - q.grad.float()).norm() / q.grad.float().norm()
        assert err <= 1e-2, f"{name}: rel err {err:.3e}"


def test_cli_flag_and_plan_row(capsys):
    """`--checkpoint-attention recompute` without `--checkpoint-layers`: one line naming both flags, exit 2; with it
    the plan shows no kept outputs, with the default 'keep' it shows them."""
    from oomb.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["plan", "--model", "qwen2.5-7b", "--seq-len", "65536", "--checkpoint-attention", "recompute"])
    assert exc.value.code == 2
    assert "without --checkpoint-layers no layer is checkpointed" in capsys.readouterr().err
    machine = ["--gpu-gib", "139.8", "--host-gib", "125"]
    base = ["plan", "--model", "qwen2.5-7b", "--seq-len", "65536", "--checkpoint-layers", *machine]
    assert main(base) == 0
    assert re.search(r"activations: kept attention out \+ lse +0\.78\n", capsys.readouterr().out)
    assert main([*base, "--checkpoint-attention", "recompute"]) == 0
    assert "kept attention" not in capsys.readouterr().out
