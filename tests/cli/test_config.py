"""The typed configuration: each field checked once, flags generated from it, YAML files read and written back."""

from __future__ import annotations

import pytest
import yaml

from oomb.cli import main
from oomb.config import ConfigError, KernelConfig, OffloadConfig, OOMBConfig, SparseConfig


def _run(argv, capsys):
    """(exit status, stdout, stderr) of ``oomb argv``."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def _refused(argv, capsys, *parts):
    code, out, err = _run(argv, capsys)
    assert code == 2, (code, err)
    assert err.count("\n") == 1 and err.startswith("oomb: error: "), err
    for p in parts:
        assert p in err, (p, err)
    return err


# ---------------------------------------------------------------- the dataclasses


@pytest.mark.parametrize("make, names", [
    (lambda: OOMBConfig(chunk_size=1000), "chunk_size"),
    (lambda: OOMBConfig(page_size=0), "page_size"),
    (lambda: OOMBConfig(attention_backend="flash"), "attention_backend"),
    (lambda: SparseConfig(page_budget=-1), "page_budget"),
    (lambda: SparseConfig(page_budget=0, sink_pages=0, local_pages=0), "page_budget"),
    (lambda: OffloadConfig(copy_streams=3), "copy_streams"),
    (lambda: OffloadConfig(mode="off", gpu_page_budget=100), "gpu_page_budget"),
    (lambda: KernelConfig(page_gather_warps=3), "page_gather_warps"),
    (lambda: KernelConfig(autotune="some"), "autotune"),
    (lambda: OOMBConfig(offload=OffloadConfig(staging_sets=3)), "staging_sets"),
])
def test_a_bad_value_names_its_field(make, names):
    with pytest.raises(ConfigError) as info:
        make()
    assert info.value.key == names
    assert names in str(info.value)


def test_sections_and_shorthands():
    cfg = OOMBConfig(sparse=True, offload=OffloadConfig(mode=True))
    assert cfg.sparse == SparseConfig() and cfg.offload.mode == "on" and cfg.offload.enabled is True
    assert cfg.dense().sparse is None and OOMBConfig().sparse is None
    assert OOMBConfig(page_size=64, attention_block_size=100).attention_block_size == 128  # whole pages


# ---------------------------------------------------------------- --print-config and --config


def test_print_config_round_trips_and_flags_override_the_file(tmp_path, capsys):
    code, first, _ = _run(["train", "--sparse", "--page-budget", "16", "--chunk-size", "1024", "--output-dir",
                           tmp_path / "run", "--print-config"], capsys)
    assert code == 0
    tree = yaml.safe_load(first)
    assert tree["engine"]["chunk_size"] == 1024 and tree["engine"]["sparse"]["page_budget"] == 16
    assert {"loss_chunk_size", "attention_block_size"} <= set(tree["engine"])  # fields without a flag too
    f = tmp_path / "run.yaml"
    f.write_text(first)
    code, again, _ = _run(["train", "--config", f, "--print-config"], capsys)
    assert code == 0 and again == first
    code, over, _ = _run(["train", "--config", f, "--chunk-size", "2048", "--print-config"], capsys)
    assert yaml.safe_load(over)["engine"]["chunk_size"] == 2048
    assert yaml.safe_load(over)["engine"]["sparse"]["page_budget"] == 16  # the rest still from the file


def test_plan_and_train_read_the_same_file_and_share_defaults(tmp_path, capsys):
    f = tmp_path / "run.yaml"
    f.write_text("engine:\n  chunk_size: 2048\n  sparse: {page_budget: 8}\n  offload: {mode: 'on'}\n"
                 "  kernels: {autotune: first}\ndata: {seq_len: 8192}\noutput: {dir: out}\n")
    trees = {}
    for command in ("train", "plan"):
        code, out, err = _run([command, "--config", f, "--print-config"], capsys)
        assert code == 0, err
        trees[command] = yaml.safe_load(out)
    for key in ("chunk_size", "page_size", "attention_backend", "checkpoint_layers", "sparse", "offload"):
        assert trees["train"]["engine"][key] == trees["plan"]["engine"][key], key
    assert trees["plan"]["data"]["seq_len"] == trees["train"]["data"]["seq_len"] == 8192
    # with no file and no flags: the same engine too (a plan with default flags describes the default run)
    defaults = {c: yaml.safe_load(_run([c, *extra, "--print-config"], capsys)[1])
                for c, extra in (("train", ["--output-dir", tmp_path / "d"]), ("plan", []))}
    for key in ("chunk_size", "page_size", "attention_backend", "sparse", "offload"):
        assert defaults["train"]["engine"][key] == defaults["plan"]["engine"][key], key
    assert defaults["train"]["data"]["seq_len"] == defaults["plan"]["data"]["seq_len"]


def test_plan_is_of_a_gpu_run_with_dtype_auto_resolved_as_train_resolves_it(tmp_path, capsys, monkeypatch):
    """`oomb plan` plans a GPU run: --device is cuda unless the flag or the file says otherwise, and a cpu run is
    refused with one line naming the fix (it has no GPU memory to plan). --dtype auto is what train runs in on that
    device (bfloat16 on cuda, float32 on cpu), and a plan of a CUDA run is made on a machine without a GPU."""
    import torch

    from oomb.cli.checks import _resolve_device_dtype
    from oomb.cli.parser import _job_config, _namespace
    from oomb.config import resolve_dtype
    from oomb.planner import Machine

    no_gpu = Machine(0, 0, 64 << 30, 64 << 30, "no GPU")
    monkeypatch.setattr(Machine, "detect", classmethod(lambda cls, device=None: no_gpu))
    machine = ["--gpu-gib", "8", "--host-gib", "8"]
    code, text, _ = _run(["train", "--output-dir", tmp_path / "o", "--print-config"], capsys)
    assert code == 0 and yaml.safe_load(text)["model"]["device"] == "cpu" and yaml.safe_load(text)["model"]["dtype"] == "auto"
    cpu = tmp_path / "cpu.yaml"
    cpu.write_text(text)
    job, _ = _job_config("train", ["train", "--config", str(cpu)], str(cpu))
    assert _resolve_device_dtype(_namespace("train", job))[1] == torch.float32  # what train runs in
    cuda = tmp_path / "cuda.yaml"
    cuda.write_text(text.replace("device: cpu", "device: cuda"))
    job, _ = _job_config("train", ["train", "--config", str(cuda)], str(cuda))
    assert resolve_dtype(job.model.dtype, job.model.device) == "bfloat16"  # what train runs in on the GPU
    for argv, dtype, kib in (([], "bfloat16", 3), (["--config", cuda], "bfloat16", 3),
                             (["--config", cpu, "--device", "cuda"], "bfloat16", 3), (["--dtype", "float32"], "float32", 4),
                             (["--config", cuda, "--dtype", "float32"], "float32", 4)):
        code, out, err = _run(["plan", *argv, *machine], capsys)
        assert code == 0, (argv, err)
        head = out.splitlines()
        assert head[0].endswith(f", {dtype}") and f"KV {kib} KiB/token" in head[1], (argv, head[:2])
    code, out, _ = _run(["plan", "--print-config"], capsys)
    assert code == 0 and yaml.safe_load(out)["model"]["device"] == "cuda"
    for argv in (["--config", cpu], ["--device", "cpu"]):
        code, out, err = _run(["plan", *argv, *machine], capsys)
        assert code == 2 and out == "" and err.count("\n") == 1, (argv, err)
        assert "oomb plan plans a run on a GPU" in err and "--device cuda" in err
    assert [resolve_dtype(d, dev) for d in ("auto", "float32", "bfloat16") for dev in ("cpu", "cuda")] == [
        "float32", "bfloat16", "float32", "float32", "bfloat16", "bfloat16"]


def test_a_bad_file_gets_one_line_naming_the_key(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine:\n  chunk_sise: 512\n")
    _refused(["train", "--config", bad, "--output-dir", tmp_path / "o"], capsys, "engine.chunk_sise",
             "did you mean engine.chunk_size")
    bad.write_text("engine:\n  chunk_size: abc\n")
    err = _refused(["train", "--config", bad, "--output-dir", tmp_path / "o"], capsys, "engine.chunk_size", str(bad))
    assert err.count(str(bad)) == 1
    bad.write_text("engine:\n  offload: {copy_streams: 3}\n")
    _refused(["plan", "--config", bad], capsys, "engine.offload.copy_streams", "1, 2")
    bad.write_text("trainer: {steps: 3}\n")
    _refused(["train", "--config", bad, "--output-dir", tmp_path / "o"], capsys, "unknown section 'trainer'")
    bad.write_text("engine: [1, 2]\n")
    _refused(["train", "--config", bad, "--output-dir", tmp_path / "o"], capsys, "'engine'", "not a mapping")
    bad.write_text("engine: {chunk_size: [\n")
    _refused(["train", "--config", bad, "--output-dir", tmp_path / "o"], capsys, "not valid YAML")
    _refused(["train", "--config", tmp_path / "missing.yaml", "--output-dir", tmp_path / "o"], capsys,
             "cannot be read")
    assert not (tmp_path / "o").exists()


def test_a_file_that_is_not_utf8_yaml_gets_one_line_naming_what_it_is(tmp_path, capsys):
    """A Latin-1 or binary --config file crashed with a UnicodeDecodeError traceback, and a TOML file was called
    invalid YAML; each is one line saying what the file is and what --config reads."""
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(b"data:\n  seq_len: 256 # caf\xe9\n")
    _refused(["train", "--config", bad, "--print-config", "--output-dir", tmp_path / "o"], capsys,
             "is not UTF-8 text (byte 0xe9 at line 2)", "save it as UTF-8")
    bad.write_bytes(bytes(range(256)) * 4)
    _refused(["plan", "--config", bad], capsys, "is a binary file, not a configuration file")
    for name, text in (("run.toml", "[data]\nseq_len = 256\n"), ("run.conf", "[data]\nseq_len = 256\n"),
                       ("one.cfg", "seq_len = 256\n")):
        (tmp_path / name).write_text(text)
        _refused(["train", "--config", tmp_path / name, "--output-dir", tmp_path / "o"], capsys,
                 "is a TOML file; --config reads YAML (or JSON", "write it as YAML")
    good = tmp_path / "bom.json"
    good.write_bytes(b'\xef\xbb\xbf{"data": {"seq_len": 256}}\n')  # JSON is YAML; a byte order mark is dropped
    code, out, err = _run(["train", "--config", good, "--print-config", "--output-dir", tmp_path / "o"], capsys)
    assert code == 0 and "seq_len: 256" in out, err
    assert not (tmp_path / "o").exists()


def test_a_flag_overrides_a_bad_value_of_the_file_and_is_named_itself(tmp_path, capsys):
    f = tmp_path / "run.yaml"
    f.write_text("engine:\n  chunk_size: 1000\n")
    code, out, err = _run(["train", "--config", f, "--chunk-size", "1024", "--output-dir", tmp_path / "o",
                           "--print-config"], capsys)
    assert code == 0, err
    _refused(["train", "--config", f, "--chunk-size", "1000", "--output-dir", tmp_path / "o"], capsys,
             "--chunk-size 1000")


def test_train_without_an_output_dir_names_the_flag_and_the_key(capsys):
    _refused(["train"], capsys, "--output-dir", "output.dir")


def test_a_file_reads_exponent_floats_as_numbers_and_leaves_ints_and_strings_alone(tmp_path, capsys):
    """YAML 1.1 (PyYAML's rules) reads 1e-4 (no dot) and 1.0e4 (no exponent sign) as strings; a config file reads
    them as YAML 1.2 does, as floats. Integers stay integers, a quoted '1e3' stays a string, and --print-config
    writes what reads back the same."""
    from oomb.cli.parser import _job_config

    f = tmp_path / "run.yaml"
    for text, lr in (("1e-4", 1e-4), ("3e-4", 3e-4), ("3E-4", 3e-4), ("1.0e-4", 1e-4), ("2.5e-4", 2.5e-4), ("1e0", 1.0)):
        f.write_text(f"train:\n  lr: {text}\n  steps: 3\nmodel: {{name: '1e3'}}\noutput: {{dir: out}}\n")
        job, _ = _job_config("train", ["train", "--config", str(f)], str(f))
        assert job.train.lr == lr and isinstance(job.train.lr, float), (text, job.train.lr)
        assert job.train.steps == 3 and type(job.train.steps) is int
        assert job.model.name == "1e3"
    code, out, err = _run(["train", "--config", f, "--print-config"], capsys)
    assert code == 0, err
    again = tmp_path / "again.yaml"
    again.write_text(out)
    assert _run(["train", "--config", again, "--print-config"], capsys)[1] == out
    f.write_text("engine: {offload: {gpu_page_budget: 1e3}}\noutput: {dir: out}\n")  # a float is no page count
    _refused(["train", "--config", f], capsys, "engine.offload.gpu_page_budget", "1000.0")


def test_a_key_given_twice_in_a_file_is_refused(tmp_path, capsys):
    """YAML keeps the last of two equal keys; a config file that has one twice is refused, naming it and the lines."""
    f = tmp_path / "twice.yaml"
    f.write_text("train:\n  lr: 1.0e-4\n  steps: 3\n  lr: 2.0e-4\n")
    _refused(["train", "--config", f, "--output-dir", tmp_path / "o"], capsys, str(f), "train.lr twice",
             "lines 2 and 4", "keep one")
    f.write_text("train: {steps: 3}\nmodel: {name: tiny}\ntrain: {lr: 1.0e-4}\n")
    _refused(["plan", "--config", f], capsys, "sets train twice (lines 1 and 3)")
    f.write_text("train: &b {steps: 3}\nbench: {<<: *b, steps: 4}\n")  # a key over a merged one is no duplicate
    code, out, err = _run(["bench", "--config", f, "--print-config"], capsys)
    assert code == 0 and yaml.safe_load(out)["bench"]["steps"] == 4, err


@pytest.mark.parametrize("command, text, told", [
    ("train", 'data: {seq_len: "abc"}', "data.seq_len (in {f}) is 'abc'; it takes an integer (e.g. data.seq_len 2048)"),
    ("train", "train: {steps: 2.0}", "train.steps (in {f}) is 2.0; it takes an integer (e.g. train.steps 30)"),
    ("train", "train: {lr: fast}", "train.lr (in {f}) is 'fast'; it takes a number (e.g. train.lr 0.003)"),
    ("train", "engine: {checkpoint_layers: 'yes'}", "engine.checkpoint_layers (in {f}) is 'yes'; it takes true or false"),
    ("train", "engine: {offload: {gpu_page_budget: many}}",
     "engine.offload.gpu_page_budget (in {f}) is 'many'; it takes an integer, or leave it out"),
    ("train", "engine: {sparse: {page_budget: 1.5}}", "engine.sparse.page_budget (in {f}) is 1.5; it takes an integer"),
    ("train", "model: {name: 7}", "model.name (in {f}) is 7; it takes a string (e.g. model.name tiny)"),
    ("train", "data: {loss_on: 3}", "data.loss_on (in {f}) is 3; pass one of 'all', 'assistant'"),
    ("eval", "eval: {depths: [deep]}", "eval.depths (in {f}) is ['deep']; it takes a list of numbers, or leave it out"),
    ("bench", "bench: {lengths: 2048}", "bench.lengths (in {f}) is 2048; it takes a list of integers (e.g. bench.lengths 2048 4096)"),
])
def test_a_value_of_the_wrong_type_is_told_as_such(tmp_path, capsys, command, text, told):
    """A value of the wrong kind for a typed field is named with the kind the field takes, before any range
    check speaks of it (seq_len 'abc' is not 'a sequence needs at least 2 tokens')."""
    f = tmp_path / "bad.yaml"
    f.write_text(text + "\n")
    _refused([command, "--config", f, "--print-config"], capsys, told.format(f=f))


@pytest.mark.parametrize("text, flags, told", [
    ("train: {steps: abc}", ["--steps", "2"], "train.steps (in {f}) is 'abc'; it takes an integer (e.g. train.steps 30)"),
    ("engine: {chunk_size: big}", ["--chunk-size", "64"],
     "engine.chunk_size (in {f}) is 'big'; it takes an integer (e.g. engine.chunk_size 4096)"),
    ("engine: {sparse: {page_budget: [1]}}", ["--sparse", "--page-budget", "8"],
     "engine.sparse.page_budget (in {f}) is [1]; it takes an integer"),
])
def test_a_files_value_of_the_wrong_type_is_told_when_a_flag_overrides_it(tmp_path, capsys, text, flags, told):
    """A file whose value is of the wrong type is refused also when a flag overrides that value: otherwise the file
    works with the flag and fails the day the flag is left out."""
    f = tmp_path / "bad.yaml"
    f.write_text(text + "\n")
    _refused(["train", "--config", f, *flags, "--print-config"], capsys, told.format(f=f))


def test_python_configs_check_types_first():
    from oomb.config import DataConfig

    with pytest.raises(ConfigError, match=r"^seq_len is 'abc'; it takes an integer \(e.g. seq_len 2048\)$"):
        DataConfig(seq_len="abc")
    with pytest.raises(ConfigError, match=r"^chunk_size is True; it takes an integer"):
        OOMBConfig(chunk_size=True)
    assert OOMBConfig(sparse=True, offload=OffloadConfig(mode=False)).offload.mode == "off"  # the Python spellings
    from pathlib import Path

    assert DataConfig(path=Path("corpus.txt")).path == Path("corpus.txt")  # a path field takes a pathlib.Path


def test_sparse_true_in_a_file_is_told_how_to_turn_sparse_attention_on(tmp_path, capsys):
    """engine.sparse is a section (what --print-config writes): true is refused with the spelling that turns it on
    with the defaults, and that spelling works."""
    f = tmp_path / "run.yaml"
    for value in ("true", "false", "64"):
        f.write_text(f"engine:\n  sparse: {value}\n")
        _refused(["train", "--config", f, "--output-dir", tmp_path / "o"], capsys, f"engine.sparse (in {f}) is {value}",
                 "write 'sparse: {}' under engine for sparse attention with the defaults", "'sparse: null'")
    f.write_text("engine:\n  sparse: {}\n")
    code, out, err = _run(["train", "--config", f, "--output-dir", tmp_path / "o", "--print-config"], capsys)
    assert code == 0 and yaml.safe_load(out)["engine"]["sparse"]["page_budget"] == 64, err


def test_a_second_config_is_refused_not_read_over_the_first(tmp_path, capsys):
    """argparse keeps the last of two --config flags, which dropped the first file's settings without a word: a
    second --config is refused, saying that one file is read and how to combine them."""
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("engine: {chunk_size: 1024}\n")
    b.write_text("train: {steps: 3}\n")
    for argv in (["--config", a, "--config", b], [f"--config={a}", "--chunk-size", "2048", f"--config={b}"]):
        _refused(["train", *argv, "--print-config"], capsys, "--config is given twice", repr(str(a)), repr(str(b)),
                 "only one --config file is read", "put the settings of both in one file", "override single settings with flags")
    code, out, err = _run(["train", "--config", a, "--steps", "3", "--print-config"], capsys)  # the way to combine
    assert code == 0 and yaml.safe_load(out)["engine"]["chunk_size"] == 1024 and yaml.safe_load(out)["train"]["steps"] == 3, err


@pytest.mark.parametrize("argv, told", [
    (["merge", "--steps", "2", "r0"], "unrecognized arguments: --steps 2 (--steps is a flag of 'oomb train', not of 'oomb merge')"),
    (["merge", "r0", "--steps", "2"], "unrecognized arguments: --steps 2 (--steps is a flag of 'oomb train'"),
    (["merge", "--lengths", "1", "2", "r0", "--bogus"], "unrecognized arguments: --lengths 1 2 --bogus (--lengths is a flag of"),
    (["merge", "--bogus", "2", "r0"], "unrecognized arguments: --bogus 2; run 'oomb merge --help'"),
    (["merge", "--dry-run", "r0"], "unrecognized arguments: --dry-run; run 'oomb merge --help'"),
    (["train", "--make-output=x", "y"], "unrecognized arguments: --make-output=x y (--make-output is a flag of 'oomb data'"),
])
def test_an_unknown_argument_is_named_with_its_own_value(argv, told, capsys):
    """argparse gives an unknown flag's value to a positional (merge --steps 2 r0: 2 became the adapter folder) and
    named the wrong token ('--steps r0'); the message names the unknown flag with the values it was given."""
    _refused(argv, capsys, told)


def test_a_reader_that_closes_stdout_early_ends_the_command_quietly(tmp_path):
    """`oomb ... | head -1`: once the reader has gone, writing to stdout raises BrokenPipeError, which ended in a
    traceback; the command ends quietly instead, with status 1 (the Python docs' note on SIGPIPE)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "oomb", "train", "--output-dir", str(tmp_path / "o"), "--print-config"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=tmp_path)
    proc.stdout.close()  # the reader goes before oomb writes a byte (it is still importing)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1, err
    assert err == "", err


def test_a_rope_scaling_mapping_in_a_file_is_shown_as_given_with_the_form_it_takes(tmp_path, capsys):
    """The braces of the mapping were read as placeholders of the message ("is model.'type': 'linear', ..."); the
    mapping is shown as written, with the one string of key=value pairs that --rope-scaling and the file take."""
    f = tmp_path / "run.yaml"
    f.write_text("model:\n  rope_scaling: {type: linear, factor: 2}\n")
    _refused(["train", "--config", f, "--print-config"], capsys,
             f"model.rope_scaling (in {f}) is the mapping {{'type': 'linear', 'factor': 2}}; write it as one string of "
             "key=value pairs: type=linear,factor=2")
    f.write_text("model:\n  rope_scaling: type=linear,factor=2\n")
    code, out, err = _run(["train", "--config", f, "--print-config"], capsys)
    assert code == 0 and yaml.safe_load(out)["model"]["rope_scaling"] == "type=linear,factor=2", err


def test_an_unknown_key_is_matched_against_the_keys_of_the_nested_sections_too(tmp_path, capsys):
    """engine.page_budget was told 'did you mean engine.page_size'; the key is engine.sparse.page_budget."""
    f = tmp_path / "run.yaml"
    for text, meant in (("engine:\n  page_budget: 8\n", "engine.sparse.page_budget"),
                        ("engine:\n  copy_stream: 2\n", "engine.offload.copy_streams"),
                        ("engine:\n  sparse:\n    chunk_size: 1024\n", "engine.chunk_size"),
                        ("engine:\n  page_sise: 64\n", "engine.page_size")):
        f.write_text(text)
        _refused(["train", "--config", f, "--print-config"], capsys, f"did you mean {meant}?")


def test_no_sparse_turns_off_the_sparse_section_of_a_file(tmp_path, capsys):
    """A file's engine.sparse section could not be turned off on the command line; --no-sparse trains dense, and
    a sparse flag given with it is refused (it would be ignored)."""
    f = tmp_path / "run.yaml"
    f.write_text("engine:\n  sparse: {page_budget: 8}\n")
    code, out, err = _run(["train", "--config", f, "--print-config"], capsys)
    assert code == 0 and yaml.safe_load(out)["engine"]["sparse"]["page_budget"] == 8, err
    for command in ("train", "plan", "data"):
        code, out, err = _run([command, "--config", f, "--no-sparse", "--print-config"], capsys)
        assert code == 0 and yaml.safe_load(out)["engine"]["sparse"] is None, (command, err)
    from oomb.cli.parser import _job_config

    job, _ = _job_config("train", ["train", "--config", str(f), "--no-sparse"], str(f))
    assert job.engine.sparse is None
    _refused(["train", "--config", f, "--no-sparse", "--page-budget", "4", "--print-config"], capsys,
             "--page-budget sets sparse attention but --no-sparse is given", "leave out --no-sparse")
    code, out, err = _run(["train", "--no-sparse", "--sparse", "--print-config"], capsys)  # the last one given counts
    assert code == 0 and yaml.safe_load(out)["engine"]["sparse"] is not None, err


def test_tokenizer_and_chat_template_from_a_file_are_named_as_its_keys(tmp_path, capsys):
    """data.tokenizer and data.chat_template given in a --config file were told as the flags --tokenizer and
    --chat-template, which the user never wrote; they are named as the file's keys (as data.path is), and as the
    flags where the flags gave them."""
    import json

    rows = tmp_path / "chat.jsonl"
    rows.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}) + "\n")
    f = tmp_path / "run.yaml"
    f.write_text(f"data:\n  tokenizer: {tmp_path / 'no-tokenizer'}\n")
    err = _refused(["data", "--config", f], capsys, f"set data.tokenizer (in {f}) to a local folder with tokenizer.json")
    assert "--tokenizer" not in err, err
    _refused(["data", "--tokenizer", tmp_path / "no-tokenizer"], capsys, "set --tokenizer to a local folder")
    _refused(["data", "--config", f, "--tokenizer", tmp_path / "other"], capsys, "'" + str(tmp_path / "other") + "'",
             "set --tokenizer to")  # the flag over the file: the flag is named
    f.write_text(f"data:\n  path: {rows}\n  chat_template: {tmp_path / 'no-template.jinja'}\n")
    err = _refused(["data", "--config", f, "--output", tmp_path / "h.png"], capsys,
                   f"cannot read data.chat_template (in {f}) '{tmp_path / 'no-template.jinja'}'",
                   "set data.chat_template to a Jinja chat template file")
    assert "--chat-template" not in err and err.count(str(f)) == 1, err
    _refused(["data", "--data", rows, "--chat-template", tmp_path / "no-template.jinja", "--output", tmp_path / "h.png"],
             capsys, f"cannot read --chat-template '{tmp_path / 'no-template.jinja'}'", "set --chat-template to")
    assert not (tmp_path / "h.png").exists()


