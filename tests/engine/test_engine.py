"""Dense chunk-recurrent training equals full-sequence training of the same HF model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    BertConfig,
    BertForMaskedLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from oomb import Engine, OOMBConfig, UnsupportedModelError
from oomb.config import SparseConfig
from configs import engine_config
from oomb.engine.kv_store import PagedKVStore

VOCAB = 101


def tiny(family: str, heads: int = 4, kv_heads: int = 2, head_dim: int = 8, layers: int = 2, **extra):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=heads * head_dim,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    common.update(extra)
    if family == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common))
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**common))
    if family == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(head_dim=head_dim, **common))
    if family == "mistral":
        return MistralForCausalLM(MistralConfig(sliding_window=None, **common))
    raise ValueError(family)


def clone_model(model):
    twin = type(model)(model.config.__class__.from_dict(model.config.to_dict()))
    twin.load_state_dict(model.state_dict())
    p = next(model.parameters())
    return twin.to(device=p.device, dtype=p.dtype)


def reference_step(model, input_ids, labels):
    """Plain full-sequence training: SDPA attention over the whole sequence, mean CE over valid labels."""
    model.set_attn_implementation("sdpa")
    logits = model(input_ids=input_ids).logits[0]
    targets = torch.cat([labels[0, 1:], torch.tensor([-100])])
    loss = F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), targets, ignore_index=-100)
    loss.backward()
    return loss.item()


def max_rel_grad_error(model, ref):
    worst, where = 0.0, None
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.grad is not None, f"no gradient for {name}"
        denom = r.grad.norm().item()
        err = (p.grad - r.grad).norm().item() / max(denom, 1e-30)
        if err > worst:
            worst, where = err, name
    return worst, where


def run_parity(model, T, chunk, page, labels_fn=None, dtype=torch.float64, seed=0, shuffle_pages=True, **cfg):
    torch.manual_seed(seed)
    model = model.to(dtype)
    ref = clone_model(model)
    input_ids = torch.randint(0, VOCAB, (1, T))
    labels = input_ids.clone() if labels_fn is None else labels_fn(input_ids.clone())
    ref_loss = reference_step(ref, input_ids, labels)

    cfg.setdefault("attention_backend", "torch")
    engine = Engine(model, engine_config(chunk_size=chunk, page_size=page, **cfg))
    if shuffle_pages:
        gen = torch.Generator().manual_seed(seed + 1)
        orig_reset = PagedKVStore.reset

        def shuffled_reset(self):
            orig_reset(self)
            self.shuffle_free_list(gen)

        PagedKVStore.reset = shuffled_reset
        try:
            out = engine.step(input_ids, labels)
        finally:
            PagedKVStore.reset = orig_reset
    else:
        out = engine.step(input_ids, labels)
    return out, ref_loss, max_rel_grad_error(model, ref), engine


CASES = [
    # family, heads, kv_heads, T, chunk, page
    ("qwen2", 4, 2, 40, 40, 8),  # a single chunk
    ("qwen2", 4, 2, 64, 8, 4),  # many chunks, exact multiple
    ("qwen2", 7, 1, 45, 12, 4),  # GQA 7:1, T multiple of neither chunk nor page
    ("llama", 4, 2, 37, 10, 5),  # odd sizes
    ("llama", 7, 1, 50, 16, 16),  # chunk == page
    ("qwen3", 4, 2, 33, 8, 4),  # q/k norms
    ("qwen3", 7, 1, 29, 6, 3),
    ("mistral", 4, 4, 30, 8, 8),  # MHA
]


@pytest.mark.parametrize("family,heads,kv_heads,T,chunk,page", CASES)
def test_dense_parity_fp64(family, heads, kv_heads, T, chunk, page):
    model = tiny(family, heads, kv_heads)
    out, ref_loss, (err, where), _ = run_parity(model, T, chunk, page)
    assert abs(out.loss - ref_loss) <= 1e-10 * abs(ref_loss), (out.loss, ref_loss)
    assert err <= 1e-10, f"worst gradient {where}: rel err {err:.3e}"
    assert out.num_tokens == T and out.num_valid_tokens == T - 1


@pytest.mark.parametrize("family,heads,kv_heads", [("qwen2", 4, 2), ("llama", 7, 1), ("qwen3", 4, 2)])
def test_dense_parity_fp32(family, heads, kv_heads):
    model = tiny(family, heads, kv_heads)
    out, ref_loss, (err, where), _ = run_parity(model, 57, 16, 8, dtype=torch.float32)
    assert abs(out.loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert err <= 1e-5, f"worst gradient {where}: rel err {err:.3e}"


def ignore_some(ids):
    ids[0, 3:7] = -100  # scattered
    ids[0, 16:32] = -100  # the whole second chunk (chunk 16) and its boundary
    ids[0, -1] = -100
    return ids


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_ignored_labels_including_whole_chunk(family):
    model = tiny(family, 4, 2)
    out, ref_loss, (err, where), _ = run_parity(model, 61, 16, 8, labels_fn=ignore_some)
    assert abs(out.loss - ref_loss) <= 1e-10 * abs(ref_loss)
    assert err <= 1e-10, f"worst gradient {where}: rel err {err:.3e}"


def test_last_chunk_without_labels():
    def ignore_tail(ids):
        ids[0, 40:] = -100
        return ids

    out, ref_loss, (err, where), _ = run_parity(tiny("qwen2"), 50, 8, 4, labels_fn=ignore_tail)
    assert abs(out.loss - ref_loss) <= 1e-10 * abs(ref_loss)
    assert err <= 1e-10, f"worst gradient {where}: rel err {err:.3e}"


def test_per_layer_checkpointing_same_gradients():
    out, ref_loss, (err, where), _ = run_parity(tiny("qwen2", 4, 2, layers=3), 40, 8, 4, checkpoint_layers=True)
    assert abs(out.loss - ref_loss) <= 1e-10 * abs(ref_loss)
    assert err <= 1e-10, f"worst gradient {where}: rel err {err:.3e}"


def test_llama3_rope_scaling_and_tied_embeddings():
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16, "rope_theta": 10000.0}
    model = tiny("llama", 4, 2, rope_parameters=rope, tie_word_embeddings=True)
    out, ref_loss, (err, where), _ = run_parity(model, 44, 8, 4)
    assert abs(out.loss - ref_loss) <= 1e-10 * abs(ref_loss)
    assert err <= 1e-10, f"worst gradient {where}: rel err {err:.3e}"


def test_small_loss_blocks_and_attention_blocks():
    # Logits in blocks of 3 tokens; the reference attention's past blocks of one page.
    out, ref_loss, (err, where), _ = run_parity(tiny("qwen2"), 41, 12, 4, loss_chunk_size=3, attention_block_size=4)
    assert abs(out.loss - ref_loss) <= 1e-10 * abs(ref_loss)
    assert err <= 1e-10, f"worst gradient {where}: rel err {err:.3e}"


def test_two_steps_accumulate_and_pages_released():
    torch.manual_seed(0)
    model = tiny("qwen2").double()
    ref = clone_model(model)
    ids = torch.randint(0, VOCAB, (1, 30))
    engine = Engine(model, engine_config(chunk_size=8, page_size=4, attention_backend="torch"))
    engine.step(ids)
    store = engine.kv_store
    assert store.num_free_pages == store.num_pages  # every page back after the step
    engine.step(ids)  # reuses the pool and accumulates
    reference_step(ref, ids, ids)
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, 2 * r.grad, rtol=1e-10, atol=1e-12)


def test_evaluate_matches_reference():
    torch.manual_seed(0)
    model = tiny("qwen3").double()
    ref = clone_model(model)
    ids = torch.randint(0, VOCAB, (1, 35))
    engine = Engine(model, engine_config(chunk_size=8, page_size=4, attention_backend="torch"))
    loss = engine.evaluate(ids)
    ref_loss = reference_step(ref, ids, ids)
    assert abs(loss - ref_loss) <= 1e-10 * ref_loss
    assert all(p.grad is None for p in model.parameters())


def _saved_bytes_per_chunk(T, chunk=16, page=8):
    """Peak bytes of tensors saved for backward while one Stage-2 chunk is alive."""
    torch.manual_seed(0)
    model = tiny("qwen2", 4, 2, layers=2).double()
    engine = Engine(model, engine_config(chunk_size=chunk, page_size=page, attention_backend="torch"))
    live = {"now": 0, "peak": 0}
    pool_storages = set()

    def pack(t):
        nbytes = t.numel() * t.element_size()
        live["now"] += nbytes
        live["peak"] = max(live["peak"], live["now"])
        if engine.kv_store is not None:
            for pool in (engine.kv_store.k_cache, engine.kv_store.v_cache, engine.kv_store.dk_cache, engine.kv_store.dv_cache):
                if t.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr():
                    pool_storages.add(True)
        return (t, nbytes)

    def unpack(packed):
        return packed[0]

    orig_backward = torch.Tensor.backward

    def backward_and_reset(self, *a, **k):
        orig_backward(self, *a, **k)
        live["now"] = 0  # the chunk's graph is freed after its backward

    torch.Tensor.backward = backward_and_reset
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            engine.step(torch.randint(0, VOCAB, (1, T)))
    finally:
        torch.Tensor.backward = orig_backward
    return live["peak"], engine.kv_store.nbytes, bool(pool_storages)


def test_activation_memory_does_not_grow_with_length():
    peak_short, store_short, saved_pool_short = _saved_bytes_per_chunk(64)
    peak_long, store_long, saved_pool_long = _saved_bytes_per_chunk(256)
    # Activations saved for backward depend on the chunk only ...
    assert peak_short == peak_long, (peak_short, peak_long)
    # ... the KV store is what grows with length (4x tokens -> 4x pages) ...
    assert store_long == 4 * store_short
    # ... and the page pools are never saved as activations.
    assert not saved_pool_short and not saved_pool_long


def test_bad_inputs():
    model = tiny("qwen2").double()
    engine = Engine(model, engine_config(chunk_size=8, page_size=4, attention_backend="torch"))
    with pytest.raises(ValueError, match="batch size 2"):
        engine.step(torch.zeros(2, 10, dtype=torch.long))
    with pytest.raises(ValueError, match="at least 2"):
        engine.step(torch.zeros(1, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        engine.step(torch.full((1, 10), VOCAB, dtype=torch.long))
    with pytest.raises(ValueError, match="every label is -100"):
        engine.step(torch.zeros(1, 10, dtype=torch.long), torch.full((1, 10), -100))
    with pytest.raises(ValueError, match=r"labels shape \(1, 9\) must match input_ids shape \(1, 10\)"):
        engine.step(torch.zeros(1, 10, dtype=torch.long), torch.zeros(1, 9, dtype=torch.long))


def _tiny_engine():
    model = tiny("qwen2", layers=1).double()
    return model, Engine(model, engine_config(chunk_size=8, page_size=4, attention_backend="torch"))


@pytest.mark.parametrize("bad", [-1, -101, VOCAB, VOCAB + 50])
def test_bad_label_values(bad):
    # A ValueError naming the value and the fix, not cross_entropy's "IndexError: Target -1 is out of bounds"
    # (a device-side assert on CUDA).
    _, engine = _tiny_engine()
    ids = torch.arange(10).unsqueeze(0)
    labels = ids.clone()
    labels[0, 5] = bad
    with pytest.raises(ValueError, match=rf"label {bad} is outside the model's vocabulary \[0, {VOCAB}\).*-100 \(the ignore index\)"):
        engine.step(ids, labels)
    with pytest.raises(ValueError, match=rf"label {bad} is outside"):
        engine.evaluate(ids, labels)
    with pytest.raises(ValueError, match=rf"label {bad} is outside"):
        engine.step(ids, torch.full_like(ids, bad))


def test_ignored_labels_and_valid_calls_still_work():
    model, engine = _tiny_engine()
    ids = torch.arange(12).unsqueeze(0)
    labels = ids.clone()
    labels[0, :6] = -100
    labels[0, -1] = VOCAB - 1  # the top of the vocabulary is a valid target
    out = engine.step(ids, labels)
    assert out.num_valid_tokens == 6 and torch.isfinite(torch.tensor(out.loss))
    assert torch.isfinite(torch.tensor(engine.evaluate(ids, labels)))
    # Other integer dtypes are accepted like int64 (and give the same loss).
    assert engine.evaluate(ids.int(), labels.int()) == pytest.approx(engine.evaluate(ids, labels))
    assert engine.count_valid_tokens(ids, labels.to(torch.int16)) == 6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.bool])
def test_non_integer_labels_and_ids(dtype):
    # Float labels or ids are refused, not truncated silently into token ids.
    _, engine = _tiny_engine()
    ids = torch.arange(10).unsqueeze(0)
    with pytest.raises(ValueError, match=rf"labels must be integer token ids.*got {dtype}"):
        engine.step(ids, ids.to(dtype))
    with pytest.raises(ValueError, match=rf"labels must be integer token ids.*got {dtype}"):
        engine.evaluate(ids, ids.to(dtype))
    with pytest.raises(ValueError, match=rf"input_ids must be integer token ids.*got {dtype}"):
        engine.step(ids.to(dtype))
    with pytest.raises(TypeError, match="labels must be a torch.Tensor"):
        engine.step(ids, ids[0].tolist())


@pytest.mark.parametrize("config, said", [
    ({"chunk_size": 128}, "got dict; pass OOMBConfig(chunk_size=128)"),
    ({}, "got dict; pass OOMBConfig()"),  # not read as the defaults for being empty
    (OOMBConfig, "got the class OOMBConfig itself; pass OOMBConfig()"),
    (SparseConfig(), "got SparseConfig; pass OOMBConfig("),
])
def test_a_config_of_another_type_is_a_type_error_before_the_model_is_changed(config, said):
    """README: a TypeError for an argument of the wrong type, not an AttributeError from inside the engine after
    the model's attention was switched to oomb's."""
    model = tiny("qwen2", layers=1)
    before = model.config._attn_implementation
    with pytest.raises(TypeError, match=r"^config must be an OOMBConfig") as info:
        Engine(model, config)
    assert said in str(info.value)
    assert model.config._attn_implementation == before


def test_a_model_that_is_not_a_module_is_a_type_error():
    from oomb import build_model, check_model_supported

    for call in (lambda: Engine("tiny"), lambda: check_model_supported("tiny")):
        with pytest.raises(TypeError, match=r"model must be a torch.nn.Module .*got str; pass oomb.build_model"):
            call()
    with pytest.raises(TypeError, match=r"name_or_path must be a preset name or a local model folder, got NoneType"):
        build_model(None)


def test_frozen_model_step_refused_evaluate_fine():
    # A fully frozen model failed deep in autograd ("element 0 of tensors does not require grad").
    model, engine = _tiny_engine()
    model.requires_grad_(False)
    ids = torch.arange(10).unsqueeze(0)
    with pytest.raises(ValueError, match=r"no trainable parameters.*unfreeze some or use evaluate\(\)"):
        engine.step(ids)
    assert torch.isfinite(torch.tensor(engine.evaluate(ids)))
    model.lm_head.weight.requires_grad_(True)  # one trainable tensor is enough
    engine.step(ids)
    assert model.lm_head.weight.grad is not None


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(chunk_size=0), "chunk_size is 0; pass a positive number of tokens"),
        (dict(page_size=-4), "page_size is -4; pass a positive number of tokens"),
        (dict(chunk_size=100, page_size=64), "multiple of page_size"),
        (dict(attention_backend="cuda"), "attention_backend is .cuda.; pass one of"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        engine_config(**kwargs)


def test_unsupported_architectures():
    with pytest.raises(UnsupportedModelError, match="model type 'bert'"):
        Engine(BertForMaskedLM(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16)))
    mistral = MistralForCausalLM(MistralConfig(vocab_size=50, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=1, sliding_window=4096))
    with pytest.raises(UnsupportedModelError, match="sliding_window=None"):
        Engine(mistral)
    qwen = Qwen2ForCausalLM(Qwen2Config(vocab_size=50, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True,
                                        sliding_window=8, max_window_layers=1))
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        Engine(qwen)


def test_engine_and_cli_give_one_reason_for_a_decoder_of_another_family():
    """GPT-2 is decoder-only: the Engine said 'encoder-only and encoder-decoder models have no causal KV
    recurrence' where the CLI's check (oomb.models.presets.check_config_supported) named the supported families;
    both raise the same message."""
    from transformers import AutoModelForCausalLM, GPT2Config

    from oomb.models.presets import check_config_supported

    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB)
    with pytest.raises(UnsupportedModelError) as engine_error:
        Engine(AutoModelForCausalLM.from_config(config), OOMBConfig(chunk_size=128, page_size=64))
    with pytest.raises(UnsupportedModelError) as cli_error:
        check_config_supported(config)
    assert str(engine_error.value) == str(cli_error.value)
    assert "model type 'gpt2' is not supported" in str(engine_error.value)
    assert "encoder" not in str(engine_error.value)


def test_generation_still_works_after_wrapping():
    model = tiny("qwen2").eval()
    Engine(model, engine_config(chunk_size=8, page_size=4))
    ids = torch.randint(0, VOCAB, (1, 5))
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 8)


def test_loss_normalizer_two_sequences_equal_joint_mean():
    """Two sequences with unequal valid-token counts, each normalised by the total, sum to the joint mean."""
    torch.manual_seed(3)
    model = tiny("llama", 4, 2).double()
    ref = clone_model(model)
    a = torch.randint(0, VOCAB, (1, 30))
    b = torch.randint(0, VOCAB, (1, 21))
    lb = b.clone()
    lb[0, :10] = -100
    engine = Engine(model, engine_config(chunk_size=8, page_size=4, attention_backend="torch"))
    n_total = 29 + (20 - 9)
    engine.step(a, loss_normalizer=n_total)
    engine.step(b, lb, loss_normalizer=n_total)
    # Reference: sum of both sequences' token losses over the total count.
    ref.set_attn_implementation("sdpa")
    total = 0
    for ids, lab in ((a, a), (b, lb)):
        logits = ref(input_ids=ids).logits[0]
        t = torch.cat([lab[0, 1:], torch.tensor([-100])])
        total = total + F.cross_entropy(logits, t, ignore_index=-100, reduction="sum")
    (total / n_total).backward()
    err, where = max_rel_grad_error(model, ref)
    assert err <= 1e-10, f"worst gradient {where}: rel err {err:.3e}"
    with pytest.raises(ValueError, match="loss_normalizer"):
        engine.step(a, loss_normalizer=3)


@pytest.mark.parametrize("family,lengths,chunk,page", [
    ("qwen2", [13, 1, 22, 9, 1, 17], 8, 4),  # docs ending mid-page and mid-chunk, one-token docs
    ("llama", [16, 16, 5], 8, 4),  # boundaries on chunk edges
    ("qwen3", [30, 1], 12, 4),  # a one-token document at the very end
])
def test_packed_documents_equal_separate_training(family, lengths, chunk, page):
    out, ref_loss, n_valid, (err, where), eval_loss = packed_parity(family, lengths, chunk, page)
    assert out.num_valid_tokens == n_valid
    assert abs(out.loss - ref_loss) <= 1e-10 * out.loss
    assert err <= 1e-10, f"worst gradient {where}: rel err {err:.3e}"
    assert abs(eval_loss - out.loss) <= 1e-10 * out.loss


def packed_parity(family, lengths, chunk, page, backend="torch", dtype=torch.float64):
    """Packed chunked training vs separate full-sequence training of each document."""
    torch.manual_seed(11)
    model = tiny(family, 4, 2).to(dtype)
    ref = clone_model(model)
    ref.set_attn_implementation("sdpa")
    T = sum(lengths)
    ids = torch.randint(0, VOCAB, (1, T))
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)))
    n_valid = sum(n - 1 for n in lengths)
    total = 0
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if b - a < 2:
            continue  # a one-token document predicts nothing
        doc = ids[:, a:b]
        logits = ref(input_ids=doc).logits[0]
        t = torch.cat([doc[0, 1:], torch.tensor([-100])])
        total = total + F.cross_entropy(logits, t, ignore_index=-100, reduction="sum")
    (total / n_valid).backward()

    engine = Engine(model, engine_config(chunk_size=chunk, page_size=page, attention_backend=backend))
    out = engine.step(ids, cu_seqlens=cu)
    return out, total.item() / n_valid, n_valid, max_rel_grad_error(model, ref), engine.evaluate(ids, cu_seqlens=cu)


@pytest.mark.parametrize("cu", [[0, 5, 5, 10], [1, 10], [0, 9], [0, 6, 4, 10]])
def test_bad_cu_seqlens(cu):
    engine = Engine(tiny("qwen2").double(), engine_config(chunk_size=8, page_size=4, attention_backend="torch"))
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        engine.step(torch.zeros(1, 10, dtype=torch.long), cu_seqlens=torch.tensor(cu))


@pytest.mark.parametrize("rope", [
    {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 16},
])
def test_rope_scaling_types_match_full_sequence(rope):
    # max_position_embeddings 16 < T: dynamic NTK rescales, and must do so as for the whole sequence.
    model = tiny("llama", 4, 2, rope_parameters=rope, max_position_embeddings=16)
    out, ref_loss, (err, where), _ = run_parity(model, 44, 8, 4)
    assert abs(out.loss - ref_loss) <= 1e-10 * abs(ref_loss)
    assert err <= 1e-10, f"worst gradient {where}: rel err {err:.3e}"


def test_reserve_allocates_the_store_up_front():
    engine = Engine(tiny("qwen2").double(), engine_config(chunk_size=8, page_size=4, attention_backend="torch"))
    store = engine.reserve(30)
    assert store.num_pages == 2 * 8 and engine.kv_store is store
    with pytest.raises(ValueError, match="seq_len must be"):
        engine.reserve(1)


def test_count_valid_tokens_matches_step():
    engine = Engine(tiny("qwen2").double(), engine_config(chunk_size=8, page_size=4, attention_backend="torch"))
    ids = torch.randint(0, VOCAB, (1, 20))
    labels = ids.clone()
    labels[0, 5:9] = -100
    cu = torch.tensor([0, 12, 20])  # the boundary drops one more target
    n = engine.count_valid_tokens(ids, labels, cu)
    assert n == engine.step(ids, labels, cu_seqlens=cu).num_valid_tokens == 19 - 4 - 1


def test_sparse_options_live_in_their_section_and_are_checked_there():
    """Sparse options exist only inside a SparseConfig (sparse=None is dense), so none can be set and silently
    ignored; the section checks its values; dense() drops it and keeps the rest."""
    from oomb.config import ConfigError

    assert OOMBConfig().sparse is None and OOMBConfig(sparse=True).sparse == SparseConfig()
    with pytest.raises(ConfigError, match=r"page_budget is -1; pass 0 or a positive number of pages"):
        SparseConfig(page_budget=-1)
    with pytest.raises(ConfigError, match=r"score is 'max'; pass one of 'mean', 'quest'"):
        SparseConfig(score="max")
    with pytest.raises(ConfigError, match=r"attends to no past page"):
        SparseConfig(page_budget=0, sink_pages=0, local_pages=0)
    cfg = OOMBConfig(sparse=SparseConfig(page_budget=16, local_pages=2, score="quest"))
    dense = cfg.dense()
    assert dense.sparse is None and cfg.sparse.page_budget == 16
    assert dense.chunk_size == cfg.chunk_size
