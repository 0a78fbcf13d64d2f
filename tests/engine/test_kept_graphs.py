"""keep_graphs: chunks whose Stage-1 forward keeps its autograd graph for Stage 2 give bitwise the same step (loss
and every gradient) as recomputing them, Stage 2 really skips their forward, and a kept forward that runs out of
GPU memory falls back to the recompute without changing the step."""

import re
import warnings

import pytest
import torch

import oomb.engine.chunk_context as chunk_context
import oomb.ops.paged_attention as pa
from oomb import Engine
from oomb.config import ConfigError, OOMBConfig
from oomb.engine.kept_graphs import GraphBudget
from oomb.memory import allocator_reserve_bytes
from configs import engine_config
from test_engine import VOCAB, clone_model, reference_step, tiny

GiB = 2**30


def _step(model, ids, cu=None, **cfg):
    cfg.setdefault("attention_backend", "torch")
    engine = Engine(model, engine_config(**cfg))
    model.zero_grad(set_to_none=True)
    return engine.step(ids, cu_seqlens=cu), engine


def _assert_same_step(a, model_a, b, model_b):
    assert a.loss == b.loss, (a.loss, b.loss)
    for (name, p), q in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(p.grad, q.grad), f"{name}: max diff {(p.grad - q.grad).abs().max().item():.3e}"


def _count_forwards(monkeypatch):
    calls = {"n": 0}
    fwd = pa._fwd

    def counted(*a, **k):
        calls["n"] += 1
        return fwd(*a, **k)

    monkeypatch.setattr(pa, "_fwd", counted)
    return calls


CASES = [
    # id, family, T, chunk, page, keep at most, extra config, packed
    pytest.param("qwen2", 45, 12, 4, 1, {}, False, id="one-of-four-partial-last-chunk"),
    pytest.param("llama", 40, 8, 4, 2, {"save_attention": "gpu"}, False, id="two-with-saved-attention"),
    pytest.param("qwen3", 36, 12, 4, 5, {"grad_accum_dtype": "float32"}, True, id="all-packed-float32-sums"),
    pytest.param("qwen2", 48, 8, 4, 3, {"save_attention": "host", "fused_wgrad": False}, False, id="three-host-saved"),
]


