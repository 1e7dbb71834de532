"""Done-when for the serving engine: Poisson traces through SmolLM2 with its real weights."""

from __future__ import annotations

import shutil

import pytest
import torch

from kvlab.serve.engine import make_serving_engine
from kvlab.serve.run import load_run, run_workload
from kvlab.serve.traffic import parse_traffic
from kvlab.serve.workload import build_workload

pytestmark = pytest.mark.slow(reason="SmolLM2 real weights through 24-request traces, about a minute a run on 2 cores")

# prompts of about 240 tokens (15 blocks of 16) and 16 new tokens: a full request ends holding 16-17
# blocks, a SnapKV 25% one 5 (60 kept + 16 new); the pool of 102 blocks holds 6 full requests
LENGTHS = {"kind": "lognormal", "input_median": 240, "input_sigma": 0.05, "max_input": 256,
           "output_median": 16, "output_sigma": 0.0}


def workload(smollm2, lengths=LENGTHS, requests=28, rate=100.0):
    spec = parse_traffic({"arrival": "poisson", "rate": rate, "requests": requests, "seed": 1, "lengths": lengths})
    return build_workload(spec, rate, smollm2.tokenizer, smollm2.spec.vocab_size)


def alone(smollm2, prompt_ids, n):
    with torch.no_grad():
        out = smollm2.model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False,
                                     min_new_tokens=n)
    return out[0, len(prompt_ids):].tolist()


def test_full_cache_tokens_equal_each_prompt_alone_and_snapkv_holds_more_requests(smollm2, tmp_path):
    wl = workload(smollm2)
    full = run_workload(make_serving_engine(smollm2, "full", num_blocks=102, max_num_batched_tokens=512), wl,
                        tmp_path / "full")
    assert full["status"] == "complete" and len(full["records"]) == 28
    for rec in full["records"]:
        item = wl.items[int(rec["request_id"][1:])]
        assert rec["output_tokens"] == item.output_len
        assert rec["token_ids"] == alone(smollm2, item.prompt_ids, item.output_len), rec["request_id"]
    snap = run_workload(make_serving_engine(smollm2, "snapkv", num_blocks=102, max_num_batched_tokens=512,
                                            keep=0.25), wl, tmp_path / "snap")
    assert snap["status"] == "complete" and len(snap["records"]) == 28
    assert all(r["output_tokens"] == wl.items[int(r["request_id"][1:])].output_len for r in snap["records"])
    peak_full, peak_snap = full["metrics"]["peak_running"], snap["metrics"]["peak_running"]
    assert peak_snap >= 2.5 * peak_full, (peak_full, peak_snap)
    for run in (full, snap):  # the capacity model's prediction, within 25% of what ran
        assert run["metrics"]["peak_running"] == pytest.approx(run["metrics"]["predicted_peak"], rel=0.25)


def test_a_pool_too_small_preempts_and_finishes_every_request(smollm2, tmp_path):
    lengths = {"kind": "fixed", "input": 40, "output": 24}  # 3 blocks at admission, 4 by the end
    wl = workload(smollm2, lengths, requests=24)
    res = run_workload(make_serving_engine(smollm2, "kvq-int4", num_blocks=12, max_num_batched_tokens=256), wl,
                       tmp_path / "small")
    assert res["status"] == "complete" and len(res["records"]) == 24
    assert all(r["output_tokens"] == 24 for r in res["records"])
    assert res["metrics"]["preemptions_total"] > 0
    assert sum(r["preemptions"] for r in res["records"]) == res["metrics"]["preemptions_total"]


def test_a_kill_mid_run_keeps_finished_records_and_marks_the_run_incomplete(smollm2, tmp_path):
    wl = workload(smollm2, {"kind": "fixed", "input": 32, "output": 4}, requests=24)
    run_dir, snapshot = tmp_path / "run", tmp_path / "at-kill"
    finished = []

    def kill_after_five(ev):
        if ev.finished:
            finished.append(ev.request_id)
        if len(finished) == 5:
            shutil.copytree(run_dir, snapshot)  # what a SIGKILL at this moment leaves on disk
            raise KeyboardInterrupt

    engine = make_serving_engine(smollm2, "full", num_blocks=40, max_num_batched_tokens=128)
    with pytest.raises(KeyboardInterrupt):
        run_workload(engine, wl, run_dir, on_event=kill_after_five)
    for folder in (snapshot, run_dir):
        run = load_run(folder)
        assert run["status"] == "incomplete"
        assert sorted(r["request_id"] for r in run["records"]) == sorted(finished)
        assert all(len(r["token_times"]) == 4 for r in run["records"])
    assert load_run(run_dir)["metrics"]["completed"] == 5
