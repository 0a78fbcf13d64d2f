"""One rank's memory and collectives under --shard (oomb.memory.sharding) and `oomb plan --nproc N --shard MODE`."""

from __future__ import annotations

import pytest
import torch

from oomb.cli import main
from oomb.memory import GiB, ModelShape, base_gpu_bytes, collective_counts, shard_bytes, shard_traffic, unit_bytes

# Qwen2.5-7B by hand: h 3584, i 18944, 28 layers, 28 query / 4 KV heads of 128, vocab 152064, untied, q/k/v biases.
LAYER = 2 * 3584 * 3584 + 2 * 3584 * 512 + 3 * 3584 * 18944 + 2 * 3584 + 3584 + 2 * 512  # 233,057,792
ROOT = 2 * 152064 * 3584 + 3584  # embeddings, output head, final norm
P = 28 * LAYER + ROOT  # 7,615,616,512


def _base(shape, dtype, lora_rank=0, targets="q_proj,k_proj,v_proj,o_proj", copies=False, accum="param"):
    return base_gpu_bytes(shape, 4096, 4096, dtype, lora_rank, "adamw", False, "triton", 4096, 1024, accum, targets,
                          copies)


@pytest.mark.parametrize("model", ["qwen2.5-7b", "tiny", "tiny-qwen3"])
@pytest.mark.parametrize("lora, copies", [(0, False), (16, False), (16, True)])
def test_the_units_add_up_to_the_unsharded_model(model, lora, copies):
    shape = ModelShape.from_config(model)
    _, _, weights, grads, _, _ = _base(shape, torch.bfloat16, lora, copies=copies)
    u = unit_bytes(shape, torch.bfloat16, lora, "q_proj,k_proj,v_proj,o_proj", copies)
    assert (u.weights, u.trainable) == (weights, grads)
    one = shard_bytes(shape, torch.bfloat16, "params", 1, lora, "q_proj,k_proj,v_proj,o_proj", copies)
    assert (one.weights, one.grads, one.gathered) == (weights, grads, 0)  # one rank: unsharded


