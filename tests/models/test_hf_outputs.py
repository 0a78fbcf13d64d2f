"""An ``oomb train`` output folder loads as-is through the standard Hugging Face calls: the same token ids as
training (AutoTokenizer), the trained weights (AutoModelForCausalLM), the adapter (peft.PeftModel)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from oomb.data import BUNDLED_CORPUS, load_documents, load_tokenizer, tokenize_documents
from oomb.models.presets import build_model
from oomb.models.saving import TOKENIZER_MODULE, save_tokenizer

from cli_helpers import run_cli
from tests.cli.test_cli import FAST


def _corpus_sample(chars: int = 3000) -> str:
    """The start of each bundled novel, ``chars`` characters each (words, names, punctuation, line breaks)."""
    return "\n\n".join(p.read_text()[:chars] for p in sorted(BUNDLED_CORPUS.glob("*.txt")))


@pytest.fixture
def corpus_file(tmp_path):
    f = tmp_path / "austen.txt"
    f.write_text(_corpus_sample())
    return f


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama", "tiny-mistral", "tiny-qwen3"])
def test_saved_tokenizer_gives_the_training_ids_through_autotokenizer(tmp_path, preset):
    """transformers 5.x builds a qwen2 folder's tokenizer as a byte-level Qwen2Tokenizer from the vocabulary alone
    (whatever tokenizer_config.json names): the bundled SentencePiece tokenizer then split 'truth' into 'tr', 'uth'."""
    trained_with = load_tokenizer(None)
    torch.manual_seed(0)
    build_model(preset).save_pretrained(tmp_path)
    save_tokenizer(trained_with, tmp_path)
    text = _corpus_sample()
    # Only where AutoTokenizer would build another pipeline does the folder carry the auto_map module; then it
    # loads the same with trust_remote_code too.
    assert (tmp_path / TOKENIZER_MODULE).exists() == (preset == "tiny")
    for trust_remote_code in (False, True) if preset == "tiny" else (False,):
        loaded = AutoTokenizer.from_pretrained(tmp_path, trust_remote_code=trust_remote_code)
        assert _ids(loaded, text) == _ids(trained_with, text)
        assert loaded.tokenize("It is a truth") == ["▁It", "▁is", "▁a", "▁truth"]
        assert (loaded.eos_token_id, loaded.bos_token_id) == (trained_with.eos_token_id, trained_with.bos_token_id)


def test_a_tokenizer_autotokenizer_already_rebuilds_gets_no_module(tmp_path):
    """A model type's own tokenizer (a Qwen2Tokenizer in a qwen2 folder) reloads as it is: no auto_map."""
    from transformers import Qwen2Tokenizer

    vocab = {"<|endoftext|>": 0, "a": 1, "b": 2, "ab": 3, "Ġ": 4}
    tok = Qwen2Tokenizer(vocab=vocab, merges=[("a", "b")])
    torch.manual_seed(0)
    build_model("tiny").save_pretrained(tmp_path)
    save_tokenizer(tok, tmp_path)
    assert not (tmp_path / TOKENIZER_MODULE).exists()
    assert "auto_map" not in json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert _ids(AutoTokenizer.from_pretrained(tmp_path), "ab ab") == _ids(tok, "ab ab")


def test_a_folder_like_one_checked_before_is_written_the_same_without_loading_it(tmp_path, monkeypatch):
    """Each checkpoint of a run saves the same tokenizer beside the same config: the AutoTokenizer check (two loads
    of the folder) runs once per process, and the later folders get the same files; another model type is checked."""
    import oomb.models.saving as saving

    trained_with = load_tokenizer(None)
    monkeypatch.setattr(saving, "_RESOLVED", {})
    probes = []
    real = saving._auto_pipeline
    monkeypatch.setattr(saving, "_auto_pipeline", lambda folder: probes.append(folder) or real(folder))
    folders = {}
    for name, preset in (("first", "tiny"), ("second", "tiny"), ("llama", "tiny-llama")):
        folders[name] = tmp_path / name
        torch.manual_seed(0)
        build_model(preset).save_pretrained(folders[name])
        save_tokenizer(trained_with, folders[name])
    # tiny needs the auto_map (a load without it, and the check with it), tiny-llama loads as saved (one load)
    assert probes == [folders["first"], folders["first"], folders["llama"]]
    files = sorted(p.name for p in folders["first"].iterdir())
    assert TOKENIZER_MODULE in files and sorted(p.name for p in folders["second"].iterdir()) == files
    for name in files:
        assert (folders["second"] / name).read_bytes() == (folders["first"] / name).read_bytes(), name
    loaded = AutoTokenizer.from_pretrained(folders["second"])
    assert _ids(loaded, _corpus_sample()) == _ids(trained_with, _corpus_sample())
    assert not (folders["llama"] / TOKENIZER_MODULE).exists()


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_train_output_loads_as_is_with_autotokenizer_and_automodel(tmp_path, corpus_file):
    out = tmp_path / "run"
    assert run_cli(["train", "--data", corpus_file, "--output-dir", out, *FAST]) == 0
    # Tokens: what AutoTokenizer gives on the data equals the token stream the run trained on.
    docs = load_documents(corpus_file)
    trained_tokens = tokenize_documents(docs, load_tokenizer(None))
    assert tokenize_documents(docs, AutoTokenizer.from_pretrained(out)).tolist() == trained_tokens.tolist()
    assert json.loads((out / "train_args.json").read_text())["num_tokens"] == len(trained_tokens)
    # Weights: the model AutoModelForCausalLM reads computes what the trained parameters (its checkpoint) compute.
    loaded = AutoModelForCausalLM.from_pretrained(out)
    torch.manual_seed(0)
    trained = build_model("tiny")
    trained.load_state_dict(load_file(out / "checkpoints" / "step-00000002" / "trainable.safetensors"), strict=False)
    ids = torch.tensor([trained_tokens[:96].tolist()])
    torch.testing.assert_close(_logits(loaded, ids), _logits(trained, ids), rtol=0, atol=0)


def test_lora_output_loads_with_peft_and_autotokenizer(tmp_path, corpus_file):
    from peft import PeftModel

    out = tmp_path / "lora"
    assert run_cli(["train", "--data", corpus_file, "--output-dir", out, "--lora-rank", "4", *FAST]) == 0
    text = _corpus_sample(500)
    assert _ids(AutoTokenizer.from_pretrained(out), text) == _ids(load_tokenizer(None), text)
    torch.manual_seed(0)  # the run's --seed: the preset's random weights
    base = build_model("tiny")
    ids = torch.tensor([_ids(load_tokenizer(None), text)[:64]])
    before = _logits(base, ids)
    model = PeftModel.from_pretrained(base, out)
    adapter = load_file(out / "adapter_model.safetensors")
    loaded = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert len(loaded) == len(adapter) > 0
    for key, value in adapter.items():
        match = [v for k, v in loaded.items() if k.replace(".default", "").endswith(key.removeprefix("base_model.model."))]
        assert len(match) == 1 and torch.equal(match[0], value), key
    assert not torch.allclose(_logits(model, ids), before)
