"""Data parallelism on CPU with 2 gloo processes equals one process trained on both sequences; bad data on one
rank stops both."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from oomb import Engine
from configs import engine_config
from oomb.distributed import RankFailedError, agree_ok, all_reduce_gradients, global_sum, init_from_env

pytestmark = pytest.mark.slow  # two gloo processes per test

VOCAB = 101


def _model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return Qwen2ForCausalLM(cfg).double()


def _data():
    g = torch.Generator().manual_seed(1)
    a = torch.randint(0, VOCAB, (1, 37), generator=g)
    b = torch.randint(0, VOCAB, (1, 29), generator=g)
    lb = b.clone()
    lb[0, 3:20] = -100  # unequal valid-token counts on the two ranks
    return [(a, a.clone()), (b, lb)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, out_dir):
    """Both cases in one process group, one after the other: every rank's data good, then bad data on rank 1."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    ctx = init_from_env("cpu", timeout_s=60)
    try:
        for case, bad_rank in (("good", -1), ("bad", 1)):
            torch.save(_case(rank, bad_rank), os.path.join(out_dir, f"{case}-rank{rank}.pt"))
    finally:
        ctx.close()


def _case(rank, bad_rank) -> dict:
    """One step of the two-rank run on this rank: its gradients and trained weights, or the error it stopped with."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = Engine(model, engine_config(chunk_size=8, page_size=4, attention_backend="torch"))
    ids, labels = _data()[rank]
    if rank == bad_rank:
        ids = ids.clone()
        ids[0, 5] = VOCAB + 3  # bad data on this rank only
    n_local = int((labels[0, 1:] != -100).sum())
    n_global = int(global_sum(n_local, torch.device("cpu")))
    err = None
    try:
        engine.step(ids, labels, loss_normalizer=n_global)
    except ValueError as e:  # a rank's own failure: tell the others, then stop
        err = e
    try:
        agree_ok(err is None, torch.device("cpu"))
    except RankFailedError as e:
        return {"error": str(e)}
    if err is not None:
        return {"error": str(err)}
    all_reduce_gradients(model.parameters(), bucket_bytes=4096)  # small buckets: several flushes
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    return {"grads": grads, "params": model.state_dict()}


def _spawn(tmp_path):
    """{case: [rank 0's result, rank 1's]} of one launch of two ranks running both cases (:func:`_worker`)."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
        assert not p.is_alive(), "a rank hung"
    return {case: [torch.load(tmp_path / f"{case}-rank{r}.pt") for r in range(2)] for case in ("good", "bad")}


def test_two_ranks_equal_single_process_and_bad_data_on_one_rank_stops_all_ranks(tmp_path):
    """One launch of two ranks (each start of a rank imports torch and transformers anew) runs both cases."""
    results = _spawn(tmp_path)

    # Every rank's data good: the same gradients and weights as a single process over both sequences, normalised
    # by the total valid tokens.
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = Engine(model, engine_config(chunk_size=8, page_size=4, attention_backend="torch"))
    data = _data()
    n_total = sum(int((lab[0, 1:] != -100).sum()) for _, lab in data)
    for ids, lab in data:
        engine.step(ids, lab, loss_normalizer=n_total)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    for r in results["good"]:
        for n, g in grads.items():
            torch.testing.assert_close(r["grads"][n], g, rtol=1e-10, atol=1e-13)
        for n, p in model.state_dict().items():
            torch.testing.assert_close(r["params"][n], p, rtol=1e-10, atol=1e-13)

    # Bad data on rank 1: it stops with its own error, and rank 0 with one saying another rank failed.
    bad = results["bad"]
    assert "outside the model's vocabulary" in bad[1]["error"], bad
    assert "another rank failed" in bad[0]["error"], bad
