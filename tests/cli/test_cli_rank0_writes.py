"""Under torchrun without --shard, rank 0 alone writes the output folder, the log, the checkpoints and the model:
where it cannot, every rank stops with status 2 (two gloo processes on the CPU, tests/cli/rank0_write_driver.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from tests.cli.test_cli_resume import FAST, ROOT, TEXT

DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank0_write_driver.py")

pytestmark = pytest.mark.slow  # two gloo processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(commands: list, tmp_path, timeout: float = 240) -> list[tuple[list[int], str]]:
    """Run the driver as ranks 0 and 1 of one gloo group (the environment torchrun gives its workers); each rank's
    exit statuses and stderr. A rank still running after ``timeout`` seconds fails the test (both are killed)."""
    spec = tmp_path / "commands.json"
    spec.write_text(json.dumps([[what, [str(a) for a in argv]] for what, argv in commands]))
    port = str(_free_port())
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        err = open(tmp_path / f"rank{rank}.err", "w")
        procs.append((subprocess.Popen([sys.executable, DRIVER, str(spec), str(tmp_path / f"rank{rank}.json")],
                                       cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err), err))
    try:
        for p, _ in procs:
            p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        for p, _ in procs:
            p.kill()
            p.wait()
        pytest.fail("a rank was still running after %d s:\n%s" % (timeout, "\n".join(
            f"rank {r}: {(tmp_path / f'rank{r}.err').read_text()[-2000:]}" for r in (0, 1))))
    finally:
        for _, err in procs:
            err.close()
    results = []
    for rank, (p, _) in enumerate(procs):
        stderr = (tmp_path / f"rank{rank}.err").read_text()
        assert p.returncode == 0, f"rank {rank}: {stderr[-3000:]}"
        results.append((json.loads((tmp_path / f"rank{rank}.json").read_text()), stderr))
    return results


def test_rank_0_failing_a_write_or_refused_by_the_lock_stops_every_rank_with_status_2(tmp_path):
    """One launch of two ranks runs every case in turn, each command after a failure in step on both ranks.

    Rank 0 cannot create the output folder, write a step of log.jsonl, a checkpoint (--save-every), or the
    trained model: every rank exits 2 at once (the others used to wait in their next collective until its
    timeout, or exit 0), rank 0 with its one-line error, the others with one line saying rank 0 failed.

    While another oomb train holds the output folder's lock, rank 0 (which alone takes it) is refused before
    it joins the process group: it joins to tell the others, which stop with status 2 and one line saying another
    rank refused the run (they used to wait in the group for it until torchrun ended them: 'oomb: interrupted');
    the command after it runs on both ranks."""
    from tests.cli.test_cli_resume import _hold_lock

    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    d = tmp_path / "runs"
    (d / "locked").mkdir(parents=True)
    train = ["train", "--data", data, *FAST, "--steps", "2"]
    commands = [("prepare", [*train, "--output-dir", d / "prepare"]),
                ("log", [*train, "--output-dir", d / "log"]),
                ("checkpoint", [*train, "--save-every", "1", "--output-dir", d / "checkpoint"]),
                ("model", [*train, "--output-dir", d / "model"]),
                ("none", [*train[:-1], "1", "--output-dir", d / "locked"]),
                ("none", [*train[:-1], "1", "--output-dir", d / "free"])]
    holder = _hold_lock(d / "locked")
    try:
        (statuses0, err0), (statuses1, err1) = _ranks(commands, tmp_path)
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert statuses0 == [2, 2, 2, 2, 2, 0], err0[-3000:]
    assert statuses1 == [2, 2, 2, 2, 2, 0], err1[-3000:]
    assert "Traceback" not in err0 and "Traceback" not in err1 and "interrupted" not in err1, (err0[-3000:], err1[-3000:])
    errors0 = [line for line in err0.splitlines() if line.startswith("oomb: error:")]
    errors1 = [line for line in err1.splitlines() if line.startswith("oomb: error:")]
    assert len(errors0) == 5, err0[-3000:]

    # the writes rank 0 cannot make
    assert errors0[0].startswith(f"oomb: error: permission denied: {d / 'prepare'} (Permission denied)")
    assert errors0[1].startswith(f"oomb: error: step 1 cannot be written to {d / 'log' / 'log.jsonl'}: the disk is "
                                 "full (No space left on device); no checkpoint was saved")
    assert errors0[2].startswith(f"oomb: error: the checkpoint of step 1 cannot be written to "
                                 f"{d / 'checkpoint' / 'checkpoints'}: the disk is full")
    assert errors0[3].startswith(f"oomb: error: the trained model cannot be written to {d / 'model'}: the disk is "
                                 "full (No space left on device); the checkpoint step-00000002 is complete")
    assert errors1[:4] == ["oomb: error: rank 0 failed to write the run's files (its error is printed above); all "
                           "ranks stopped"] * 4, err1[-3000:]
    assert not (d / "log" / "model.safetensors").exists() and not (d / "checkpoint" / "model.safetensors").exists()

    # the run the output lock refuses on rank 0
    assert f"is being written by another oomb train (pid {holder.pid}" in errors0[4], errors0
    assert errors1[4:] == ["oomb: error: another rank refused the run (its error is printed above); fix the input "
                           "and start again"], err1[-3000:]
    assert (d / "free" / "model.safetensors").is_file() and not (d / "locked" / "model.safetensors").exists()
