"""Run several ``oomb train`` commands in one ``torchrun`` launch (tests/cli/test_cli_shard.py).

Usage: torchrun --nproc_per_node 2 tests/cli/shard_driver.py OUT_JSON -- ARGS... [-- ARGS...]

Joins the process group once (gloo), then runs ``oomb.cli.main`` with each argument list in turn on every rank
(``oomb train`` uses the group it finds and leaves it open), and rank 0 writes the exit statuses to OUT_JSON.
One launch instead of one per command: starting Python, torch and transformers twice per command is most of a
tiny run's time.
"""

import json
import sys

import torch.distributed as dist

from oomb.cli import main


def _status(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1


if __name__ == "__main__":
    out, rest = sys.argv[1], sys.argv[2:]
    commands, current = [], None
    for a in rest:
        if a == "--":
            current = []
            commands.append(current)
        else:
            current.append(a)
    dist.init_process_group("gloo")
    statuses = [_status(c) for c in commands]
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(statuses, f)
    dist.destroy_process_group()
