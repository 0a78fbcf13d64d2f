"""The optimizers of ``train.optimizer`` (oomb.train.optim): each against plain torch AdamW, their state bytes
against the memory model (oomb.memory.optimizer), checkpoints that resume them exactly, and the planner's choice
of an optimizer that makes a refused run fit."""

from __future__ import annotations

import sys

import pytest
import torch

from oomb.checkpoint import find_latest, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from oomb.memory import GiB, Machine, ModelShape, OptimizerBytes, optimizer_bytes, trainable_numels
from oomb.planner import plan
from oomb.train import optim
from oomb.train.optim import HostAdamW, OptimizerUnavailable, build_optimizer

NAMES = ("adamw", "adamw8bit", "adamw-bf16", "adamw-cpu")


def _steps(name, p0, grads, dtype=torch.float32, lrs=(1e-2, 2e-2, 5e-3)):
    p = torch.nn.Parameter(p0.clone().to(dtype))
    opt = build_optimizer(name, [p], lr=lrs[0], weight_decay=0.1, device="cpu")
    for g, lr in zip(grads, lrs):
        for group in opt.param_groups:
            group["lr"] = lr  # as the training loop sets it: a float
        p.grad = g.clone().to(dtype)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return p.detach().float(), opt


def test_each_optimizer_against_torch_adamw():
    """adamw-cpu and adamw-bf16 (float32 weights: no rounding to bf16) give torch's AdamW up to float32 rounding;
    adamw8bit is within its quantization error of it (and not equal: its states are really 8-bit)."""
    torch.manual_seed(0)
    p0, grads = torch.randn(64, 128), [torch.randn(64, 128) for _ in range(3)]
    ref, _ = _steps("adamw", p0, grads)
    update = (ref - p0).abs().max()
    for name in ("adamw-cpu", "adamw-bf16"):
        got, _ = _steps(name, p0, grads)
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    got, opt = _steps("adamw8bit", p0, grads)
    state = opt.state[opt.param_groups[0]["params"][0]]["exp_avg"]
    assert state.codes.dtype == torch.uint8 and state.codes.shape == (64, 128) and state.scale.numel() == 64 * 128 // 256
    err = (got - ref).abs().max()
    assert 0 < err < 0.1 * update


def test_adamw_bf16_rounds_stochastically():
    """An update of 1/8 of a bf16 ulp: torch's AdamW rounds every weight back (nothing learnt), adamw-bf16 moves
    the mean weight by the update (stochastic rounding is unbiased)."""
    n, lr = 65536, 2**-10  # weights 1.0 (bf16 ulp 2**-7); AdamW's first step moves each by lr (sign of the grad)
    p0, grads = torch.ones(n), [torch.ones(n)]
    plain, _ = _steps("adamw", p0, grads, torch.bfloat16, lrs=(lr,))
    assert torch.equal(plain, p0)
    torch.manual_seed(0)
    sr, _ = _steps("adamw-bf16", p0, grads, torch.bfloat16, lrs=(lr,))
    assert set(sr.unique().tolist()) == {1.0 - 2**-8, 1.0}  # each weight rounds down or up to a bf16 neighbour
    # the step: decay by lr * 0.1 (weight 1), then lr (Adam's first step, m / sqrt(v) = 1); the mean of 65,536
    # stochastic roundings is within 0.04 lr of it (6 standard deviations)
    assert abs((p0 - sr).mean().item() - 1.1 * lr) < 0.04 * lr


def _tiny_bf16():
    from oomb.models.presets import build_model

    torch.manual_seed(0)
    return build_model("tiny", dtype=torch.bfloat16, device="cpu")


def _state_bytes(opt) -> tuple[int, int, int]:
    """(device, host, pinned-or-staging host) bytes of an optimizer's states, read from its tensors."""
    if isinstance(opt, HostAdamW):
        copies = sum(h.nbytes + h.grad.nbytes for _, h, _ in opt._host)
        states = sum(t.nbytes for _, _, o in opt._host for s in o.state.values()
                     for k, t in s.items() if k != "step")
        return 0, copies + states, copies
    total = 0
    for s in opt.state.values():
        for k, t in s.items():
            if k == "step":
                continue
            total += sum(x.nbytes for x in (t.codes, t.scale, t.qmap)) if hasattr(t, "codes") else t.nbytes
    return total, 0, 0


