"""Atomic checkpoints: verified loads, refusal of other runs, survival of a SIGKILL mid-write."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from oomb.checkpoint import CheckpointError, GracefulStop, find_latest, load_checkpoint, rng_state, save_checkpoint, set_rng_state


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))


def _train(model, opt, sched, steps):
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 4)  # from the global RNG: restored on resume
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


FP = {"model": "tiny", "seq_len": 128}


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    torch.manual_seed(123)
    _train(model, opt, sched, 3)
    save_checkpoint(tmp_path, 3, model, opt, sched, FP, extra={"rng": rng_state(), "data_position": 3})
    expected = _train(model, opt, sched, 4)

    model2 = _model()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    sched2 = torch.optim.lr_scheduler.CosineAnnealingLR(opt2, T_max=10)
    step, extra = load_checkpoint(find_latest(tmp_path), model2, opt2, sched2, FP)
    set_rng_state(extra["rng"])
    assert step == 3 and extra["data_position"] == 3
    assert _train(model2, opt2, sched2, 4) == expected  # exactly


def test_keeps_the_last_checkpoints_and_pointer(tmp_path):
    model = _model()
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model, None, None, FP, keep_last=2)
    names = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert names == ["step-00000002", "step-00000003"]
    assert (tmp_path / "latest").read_text().strip() == "step-00000003"


def test_corrupt_and_partial_checkpoints_are_named(tmp_path):
    model = _model()
    path = save_checkpoint(tmp_path, 1, model, None, None, FP)
    weights = path / "trainable.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="trainable.safetensors is truncated"):
        load_checkpoint(path, _model(), None, None, FP)
    os.remove(path / "meta.json")
    with pytest.raises(CheckpointError, match="meta.json is missing"):
        load_checkpoint(path, _model(), None, None, FP)


@pytest.mark.parametrize("edit, fragment", [
    (lambda meta: [1, 2], "not an oomb checkpoint"),
    (lambda meta: "text", "not an oomb checkpoint"),
    (lambda meta: {k: v for k, v in meta.items() if k != "step"}, "is damaged (its step is None"),
    (lambda meta: {**meta, "step": "3"}, "is damaged (its step is '3'"),
    (lambda meta: {**meta, "files": [1]}, "is damaged (its file list"),
    (lambda meta: {**meta, "files": {k: {"bytes": v["bytes"]} for k, v in meta["files"].items()}}, "is damaged (its file list"),
    (lambda meta: {**meta, "fingerprint": [1]}, "is damaged (its run fingerprint"),
    (lambda meta: {**meta, "files": {"../x": {"bytes": 1, "sha256": "0"}}}, "is damaged (it names files outside"),
])
def test_a_damaged_meta_json_is_named(tmp_path, edit, fragment):
    path = save_checkpoint(tmp_path, 1, _model(), None, None, FP)
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps(edit(meta)))
    with pytest.raises(CheckpointError, match=r"meta\.json .*; no earlier checkpoint of this run is intact") as info:
        load_checkpoint(path, _model(), None, None, FP)
    assert fragment in str(info.value)


def test_a_damaged_file_is_called_truncated_or_corrupt_and_the_earlier_checkpoints_are_named(tmp_path):
    """A flipped byte was 'corrupt or truncated (N bytes, expected N, or a checksum mismatch)'; now a file of the
    right size is a checksum mismatch, a shorter one truncated, and the fix names the newest earlier checkpoints
    that have all their files. Nothing of the damaged checkpoint is deleted or rewritten."""
    model = _model()
    first, second, third = (save_checkpoint(tmp_path, s, model, None, None, FP, keep_last=3) for s in (1, 2, 3))
    state = third / "trainer_state.pt"
    good = state.read_bytes()
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 1

    def refusal(data: bytes) -> str:
        state.write_bytes(data)
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(third, _model(), None, None, FP)
        assert state.read_bytes() == data and (third / "meta.json").is_file()
        return str(info.value)

    err = refusal(bytes(flipped))
    assert "trainer_state.pt is corrupt (its size is right but its SHA-256 checksum is not" in err, err
    assert f"--resume {second} (or the one before it, {first}) and a new --output-dir" in err, err
    assert "truncated" not in err and "bytes" not in err
    err = refusal(good[:100])
    assert f"trainer_state.pt is truncated (100 of its {len(good):,} bytes)" in err and f"--resume {second} " in err
    assert "corrupt" not in err
    err = refusal(good + b"x")
    assert f"is corrupt ({len(good) + 1} bytes, {len(good)} written)" in err, err
    (second / "trainable.safetensors").write_bytes(b"x")  # the earlier ones are named only with all their files
    err = refusal(bytes(flipped))
    assert f"--resume {first} and a new --output-dir" in err and str(second) not in err, err
    (first / "meta.json").unlink()
    err = refusal(bytes(flipped))
    assert "no earlier checkpoint of this run is intact: restore the file from a copy" in err, err


def test_checkpoint_files_get_the_mode_open_gives(tmp_path):
    """trainable.safetensors was written 0600 (safetensors' own mode) beside 0644 files: every file of a checkpoint
    gets 0666 less the umask, as open() gives."""
    old = os.umask(0o022)
    try:
        path = save_checkpoint(tmp_path / "a", 1, _model(), None, None, FP)
        os.umask(0o027)
        other = save_checkpoint(tmp_path / "b", 1, _model(), None, None, FP)
    finally:
        os.umask(old)
    for folder, mode in ((path, 0o644), (other, 0o640)):
        modes = {f.name: f.stat().st_mode & 0o777 for f in folder.iterdir()}
        assert set(modes) == {"meta.json", "trainable.safetensors", "trainer_state.pt"}
        assert set(modes.values()) == {mode}, modes


def test_a_different_run_is_refused_with_the_reason(tmp_path):
    path = save_checkpoint(tmp_path, 1, _model(), None, None, FP)
    with pytest.raises(CheckpointError, match="seq_len: checkpoint 128, now 256"):
        load_checkpoint(path, _model(), None, None, {"model": "tiny", "seq_len": 256})
    other = torch.nn.Sequential(torch.nn.Linear(4, 8))
    with pytest.raises(CheckpointError, match="does not match the model's trainable parameters"):
        load_checkpoint(path, other, None, None, FP)


def test_sigkill_while_writing_keeps_the_previous_checkpoint(tmp_path):
    """A real SIGKILL in the middle of writing checkpoint 2: checkpoint 1 still loads."""
    script = textwrap.dedent(f"""
        import os, signal, torch
        import oomb.checkpoint as ck
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        ck.save_checkpoint({str(tmp_path)!r}, 1, model, None, None, {FP!r})
        with torch.no_grad():
            model[0].weight.add_(1.0)
        real_save = torch.save
        def dying_save(obj, f, *a, **k):
            real_save(obj, f, *a, **k)
            os.kill(os.getpid(), signal.SIGKILL)  # after the weights, before meta.json and the rename
        torch.save = dying_save
        ck.save_checkpoint({str(tmp_path)!r}, 2, model, None, None, {FP!r})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert any(p.name.startswith(".tmp-step-00000002") for p in tmp_path.iterdir())  # the interrupted write
    latest = find_latest(tmp_path)
    assert latest.name == "step-00000001"
    model = _model()
    step, _ = load_checkpoint(latest, model, None, None, FP)
    assert step == 1
    torch.testing.assert_close(model[0].weight, _model()[0].weight)
    # The next save clears the debris.
    save_checkpoint(tmp_path, 2, model, None, None, FP)
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())
    assert json.loads((tmp_path / "step-00000002" / "meta.json").read_text())["step"] == 2


