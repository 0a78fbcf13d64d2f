"""Logs people look at: TensorBoard event files (--report-to tensorboard) and loss.png, from the run's step
records; --overwrite treats them as the earlier run's own, and someone else's tensorboard/ folder is left alone."""

from __future__ import annotations

import json
import shutil

import pytest

from oomb.train import TensorBoardLog, plot_log
from oomb.train.plot import read_log

from cli_helpers import run_cli
from tests.cli.test_cli import FAST, OOMB_LOG_LINE, snapshot


def _scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _log(out) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def test_tensorboard_scalars_are_the_step_records(tmp_path):
    out = tmp_path / "run"
    assert run_cli(["train", "--output-dir", out, *FAST, "--steps", "3", "--report-to", "tensorboard"]) == 0
    scalars = _scalars(out / "tensorboard")
    # The CPU has no peak GPU memory (null in log.jsonl): no such scalar.
    assert set(scalars) == {"train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s"}
    records = _log(out)
    for tag, key in (("train/loss", "loss"), ("train/lr", "lr"), ("train/grad_norm", "grad_norm"),
                     ("perf/tokens_per_s", "tokens_per_s")):
        assert [s for s, _ in scalars[tag]] == [1, 2, 3]
        assert [v for _, v in scalars[tag]] == pytest.approx([r[key] for r in records], rel=1e-6)


def test_tensorboard_peak_memory_in_gib(tmp_path):
    record = json.loads(OOMB_LOG_LINE) | {"peak_memory_bytes": 3 * 2**29}
    with TensorBoardLog(tmp_path) as board:
        board.write(record)
    assert _scalars(tmp_path)["perf/peak_memory_gib"] == [(1, 1.5)]


def test_resumed_run_logs_every_step_once_and_plots_them_all(tmp_path):
    out = tmp_path / "run"
    args = ["train", "--output-dir", out, *FAST, "--save-every", "1", "--report-to", "tensorboard"]
    assert run_cli([*args, "--steps", "3"]) == 0
    first = _log(out)
    # Go back to step 2 (its later checkpoint removed): step 3 is trained again (its old events purged), then 4.
    shutil.rmtree(out / "checkpoints" / "step-00000003")
    assert run_cli([*args, "--steps", "4", "--resume", out / "checkpoints" / "step-00000002"]) == 0
    records = _log(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    scalars = _scalars(out / "tensorboard")["train/loss"]
    assert [s for s, _ in scalars] == [1, 2, 3, 4]
    assert [v for _, v in scalars] == pytest.approx([r["loss"] for r in records], rel=1e-6)
    assert records[0] == first[0]
    assert [r["step"] for r in read_log(out / "log.jsonl")] == [1, 2, 3, 4]  # what loss.png is drawn from
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_run_draws_loss_png_from_its_log(tmp_path):
    out = tmp_path / "run"
    assert run_cli(["train", "--output-dir", out, *FAST]) == 0
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "tensorboard").exists()  # only with --report-to tensorboard
    log = tmp_path / "log.jsonl"
    log.write_text("")
    assert plot_log(log, tmp_path / "empty.png") is False and not (tmp_path / "empty.png").exists()
    # A line cut by a crash is skipped; a step logged twice counts once (its last line).
    line = json.loads(OOMB_LOG_LINE)
    log.write_text(json.dumps(line) + "\n" + json.dumps(line | {"loss": 9.0}) + "\n" + json.dumps(line | {"step": 2})
                   + "\n" + '{"step": 3, "lo')
    assert [(r["step"], r["loss"]) for r in read_log(log)] == [(1, 9.0), (2, line["loss"])]
    assert plot_log(log, tmp_path / "two.png") is True and not list(tmp_path.glob(".*.tmp"))


def test_overwrite_replaces_the_earlier_runs_tensorboard_and_plot(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli(["train", "--output-dir", out, *FAST, "--report-to", "tensorboard"]) == 0
    old_png = (out / "loss.png").read_bytes()
    assert run_cli(["train", "--output-dir", out, *FAST, "--steps", "1", "--overwrite"]) == 0
    assert not (out / "tensorboard").exists() and not (out / ".oomb-replaced").exists()
    assert (out / "loss.png").exists() and (out / "loss.png").read_bytes() != old_png
    assert "kept what it did not write" not in capsys.readouterr().err


def test_overwrite_refuses_a_folder_with_someone_elses_tensorboard_folder(tmp_path, capsys):
    out = tmp_path / "theirs"
    (out / "tensorboard").mkdir(parents=True)
    with TensorBoardLog(out / "tensorboard") as board:  # event files as any tool writes them
        board.write(json.loads(OOMB_LOG_LINE))
    (out / "notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    assert run_cli(["train", "--output-dir", out, *FAST, "--overwrite"]) == 2
    assert "does not look like an oomb output" in capsys.readouterr().err
    assert snapshot(tmp_path) == before
    # With only a tensorboard/ folder beside an empty log.jsonl (a run stopped in its first step), it is oomb's.
    (out / "notes.txt").unlink()
    (out / "log.jsonl").write_text("")
    assert run_cli(["train", "--output-dir", out, *FAST, "--steps", "1", "--overwrite"]) == 0
    assert not (out / "tensorboard").exists()


def test_a_run_folder_named_in_another_script_draws_without_a_warning(tmp_path):
    """The loss curve's title names the run folder; a character the font lacks is drawn as a box, and matplotlib's
    warning for it (one per character, printed by oomb train as its own warning) is not passed on."""
    import warnings

    from oomb.train.plot import plot_log

    run = tmp_path / "ünï 日本語"
    run.mkdir()
    (run / "log.jsonl").write_text(json.dumps({"step": 1, "loss": 3.0, "tokens_per_s": 10.0}) + "\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert plot_log(run / "log.jsonl", run / "loss.png")
    assert not [w for w in caught if "Glyph" in str(w.message)], [str(w.message) for w in caught]
    assert (run / "loss.png").stat().st_size > 0
