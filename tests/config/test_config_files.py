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
