"""LoRA targets (--lora-targets) and trained embeddings and norms (--train-embeddings-norms): what peft adapts,
what the memory model counts, what the output folder holds and loads."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from oomb.memory import ModelShape, base_gpu_bytes
from oomb.models.lora import LoraTargetError, apply_lora, embedding_norm_modules, resolve_targets
from oomb.models.presets import build_model

from cli_helpers import run_cli
from tests.cli.test_cli import FAST, snapshot


def _trainable(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3"])
@pytest.mark.parametrize("targets", ["q_proj,k_proj,v_proj,o_proj", "all-linear", "v_proj, down_proj"])
@pytest.mark.parametrize("embeddings_norms", [False, True])
def test_memory_model_counts_the_trainable_parameters_peft_makes(preset, targets, embeddings_norms):
    torch.manual_seed(0)
    model = build_model(preset)
    shape = ModelShape.from_config(model.config)
    peft_model = apply_lora(model, 4, None, targets, embeddings_norms)
    expected = shape.lora_params(4, targets) + (shape.embedding_norm_params() if embeddings_norms else 0)
    assert _trainable(peft_model) == expected
    _, trainable, *_ = base_gpu_bytes(shape, 128, 64, torch.float32, 4, "adamw", False, "torch", 4096, 1024,
                                      lora_targets=targets, train_embeddings_norms=embeddings_norms)
    assert trainable == expected


def test_targets_resolve_to_linear_layers_and_refuse_unknown_names():
    model = build_model("tiny")
    assert resolve_targets(model, "all-linear") == "all-linear"
    assert resolve_targets(model, "q_proj, v_proj,q_proj") == ["q_proj", "v_proj"]
    with pytest.raises(LoraTargetError) as info:
        resolve_targets(model, "q_proj,lm_head,mlp")
    assert info.value.unknown == ["lm_head", "mlp"]  # the output projection is not a LoRA target (as peft's all-linear)
    assert "gate_proj" in info.value.available and "lm_head" not in info.value.available
    assert embedding_norm_modules(model) == ["embed_tokens", "input_layernorm", "norm", "post_attention_layernorm"]


def _adapted_layers(out) -> set[str]:
    return {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in load_file(out / "adapter_model.safetensors") if ".lora_" in k}


def test_lora_targets_choose_the_adapted_layers(tmp_path, capsys):
    out = tmp_path / "default"
    assert run_cli(["train", "--output-dir", out, *FAST, "--lora-rank", "2"]) == 0
    assert _adapted_layers(out) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    out = tmp_path / "all"
    assert run_cli(["train", "--output-dir", out, *FAST, "--lora-rank", "2", "--lora-targets", "all-linear"]) == 0
    assert _adapted_layers(out) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@pytest.mark.parametrize("argv, fragment", [
    (["--lora-rank", "2", "--lora-targets", "q_proj,qproj,mlp"],
     "--lora-targets q_proj,qproj,mlp: model 'tiny' has no linear layers named qproj, mlp; pass some of down_proj, "
     "gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj, or all-linear"),
    (["--lora-rank", "2", "--lora-targets", " , "], "--lora-targets is ' , '"),
    (["--lora-targets", "all-linear"], "--lora-targets sets up a LoRA adapter but --lora-rank is 0"),
    (["--train-embeddings-norms"], "--train-embeddings-norms sets up a LoRA adapter but --lora-rank is 0"),
])
def test_bad_lora_targets_are_refused_in_one_line(tmp_path, capsys, argv, fragment):
    tmp_path.joinpath("keep").write_text("x")
    before = snapshot(tmp_path)
    assert run_cli(["train", "--output-dir", tmp_path / "run", *FAST, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and fragment in err, err
    assert snapshot(tmp_path) == before and not (tmp_path / "run").exists()


def test_plan_refuses_unknown_lora_targets(capsys):
    assert run_cli(["plan", "--gpu-gib", "8", "--host-gib", "8", "--lora-rank", "2", "--lora-targets", "x_proj"]) == 2
    assert "model 'tiny' has no linear layers named x_proj" in capsys.readouterr().err


def test_trained_embeddings_and_norms_are_saved_in_the_adapter_and_load_with_peft(tmp_path):
    from peft import PeftModel

    out = tmp_path / "longlora"
    assert run_cli(["train", "--output-dir", out, *FAST, "--lora-rank", "2", "--train-embeddings-norms"]) == 0
    saved = load_file(out / "adapter_model.safetensors")
    torch.manual_seed(0)  # the run's --seed: the preset's random weights
    base = build_model("tiny")
    init = {k: v.clone() for k, v in base.state_dict().items()}
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.1.input_layernorm.weight"):
        key = f"base_model.model.{name}"
        assert key in saved and not torch.equal(saved[key], init[name]), name  # trained
    model = PeftModel.from_pretrained(base, out)
    model.eval()
    ids = torch.arange(5, 69)[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    # A plain reference: the base with the saved embeddings and norms, and the saved LoRA update W + s * B @ A.
    torch.manual_seed(0)
    ref = build_model("tiny")
    state = ref.state_dict()
    scale = 2 * 2 / 2  # lora_alpha (2 x rank) / rank
    for key, value in saved.items():
        name = key.removeprefix("base_model.model.")
        if ".lora_A." in name:
            layer = name.split(".lora_A.")[0]
            b = saved[key.replace(".lora_A.", ".lora_B.")]
            state[f"{layer}.weight"] += scale * b @ value
        elif ".lora_" not in name:
            state[name] = value
    ref.load_state_dict(state)
    ref.tie_weights()
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
