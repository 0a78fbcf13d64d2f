"""`oomb train --shard params|grads-optim` under torchrun with 2 gloo ranks (tiny preset): losses and final weights
equal one process accumulating the same sequences (a full fine-tune; a LoRA adapter with sparse attention and
offload), a DCP checkpoint resumed equals the uninterrupted run, a refused resume, a failing rank (one launch for
all); --shard in one process and the optimizers it refuses."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from cli_helpers import run_cli

FAST = ["--seq-len", "64", "--chunk-size", "32", "--page-size", "16", "--no-progress"]
# pages of 8 tokens: the second chunk of 32 keeps 3 (sink, local, 1 chosen) of its 4 past pages; every page
# offloaded (the CPU simulation of the host tier); the adapter also trains the (tied) embeddings and the norms
SPARSE_LORA = ["--seq-len", "64", "--chunk-size", "32", "--page-size", "8", "--no-progress", "--lora-rank", "4",
               "--train-embeddings-norms", "--sparse", "--page-budget", "1", "--local-pages", "1", "--lr", "1e-2",
               "--steps", "2", "--offload", "on"]
TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife. However little known the feelings or views of such a man may be "
    "on his first entering a neighbourhood, this truth is so well fixed in the minds of the "
    "surrounding families, that he is considered as the rightful property of some one or other "
    "of their daughters.\n"
) * 4
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shard_driver.py")

pytestmark = pytest.mark.slow  # torchrun with two gloo ranks


@pytest.fixture
def text_file(tmp_path):
    f = tmp_path / "text.txt"
    f.write_text(TEXT)
    return f


def losses(out):
    return [(r["step"], r["loss"]) for r in map(json.loads, (out / "log.jsonl").read_text().splitlines())]


def _torchrun(target: list[str]) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node 2 TARGET`` with one CPU thread per rank and this checkout's oomb."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(random.randint(20000, 40000)), *map(str, target)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)


def _same_weights(a, b, atol):
    wa, wb = load_file(a), load_file(b)
    assert sorted(wa) == sorted(wb)  # a tied output head is written once, as without sharding
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=atol, msg=k)


def test_torchrun_shard_modes_lora_sparse_resume_and_a_failing_rank(tmp_path, text_file):
    """One torchrun launch runs every command (tests/cli/shard_driver.py); each is checked against one process."""
    d = tmp_path
    dense = ["train", "--data", text_file, *FAST, "--steps", "2"]
    first = d / "params" / "checkpoints" / "step-00000001"
    # Two sequences of 16 tokens: 16 words, then 16 EOS tokens (one-token documents: no target with
    # --document-mask), so the rank that gets the second fails its first step.
    bad = d / "bad.jsonl"
    bad.write_text(json.dumps({"text": " ".join(["a"] * 16)}) + "\n" + json.dumps({"text": "</s>" * 15}) + "\n")
    commands = {
        "params": [*dense, "--save-every", "1", "--shard", "params", "--output-dir", d / "params"],
        # grads-optim keeps the layers gathered through a step: its second step shows they are gathered anew
        "grads-optim": ["train", "--data", text_file, *SPARSE_LORA, "--shard", "grads-optim",
                        "--output-dir", d / "grads-optim"],
        "resumed": [*dense, "--shard", "params", "--resume", first, "--output-dir", d / "resumed"],
        "refused": [*dense, "--shard", "grads-optim", "--resume", first, "--output-dir", d / "refused"],
        "two-dtypes": [*dense, "--dtype", "bfloat16", "--lora-rank", "4", "--train-embeddings-norms", "--shard",
                       "params", "--output-dir", d / "two-dtypes"],
        "failing": ["train", "--data", bad, "--document-mask", "--seq-len", "16", "--chunk-size", "16",
                    "--page-size", "16", "--steps", "2", "--no-progress", "--shard", "params", "--output-dir",
                    d / "failing"],
    }
    target = [DRIVER, d / "statuses.json"]
    for argv in commands.values():
        target += ["--", *map(str, argv)]
    res = _torchrun(target)
    assert res.returncode == 0, res.stderr[-3000:]
    statuses = dict(zip(commands, json.loads((d / "statuses.json").read_text())))
    assert statuses == {"params": 0, "grads-optim": 0, "resumed": 0, "refused": 2, "two-dtypes": 2, "failing": 1}, \
        res.stderr[-3000:]
    err = res.stderr  # both ranks' lines (torchrun may join two ranks' lines into one)

    # One process accumulating the two ranks' sequences of each step: the full fine-tune (params) and the LoRA
    # adapter with sparse attention and offload (grads-optim).
    assert run_cli([*dense, "--grad-accum", "2", "--output-dir", d / "one"]) == 0
    assert run_cli(["train", "--data", text_file, *SPARSE_LORA, "--grad-accum", "2", "--output-dir", d / "lora-one"]) == 0
    for mode, one, weights in (("params", "one", "model.safetensors"),
                               ("grads-optim", "lora-one", "adapter_model.safetensors")):
        got, want = losses(d / mode), losses(d / one)
        assert [s for s, _ in got] == [1, 2]
        assert abs(got[0][1] - want[0][1]) < 1e-5 and abs(got[1][1] - want[1][1]) < 1e-4, (mode, got, want)
        # AdamW's first steps move every weight by ~lr; weights whose gradient is ~0 differ by rounding Adam scales up
        _same_weights(d / mode / weights, d / one / weights, atol=2e-4)
        train_args = json.loads((d / mode / "train_args.json").read_text())
        assert train_args["shard"] == mode and train_args["world_size"] == 2

    # The checkpoint: every rank's shards as torch.distributed.checkpoint files, listed and hashed in meta.json.
    meta = json.loads((first / "meta.json").read_text())
    assert meta["sharded"] == {"world_size": 2} and "dcp/.metadata" in meta["files"]
    assert not (first / "trainable.safetensors").exists()
    # Resumed from step 1: step 2 and the weights are exactly the uninterrupted run's.
    assert losses(d / "resumed") == [(2, losses(d / "params")[1][1])]
    _same_weights(d / "resumed" / "model.safetensors", d / "params" / "model.safetensors", atol=0)
    # Resuming with another --shard is refused in one line per rank, before anything is written.
    assert err.count("oomb: error: --resume:") == 2, err[-3000:]
    assert err.count("was trained with --shard params but this command has --shard grads-optim") == 2
    assert not (d / "refused").exists()
    # bf16 weights with float32 LoRA adapters and bf16 copies of the norms in one layer: FSDP2 reduces one dtype
    assert err.count("oomb: error: a sharded layer trains parameters of two dtypes (bfloat16 and float32") == 2
    assert err.count("train in float32 (--dtype float32), leave out --train-embeddings-norms, or use --shard none") == 2
    # A rank without a target stops both ranks, each with one line, before the step's collectives begin.
    assert err.count("oomb: error: step 1 failed: every label is -100") == 1, err[-3000:]
    assert err.count("oomb: error: step 1: another rank failed") == 1
    assert err.count("oomb: error:") == 6
    assert not (d / "failing" / "model.safetensors").exists()



def test_shard_in_one_process_trains_unsharded_with_a_note(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    assert run_cli(["train", "--data", text_file, *FAST, "--steps", "1", "--shard", "grads-optim",
                    "--output-dir", out]) == 0
    err = capsys.readouterr().err
    assert "note: --shard grads-optim shards over the ranks of torchrun; this is one process" in err
    assert json.loads((out / "train_args.json").read_text())["shard"] == "none"
    assert (out / "checkpoints" / "step-00000001" / "trainable.safetensors").is_file()  # the one-process format


def test_shard_in_one_process_refused_by_the_plan_says_it_planned_one_process(tmp_path, text_file, capsys,
                                                                            monkeypatch):
    """A (faked) GPU with 8 GiB free: a 7B --shard params run without torchrun is planned unsharded and refused in
    one line that says so (the note that --shard does nothing here is printed only on a run that starts)."""
    import oomb.models.presets as presets
    from oomb.planner import Machine

    def no_build(*args, **kwargs):
        raise AssertionError("the model was built before the plan check")

    small_gpu = Machine(8 << 30, 8 << 30, 64 << 30, 64 << 30, "fake 8 GiB GPU")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(Machine, "detect", classmethod(lambda cls, device=None: small_gpu))
    monkeypatch.setattr(presets, "build_model", no_build)
    out = tmp_path / "run"
    assert run_cli(["train", "--data", text_file, "--model", "qwen2.5-7b", "--device", "cuda", *FAST,
                    "--shard", "params", "--output-dir", out]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("oomb: error: "), err
    assert "(planned as one process: --shard params shards only over the ranks of torchrun)" in err
    assert "note:" not in err and not out.exists()


@pytest.mark.parametrize("optimizer", ["adamw8bit", "adamw-bf16", "adamw-cpu"])
def test_shard_refuses_optimizers_that_keep_whole_tensor_states(tmp_path, capsys, optimizer):
    assert run_cli(["train", "--shard", "params", "--optimizer", optimizer, "--output-dir", tmp_path / "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--optimizer {optimizer} cannot" in err and "pass --optimizer adamw" in err
    assert not (tmp_path / "x").exists()
