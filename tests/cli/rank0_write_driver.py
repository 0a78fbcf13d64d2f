"""One rank of ``oomb train`` commands whose rank 0 cannot write (tests/cli/test_cli_rank0_writes.py).

Usage: RANK=R WORLD_SIZE=N MASTER_ADDR=... MASTER_PORT=... python tests/cli/rank0_write_driver.py COMMANDS_JSON OUT_JSON

COMMANDS_JSON holds a list of ``[WHAT, ARGS]``: on rank 0 the write WHAT fails while ``oomb.cli.main(ARGS)`` runs
(``prepare``: creating the output folder, PermissionError; ``log``: a step record of log.jsonl, ``checkpoint``:
a checkpoint, ``model``: the trained model, each OSError ENOSPC; ``none``: nothing fails but what ARGS meet); the
other ranks run ARGS unchanged. Joins the
process group once (gloo, with a collective timeout of 60 s: a rank left waiting fails instead of hanging for
the default half hour), runs every command (``oomb train`` uses the group it finds and leaves it open) and
writes this rank's exit statuses to OUT_JSON.
"""

import datetime
import errno
import json
import sys

import torch.distributed as dist

import oomb.checkpoint
import oomb.cli.train
from oomb.cli import main
from oomb.train import StepLog


def _full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _denied(out, *args, **kwargs):
    raise PermissionError(errno.EACCES, "Permission denied", str(out))


PATCHES = {"prepare": (oomb.cli.train, "_prepare_output", _denied), "log": (StepLog, "write", _full),
           "checkpoint": (oomb.checkpoint, "save_checkpoint", _full), "model": (oomb.cli.train, "_save", _full)}


def _status(what: str, argv: list[str]) -> int:
    owner, name, failing = PATCHES.get(what, (None, None, None))
    real = getattr(owner, name) if owner is not None else None
    if dist.get_rank() == 0 and owner is not None:
        setattr(owner, name, failing)
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    finally:
        if owner is not None:
            setattr(owner, name, real)


if __name__ == "__main__":
    commands_json, out = sys.argv[1:]
    with open(commands_json) as f:
        commands = json.load(f)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    statuses = [_status(what, argv) for what, argv in commands]
    with open(out, "w") as f:
        json.dump(statuses, f)
    dist.destroy_process_group()