@pytest.mark.parametrize("name", NAMES)
def test_state_bytes_are_those_of_the_memory_model(name):
    """The bytes each optimizer really keeps for the tiny bf16 model (its tensors after a step) are those
    oomb.memory.optimizer counts from the model's shape, and those oomb.plan shows."""
    model = _tiny_bf16()
    params = list(model.parameters())
    shape = ModelShape.from_config(model.config)
    assert sorted(trainable_numels(shape)) == sorted(p.numel() for p in params)
    opt = build_optimizer(name, params, lr=1e-3, weight_decay=0.0, device="cpu")
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    counted = optimizer_bytes(shape, torch.bfloat16, 0, name)
    assert _state_bytes(opt) == (counted.gpu, counted.host, counted.pinned)
    p = plan(shape, 4096, dtype="bfloat16", optimizer=name, machine=Machine(80 * GiB, 80 * GiB, 100 * GiB, 100 * GiB))
    assert p.optimizer == counted.gpu and p.optimizer_host == counted.host and p.host_peak >= counted.host


def test_state_bytes_by_hand():
    """The tiny preset by hand: 32,000 x 128 tied embedding; per layer q/o 128 x 128, k/v 64 x 128, gate/up/down
    128 x 384, q/k/v biases 128 + 64 + 64, two norms of 128; a final norm of 128."""
    shape = ModelShape.from_config("tiny")
    big = [32000 * 128] + 4 * ([128 * 128, 64 * 128, 64 * 128, 128 * 128] + 3 * [128 * 384])
    small = 4 * [128, 64, 64, 128, 128] + [128]  # under 4,096 elements: plain states in 8-bit AdamW too
    n = sum(big) + sum(small)
    assert n == shape.num_params()
    bf16 = torch.bfloat16
    assert optimizer_bytes(shape, bf16, 0, "adamw").gpu == 4 * n
    assert optimizer_bytes(shape, bf16, 0, "adamw-bf16").gpu == 4 * n
    # two uint8 codes per element, two float32 scales per 256 elements, two 256-entry float32 maps per tensor
    assert optimizer_bytes(shape, bf16, 0, "adamw8bit").gpu == sum(2 * k + 8 * k // 256 + 2048 for k in big) + 4 * sum(small)
    assert optimizer_bytes(shape, bf16, 0, "adamw-cpu") == OptimizerBytes(0, 8 * n, 4 * n)  # copy + grad pinned
    assert optimizer_bytes(shape, torch.float32, 0, "adamw").gpu == 8 * n
    assert optimizer_bytes(shape, bf16, 8, "adamw").gpu == 8 * shape.lora_params(8)  # float32 adapters


def _train(model, opt, steps):
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 64).to(torch.bfloat16)  # from the global RNG: restored on resume
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _model():
    torch.manual_seed(0)
    # 64 x 128 = 8,192 elements: quantized by adamw8bit; the biases are not
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 2)).to(torch.bfloat16)


@pytest.mark.parametrize("name", NAMES)
def test_resume_reproduces_the_uninterrupted_run(tmp_path, name):
    """Save after 3 steps, then 4 more; a fresh model and optimizer loaded from the checkpoint give the same 4
    losses and weights exactly (8-bit states and their scales, host states, the stochastic rounding's RNG)."""
    fp = {"model": "seq", "optimizer": name}
    model = _model()
    opt = build_optimizer(name, model.parameters(), lr=1e-2, weight_decay=0.1, device="cpu")
    torch.manual_seed(123)
    _train(model, opt, 3)
    save_checkpoint(tmp_path, 3, model, opt, None, fp, extra={"rng": rng_state()})
    expected = _train(model, opt, 4)

    model2 = _model()
    opt2 = build_optimizer(name, model2.parameters(), lr=1e-2, weight_decay=0.1, device="cpu")
    step, extra = load_checkpoint(find_latest(tmp_path), model2, opt2, None, fp)
    set_rng_state(extra["rng"])
    assert step == 3
    assert _train(model2, opt2, 4) == expected
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_host_adamw_refuses_another_optimizers_state():
    model = _model()
    opt = build_optimizer("adamw", model.parameters(), lr=1e-2, weight_decay=0.0, device="cpu")
    host = build_optimizer("adamw-cpu", model.parameters(), lr=1e-2, weight_decay=0.0, device="cpu")
    with pytest.raises(ValueError, match="not the state of a HostAdamW"):
        host.load_state_dict(opt.state_dict())


