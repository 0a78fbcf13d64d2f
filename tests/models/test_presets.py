"""Built-in presets and loading of local Hugging Face model directories."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, BertConfig, Qwen2Config, Qwen2ForCausalLM

from oomb import Engine, UnsupportedModelError
from configs import engine_config
from oomb.data import load_tokenizer
from oomb.models.presets import PRESETS, UnknownModelError, build_model, preset_config, preset_names

TINY = ["tiny", "tiny-llama", "tiny-mistral", "tiny-qwen3"]


@pytest.mark.parametrize("name", preset_names())
def test_preset_configs_cover_the_bundled_tokenizer_and_a_million_tokens(name):
    cfg = preset_config(name)
    assert cfg.vocab_size >= len(load_tokenizer())
    assert cfg.max_position_embeddings >= 1 << 20
    assert getattr(cfg, "sliding_window", None) is None
    assert cfg.model_type in ("qwen2", "llama", "mistral", "qwen3")
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0


def test_qwen25_7b_has_the_published_shape():
    cfg = preset_config("qwen2.5-7b")
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (28, 3584, 28, 4)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.rope_parameters["rope_theta"]) == (18944, 152064, 1e6)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    n = sum(p.numel() for p in model.parameters())
    assert 7.5e9 < n < 7.7e9  # Qwen2.5-7B: 7.62B parameters


@pytest.mark.parametrize("name, low, high", [("qwen2.5-32b", 32.5e9, 33.0e9), ("qwen2.5-72b", 72.5e9, 72.9e9)])
def test_the_large_qwen25_presets_have_the_published_sizes(name, low, high):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(preset_config(name))
    assert low < sum(p.numel() for p in model.parameters()) < high  # Qwen2.5-32B: 32.8B; 72B: 72.7B parameters


def test_qwen25_05b_has_the_published_shape():
    cfg = preset_config("qwen2.5-0.5b")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    n = sum(p.numel() for p in model.parameters())
    assert 4.8e8 < n < 5.0e8  # Qwen2.5-0.5B: 494M parameters (tied embeddings)


@pytest.mark.parametrize("name", TINY)
def test_tiny_presets_train_with_the_engine(name):
    torch.manual_seed(0)
    model = build_model(name)
    assert model.training and model.dtype == torch.float32
    engine = Engine(model, engine_config(chunk_size=32, page_size=16))
    ids = torch.randint(0, model.config.vocab_size, (1, 80))
    out = engine.step(ids)
    assert abs(out.loss - torch.log(torch.tensor(32000.0)).item()) < 0.5  # random init: ~ln(vocab)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_presets_are_seeded_and_dtype_follows_the_argument():
    torch.manual_seed(3)
    a = build_model("tiny")
    torch.manual_seed(3)
    b = build_model("tiny", dtype=torch.bfloat16)
    assert b.dtype == torch.bfloat16
    wa = a.model.layers[0].self_attn.q_proj.weight
    wb = b.model.layers[0].self_attn.q_proj.weight
    torch.testing.assert_close(wa.to(torch.bfloat16), wb)


def test_unknown_name_lists_the_presets():
    with pytest.raises(UnknownModelError) as info:
        build_model("no-such-model")
    for name in PRESETS:
        assert name in str(info.value)


def test_local_directory_round_trip(tmp_path):
    cfg = Qwen2Config(vocab_size=500, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    saved = Qwen2ForCausalLM(cfg)
    saved.save_pretrained(tmp_path)
    loaded = build_model(str(tmp_path))
    assert isinstance(loaded, Qwen2ForCausalLM) and loaded.training
    torch.testing.assert_close(loaded.model.embed_tokens.weight, saved.model.embed_tokens.weight)


def test_local_directory_of_an_encoder_is_refused_before_loading_weights(tmp_path):
    BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="bert"):
        build_model(str(tmp_path))


def test_directory_without_config_is_an_unknown_model(tmp_path):
    with pytest.raises(UnknownModelError, match="config.json"):
        build_model(str(tmp_path))


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_local_directory_with_missing_or_truncated_weights_is_a_clear_error(tmp_path, damage):
    """One UnknownModelError (which the CLI turns into exit status 2 and one line) naming the folder, the cause
    and the fix, not a raw OSError / SafetensorError traceback."""
    cfg = Qwen2Config(vocab_size=500, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    Qwen2ForCausalLM(cfg).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    if damage == "missing":
        weights.unlink()
    else:
        weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(UnknownModelError, match=r"could not read the weights of the model folder .*re-save the model"):
        build_model(str(tmp_path))


def _drop_second_layer(folder):
    from safetensors.torch import load_file, save_file

    weights = folder / "model.safetensors"
    kept = {k: v for k, v in load_file(weights).items() if not k.startswith("model.layers.1.")}
    save_file(kept, weights, metadata={"format": "pt"})


def test_local_directory_whose_weights_lack_tensors_is_refused(tmp_path):
    """Tensors absent from the weights would start random: refused, naming the folder, the count and the first names."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=500, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    build_model(str(tmp_path))  # complete: the tied output layer, not in the file, is not missing
    _drop_second_layer(tmp_path)
    with pytest.raises(UnknownModelError, match=r"lack 9 of the model's tensors \(model\.layers\.1\.input_layernorm\.weight, "
                       r".*, \.\.\.\).*re-save the complete model") as info:
        build_model(str(tmp_path))
    assert repr(str(tmp_path)) in str(info.value)


def test_local_directory_with_an_unused_extra_tensor_still_loads(tmp_path):
    from safetensors.torch import load_file, save_file

    cfg = Qwen2Config(vocab_size=500, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    Qwen2ForCausalLM(cfg).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    tensors = load_file(weights)
    save_file({**tensors, "model.unused.weight": torch.zeros(3)}, weights, metadata={"format": "pt"})
    assert torch.equal(build_model(str(tmp_path)).model.embed_tokens.weight, tensors["model.embed_tokens.weight"])


def test_lora_adapter_folder_is_named_as_such(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(UnknownModelError, match="holds a LoRA adapter .* merge it into its base model"):
        build_model(str(tmp_path))