@pytest.mark.parametrize("family,T,chunk,page,most,extra,packed", CASES)
def test_kept_graphs_give_bitwise_the_same_step(monkeypatch, family, T, chunk, page, most, extra, packed):
    torch.manual_seed(T)
    model = tiny(family, 4, 2).double()
    twin = clone_model(model)
    ids = torch.randint(0, VOCAB, (1, T))
    cu = torch.tensor([0, 5, 17, 30, T]) if packed else None
    cfg = dict(chunk_size=chunk, page_size=page, **extra)
    ref, _ = _step(twin, ids, cu, **cfg)
    calls = _count_forwards(monkeypatch)
    out, _ = _step(model, ids, cu, keep_graphs="auto", keep_graphs_max=most, **cfg)
    _assert_same_step(out, model, ref, twin)
    # Stage 1 runs chunks 0..N-2 once (kept or not), Stage 2 every chunk but the kept ones (with saved attention
    # outputs: the last chunk's only).
    N, L = -(-T // chunk), model.config.num_hidden_layers
    kept = min(most, N - 1)
    assert out.kept_graphs == kept
    stage2 = L if "save_attention" in extra else (N - kept) * L
    assert calls["n"] == (N - 1) * L + stage2, calls


def test_kept_graphs_match_full_sequence_training():
    """Against plain full-sequence training (not only against the engine without kept graphs)."""
    torch.manual_seed(5)
    model = tiny("qwen2", 4, 2).double()
    twin = clone_model(model)
    ids = torch.randint(0, VOCAB, (1, 40))
    loss = reference_step(twin, ids, ids)
    out, _ = _step(model, ids, chunk_size=8, page_size=4, keep_graphs="auto", keep_graphs_max=3)
    assert out.kept_graphs == 3
    assert abs(out.loss - float(loss)) < 1e-12
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_out_of_memory_in_a_kept_forward_falls_back_to_the_recompute(monkeypatch):
    """The second kept chunk runs out of memory in its last layer, after every layer wrote its K/V: its pages are
    released, Stage 1 runs it again without autograd, Stage 2 recomputes it; the step is unchanged."""
    torch.manual_seed(6)
    model = tiny("qwen2", 4, 2).double()
    twin = clone_model(model)
    ids = torch.randint(0, VOCAB, (1, 40))
    cfg = dict(chunk_size=8, page_size=4)
    ref, _ = _step(twin, ids, **cfg)
    with_grad = chunk_context._attention_with_grad
    calls = {"n": 0}

    def failing(*a, **k):
        if torch.is_grad_enabled() and calls["n"] >= 0:
            calls["n"] += 1
            if calls["n"] == 4:  # chunk 3's layer 1 (chunks 2 and 3 are kept, two layers each)
                raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return with_grad(*a, **k)

    monkeypatch.setattr(chunk_context, "_attention_with_grad", failing)
    engine = Engine(model, engine_config(attention_backend="torch", keep_graphs="auto", keep_graphs_max=2, **cfg))
    model.zero_grad(set_to_none=True)
    with pytest.warns(UserWarning, match="ran out of memory keeping the graph of the chunk at token 24"):
        out = engine.step(ids)
    assert out.kept_graphs == 1
    _assert_same_step(out, model, ref, twin)


def test_where_no_graph_is_kept():
    """Off, and one chunk, keep none quietly; auto where it cannot keep any (the CPU without a cap, sparse
    attention, layer checkpoints) keeps none and says why once per engine; the step is the plain one."""
    torch.manual_seed(7)
    model = tiny("llama", 4, 2).double()
    ids = torch.randint(0, VOCAB, (1, 24))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for cfg in (dict(chunk_size=8), dict(chunk_size=24, keep_graphs="auto", keep_graphs_max=3)):
            out, _ = _step(model, ids, page_size=4, **cfg)
            assert out.kept_graphs == 0, cfg
    for cfg, why in ((dict(), "no --keep-graphs-max on the CPU"),
                     (dict(keep_graphs_max=2, sparse=True, page_budget=1), "sparse attention"),
                     (dict(keep_graphs_max=2, checkpoint_layers=True), "--checkpoint-layers")):
        engine = Engine(model, engine_config(chunk_size=8, page_size=4, attention_backend="torch", keep_graphs="auto",
                                             **cfg))
        with pytest.warns(UserWarning, match=f"keeps no chunk graph with {re.escape(why)}"):
            assert engine.step(ids).kept_graphs == 0
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert engine.step(ids).kept_graphs == 0


def test_config_refuses_bad_values():
    with pytest.raises(ConfigError, match="keep_graphs_max is -1"):
        OOMBConfig(keep_graphs="auto", keep_graphs_max=-1)
    with pytest.raises(ConfigError, match="keep_graphs is 'on'; pass one of 'off', 'auto'"):
        OOMBConfig(keep_graphs="on")


def test_keep_graphs_max_without_keep_graphs_auto_is_refused():
    """A cap on the graphs keep_graphs 'auto' keeps, with keep_graphs 'off', was ignored without a word (as
    checkpoint_attention without checkpoint_layers is not): the configuration refuses it, naming both fixes."""
    with pytest.raises(ConfigError, match="keep_graphs_max caps the chunk graphs keep_graphs auto keeps, and "
                                          "keep_graphs is 'off', which keeps none; pass keep_graphs auto, or leave "
                                          "keep_graphs_max out"):
        OOMBConfig(keep_graphs_max=2)
    assert OOMBConfig(keep_graphs="auto", keep_graphs_max=2).keep_graphs_max == 2


def test_graph_budget_counts_what_fits():
    b = GraphBudget()
    assert b.chunks(100, 10, 80 * GiB, 80 * GiB, 9) == 0  # nothing measured yet
    b.note_graph(8, 8 * GiB)  # a short last chunk: 1 GiB per token
    b.note_step(100, peak=30 * GiB, start=10 * GiB, kept=0, chunk_size=10)
    assert b.chunk_bytes(10) == 10 * GiB and b.work == (100, 20 * GiB)
    reserve = allocator_reserve_bytes(80 * GiB)
    assert reserve == int(0.03 * 80 * GiB)
    # 70 GiB free - 20 GiB of work - 2.4 GiB reserve = 47.6 GiB: four 10-GiB graphs
    assert b.chunks(100, 10, 70 * GiB, 80 * GiB, 9) == 4
    assert b.chunks(100, 10, 70 * GiB, 80 * GiB, 3) == 3  # the cap
    assert b.chunks(60, 10, 70 * GiB, 80 * GiB, 9) == 4  # shorter than measured: the longer one's work
    assert b.chunks(101, 10, 70 * GiB, 80 * GiB, 9) == 0  # longer than measured: none until measured
    assert b.chunks(100, 10, 20 * GiB, 80 * GiB, 9) == 0  # no room
    # A step that kept 4 graphs: its work is its peak less them.
    b.note_step(100, peak=70 * GiB, start=10 * GiB, kept=4, chunk_size=10)
    assert b.work == (100, 20 * GiB)
    b.note_graph(10, 5 * GiB)  # a smaller graph later: the largest measured stays
    assert b.chunk_bytes(10) == 10 * GiB


@pytest.mark.cuda(reason="the number of kept graphs is read from CUDA memory")
def test_auto_keeps_what_fits_on_cuda_and_the_step_is_unchanged():
    """On CUDA the first step measures and keeps none; the second keeps every Stage-1 chunk of a small model, and
    its gradients equal the recomputing engine's on the same GPU kernels."""
    torch.manual_seed(8)
    model = tiny("qwen2", 4, 2, head_dim=64, layers=3).to("cuda", torch.float32)
    twin = clone_model(model)
    ids = torch.randint(0, VOCAB, (1, 1000), device="cuda")
    cfg = dict(chunk_size=128, page_size=64, attention_backend="triton")
    ref, _ = _step(twin, ids, **cfg)
    engine = Engine(model, engine_config(keep_graphs="auto", **cfg))
    outs = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        outs.append(engine.step(ids))
    assert outs[0].kept_graphs == 0 and outs[1].kept_graphs == 7, [o.kept_graphs for o in outs]
    assert engine._graph_budget.bytes_per_token > 0
    assert abs(outs[1].loss - ref.loss) <= 1e-6 * ref.loss
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