def test_without_torchao_the_error_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.optim", None)  # import torchao.optim raises ImportError
    optim._torchao_optimizers.cache_clear()
    try:
        with pytest.raises(OptimizerUnavailable, match=r"optimizer='adamw8bit' needs torchao.*pip install torchao"):
            build_optimizer("adamw8bit", _model().parameters(), lr=1e-3, weight_decay=0.0, device="cpu")
    finally:
        optim._torchao_optimizers.cache_clear()
    with pytest.raises(ValueError, match="unknown optimizer 'sgd'"):
        build_optimizer("sgd", _model().parameters(), lr=1e-3, weight_decay=0.0, device="cpu")


H200_SMALL_HOST = Machine(int(139.8 * GiB), int(139.8 * GiB), 110 * GiB, 110 * GiB, "given")


def test_a_refused_plan_names_the_optimizer_that_fits():
    """Qwen2.5-7B, 1M tokens dense, chunk 4096, per-layer checkpointing, an H200 with 110 GiB of host RAM: with
    adamw the host tier is too small; adamw8bit's 14 GiB fewer GPU states keep enough pages on the GPU, and the
    refusal says so with its numbers; adamw-cpu's 57 GiB on the host leave too little for the KV pages."""
    kw = dict(chunk_size=4096, checkpoint_layers=True, machine=H200_SMALL_HOST)
    adamw = plan("qwen2.5-7b", 1 << 20, optimizer="adamw", **kw)
    eight = plan("qwen2.5-7b", 1 << 20, optimizer="adamw8bit", **kw)
    cpu = plan("qwen2.5-7b", 1 << 20, optimizer="adamw-cpu", **kw)
    assert not adamw.fits and eight.fits and not cpu.fits
    assert adamw.problems[-1] == (f"with optimizer='adamw8bit' it fits (GPU {eight.gpu_peak / GiB:.2f} of "
                                  f"{eight.gpu_budget / GiB:.2f} GiB, host {eight.host_peak / GiB:.2f} of "
                                  f"{eight.host_budget / GiB:.2f} GiB)")
    assert adamw.optimizer - eight.optimizer > 13 * GiB
    assert cpu.optimizer == 0 and cpu.optimizer_host == 8 * cpu.num_params and cpu.optimizer_pinned == 4 * cpu.num_params
    assert "budget left after the optimizer's 56.74 GiB" in cpu.problems[0]
    assert "optimizer: states + pinned copies" in cpu.table()
    assert not plan("qwen2.5-7b", 1 << 20, optimizer="adamw", suggest_optimizer=False, **kw).problems[-1].startswith("with")


FAST = ["--seq-len", "64", "--chunk-size", "32", "--page-size", "16", "--no-progress"]


def _run_cli(argv):
    from oomb.cli import main

    try:
        return main([str(a) for a in argv])
    except SystemExit as exc:
        return exc.code


@pytest.mark.parametrize("name", ["adamw-bf16", "adamw-cpu"])
def test_oomb_train_resumes_each_optimizer_exactly(tmp_path, capsys, name):
    """``oomb train --optimizer X``: resumed from its step-1 checkpoint, step 2's loss and the saved model equal
    the uninterrupted run's; a resume with another --optimizer is refused with one line naming the run's.
    (adamw8bit's eager 8-bit step takes ~10 s a step for the tiny model on 2 CPU cores: its checkpoint is
    tested above, through the same save_checkpoint and load_checkpoint.)"""
    import json
    import shutil

    from safetensors.torch import load_file

    text = tmp_path / "text.txt"
    text.write_text("It is a truth universally acknowledged, that a single man in possession of a good fortune, "
                    "must be in want of a wife.\n" * 8)
    a, b = tmp_path / "a", tmp_path / "b"
    argv = ["train", "--data", text, *FAST, "--steps", "2", "--warmup-steps", "1", "--save-every", "1",
            "--weight-decay", "0.1", "--optimizer", name]
    assert _run_cli([*argv, "--output-dir", a]) == 0
    shutil.copytree(a, b)
    shutil.rmtree(b / "checkpoints" / "step-00000002")  # going back to step 1 in place: the later one removed
    assert _run_cli([*argv, "--output-dir", b, "--resume", b / "checkpoints" / "step-00000001"]) == 0
    log = [json.loads(line)["loss"] for line in (a / "log.jsonl").read_text().splitlines()]
    assert [json.loads(line)["loss"] for line in (b / "log.jsonl").read_text().splitlines()] == log
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    capsys.readouterr()
    assert _run_cli([*argv[:-1], "adamw", "--output-dir", b, "--resume", "latest"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"was trained with --optimizer {name} but this command has --optimizer adamw" in err
