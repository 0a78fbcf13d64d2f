"""`oomb train` checkpoints and --resume, SIGTERM, --grad-accum, --lr-schedule, RoPE options, torchrun."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from oomb.cli import main
from oomb.cli.resume import _resume_command
from oomb.train import lr_at
from cli_helpers import run_cli

FAST = ["--seq-len", "64", "--chunk-size", "32", "--page-size", "16", "--no-progress"]
TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife. However little known the feelings or views of such a man may be "
    "on his first entering a neighbourhood, this truth is so well fixed in the minds of the "
    "surrounding families, that he is considered as the rightful property of some one or other "
    "of their daughters.\n"
) * 4
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _python(script: str, *args: str, timeout: float = 300, cwd: str | None = None) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh Python that imports this checkout's oomb (output captured as text), with as many
    CPU threads as this process: a float32 sum over a different number of threads rounds differently, and the
    tests compare losses of the two processes exactly."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": str(torch.get_num_threads())}
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env=env)


@pytest.fixture
def text_file(tmp_path):
    f = tmp_path / "text.txt"
    f.write_text(TEXT)
    return f


def losses(out):
    return [(r["step"], r["loss"]) for r in map(json.loads, (out / "log.jsonl").read_text().splitlines())]


def test_resume_reproduces_the_uninterrupted_losses_exactly(tmp_path, text_file, capsys):
    a = tmp_path / "a"
    argv = ["train", "--data", text_file, *FAST, "--steps", "6", "--warmup-steps", "2", "--save-every", "3"]
    assert run_cli([*argv, "--output-dir", a]) == 0
    assert sorted(os.listdir(a / "checkpoints")) == ["latest", "step-00000003", "step-00000006"]
    straight = losses(a)
    assert [s for s, _ in straight] == [1, 2, 3, 4, 5, 6]
    # Continue from the step-3 checkpoint (a copy of the run): steps 4..6 are trained again.
    b = tmp_path / "b"
    shutil.copytree(a, b)
    for name in ("model.safetensors", "config.json"):
        (b / name).unlink()
    with open(b / "log.jsonl", "a") as f:  # a record cut off by a crash is dropped too
        f.write('{"step": 7, "lo')
    # Going back to step 3 where step 6 exists would replace it: refused, nothing touched.
    before = {p.relative_to(b): p.read_bytes() for p in b.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert run_cli([*argv, "--output-dir", b, "--resume", b / "checkpoints" / "step-00000003"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not the newest checkpoint" in err and "step-00000006 comes after it" in err
    assert "--output-dir NEW_DIR" in err and "--resume latest" in err
    assert {p.relative_to(b): p.read_bytes() for p in b.rglob("*") if p.is_file()} == before
    # Once the user removes the later checkpoint, the run goes back to step 3 there.
    shutil.rmtree(b / "checkpoints" / "step-00000006")
    assert run_cli([*argv, "--output-dir", b, "--resume", b / "checkpoints" / "step-00000003"]) == 0
    assert losses(b) == straight  # the log keeps steps 1..3 and gets 4..6 again, equal to the last digit
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert "resuming from" in capsys.readouterr().err
    assert sorted(os.listdir(b / "checkpoints")) == ["latest", "step-00000003", "step-00000006"]


def test_resume_refuses_other_settings_and_corrupt_checkpoints(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    argv = ["train", "--data", text_file, *FAST, "--steps", "2", "--output-dir", out]
    assert run_cli(argv) == 0
    capsys.readouterr()
    # --resume with --overwrite
    assert run_cli([*argv, "--resume", "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--overwrite" in err
    # another sequence length / model: refused with the reason
    assert run_cli([*argv, "--resume", "--seq-len", "32"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a checkpoint of another run (--seq-len 64 there, 32 here)" in err
    assert run_cli([*argv, "--resume", "--model", "tiny-llama"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "(--model tiny there, tiny-llama here)" in err
    # --resume in a directory without checkpoints
    assert run_cli(["train", "--data", text_file, *FAST, "--output-dir", tmp_path / "new", "--resume"]) == 2
    assert "no checkpoints" in capsys.readouterr().err
    # a checkpoint path that is not there, or a file: said so
    assert run_cli([*argv, "--resume", tmp_path / "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{tmp_path / 'nope'} does not exist; pass 'latest' or a checkpoint folder" in err
    assert run_cli([*argv, "--resume", text_file]) == 2
    assert "is a file, not a checkpoint folder" in capsys.readouterr().err
    # a truncated file: named
    ckpt = out / "checkpoints" / "step-00000002"
    weights = ckpt / "trainable.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    before = (out / "log.jsonl").read_bytes()
    assert run_cli([*argv, "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{weights} is truncated (100 of its " in err, err
    assert (out / "log.jsonl").read_bytes() == before
    # a partial checkpoint (no meta.json): named
    (ckpt / "meta.json").unlink()
    assert run_cli([*argv, "--resume", ckpt]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "meta.json" in err


def test_resume_names_the_other_seq_len_before_what_it_breaks(tmp_path, text_file, capsys):
    """--resume with a --seq-len other than the checkpoint's is refused for that mismatch first, not for what the
    other length breaks (a --gpu-page-budget too small for it, data shorter than it): exit 2, one line."""
    out = tmp_path / "run"
    argv = ["train", "--data", text_file, *FAST, "--steps", "2", "--output-dir", out, "--offload", "on",
            "--gpu-page-budget", "8"]  # 8 pages: two staging buffers of the 4 pages of a 64-token layer
    assert run_cli(argv) == 0
    capsys.readouterr()
    for seq_len in ("128", "4096"):  # 128: the budget is too small for it; 4096: the data too
        assert run_cli([*argv, "--resume", "latest", "--seq-len", seq_len]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"is a checkpoint of another run (--seq-len 64 there, {seq_len} here)" in err, err


def test_resume_says_the_data_changed_where_its_settings_are_the_same(tmp_path, capsys):
    """The same command over a --data file whose contents changed since the checkpoint is refused as changed data
    (restore it), not as another run's settings; a data setting that differs is named with both values."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"text": TEXT, "body": TEXT.upper()}) + "\n" for _ in range(2)))
    out = tmp_path / "run"
    argv = ["train", "--data", data, *FAST, "--save-every", "1", "--output-dir", out, "--steps"]
    assert run_cli([*argv, "1"]) == 0
    capsys.readouterr()
    assert run_cli([*argv, "2", "--resume", "latest", "--text-field", "body"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a checkpoint of another run (the --data tokens differ (--text-field text " \
        "there, body here))" in err, err
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    original = data.read_text()
    data.write_text(original.replace("fortune", "fortunes"))
    assert run_cli([*argv, "2", "--resume", "latest"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "another run" not in err, err
    assert "the data's contents changed since" in err and "the data settings are the same" in err
    assert "restore the data the run trained on, or start a new run without --resume in another --output-dir" in err
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    data.write_text(original)  # restored: the run continues
    assert run_cli([*argv, "2", "--resume", "latest"]) == 0


def test_resume_names_a_changed_tokenizer_and_an_older_checkpoint_s_unknown_data_settings(tmp_path):
    from oomb.cli.errors import UsageError
    from oomb.cli.resume import _check_resume_fingerprint

    saved, now = {"seq_len": 64, "data_sha256": "a"}, {"seq_len": 64, "data_sha256": "b"}
    settings = {"path": "/d.jsonl", "split": "train", "format": "auto", "text_field": "text", "chat_template": None,
                "loss_on": None, "long_examples": None, "tokenizer_sha256": "t1"}
    with pytest.raises(UsageError) as info:
        _check_resume_fingerprint(saved, now, tmp_path, settings, {**settings, "tokenizer_sha256": "t2"})
    assert "the tokenizer changed since" in info.value.problem and "restore the tokenizer" in info.value.fix
    with pytest.raises(UsageError) as info:  # a checkpoint that recorded no data settings: the tokens differ
        _check_resume_fingerprint(saved, now, tmp_path, None, settings)
    assert info.value.problem.endswith("is a checkpoint of another run (the --data tokens differ)")


@pytest.mark.parametrize("meta", ["[1, 2]", "no-step"])
def test_resume_from_a_damaged_meta_json_exits_2_with_one_line(tmp_path, text_file, capsys, meta):
    out = tmp_path / "run"
    argv = ["train", "--data", text_file, *FAST, "--steps", "2", "--output-dir", out]
    assert run_cli(argv) == 0
    capsys.readouterr()
    meta_path = out / "checkpoints" / "step-00000002" / "meta.json"
    if meta == "no-step":
        data = json.loads(meta_path.read_text())
        del data["step"]
        meta = json.dumps(data)
    meta_path.write_text(meta)
    before = (out / "log.jsonl").read_bytes()
    assert run_cli([*argv, "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(meta_path) in err and "no earlier checkpoint of this run is intact" in err, err
    assert "Traceback" not in err
    assert (out / "log.jsonl").read_bytes() == before


def test_sigterm_saves_a_checkpoint_and_says_how_to_resume(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    args = ["train", "--data", str(text_file), *FAST, "--steps", "100000", "--lr-schedule", "constant", "--output-dir", str(out)]
    proc = subprocess.Popen([sys.executable, "-m", "oomb", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and not ((out / "log.jsonl").exists() and (out / "log.jsonl").read_text().count("\n") >= 2):
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    line = [x for x in err.splitlines() if "stopped by SIGTERM" in x]
    assert len(line) == 1 and "--resume latest" in line[0], err
    step = losses(out)[-1][0]
    assert (out / "checkpoints" / f"step-{step:08d}" / "meta.json").is_file()
    assert line[0].endswith(_resume_command(args))
    assert "SIGTERM received: finishing this step, then saving a checkpoint" in err  # said at once
    # the same command again (no --resume) points at --resume instead of only at --overwrite
    assert run_cli(args) == 2
    refused = capsys.readouterr().err
    assert "holds an oomb run that stopped before its end" in refused and "pass --resume to continue it" in refused
    # continue for one more step (--steps may change on resume)
    assert run_cli([*args[:-4], "--steps", step + 1, "--lr-schedule", "constant", "--output-dir", out, "--resume"]) == 0
    assert [s for s, _ in losses(out)] == list(range(1, step + 2))
    assert (out / "model.safetensors").is_file()


def test_grad_accum_equals_one_step_over_both_sequences_by_hand(tmp_path, text_file):
    out = tmp_path / "run"
    lr = 1e-2
    assert run_cli(["train", "--data", text_file, *FAST, "--steps", "1", "--grad-accum", "2", "--lr", lr, "--max-grad-norm", "0.5", "--output-dir", out]) == 0
    from oomb.data import TokenSequences, load_tokenizer, tokenize_documents, load_documents
    from oomb.models.presets import build_model

    tok = load_tokenizer(None)
    seqs = TokenSequences(tokenize_documents(load_documents(str(text_file)), tok), 64, seed=0)
    order = seqs.order(0)
    x0, x1 = seqs[int(order[0])], seqs[int(order[1])]
    torch.manual_seed(0)
    model = build_model("tiny", dtype=torch.float32)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    # One plain full-sequence step over the two sequences: mean over all their target tokens.
    logits0, logits1 = model(x0).logits[0, :-1], model(x1).logits[0, :-1]
    loss = torch.nn.functional.cross_entropy(torch.cat([logits0, logits1]).float(), torch.cat([x0[0, 1:], x1[0, 1:]]))
    loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, 0.5))
    opt.step()
    trained = load_file(out / "model.safetensors")
    for name, p in model.state_dict().items():
        if name in trained:
            # AdamW's first step moves every weight by ~lr = 1e-2; a few weights whose gradient is ~0 differ by
            # rounding amplified by Adam's normalisation, far below that.
            torch.testing.assert_close(trained[name], p, rtol=0, atol=1e-4, msg=name)
    rec = json.loads((out / "log.jsonl").read_text())
    # The loss and the (pre-clip) gradient norm show the normalisation by the 126 target tokens of the step.
    assert rec["num_tokens"] == 128 and abs(rec["loss"] - loss.item()) < 1e-5
    assert abs(rec["grad_norm"] - grad_norm) < 1e-5 * grad_norm


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
def test_lr_schedules(schedule):

    lrs = [lr_at(s, lr=1.0, steps=10, warmup=2, schedule=schedule) for s in range(1, 11)]
    assert lrs[:2] == [0.5, 1.0]
    if schedule == "constant":
        assert lrs[2:] == [1.0] * 8
    else:
        assert lrs[2] == 1.0 and abs(lrs[-1] - 0.1) < 1e-12 and lrs == sorted(lrs[:2]) + sorted(lrs[2:], reverse=True)


def test_rope_options_are_in_the_saved_config(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    spec = "type=yarn,factor=4,original_max_position_embeddings=32768"
    assert run_cli(["train", "--data", text_file, *FAST, "--steps", "1", "--rope-theta", "500000", "--rope-scaling", spec, "--output-dir", out]) == 0
    cfg = json.loads((out / "config.json").read_text())
    rope = cfg.get("rope_parameters") or {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta")}
    assert rope["rope_type"] == "yarn" and rope["factor"] == 4 and rope["original_max_position_embeddings"] == 32768
    assert rope["rope_theta"] == 500000
    capsys.readouterr()
    assert run_cli(["train", "--data", text_file, *FAST, "--rope-scaling", "type=nope,factor=2", "--output-dir", tmp_path / "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nope" in err and not (tmp_path / "x").exists()


def _torchrun(args, tmp_path, port):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port), "-m", "oomb", *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)


def test_torchrun_two_ranks_equal_one_process_accumulating_their_two_sequences(tmp_path, text_file):
    import random

    port = random.randint(20000, 40000)
    common = ["train", "--data", text_file, *FAST, "--steps", "2", "--save-every", "1"]
    dp = _torchrun([*common, "--output-dir", tmp_path / "dp"], tmp_path, port)
    assert dp.returncode == 0, dp.stderr[-3000:]
    assert dp.stdout.count("step     2/2") == 1  # rank 0 alone logs
    assert run_cli([*common, "--grad-accum", "2", "--output-dir", tmp_path / "one"]) == 0
    a, b = losses(tmp_path / "dp"), losses(tmp_path / "one")
    assert [s for s, _ in a] == [1, 2] and abs(a[0][1] - b[0][1]) < 1e-5 and abs(a[1][1] - b[1][1]) < 1e-4
    wa, wb = load_file(tmp_path / "dp" / "model.safetensors"), load_file(tmp_path / "one" / "model.safetensors")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=2e-4, msg=k)
    assert json.loads((tmp_path / "dp" / "train_args.json").read_text())["world_size"] == 2


def test_torchrun_a_rank_that_fails_stops_every_rank_with_one_line(tmp_path):
    import random

    # Two sequences of 16 tokens: 16 words, then 16 EOS tokens (16 one-token documents: no target with
    # --document-mask), so the rank that gets the second sequence fails its step.
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"text": " ".join(["a"] * 16)}) + "\n" + json.dumps({"text": "</s>" * 15}) + "\n")
    args = ["train", "--data", data, "--document-mask", "--seq-len", "16", "--chunk-size", "16", "--page-size", "16",
            "--steps", "2", "--no-progress", "--output-dir", tmp_path / "run"]
    res = _torchrun(args, tmp_path, random.randint(20000, 40000))
    assert res.returncode != 0
    errors = [line for line in res.stderr.splitlines() if line.startswith("oomb: error:")]
    # The failing rank says why; the other says another rank failed -- unless torchrun, which ends the
    # remaining workers as soon as one exits with an error, got there first.
    assert 1 <= len(errors) <= 2, res.stderr[-3000:]
    assert sum("step 1 failed: every label is -100" in e for e in errors) == 1, res.stderr[-3000:]
    assert all("step 1 failed" in e or "step 1: another rank failed" in e for e in errors)
    assert not (tmp_path / "run" / "model.safetensors").exists()


def test_grad_error_subcommand(tmp_path, text_file, capsys):
    js = tmp_path / "report.json"
    argv = ["grad-error", "--data", text_file, "--seq-len", "128", "--chunk-size", "32", "--page-size", "16",
            "--budgets", "1", "64", "--local-pages", "1", "--json", js]
    assert run_cli(argv) == 0
    table = capsys.readouterr().out
    assert "rel err @ 1 pages" in table and "**all**" in table
    report = json.loads(js.read_text())
    assert report["rel_error_all"]["64"] == 0.0 and report["rel_error_all"]["1"] > 0  # every page fits in 64
    assert run_cli([*argv[:-2], "--budgets", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--budgets" in err


def test_sigkill_while_writing_a_checkpoint_then_resume(tmp_path, text_file):
    """`oomb train` is SIGKILLed in the middle of writing its step-2 checkpoint: the step-1
    checkpoint still loads, and resuming from it reproduces the uninterrupted run's losses."""
    argv = ["train", "--data", str(text_file), *FAST, "--steps", "4", "--warmup-steps", "1", "--save-every", "1"]
    straight = tmp_path / "straight"
    assert run_cli([*argv, "--output-dir", straight]) == 0
    killed = tmp_path / "killed"
    script = (
        "import os, signal, sys, torch\n"
        "import oomb.checkpoint as ck\n"
        "from oomb.cli import main\n"
        "real_save, calls = torch.save, []\n"
        "def dying_save(obj, f, *a, **k):\n"
        "    real_save(obj, f, *a, **k)\n"
        "    calls.append(f)\n"
        "    if len(calls) == 2:  # inside the step-2 checkpoint: weights and state written, meta.json not yet\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "ck.torch.save = dying_save\n"
        f"sys.exit(main({[str(a) for a in argv] + ['--output-dir', str(killed)]!r}))\n"
    )
    proc = _python(script)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    ckpts = killed / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step-00000001"
    assert any(p.name.startswith(".tmp-step-00000002") for p in ckpts.iterdir())
    assert run_cli([*argv, "--output-dir", killed, "--resume", "latest"]) == 0
    assert losses(killed) == losses(straight)


def _files(path):
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_resume_refuses_engine_settings_that_change_the_training(tmp_path, text_file, capsys):
    """--sparse and its options, and with --sparse the chunk and page sizes, were not in the checkpoint: a
    sparse run resumed without --sparse (or with another budget) silently trained otherwise. Refused with both
    values and the fix; the checkpoint is left as it was. A dense run's chunk size may change (a note)."""
    out = tmp_path / "sparse-run"
    argv = ["train", "--data", text_file, *FAST, "--steps", "2", "--output-dir", out, "--sparse", "--page-budget", "2"]
    assert run_cli(argv) == 0
    capsys.readouterr()
    before = _files(out)
    base = ["train", "--data", text_file, *FAST, "--steps", "3", "--output-dir", out, "--resume"]
    for extra, said in (
        ([], "was trained with --sparse, --page-budget 2 but this command has no --sparse, --page-budget 64"),
        (["--sparse", "--page-budget", "1"], "was trained with --page-budget 2 but this command has --page-budget 1"),
        (["--sparse", "--page-budget", "2", "--sparse-score", "quest"], "--sparse-score mean but this command has --sparse-score quest"),
        (["--sparse", "--page-budget", "2", "--chunk-size", "16"], "--chunk-size 32 but this command has --chunk-size 16"),
    ):
        assert run_cli([*base, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err and "continue it with the checkpoint's settings (" in err, err
        assert _files(out) == before
    assert run_cli([*base, "--sparse", "--page-budget", "2"]) == 0
    capsys.readouterr()

    dense = tmp_path / "dense-run"
    dargv = ["train", "--data", text_file, *FAST, "--steps", "2", "--output-dir", dense]
    assert run_cli(dargv) == 0
    capsys.readouterr()
    before = _files(dense)
    # AdamW's saved weight decay silently replaced --weight-decay: refused
    assert run_cli([*dargv, "--steps", "3", "--resume", "--weight-decay", "0.1"]) == 2
    err = capsys.readouterr().err
    assert "was trained with --weight-decay 0 but this command has --weight-decay 0.1" in err and "continue it with --weight-decay 0" in err
    assert _files(dense) == before
    # dense attention is exact at any chunk size: accepted with a note
    assert run_cli([*dargv, "--steps", "3", "--resume", "--chunk-size", "16"]) == 0
    err = capsys.readouterr().err
    assert "oomb: note: --resume:" in err and "--chunk-size 32; this run has --chunk-size 16" in err
    assert [s for s, _ in losses(dense)] == [1, 2, 3]


def test_resume_from_another_folder_never_touches_either_run(tmp_path, text_file, capsys):
    """--resume PATH of another run's folder into a non-empty --output-dir mixed the two runs (log rewritten,
    checkpoints pruned, model replaced): refused. Into a new folder it continues there, with a note, and the
    checkpoint's own folder is left as it was."""
    a = tmp_path / "a"
    argv = ["train", "--data", text_file, *FAST, "--output-dir"]
    assert run_cli([*argv, a, "--steps", "2"]) == 0
    capsys.readouterr()
    before = _files(a)
    ckpt = a / "checkpoints" / "step-00000002"
    other = tmp_path / "other"
    other.mkdir()
    (other / "log.jsonl").write_text('{"step": 7, "loss": 1.0}\n')
    (other / "notes.txt").write_text("mine")
    other_before = _files(other)
    assert run_cli([*argv, other, "--steps", "3", "--resume", ckpt]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"is not a checkpoint of --output-dir {str(other)!r}" in err
    assert "pass the --output-dir the checkpoint belongs to, or a new or empty --output-dir" in err
    assert _files(other) == other_before and _files(a) == before
    new = tmp_path / "new"
    assert run_cli([*argv, new, "--steps", "3", "--resume", ckpt]) == 0
    err = capsys.readouterr().err
    assert f"oomb: note: --resume: {ckpt} is a checkpoint of another folder" in err and "starts at step 3" in err
    assert [s for s, _ in losses(new)] == [3] and (new / "model.safetensors").is_file()
    assert _files(a) == before
    # the run's own folder given as --resume: named as such, with the command that continues it
    assert run_cli([*argv, tmp_path / "newer", "--steps", "3", "--resume", a]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is the output folder of a run, not one of its checkpoints" in err
    assert f"pass --output-dir {a} --resume latest" in err and not (tmp_path / "newer").exists()
    assert _files(a) == before


def test_resume_of_the_checkpoints_folder_names_what_to_pass(tmp_path, text_file, capsys):
    """--resume DIR/checkpoints (the folder, not a checkpoint in it) was refused as a checkpoint of another folder, or
    read as a checkpoint: it is named as the checkpoints folder, with what --resume takes instead."""
    a = tmp_path / "a"
    argv = ["train", "--data", text_file, *FAST, "--output-dir"]
    assert run_cli([*argv, a, "--steps", "2"]) == 0
    capsys.readouterr()
    before = _files(a)
    ckpts = a / "checkpoints"
    assert run_cli([*argv, a, "--steps", "3", "--resume", ckpts]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--resume {str(ckpts)!r} is the checkpoints folder of a run, not one of its " \
        "checkpoints (a step-NNNNNNNN folder in it)" in err
    assert f"pass --resume latest to continue from its newest checkpoint, or --resume {ckpts / 'step-00000002'}" in err
    assert _files(a) == before
    new = tmp_path / "new"
    assert run_cli([*argv, new, "--steps", "3", "--resume", ckpts]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is the checkpoints folder of a run" in err
    assert f"pass --output-dir {a} --resume latest to continue that run in its folder, or --resume " \
        f"{ckpts / 'step-00000002'} (its newest checkpoint) with a new or empty --output-dir" in err
    assert not new.exists() and _files(a) == before
    # what it names is taken
    assert run_cli([*argv, a, "--steps", "3", "--resume", "latest"]) == 0
    assert [s for s, _ in losses(a)] == [1, 2, 3]


@pytest.mark.parametrize("partial", [False, True])
def test_resume_latest_after_an_unfinished_overwrite_names_the_replaced_run(tmp_path, text_file, capsys, monkeypatch,
                                                                            partial):
    """--overwrite moves the earlier run to DIR/.oomb-replaced; where the new run stops before its first checkpoint,
    --resume latest says where the earlier run's checkpoint is and the command that continues it (exit 2, one
    line, nothing touched), and that command continues it."""
    from oomb.train import Trainer

    out = tmp_path / "run"
    argv = ["train", "--data", text_file, *FAST, "--output-dir", out]
    assert run_cli([*argv, "--steps", "2"]) == 0

    def killed(self, *args, **kwargs):
        raise KeyboardInterrupt  # as a kill in the first step would: no checkpoint written

    monkeypatch.setattr(Trainer, "step", killed)
    assert run_cli([*argv, "--steps", "2", "--overwrite"]) == 130
    monkeypatch.undo()
    if partial:  # a checkpoint cut short (no meta.json): not a complete one
        (out / "checkpoints" / "step-00000001").mkdir(parents=True)
    capsys.readouterr()
    ckpt = out / ".oomb-replaced" / "checkpoints" / "step-00000002"
    before = _files(out)
    assert run_cli([*argv, "--steps", "3", "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("oomb: error: --resume latest: "), err
    assert f"the run it replaced is in {out / '.oomb-replaced'} (its last checkpoint: step-00000002)" in err, err
    assert f"continue that run with --resume {ckpt} --output-dir NEW_DIR" in err, err
    assert _files(out) == before
    new = tmp_path / "new"
    assert run_cli([*argv[:-1], new, "--steps", "3", "--resume", ckpt]) == 0
    assert [s for s, _ in losses(new)] == [3] and _files(out) == before


def test_a_signal_during_grad_accum_stops_at_the_sequence_boundary(tmp_path, text_file, capsys, monkeypatch):
    """SIGINT in the middle of a --grad-accum step stops before the step's next sequence (not after all of them),
    saves the checkpoint of the step before, and --resume re-runs the interrupted step: the same losses as an
    uninterrupted run."""
    from oomb import Engine

    argv = ["train", "--data", text_file, *FAST, "--steps", "3", "--grad-accum", "3", "--warmup-steps", "1"]
    straight = tmp_path / "straight"
    assert run_cli([*argv, "--output-dir", straight]) == 0
    capsys.readouterr()

    real_step = Engine.step
    calls = []

    def step_then_signal(self, *a, **k):
        calls.append(1)
        out = real_step(self, *a, **k)
        if len(calls) == 5:  # step 2, its second of three sequences
            os.kill(os.getpid(), signal.SIGINT)
        return out

    monkeypatch.setattr(Engine, "step", step_then_signal)
    run = tmp_path / "run"
    assert run_cli([*argv, "--output-dir", run]) == 0
    err = capsys.readouterr().err
    assert len(calls) == 5, "the third sequence of step 2 must not run"
    assert "SIGINT received: finishing this step (with --grad-accum: this sequence), then saving" in err
    assert "stopped by SIGINT during step 2 (its 2 of 3 sequences done were dropped)" in err
    assert "step-00000001" in err and "--resume" in err
    assert [s for s, _ in losses(run)] == [1]
    monkeypatch.setattr(Engine, "step", real_step)
    assert run_cli([*argv, "--output-dir", run, "--resume", "latest"]) == 0
    assert losses(run) == losses(straight)


def test_resume_of_a_finished_run_writes_nothing(tmp_path, text_file, capsys):
    """--resume with no steps left to train leaves every file as it was (it rewrote the last checkpoint,
    train_args.json and the model with the same content)."""
    out = tmp_path / "run"
    argv = ["train", "--data", text_file, *FAST, "--steps", "2", "--output-dir", out]
    assert run_cli(argv) == 0
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*") if p.is_file()}
    time.sleep(0.01)  # a rewrite would show in the times as well as in the listing
    capsys.readouterr()
    assert run_cli([*argv, "--resume"]) == 0
    err = capsys.readouterr().err
    assert "no steps left to train" in err and "nothing was written" in err, err
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*") if p.is_file()} == before
    # with more --steps it trains on
    assert run_cli([*argv[:-4], "--steps", "3", "--output-dir", out, "--resume"]) == 0
    assert [s for s, _ in losses(out)] == [1, 2, 3]


def test_resume_through_a_broken_latest_pointer_says_which_checkpoint_it_used(tmp_path, text_file, capsys):
    """checkpoints/latest naming a folder that is not there: --resume latest still takes the newest checkpoint,
    and says so in one note (it passed over the pointer silently)."""
    out = tmp_path / "run"
    argv = ["train", "--data", text_file, *FAST, "--steps", "2", "--save-every", "1", "--output-dir", out]
    assert run_cli(argv) == 0
    (out / "checkpoints" / "latest").write_text("step-00000009\n")
    capsys.readouterr()
    assert run_cli([*argv[:-6], "--steps", "3", "--output-dir", out, "--resume"]) == 0
    err = capsys.readouterr().err
    note = [line for line in err.splitlines() if "step-00000009" in line]
    assert len(note) == 1 and note[0].startswith("oomb: note: --resume latest: ") and "step-00000002" in note[0], err
    assert [s for s, _ in losses(out)] == [1, 2, 3]


def _signal_in_a_finalizer(signum):
    """An object whose ``__del__`` gets ``signum``: Python drops a KeyboardInterrupt raised there ("Exception
    ignored in ..."), as a user saw a Ctrl-C at startup dropped and the run train to its end."""

    class Finalized:
        def __del__(self):
            signal.raise_signal(signum)  # the handler runs inside raise_signal: deterministic

    Finalized()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the dropped KeyboardInterrupt
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_ctrl_c_during_setup_stops_the_run_even_where_python_drops_it(tmp_path, text_file, capsys, monkeypatch, overwrite):
    """SIGINT while `oomb train` sets up (here inside a finalizer, whose KeyboardInterrupt Python drops): exit 130
    with one line, nothing trained or written, an earlier run (--overwrite) untouched, and the same command then
    runs."""
    import oomb.data

    out = tmp_path / "run"
    argv = ["train", "--data", text_file, *FAST, "--steps", "2", "--output-dir", out] + (["--overwrite"] if overwrite else [])
    if overwrite:
        assert run_cli(argv) == 0
    before = _files(out) if overwrite else None
    real = oomb.data.load_tokenizer

    def load_tokenizer(*a, **k):
        _signal_in_a_finalizer(signal.SIGINT)
        return real(*a, **k)

    monkeypatch.setattr(oomb.data, "load_tokenizer", load_tokenizer)
    capsys.readouterr()
    assert run_cli(argv) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "oomb: interrupted" and "step" not in err, err
    if overwrite:
        assert _files(out) == before
    else:
        assert not out.exists() or not any(out.iterdir())
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # main() restored Python's handler
    monkeypatch.setattr(oomb.data, "load_tokenizer", real)
    assert run_cli(argv) == 0
    assert [s for s, _ in losses(out)] == [1, 2]


def test_a_ctrl_c_while_the_output_is_prepared_stops_before_training(tmp_path, text_file, capsys, monkeypatch):
    """SIGINT while --overwrite moves the earlier run aside: the move finishes (never cut in two), the run stops
    before its first step (exit 130), the earlier run is whole in .oomb-replaced and the same command runs."""
    import oomb.cli.train

    out = tmp_path / "run"
    argv = ["train", "--data", text_file, *FAST, "--steps", "2", "--output-dir", out, "--overwrite"]
    assert run_cli(argv) == 0
    before = _files(out)
    real = oomb.cli.train._prepare_output

    def prepare_output(*a, **k):
        signal.raise_signal(signal.SIGINT)
        return real(*a, **k)

    monkeypatch.setattr(oomb.cli.train, "_prepare_output", prepare_output)
    capsys.readouterr()
    assert run_cli(argv) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "oomb: interrupted", err
    assert _files(out / ".oomb-replaced") == before
    assert not (out / "log.jsonl").exists() and not (out / "checkpoints").exists()
    monkeypatch.setattr(oomb.cli.train, "_prepare_output", real)
    assert run_cli(argv) == 0
    assert not (out / ".oomb-replaced").exists() and [s for s, _ in losses(out)] == [1, 2]


def test_sigterm_during_setup_prints_one_line(tmp_path, text_file):
    """SIGTERM before training starts: 'oomb: interrupted' and exit 130, as SIGINT (it killed the process)."""
    out = tmp_path / "run"
    script = (
        "import signal, sys\n"
        "import oomb.data\n"
        "from oomb.cli import main\n"
        "real = oomb.data.load_tokenizer\n"
        "def load_tokenizer(*a, **k):\n"
        "    signal.raise_signal(signal.SIGTERM)\n"
        "    return real(*a, **k)\n"
        "oomb.data.load_tokenizer = load_tokenizer\n"
        f"sys.exit(main({['train', '--data', str(text_file), *FAST, '--steps', '2', '--output-dir', str(out)]!r}))\n"
    )
    proc = _python(script)
    assert proc.returncode == 130 and proc.stderr.strip() == "oomb: interrupted", (proc.returncode, proc.stderr[-2000:])
    assert not out.exists()


def test_a_ctrl_c_at_any_moment_of_the_command_prints_one_line(tmp_path, monkeypatch, capsys):
    """KeyboardInterrupt while the arguments are read, while the planner runs (torch imported) and while `python
    -m oomb` imports oomb.cli: 'oomb: interrupted', exit 130, no traceback."""
    import oomb.cli.parser
    import oomb.models.presets

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    for target, name in ((oomb.models.presets, "load_config"), (oomb.cli.parser._Parser, "parse_args")):
        with monkeypatch.context() as m:
            m.setattr(target, name, interrupt)
            assert run_cli(["plan", "--seq-len", "4096"]) == 130
        assert capsys.readouterr().err == "oomb: interrupted\n"
    script = (
        "import builtins, runpy\n"
        "real = builtins.__import__\n"
        "def interrupted_import(name, globals=None, locals=None, fromlist=(), level=0):\n"
        "    if level == 1 and name == 'cli':  # oomb/__main__.py's 'from .cli import main'\n"
        "        raise KeyboardInterrupt\n"
        "    return real(name, globals, locals, fromlist, level)\n"
        "builtins.__import__ = interrupted_import\n"
        "runpy.run_module('oomb', run_name='__main__')\n"
    )
    proc = _python(script, "--help", timeout=60, cwd=ROOT)
    assert proc.returncode == 130 and proc.stderr == "oomb: interrupted\n", (proc.returncode, proc.stderr)


def test_resume_of_a_lora_preset_run_refuses_another_device(tmp_path, text_file, capsys):
    """A LoRA adapter on a random preset trains on weights drawn on its run's device: drawn again on another
    device they differ, and the adapter would silently continue on another base. Every checkpoint records its
    device (here edited into a checkpoint of a run on cuda); a full fine-tune, whose checkpoint replaces every
    weight, may move."""
    out = tmp_path / "lora"
    argv = ["train", "--data", text_file, *FAST, "--steps", "2", "--output-dir", out, "--lora-rank", "2"]
    assert run_cli(argv) == 0
    capsys.readouterr()
    meta_file = out / "checkpoints" / "step-00000002" / "meta.json"
    meta = json.loads(meta_file.read_text())
    assert meta["settings"]["device"] == "cpu"
    meta["settings"]["device"] = "cuda"
    meta_file.write_text(json.dumps(meta))
    before = _files(out)
    assert run_cli([*argv[:-4], "--steps", "3", "--output-dir", out, "--lora-rank", "2", "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a LoRA run on the random preset 'tiny', whose weights were drawn on cuda; " \
        "drawn again on cpu they are other weights under the same adapter; continue it with --device cuda" in err, err
    assert _files(out) == before

    full = tmp_path / "full"
    fargv = ["train", "--data", text_file, *FAST, "--steps", "2", "--output-dir", full]
    assert run_cli(fargv) == 0
    meta_file = full / "checkpoints" / "step-00000002" / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["settings"]["device"] = "cuda"
    meta_file.write_text(json.dumps(meta))
    assert run_cli([*fargv[:-2], "--output-dir", full, "--steps", "3", "--resume"]) == 0


@pytest.mark.parametrize("where", ["checkpoint", "model"])
def test_sigterm_after_the_last_step_lets_the_final_save_finish(tmp_path, text_file, capsys, where):
    """SIGTERM while the last step's checkpoint or the model is written: the save finishes (it killed the process
    there, losing the run), the run exits 0 as a stop during training does, and --resume has nothing left to do."""
    out = tmp_path / "run"
    argv = ["train", "--data", str(text_file), *FAST, "--steps", "2", "--output-dir", str(out)]
    script = (
        "import os, signal, sys\n"
        "import oomb.checkpoint, oomb.cli.train\n"
        "from oomb.cli import main\n"
        "real_checkpoint, real_save = oomb.checkpoint.save_checkpoint, oomb.cli.train._save\n"
        "def save_checkpoint(root, step, *a, **k):\n"
        f"    if {where!r} == 'checkpoint' and step == 2:\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return real_checkpoint(root, step, *a, **k)\n"
        "def save(*a, **k):\n"
        f"    if {where!r} == 'model':\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return real_save(*a, **k)\n"
        "oomb.checkpoint.save_checkpoint, oomb.cli.train._save = save_checkpoint, save\n"
        f"sys.exit(main({argv!r}))\n"
    )
    proc = _python(script)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "SIGTERM received" in proc.stderr and "SIGTERM came after the last step" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert (out / "checkpoints" / "step-00000002" / "meta.json").is_file()
    assert (out / "model.safetensors").is_file() and (out / "train_args.json").is_file()
    assert not list(out.glob(".oomb-save-*"))
    assert [s for s, _ in losses(out)] == [1, 2]
    capsys.readouterr()
    assert run_cli([*argv, "--resume"]) == 0
    assert "no steps left to train" in capsys.readouterr().err


def test_ctrl_c_while_the_loss_is_plotted_lets_the_final_save_finish(tmp_path, text_file, capsys, monkeypatch):
    """SIGINT while loss.png is drawn after the last step: the final checkpoint and model are still written (the
    default handler interrupted the run there, before either), exit 0."""
    import oomb.cli.train

    real = oomb.cli.train._draw_loss_png

    def draw(*a, **k):
        signal.raise_signal(signal.SIGINT)
        return real(*a, **k)

    monkeypatch.setattr(oomb.cli.train, "_draw_loss_png", draw)
    out = tmp_path / "run"
    assert run_cli(["train", "--data", text_file, *FAST, "--steps", "2", "--output-dir", out]) == 0
    err = capsys.readouterr().err
    assert "SIGINT received" in err and "SIGINT came after the last step" in err, err
    assert (out / "checkpoints" / "step-00000002" / "meta.json").is_file() and (out / "model.safetensors").is_file()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def _disk_full(kind: str) -> Exception:
    """What a write raises on a full disk: safetensors' error, or the OSError of a plain write."""
    import errno

    from safetensors import SafetensorError

    if kind == "safetensors":
        return SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("kind", ["safetensors", "oserror"])
def test_a_full_disk_exits_2_with_one_line_and_keeps_the_checkpoints(tmp_path, text_file, capsys, monkeypatch, kind):
    """A checkpoint, then the model, that cannot be written for a full disk: one line naming the folder, the full
    disk and the fix, exit 2 (it was a traceback, exit 1); the earlier checkpoint stays the newest complete one, no
    unfinished folder is left, and --resume then continues and writes the model."""
    import oomb.checkpoint
    import transformers.modeling_utils

    from oomb.checkpoint import find_latest

    out = tmp_path / "run"
    argv = ["train", "--data", text_file, *FAST, "--steps", "3", "--save-every", "1", "--output-dir", out]
    real = oomb.checkpoint.save_file
    calls = []

    def save_file(tensors, filename, *a, **k):
        calls.append(filename)
        if len(calls) == 2:  # the checkpoint of step 2: a part written, then the disk is full
            with open(filename, "wb") as f:
                f.write(b"\0" * 100)
            raise _disk_full(kind)
        return real(tensors, filename, *a, **k)

    monkeypatch.setattr(oomb.checkpoint, "save_file", save_file)
    capsys.readouterr()
    assert run_cli(argv) == 2
    err = capsys.readouterr().err
    line = err.splitlines()[-1]
    assert line.startswith("oomb: error: ") and "Traceback" not in err, err
    assert f"the checkpoint of step 2 cannot be written to {out / 'checkpoints'}: the disk is full" in line, line
    assert "the checkpoint step-00000001 is complete" in line and "free space" in line and "--output-dir" in line
    assert "--resume latest" in line
    assert sorted(os.listdir(out / "checkpoints")) == ["latest", "step-00000001"]
    assert find_latest(out / "checkpoints").name == "step-00000001"

    monkeypatch.setattr(oomb.checkpoint, "save_file", real)
    real_model = transformers.modeling_utils.safe_save_file

    def safe_save_file(tensors, filename, *a, **k):
        with open(filename, "wb") as f:
            f.write(b"\0" * 100)
        raise _disk_full(kind)

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", safe_save_file)
    assert run_cli([*argv, "--resume"]) == 2
    err = capsys.readouterr().err
    line = err.splitlines()[-1]
    assert line.startswith("oomb: error: ") and "Traceback" not in err, err
    assert f"the trained model cannot be written to {out}: the disk is full" in line, line
    assert "the checkpoint step-00000003 is complete" in line and "--resume latest" in line
    assert not list(out.glob(".oomb-save-*")) and not (out / "model.safetensors").exists()
    assert find_latest(out / "checkpoints").name == "step-00000003"

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", real_model)
    assert run_cli([*argv, "--resume"]) == 0
    assert (out / "model.safetensors").is_file() and [s for s, _ in losses(out)] == [1, 2, 3]


def test_a_save_removes_the_temporary_folders_of_killed_saves_only(tmp_path, text_file, capsys):
    """.oomb-save-PID folders that a save killed mid-way left in the output folder are removed by the next save there
    (they stayed after a --resume); the one of a live process, which may be saving, is kept."""
    out = tmp_path / "run"
    argv = ["train", "--data", text_file, *FAST, "--steps", "1", "--output-dir", out]
    assert run_cli(argv) == 0
    gone = subprocess.Popen(["true"])
    gone.wait()
    alive = subprocess.Popen(["sleep", "120"])
    try:
        for pid in (gone.pid, alive.pid):
            (out / f".oomb-save-{pid}").mkdir()
            (out / f".oomb-save-{pid}" / "model.safetensors").write_bytes(b"\0" * 100)
        capsys.readouterr()
        assert run_cli([*argv[:-4], "--steps", "2", "--output-dir", out, "--resume"]) == 0
        assert not (out / f".oomb-save-{gone.pid}").exists()
        assert (out / f".oomb-save-{alive.pid}" / "model.safetensors").is_file()
    finally:
        alive.kill()
        alive.wait()


def test_resume_into_a_read_only_checkpoints_folder_is_refused_before_training(tmp_path, text_file, capsys):
    """--resume where checkpoints/ cannot be written: exit 2 with one line before any step (it trained a step, then
    failed at its checkpoint with log.jsonl past the newest checkpoint); nothing in the folder changes."""
    out = tmp_path / "run"
    argv = ["train", "--data", text_file, *FAST, "--steps", "2", "--save-every", "1", "--output-dir", out]
    assert run_cli(argv) == 0
    ckpts = out / "checkpoints"
    before = _files(out)
    if os.geteuid() == 0:  # root writes into a folder without write permission: make it immutable instead
        if subprocess.run(["chattr", "+i", str(ckpts)], capture_output=True).returncode != 0:
            pytest.skip("running as root where chattr +i is not available")
        undo = ["chattr", "-i", str(ckpts)]
    else:
        ckpts.chmod(0o555)
        undo = ["chmod", "755", str(ckpts)]
    try:
        capsys.readouterr()
        assert run_cli([*argv[:-6], "--steps", "4", "--save-every", "1", "--output-dir", out, "--resume"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("oomb: error: "), err
        assert f"its checkpoints folder {str(ckpts)!r} cannot be written" in err and "chmod u+w" in err, err
        assert f"--resume {ckpts / 'step-00000002'} --output-dir NEW_DIR" in err, err
        assert _files(out) == before
    finally:
        subprocess.run(undo, check=True)


# ---------------------------------------------------------------- the output folder's lock

_HOLD_LOCK = (
    "import fcntl, json, os, signal, socket, sys\n"
    "fd = os.open(os.path.join(sys.argv[1], '.oomb-lock'), os.O_RDWR | os.O_CREAT, 0o666)\n"
    "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
    "os.write(fd, json.dumps({'pid': os.getpid(), 'host': socket.gethostname(),\n"
    "                         'command': 'oomb train --output-dir ' + sys.argv[1]}).encode())\n"
    "if sys.argv[2] == 'die':\n"
    "    os.kill(os.getpid(), signal.SIGKILL)\n"
    "print('locked', flush=True)\n"
    "sys.stdin.read()\n"
)
"""Holds the lock of the output folder argv[1] as a running ``oomb train`` does (its pid, host and command in the
file) until its stdin closes; with argv[2] == 'die', is killed while it holds it."""


def _hold_lock(out, then="wait"):
    proc = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(out), then], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    if then == "die":
        assert proc.wait(timeout=60) == -signal.SIGKILL
    else:
        assert proc.stdout.readline() == "locked\n"
    return proc


def test_a_run_into_a_folder_another_run_writes_is_refused_and_changes_nothing(tmp_path, text_file, capsys):
    """While a live run holds the output folder's lock, a second oomb train into it -- a new run, --resume or
    --overwrite -- exits 2 with one line naming the folder, the holder's pid and the fix, and changes nothing there:
    the unfinished checkpoint and model the live run is writing stay (a --resume deleted them as a killed run's
    debris, an --overwrite moved them away). Once the holder is gone, the run goes ahead."""
    out = tmp_path / "run"
    argv = ["train", "--data", text_file, *FAST, "--steps", "2", "--save-every", "1", "--output-dir", out]
    assert run_cli(argv) == 0
    holder = _hold_lock(out)
    try:
        being_written = out / "checkpoints" / ".tmp-step-00000003-k2j4x9"
        being_written.mkdir()
        (being_written / "trainable.safetensors").write_bytes(b"\0" * 100)
        (out / f".oomb-save-{holder.pid}").mkdir()
        (out / f".oomb-save-{holder.pid}" / "model.safetensors").write_bytes(b"\0" * 100)
        before = _files(out)
        capsys.readouterr()
        for extra in (["--resume", "latest", "--steps", "3"], ["--overwrite"], ["--resume"], []):
            assert run_cli([*argv, *extra]) == 2, extra
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and err.startswith("oomb: error: "), err
            assert f"--output-dir {str(out)!r} is being written by another oomb train (pid {holder.pid}: " in err, err
            assert f"wait for it to end or stop it (kill {holder.pid}), or pass another --output-dir" in err, err
            assert _files(out) == before, extra
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert run_cli([*argv[:-6], "--steps", "3", "--save-every", "1", "--output-dir", out, "--resume"]) == 0
    assert [s for s, _ in losses(out)] == [1, 2, 3]
    assert sorted(os.listdir(out / "checkpoints")) == ["latest", "step-00000002", "step-00000003"]
    assert not (out / ".oomb-lock").exists() and not list(out.glob(".oomb-save-*"))


def test_a_lock_left_by_a_killed_run_does_not_block(tmp_path, text_file, capsys):
    """The lock file of a run that was killed (SIGKILL) stays, but its lock went with the process: a new run, an
    --overwrite and a --resume go ahead as if the file were not there (it is neither an entry that makes the
    folder non-empty nor one --overwrite names as kept), and each removes it as it ends. A read-only folder with
    such a file is refused as read-only."""
    out = tmp_path / "run"
    out.mkdir()
    _hold_lock(out, "die")
    argv = ["train", "--data", text_file, *FAST, "--steps", "1", "--output-dir", out]
    assert run_cli(argv) == 0
    assert not (out / ".oomb-lock").exists()
    for extra in (["--overwrite"], ["--steps", "2", "--resume"]):
        _hold_lock(out, "die")
        capsys.readouterr()
        assert run_cli([*argv, *extra]) == 0, extra
        err = capsys.readouterr().err
        assert ".oomb-lock" not in err and not (out / ".oomb-lock").exists(), err
        assert not (out / ".oomb-replaced").exists()
    assert [s for s, _ in losses(out)] == [1, 2]

    _hold_lock(out, "die")
    before = _files(out)
    if os.geteuid() == 0:  # root writes into a folder without write permission: make it immutable instead
        if subprocess.run(["chattr", "+i", str(out)], capture_output=True).returncode != 0:
            pytest.skip("running as root where chattr +i is not available")
        undo = ["chattr", "-i", str(out)]
    else:
        out.chmod(0o555)
        undo = ["chmod", "755", str(out)]
    try:
        capsys.readouterr()
        assert run_cli([*argv, "--steps", "3", "--resume"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"cannot create folders in {str(out)!r}" in err, err
        assert _files(out) == before
    finally:
        subprocess.run(undo, check=True)


def test_a_run_holds_its_output_folder_locked_from_before_it_writes_until_it_ends(tmp_path, text_file, capsys,
                                                                                    monkeypatch):
    """The lock is held, with this process's pid and command in its file, when the run prepares the folder (where
    --overwrite moves an earlier run and a checkpoint removes debris) and when it saves the model (where the
    temporary folders of killed saves are removed); at the end it is released and its file deleted, so a --resume
    goes ahead. Without fcntl (Windows) the run trains unlocked; on a file system that refuses flock it does too,
    with a note."""
    import fcntl

    import oomb.cli.train

    out = tmp_path / "run"
    argv = ["train", "--data", text_file, *FAST, "--steps", "1", "--output-dir", out]
    seen = []

    def held(where):
        fd = os.open(out / ".oomb-lock", os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        holder = json.loads((out / ".oomb-lock").read_text())
        assert holder["pid"] == os.getpid() and holder["command"].startswith("oomb train --data "), holder
        seen.append(where)

    def wrap(name):
        real = getattr(oomb.cli.train, name)

        def wrapped(*a, **k):
            held(name)
            return real(*a, **k)

        monkeypatch.setattr(oomb.cli.train, name, wrapped)

    wrap("_prepare_output")
    wrap("_save")
    assert run_cli(argv) == 0
    assert seen == ["_prepare_output", "_save"]
    assert not (out / ".oomb-lock").exists()
    assert run_cli([*argv, "--steps", "2", "--resume"]) == 0
    assert seen == ["_prepare_output", "_save"] * 2 and not (out / ".oomb-lock").exists()
    assert [s for s, _ in losses(out)] == [1, 2]

    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "fcntl", None)  # import fcntl raises ImportError, as on Windows
    capsys.readouterr()
    assert run_cli([*argv, "--steps", "3", "--resume"]) == 0
    assert "lock" not in capsys.readouterr().err and not (out / ".oomb-lock").exists()

    import errno

    monkeypatch.undo()

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    assert run_cli([*argv, "--steps", "4", "--resume"]) == 0
    err = capsys.readouterr().err
    assert f"oomb: note: {out} cannot be locked ({os.strerror(errno.ENOLCK)}): a second oomb train into it" in err, err
    assert [s for s, _ in losses(out)] == [1, 2, 3, 4] and not (out / ".oomb-lock").exists()


def test_torchrun_into_a_folder_another_run_writes_is_refused_by_rank_0(tmp_path, text_file):
    """Under torchrun rank 0 alone takes the lock (the other ranks write only inside the folder it holds): into a
    folder another run holds, rank 0 refuses with the one line naming the holder, the other rank stops with status 2
    and one line saying another rank refused the run (it was ended by torchrun while it waited for rank 0: 'oomb:
    interrupted'), and nothing there changes."""
    import random

    out = tmp_path / "run"
    out.mkdir()
    holder = _hold_lock(out)
    try:
        before = _files(out)
        res = _torchrun(["train", "--data", text_file, *FAST, "--steps", "1", "--output-dir", out], tmp_path,
                        random.randint(20000, 40000))
        errors = sorted(line for line in res.stderr.splitlines() if line.startswith("oomb: error:"))
        assert res.returncode != 0 and len(errors) == 2 and "oomb: interrupted" not in res.stderr, res.stderr[-3000:]
        assert f"is being written by another oomb train (pid {holder.pid}: " in errors[0], errors
        assert errors[1] == ("oomb: error: another rank refused the run (its error is printed above); fix the input "
                             "and start again"), errors
        assert "exitcode: 130" not in res.stderr, res.stderr[-3000:]
        assert _files(out) == before
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)


def test_a_short_write_of_torch_save_is_named_as_such_not_as_its_writer_assertion():
    """torch.save's zip writer reports a write the full disk cut short as "[enforce fail at inline_container.cc:672]
    . unexpected pos 15616 vs 15508", without the errno: the line says a write was cut short, as on a full disk."""
    from oomb.cli.train import _write_failure

    why = _write_failure(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 15616 vs 15508"))
    assert why == "a write was cut short, as on a full disk (torch.save: unexpected pos 15616 vs 15508)"


@pytest.mark.usefixtures("_cache")
def test_resume_and_device_from_the_config_file_are_named_as_its_keys(tmp_path, capsys, monkeypatch):
    """A resume, a device or an attention backend that came from the --config file is named as the file's key
    (``output.resume (in FILE)``), not as a flag the user did not type; given as flags they are named as flags."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same refusal on a machine with a GPU

    def refusal(argv) -> str:
        capsys.readouterr()
        assert run_cli(["train", *argv, "--steps", "1", *FAST]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("oomb: error: "), err
        assert not (tmp_path / "runs").exists()
        return err[0]

    config = tmp_path / "k.yaml"
    config.write_text("output:\n  resume: latest\n")
    line = refusal(["--config", config, "--output-dir", "runs/none"])
    assert line.startswith(f"oomb: error: output.resume (in {config}): --output-dir 'runs/none' has no checkpoints "
                           "folder;"), line
    assert "--resume" not in line.split(";")[0] and line.endswith("start without output.resume"), line
    assert refusal(["--resume", "latest", "--output-dir", "runs/none"]).startswith(
        "oomb: error: --resume: --output-dir 'runs/none' has no checkpoints folder;")
    config.write_text("model:\n  device: cuda\n")
    line = refusal(["--config", config, "--output-dir", "runs/gpu"])
    assert line.startswith(f"oomb: error: model.device (in {config}) is cuda but no CUDA GPU is available"), line
    assert refusal(["--device", "cuda", "--output-dir", "runs/gpu"]).startswith(
        "oomb: error: --device cuda was given but no CUDA GPU is available")
    config.write_text("engine:\n  attention_backend: triton\n")
    line = refusal(["--config", config, "--output-dir", "runs/triton"])
    assert line.startswith(f"oomb: error: engine.attention_backend (in {config}) triton runs on the GPU only, but the "
                           "run's device is cpu;"), line
