"""Teacher-forced retrieval scoring: the engine's chunked no-grad pass gives the log-probabilities of a plain
transformers forward (fp32, 1e-5), exact match is "every answer token is the argmax", and sparse attention with a
budget holding the whole past scores like dense while a small budget does not."""

from __future__ import annotations

import math

import pytest
import torch

from oomb import Engine, OOMBConfig
from oomb.config import SparseConfig
from oomb.data import load_tokenizer
from oomb.models.presets import build_model
from oomb.retrieval import (
    build_prompts,
    evaluate_retrieval,
    passkey_prompt,
    score_prompt,
)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


def _model(name="tiny", seed=0):
    torch.manual_seed(seed)
    return build_model(name).eval()


def _hf_logprobs(model, ids):
    with torch.no_grad():
        logits = model(input_ids=ids.view(1, -1)).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])
def test_answer_logprobs_equal_a_plain_transformers_forward(tok, name):
    model = _model(name)
    p = passkey_prompt(tok, 200, 40.0)
    engine = Engine(model, OOMBConfig(chunk_size=32, page_size=8))
    logprobs, greedy = engine.score_targets(p.input_ids, p.labels)
    ref = _hf_logprobs(model, p.input_ids)
    rows = torch.arange(p.answer_start - 1, p.length - 1)
    targets = p.input_ids[p.answer_start:]
    expected = ref[rows, targets]
    assert logprobs.dtype == torch.float32 and logprobs.shape == (p.length - p.answer_start,)
    torch.testing.assert_close(logprobs, expected, atol=1e-5, rtol=0)
    assert greedy.tolist() == (ref[rows].argmax(-1) == targets).tolist()
    # every position at once (labels = the prompt): the whole sequence's log-probs, and evaluate() is their mean
    all_lp, all_greedy = engine.score_targets(p.input_ids)
    torch.testing.assert_close(all_lp, ref[torch.arange(p.length - 1), p.input_ids[1:]], atol=1e-5, rtol=0)
    assert all_greedy.tolist() == (ref[:-1].argmax(-1) == p.input_ids[1:]).tolist()
    # labels that are the reference's argmax at every other position: greedy exactly there
    best = torch.cat([p.input_ids[:1], ref[:-1].argmax(-1)])
    mixed = torch.where(torch.arange(p.length) % 2 == 0, best, p.input_ids)
    _, hits = engine.score_targets(p.input_ids, mixed)
    assert hits.tolist() == (ref[:-1].argmax(-1) == mixed[1:]).tolist() and hits[1::2].all()
    assert engine.evaluate(p.input_ids) == pytest.approx(-float(all_lp.double().mean()), abs=1e-5)
    trial = score_prompt(engine, p)
    assert trial.logprob == pytest.approx(float(expected.double().sum()), abs=1e-5)
    assert trial.exact == bool((ref[rows].argmax(-1) == targets).all())


def test_a_budget_holding_the_whole_past_scores_like_dense_and_a_small_one_differs(tok):
    model = _model()
    prompts = build_prompts("passkey", tok, [256], [0.0, 100.0], trials=1)
    cfg = OOMBConfig(chunk_size=32, page_size=8, sparse=SparseConfig(sink_pages=0, local_pages=0))
    # 256 tokens, chunks of 32, pages of 8: the last chunk has 28 past pages.
    report = evaluate_retrieval(model, prompts, cfg, budgets=[1, 28])
    dense, small, whole = report.rows
    assert [r.name for r in report.rows] == ["dense", "sparse 1", "sparse 28"]
    for d, w, s in zip(dense.trials, whole.trials, small.trials):
        assert w.token_logprobs == pytest.approx(d.token_logprobs, abs=1e-5)
        assert abs(s.logprob - d.logprob) > 1e-4
    assert report.lengths == [256] and report.depths == [0.0, 100.0] and report.trials == 1


def test_the_report_table_json_and_heatmap(tok, tmp_path):
    model = _model()
    prompts = build_prompts("passkey", tok, [100, 150], [0.0, 50.0, 100.0], trials=2)
    report = evaluate_retrieval(model, prompts, OOMBConfig(chunk_size=64, page_size=16), seed=0)
    row = report.rows[0]
    for t in row.trials[:3]:  # rig the records: the table and grid must follow them
        t.exact = True
    grid = report.grid(row)
    assert grid[0] == [1.0, 0.0] and grid[1] == [0.5, 0.0] and grid[2] == [0.0, 0.0]
    lines = report.table().splitlines()
    assert lines[0].startswith("**passkey, dense: exact match over 2 trials per cell**")
    report.trials = 1
    assert report.table().splitlines()[0].startswith("**passkey, dense: exact match over 1 trial per cell**")
    report.trials = 2
    assert "| depth \\ length | 100 | 150 |" in lines
    assert "| 0% | 100% | 0% |" in lines and "| 50% | 50% | 0% |" in lines and "| **all** | 50% | 0% |" in lines
    data = report.to_dict()
    assert data["rows"][0]["accuracy_grid"] == grid and data["rows"][0]["accuracy"] == 0.25
    assert len(data["rows"][0]["results"]) == 12 and all(math.isfinite(r["logprob"]) for r in data["rows"][0]["results"])
    row.trials[0].logprob, row.trials[1].logprob = -1.0, -4.0  # the (100 tokens, 0%) cell's two trials
    lp = report.logprob_grid(row)
    assert lp[0][0] == -2.5 and row.mean_logprob(100, 0.0) == -2.5
    assert lp[2][1] == pytest.approx(sum(t.logprob for t in row.cell(150, 100.0)) / 2)
    assert report.to_dict()["rows"][0]["mean_logprob_grid"] == lp
    png = report.heatmap(tmp_path / "map.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_bad_scoring_input_is_refused(tok):
    model = _model()
    with pytest.raises(ValueError, match="prompts is empty"):
        evaluate_retrieval(model, [], OOMBConfig())
    p = passkey_prompt(tok, 120, 0.0)
    with pytest.raises(ValueError, match="budgets must be page counts >= 0"):
        evaluate_retrieval(model, [p], OOMBConfig(), budgets=[-1])
