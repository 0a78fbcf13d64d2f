"""`oomb bench` and oomb.bench: one step of oomb next to plain HF training on the same model and tokens."""

from __future__ import annotations

import json

import pytest
import torch

import oomb.bench as ob
from configs import engine_config
from oomb.cli import main

from tests.engine.test_engine import tiny


def test_cli_bench_table_json_and_equal_losses(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert main(["bench", "--lengths", "256", "384", "--chunk-size", "128", "--warmup-len", "0", "--steps", "2",
                 "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.count("| hf |") == 2 and out.count("| oomb |") == 2 and out.count("x |") == 2
    report = json.loads(path.read_text())
    assert report["lengths"] == [256, 384] and report["systems"] == ["hf", "oomb"] and report["steps"] == 2
    assert report["config"]["attention_backend"] == "torch" and report["warmup_len"] == 0  # auto, resolved on the CPU
    assert report["config"]["fused_glue"] == "none"
    rows = {(r["system"], r["tokens"]): r for r in report["rows"]}
    for T in (256, 384):
        hf, oomb = rows[("hf", T)], rows[("oomb", T)]
        assert hf["first_step_seconds"] > 0 and oomb["first_step_seconds"] > 0 and oomb["tokens_per_s"] == T / oomb["seconds"]
        # the same tokens, the same weights, the same mean loss (fp32): both systems really trained on them
        assert abs(hf["loss"] - oomb["loss"]) <= 1e-4 * hf["loss"]
    # an earlier report may be replaced; a different file may not
    assert main(["bench", "--lengths", "256", "--systems", "oomb", "--chunk-size", "128", "--warmup-len", "0",
                 "--json", str(path)]) == 0
    other = tmp_path / "notes.json"
    other.write_text('{"mine": 1}')
    with pytest.raises(SystemExit) as e:
        main(["bench", "--json", str(other)])
    assert e.value.code == 2
    assert "not an earlier 'oomb bench' report" in capsys.readouterr().err
    assert other.read_text() == '{"mine": 1}'


def test_cli_bench_runs_dense_attention_and_keeps_graphs(monkeypatch, tmp_path):
    """oomb bench's oomb rows run dense attention (bench has no sparse setting; a --config file's engine.sparse
    section, written for train, is not used), and --keep-graphs reaches the engine, its report and its rows."""
    seen = []
    real = ob.Engine

    def spy(model, config):
        seen.append(config)
        return real(model, config)

    monkeypatch.setattr(ob, "Engine", spy)
    cfg = tmp_path / "run.yaml"
    cfg.write_text("engine:\n  sparse:\n    page_budget: 1\n  keep_graphs: auto\n  keep_graphs_max: 1\n")
    path = tmp_path / "bench.json"
    assert main(["bench", "--config", str(cfg), "--lengths", "512", "--chunk-size", "128", "--warmup-len", "0",
                 "--systems", "oomb", "--json", str(path)]) == 0
    assert seen and all(c.sparse is None and c.keep_graphs == "auto" and c.keep_graphs_max == 1 for c in seen)
    report = json.loads(path.read_text())
    assert report["config"]["keep_graphs"] == "auto" and report["config"]["keep_graphs_max"] == 1
    assert report["rows"][0]["kept_graphs"] == 1


@pytest.mark.parametrize("argv,fragment", [
    (["--lengths", "1"], "--lengths has 1"),
    (["--systems", "hf", "hf"], "lists a system twice"),
    (["--lengths", "64", "64"], "lists a length twice"),
    (["--lengths", "99999999999999999999"], "pass at most"),
    (["--chunk-size", "100"], "not a multiple of --page-size"),
    (["--steps", "0"], "--steps is 0"),
    (["--warmup-len", "1"], "--warmup-len is 1"),
    (["--attention-backend", "triton"], "runs on the GPU only"),
    (["--model", "no-such-model"], "no-such-model"),
    (["--fused-glue", "liger"], "--fused-glue 'liger' runs Triton kernels on CUDA, and the model is on cpu"),
    (["--json", ""], "--json is empty"),
])
def test_cli_bench_bad_input(argv, fragment, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", *argv])
    assert e.value.code == 2
    assert fragment in capsys.readouterr().err


def test_out_of_memory_is_a_row_and_the_run_goes_on(monkeypatch):
    model = tiny("qwen2").float()
    calls = []

    def oom(self, *a, **k):
        calls.append(1)
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(ob.Engine, "step", oom)
    rows = ob.bench_rows(model, [32, 48], engine_config(chunk_size=16, page_size=8, attention_backend="torch"),
                         systems=["oomb", "hf"], steps=1)
    # ordered by length, then system; each oomb row is an error row, each hf row a measurement
    assert [(r["tokens"], r["system"], r.get("error")) for r in rows] == [
        (32, "oomb", "out of memory"), (32, "hf", None), (48, "oomb", "out of memory"), (48, "hf", None)]
    assert len(calls) == 2
    table = ob.bench_table(rows)
    assert table.count("out of memory") == 2 and "| hf | 48 |" in table

    def cpu_alloc_failure(self, *a, **k):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes")

    monkeypatch.setattr(ob.Engine, "step", cpu_alloc_failure)
    rows = ob.bench_rows(model, [32], engine_config(chunk_size=16, page_size=8, attention_backend="torch"),
                         systems=["oomb"], steps=1)
    assert rows[0]["error"] == "out of memory"

    def other_error(self, *a, **k):
        raise RuntimeError("a real bug")

    monkeypatch.setattr(ob.Engine, "step", other_error)
    with pytest.raises(RuntimeError, match="a real bug"):
        ob.bench_rows(model, [32], engine_config(chunk_size=16, page_size=8, attention_backend="torch"), systems=["oomb"])
    with pytest.raises(ValueError, match="systems"):
        ob.bench_rows(model, [32], engine_config(), systems=["deepspeed"])
    with pytest.raises(ValueError, match="lengths"):
        ob.bench_rows(model, [1], engine_config())
    with pytest.raises(ValueError, match="lengths"):
        ob.bench_rows(model, [8, 8], engine_config())


def test_stage2_rate_reads_the_timed_steps_bar(tmp_path):
    """benchmarks/stage2_rate.py: seconds per chunk over the first N chunks of the longest Stage-2 bar (the timed
    step, not the warm-up), also from a console cut mid-step."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "stage2_rate.py"
    spec = importlib.util.spec_from_file_location("stage2_rate", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    console = "\n".join([
        "stage 2 (recompute + backward):  40%|####      | 2/5 [00:09<00:13,  4.50s/chunk]",  # warm-up step
        "stage 2 (recompute + backward):   4%|4         | 10/256 [00:13<04:58,  1.21s/chunk]",
        "stage 2 (recompute + backward):  10%|#         | 26/256 [00:32<04:28,  1.17s/chunk]",
        "stage 2 (recompute + backward):  16%|#6        | 42/256 [01:01<04:13,  1.18s/chunk]",
    ])
    assert mod.stage2_points(console) == [(10, 13), (26, 32), (42, 61)]
    f = tmp_path / "console.txt"
    f.write_text(console)
    assert mod.main([str(f), "--chunks", "40", "--label", "x"]) == 0
    (tmp_path / "empty.txt").write_text("nothing here")
    assert mod.main([str(tmp_path / "empty.txt")]) == 1