def test_an_output_dir_from_the_file_is_named_as_its_key(tmp_path, capsys):
    """A refusal of output.dir given in --config names that key and the file, not the --output-dir the user never
    typed; the same folder given as --output-dir is named as the flag."""
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("the user's file\n")
    f = tmp_path / "c.yaml"
    f.write_text(f"output:\n  dir: {taken}\n")
    _refused(["train", "--config", f], capsys, f"output.dir (in {f}) '{taken}' exists, is not empty")
    _refused(["train", "--output-dir", taken], capsys, f"--output-dir '{taken}' exists, is not empty")
    assert (taken / "notes.txt").read_text() == "the user's file\n"


@pytest.mark.parametrize("command", [["train", "--output-dir", "{tmp}/run"], ["eval"], ["grad-error"], ["plan"],
                                     ["data", "--output", "{tmp}/h.png"], ["bench"]])
def test_an_unknown_model_from_the_file_is_named_as_its_key(tmp_path, capsys, command):
    """A misspelt model.name in --config was refused as 'unknown model ...', naming neither the key nor the file;
    the flag's refusal stays as it was."""
    argv = [a.replace("{tmp}", str(tmp_path)) for a in command]
    f = tmp_path / "c.yaml"
    f.write_text("model:\n  name: qwen2.5-7bb\n")
    err = _refused([*argv, "--config", f], capsys, f"model.name (in {f}): unknown model 'qwen2.5-7bb': not a preset")
    assert "--model" not in err, err
    _refused([*argv, "--model", "qwen2.5-7bb"], capsys, "oomb: error: unknown model 'qwen2.5-7bb': not a preset")
    assert not (tmp_path / "run").exists() and not (tmp_path / "h.png").exists()