def test_one_ranks_bytes_of_the_7b_shape_by_hand():
    shape = ModelShape.from_config("qwen2.5-7b")
    assert shape.num_params() == P == 7_615_616_512
    u = unit_bytes(shape, torch.bfloat16)
    assert (u.root_weights, u.layer_weights) == (2 * ROOT, 2 * LAYER)
    # params: a shard of everything + the root and three layers gathered; grads: a shard + the root's, the layer in
    # its backward and its reduce-scatter buffer; AdamW's two bf16 states (4 bytes per parameter) sharded.
    s = shard_bytes(shape, torch.bfloat16, "params", 2)
    assert s.weights == 2 * P // 2 + 2 * ROOT + 3 * 2 * LAYER
    assert s.grads == 2 * P // 2 + 2 * ROOT + 2 * 2 * LAYER
    assert s.optimizer == 4 * P // 2
    f32 = shard_bytes(shape, torch.bfloat16, "params", 2, grad_accum_dtype="float32")
    assert f32.grads == 4 * P // 2 + 2 * ROOT + 2 * LAYER + 4 * LAYER  # float32 sums of the shard, float32 reduction
    # grads-optim: a shard of the weights + all of them gathered; the step's unsharded sums; states sharded.
    g = shard_bytes(shape, torch.bfloat16, "grads-optim", 4)
    assert (g.weights, g.grads, g.optimizer) == (2 * P // 4 + 2 * P, 2 * P, 4 * P // 4)
    assert shard_bytes(shape, torch.bfloat16, "grads-optim", 4, grad_accum_dtype="float32").grads == 4 * P
    none = shard_bytes(shape, torch.bfloat16, "none", 8)
    assert (none.weights, none.grads, none.optimizer) == (2 * P, 2 * P, 4 * P)
    # base_gpu_bytes (what oomb plan adds up) takes a rank's bytes from it
    _, _, weights, grads, optim, _ = base_gpu_bytes(shape, 262144, 4096, torch.bfloat16, 0, "adamw", False, "triton",
                                                    4096, 1024, shard="params", nproc=2)
    assert (weights, grads, optim) == (s.weights, s.grads, s.optimizer)


def test_the_collectives_of_a_7b_step_at_256k_by_hand():
    shape = ModelShape.from_config("qwen2.5-7b")
    N = 262144 // 4096  # 64 chunks
    assert collective_counts("params", 28, N) == {"root": 1, "first": 2 * N, "middle": 3 * N - 1, "last": 1,
                                                  "reduce_scatter": N}
    params = shard_traffic(shape, torch.bfloat16, "params", 2, 262144, 4096)
    assert params["all_gather"] == 2 * (ROOT + 2 * N * LAYER + 26 * (3 * N - 1) * LAYER + LAYER)  # 2.16 TiB
    assert params["reduce_scatter"] == N * 2 * P and params["all_reduce"] == 0
    # gradient accumulation: the layers are gathered again for each sequence, grads-optim's stay once per step
    assert collective_counts("params", 28, N, sequences=4)["middle"] == 4 * (3 * N - 1)
    assert shard_traffic(shape, torch.bfloat16, "grads-optim", 2, 262144, 4096, sequences=4) == {
        "all_gather": 2 * P, "reduce_scatter": 2 * P, "all_reduce": 0}
    assert shard_traffic(shape, torch.bfloat16, "none", 2, 262144, 4096)["all_reduce"] == 2 * P
    # a float32 reduction (grad_accum_dtype float32) moves 4 bytes per gradient
    assert shard_traffic(shape, torch.bfloat16, "grads-optim", 2, 262144, 4096,
                         grad_accum_dtype="float32")["reduce_scatter"] == 4 * P


PLAN = ["plan", "--model", "qwen2.5-7b", "--seq-len", "262144", "--gpu-gib", "139", "--host-gib", "120"]


def _rows(text: str) -> dict[str, float]:
    rows = {}
    for line in text.splitlines():
        parts = line.rsplit(None, 1)
        if line.startswith("  ") and len(parts) == 2:
            try:
                rows[parts[0].strip()] = float(parts[1])
            except ValueError:
                pass
    return rows


def test_plan_with_nproc_and_shard_prints_one_ranks_memory(capsys):
    assert main(PLAN) == 0
    whole = _rows(capsys.readouterr().out)
    assert main([*PLAN, "--nproc", "2", "--shard", "params"]) == 0
    out = capsys.readouterr().out
    assert "one rank of 2, --shard params (FSDP2)" in out
    rows = _rows(out)
    s = shard_bytes(ModelShape.from_config("qwen2.5-7b"), torch.bfloat16, "params", 2)
    assert rows[f"weights (shard + {s.gathered / GiB:.2f} gathered)"] == round(s.weights / GiB, 2)
    assert rows["gradients (shard + buffers)"] == round(s.grads / GiB, 2)
    assert rows["optimizer states (adamw)"] == round(s.optimizer / GiB, 2)
    saved = (2 * P + 2 * P + 4 * P - s.weights - s.grads - s.optimizer) / GiB
    assert abs(whole["predicted peak"] - rows["predicted peak"] - saved) < 0.02  # everything else is the same
    assert "collectives per optimizer step" in out and "reduce-scatter" in out


def test_plan_with_nproc_and_no_shard_is_every_ranks_whole_model_and_its_all_reduce(capsys):
    assert main(PLAN) == 0
    whole = capsys.readouterr().out
    assert main([*PLAN, "--nproc", "2"]) == 0
    out = capsys.readouterr().out
    assert "one rank of 2, --shard none (data parallel: every rank holds the whole model)" in out
    assert _rows(out) == _rows(whole)
    assert f"{2 * P / GiB:,.1f} GiB all-reduce" in out and "reduce-scatter" not in out


def test_plan_with_shard_in_one_process_plans_unsharded_with_a_note(capsys):
    assert main(PLAN) == 0
    whole = capsys.readouterr().out
    assert main([*PLAN, "--shard", "grads-optim"]) == 0
    got = capsys.readouterr()
    assert got.out == whole
    assert "note: --shard grads-optim shards over ranks but --nproc is 1" in got.err


def test_a_one_process_shard_plan_that_does_not_fit_names_an_optimizer_with_shard_none(capsys):
    # the other optimizers are refused with a shard mode: the suggestion names both flags, and they fit
    tight = ["plan", "--model", "qwen2.5-7b", "--seq-len", "65536", "--gpu-gib", "60", "--host-gib", "120"]
    assert main([*tight, "--shard", "params"]) == 1
    got = capsys.readouterr()
    assert "DOES NOT FIT" in got.out and "with --optimizer adamw-cpu and --shard none it fits" in got.out
    assert "note: --shard params shards over ranks but --nproc is 1" in got.err
    assert main([*tight, "--optimizer", "adamw-cpu", "--shard", "none"]) == 0
    assert main([*tight]) == 1  # unsharded, the suggestion names the optimizer alone
    assert "with --optimizer adamw-cpu it fits" in capsys.readouterr().out


def test_a_refused_plan_with_shard_prints_its_error_line_only(capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*PLAN, "--shard", "params", "--device", "cpu"])
    assert exit_.value.code == 2
    got = capsys.readouterr()
    assert got.out == "" and got.err.count("\n") == 1 and "device is cpu" in got.err


def test_a_plan_that_does_not_fit_names_the_shard_mode_that_does(capsys):
    assert main(["plan", "--model", "qwen2.5-7b", "--seq-len", "65536", "--gpu-gib", "60", "--host-gib", "120",
                 "--nproc", "4", "--shard", "grads-optim"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "with --shard params it fits" in out