def test_graceful_stop_turns_a_signal_into_a_flag():
    with GracefulStop() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_graceful_stop_says_what_the_first_signal_does(capsys):
    """A second Ctrl-C aborts without saving; the first one says so (a silent first Ctrl-C during a long step
    invites the second)."""
    with GracefulStop(notice="got {name}: saving after this step (again: stop without saving)") as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested == signal.SIGINT
        assert "got SIGINT: saving after this step" in capsys.readouterr().err
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)


def test_graceful_stop_takes_over_an_earlier_handler_and_its_pending_signal():
    """take_over: on exit the handler from before the earlier one is back (not the earlier one), and a signal the
    earlier one recorded counts as received (oomb train's startup handler hands over to the training loop's)."""
    before = signal.getsignal(signal.SIGTERM)
    startup = lambda signum, frame: None  # noqa: E731 - the earlier handler, installed over `before`
    signal.signal(signal.SIGTERM, startup)
    try:
        with GracefulStop() as stop:
            assert stop.requested is None
            stop.take_over({signal.SIGTERM: before}, signal.SIGTERM)
            assert stop.requested == signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        signal.signal(signal.SIGTERM, before)


def test_saving_an_earlier_step_keeps_the_new_checkpoint(tmp_path):
    """A run resumed from an earlier checkpoint saves steps below those already in the folder: the new
    checkpoint must survive pruning and `latest` must point at it (pruning by position deleted it)."""
    model = _model()
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, model, None, None, FP, keep_last=2)
    save_checkpoint(tmp_path, 2, model, None, None, FP, keep_last=2)  # resumed from step 1, saving step 2 again
    assert find_latest(tmp_path) == tmp_path / "step-00000002" and (tmp_path / "step-00000002" / "meta.json").is_file()
    names = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert names == ["step-00000002", "step-00000003", "step-00000004"]  # later steps kept until saved again
    save_checkpoint(tmp_path, 3, model, None, None, FP, keep_last=2)
    names = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert names == ["step-00000002", "step-00000003", "step-00000004"]
    assert find_latest(tmp_path) == tmp_path / "step-00000003"
