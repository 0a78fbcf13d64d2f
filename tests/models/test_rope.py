"""set_rope: the change reaches the forward, the saved config, and chunked training stays exact."""

import pytest
import torch

from oomb.models.rope import parse_rope_scaling, set_rope
from tests.engine.test_engine import VOCAB, run_parity, tiny


def test_parse_rope_scaling():
    assert parse_rope_scaling("type=yarn, factor=4,original_max_position_embeddings=32768") == {
        "rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 32768}
    assert parse_rope_scaling("type=linear,factor=2.5") == {"rope_type": "linear", "factor": 2.5}
    with pytest.raises(ValueError, match="key=value"):
        parse_rope_scaling("yarn")
    assert parse_rope_scaling("") == {}


@pytest.mark.parametrize("spec, match", [
    ("factor=4", "has no type"),
    ("factor=4,original_max_position_embeddings=32768", "has no type"),
    ("type=linear,factor=0.5", "must be >= 1 for type 'linear'"),
    ("type=yarn,factor=0", "must be > 0"),
    ("type=dynamic,factor=-1", "must be > 0"),
    ("type=linear,factor=big", "must be a number"),
])
def test_parse_rope_scaling_refuses_no_type_and_bad_factors(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_rope_scaling(spec)


def test_set_rope_changes_forward_and_saved_config(tmp_path):
    torch.manual_seed(0)
    model = tiny("qwen2").double().eval()
    ids = torch.randint(0, VOCAB, (1, 20))
    before = model(input_ids=ids).logits
    params = set_rope(model, rope_theta=500000.0, rope_scaling=parse_rope_scaling("type=linear,factor=4"))
    assert params["rope_theta"] == 500000.0 and params["rope_type"] == "linear"
    after = model(input_ids=ids).logits
    assert not torch.allclose(before, after)
    # A fresh model built from the edited config computes the same thing.
    model.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path, dtype=torch.float64).eval()
    assert reloaded.config.rope_parameters["rope_type"] == "linear"
    assert reloaded.config.rope_parameters["rope_theta"] == 500000.0
    torch.testing.assert_close(reloaded(input_ids=ids).logits, after)


def test_set_rope_then_chunked_training_is_exact():
    model = tiny("llama", 4, 2, max_position_embeddings=16)
    set_rope(model, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})
    out, ref_loss, (err, where), _ = run_parity(model, 40, 8, 4)
    assert abs(out.loss - ref_loss) <= 1e-10 * ref_loss
    assert err <= 1e-10, f"worst gradient {where}: rel err {err:.3e}"


@pytest.mark.parametrize("kwargs,match", [
    (dict(rope_theta=-1.0), "rope_theta must be > 0"),
    (dict(rope_scaling={"rope_type": "longrope", "factor": 2}), "not supported"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8}), "needs low_freq_factor"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 0}), "factor must be > 0"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 0.5}), "factor must be >= 1"),
    (dict(rope_scaling={"type": "bogus"}), "rope type 'bogus' is not supported"),  # the older key is read too
])
def test_set_rope_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        set_rope(tiny("qwen2"), **kwargs)


def test_set_rope_reads_the_older_type_key():
    """``{"type": "linear", ...}`` (transformers' older spelling) scales as ``{"rope_type": "linear", ...}``."""
    a, b = tiny("qwen2"), tiny("qwen2")
    assert set_rope(a, rope_scaling={"type": "linear", "factor": 4}) == set_rope(b, rope_scaling={"rope_type": "linear", "factor": 4})