def test_a_chunk_size_fix_reads_right_with_the_file_s_key(tmp_path, capsys):
    """The fix of a chunk size that is no multiple of the page size names the page size without an article, which
    read "a engine.page_size" where the value came from the --config file."""
    f = tmp_path / "c.yaml"
    f.write_text("engine: {chunk_size: 100}\n")
    err = _refused(["train", "--config", f, "--print-config"], capsys,
                   f"engine.chunk_size (in {f}) 100 is not a multiple of engine.page_size 128",
                   "pass e.g. engine.chunk_size 128, or a divisor of 100 as engine.page_size")
    assert " a engine." not in err


@pytest.mark.parametrize("value, shown", [("true", "true"), ("false", "false"), ("null", "null")])
def test_a_file_s_bool_or_null_is_told_as_yaml_writes_it(tmp_path, capsys, value, shown):
    """A true, false or null in the --config file is echoed as YAML writes it (as engine.sparse: true is), not as
    Python's True, False or None; the Python API keeps Python's spelling."""
    f = tmp_path / "c.yaml"
    f.write_text(f"train:\n  steps: {value}\n")
    err = _refused(["train", "--config", f, "--print-config"], capsys, f"train.steps (in {f}) is {shown};")
    assert "True" not in err and "False" not in err and "None" not in err
    from oomb.config import TrainConfig

    with pytest.raises(ConfigError, match=r"^steps is True; "):
        TrainConfig(steps=True)


def test_a_text_field_with_a_format_that_reads_no_text_field_is_refused(tmp_path, capsys):
    """--text-field with --data-format prompt-completion (or messages, segments) named a field nothing reads: the
    rows were read in that format without a word. Both settings are named as the user gave them."""
    rows = tmp_path / "pc.csv"
    rows.write_text("prompt,completion\na b,c d\n")
    png = tmp_path / "h.png"
    _refused(["data", "--data", rows, "--data-format", "prompt-completion", "--text-field", "prompt", "--output", png],
             capsys, "--text-field 'prompt' names the field of text rows, but --data-format is 'prompt-completion'",
             "leave --text-field out, or pass --data-format text")
    f = tmp_path / "c.yaml"
    f.write_text("data:\n  format: messages\n  text_field: body\n")
    _refused(["train", "--config", f, "--output-dir", tmp_path / "run"], capsys,
             f"data.text_field (in {f}) 'body' names the field of text rows, but data.format is 'messages'",
             "leave data.text_field out, or pass data.format text")
    assert not png.exists() and not (tmp_path / "run").exists()
