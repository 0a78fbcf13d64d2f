"""Configuration files as :mod:`oomb.config.io` reads and writes them, and the messages of :class:`ConfigError`."""

from __future__ import annotations

import pytest
import yaml

from oomb.config import ConfigError, JobConfig, OOMBConfig
from oomb.config.io import _load, dump_yaml, read_yaml


@pytest.mark.parametrize("text, value", [
    ("off", "off"), ("on", "on"), ("yes", "yes"), ("no", "no"), ("y", "y"), ("n", "n"), ("Off", "Off"),
    ("YES", "YES"), ("true", True), ("True", True), ("TRUE", True), ("false", False), ("False", False),
    ("FALSE", False), ("tRue", "tRue"), ("'true'", "true"), ("1e-4", 1e-4), ("~", None),
])
def test_booleans_are_read_as_yaml_1_2_reads_them(text, value):
    """YAML 1.1 (PyYAML's rules) reads yes/no/on/off/y/n as booleans, so that a string field given off was
    refused as a boolean; a config file reads only true and false (in three case forms) as booleans."""
    got = _load(f"key: {text}\n")["key"]
    assert got == value and type(got) is type(value), (text, got)


def test_off_is_a_string_setting_and_true_a_boolean_one(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("engine:\n  save_attention: off\n  checkpoint_layers: true\n")
    values = read_yaml(f)["engine"]
    assert values == {"save_attention": "off", "checkpoint_layers": True}
    assert OOMBConfig(**values).save_attention == "off"


def test_strings_that_yaml_1_1_reads_as_booleans_are_written_quoted_and_read_back(tmp_path):
    """--print-config quotes 'off', 'yes', 'n', ... so that the file reads back the same under any YAML reader
    (PyYAML's YAML 1.1 rules included), and true/false stay booleans."""
    job = JobConfig()
    job.engine.save_attention = "off"
    job.data.split = "yes"
    job.model.name = "n"
    text = dump_yaml(job, "train")
    assert "save_attention: 'off'" in text and "split: 'yes'" in text and "name: 'n'" in text
    assert "checkpoint_layers: false" in text or "checkpoint_layers: true" in text
    for tree in (yaml.safe_load(text), _load(text)):  # YAML 1.1 and the config reader alike
        assert tree["engine"]["save_attention"] == "off" and tree["data"]["split"] == "yes" and tree["model"]["name"] == "n"
        assert isinstance(tree["engine"]["checkpoint_layers"], bool)
    f = tmp_path / "run.yaml"
    f.write_text(text)
    values = read_yaml(f)
    assert values["engine"]["save_attention"] == "off" and values["data"]["split"] == "yes"


def test_braces_of_a_value_are_shown_as_they_are():
    """A message names settings as {field} placeholders; the braces of a value shown in it (a mapping, a set, a
    string such as '{split}.jsonl') were read as placeholders too, which garbled the message."""
    from oomb.config import DataConfig, ModelConfig, OffloadConfig, TrainConfig
    from oomb.config.errors import literal

    error = ConfigError("seq_len", f"{{seq_len}} is {literal({'a': {'b': 1}})}", "pass {seq_len} 2 or more, e.g. {{x}}")
    assert str(error) == "seq_len is {'a': {'b': 1}}; pass seq_len 2 or more, e.g. {x}"
    assert error.render(lambda name: f"--{name}") == "--seq_len is {'a': {'b': 1}}; pass --seq_len 2 or more, e.g. {x}"
    with pytest.raises(ConfigError) as info:
        DataConfig(seq_len="{split}")
    assert str(info.value).startswith("seq_len is '{split}'; it takes an integer"), str(info.value)
    with pytest.raises(ConfigError) as info:
        TrainConfig(steps={1, 2})
    assert str(info.value).startswith("steps is {1, 2}; "), str(info.value)
    with pytest.raises(ConfigError) as info:
        OOMBConfig(offload={"mode": "on"})
    assert "{'mode': 'on'}" in str(info.value), str(info.value)
    told = r"^rope_scaling is the mapping \{'type': 'linear', 'factor': 2\}; write it as one string of key=value pairs: "
    with pytest.raises(ConfigError, match=told + "type=linear,factor=2$"):
        ModelConfig(rope_scaling={"type": "linear", "factor": 2})
    with pytest.raises(ConfigError, match=r"^rope_scaling is 4; write it as one string of key=value pairs, e\.g\. "
                                          r"type=linear,factor=2"):
        ModelConfig(rope_scaling=4)
    assert ModelConfig(rope_scaling="type=linear,factor=2").rope_scaling == "type=linear,factor=2"


def test_a_data_error_names_its_setting_as_the_caller_names_it(tmp_path):
    """The data library names the setting at fault by its field (the CLI renders it as its flag or file key)."""
    from oomb.data import DataError, load_tokenizer
    from oomb.data.chat import read_chat_template

    with pytest.raises(DataError) as info:
        load_tokenizer(str(tmp_path / "none"))
    assert info.value.setting == "tokenizer" and "set tokenizer to a local folder" in str(info.value)
    assert "set --tokenizer to" in info.value.parts(lambda name: "--" + name)[1]
    (tmp_path / "empty.jinja").write_text(" \n")
    with pytest.raises(DataError) as info:
        read_chat_template(str(tmp_path / "empty.jinja"))
    assert str(info.value).startswith("chat_template '") and info.value.setting == "chat_template"
