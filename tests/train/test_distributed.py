"""Data parallelism on CPU with 2 gloo processes equals one process trained on both sequences."""

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


def _worker(rank, world, port, out_dir, bad_rank):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    ctx = init_from_env("cpu", timeout_s=60)
    try:
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
            torch.save({"error": str(e)}, os.path.join(out_dir, f"rank{rank}.pt"))
            return
        if err is not None:
            torch.save({"error": str(err)}, os.path.join(out_dir, f"rank{rank}.pt"))
            return
        all_reduce_gradients(model.parameters(), bucket_bytes=4096)  # small buckets: several flushes
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        torch.save({"grads": grads, "params": model.state_dict()}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        ctx.close()


def _spawn(tmp_path, bad_rank=-1):
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, str(tmp_path), bad_rank)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
        assert not p.is_alive(), "a rank hung"
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]


def test_two_ranks_equal_single_process(tmp_path):
    results = _spawn(tmp_path)
    # Single process, both sequences, normalised by the total valid tokens.
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = Engine(model, engine_config(chunk_size=8, page_size=4, attention_backend="torch"))
    data = _data()
    n_total = sum(int((lab[0, 1:] != -100).sum()) for _, lab in data)
    for ids, lab in data:
        engine.step(ids, lab, loss_normalizer=n_total)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    for r in results:
        for n, g in grads.items():
            torch.testing.assert_close(r["grads"][n], g, rtol=1e-10, atol=1e-13)
        for n, p in model.state_dict().items():
            torch.testing.assert_close(r["params"][n], p, rtol=1e-10, atol=1e-13)


def test_bad_data_on_one_rank_stops_all_ranks(tmp_path):
    results = _spawn(tmp_path, bad_rank=1)
    assert "outside the model's vocabulary" in results[1]["error"]
    assert "another rank failed" in results[0]["error"]
