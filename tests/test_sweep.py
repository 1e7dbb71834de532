"""Sweep params, expansion and the resumable runner on the tiny random Llama."""

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pandas as pd
import pytest
import yaml

from kvlab.cli import main
from kvlab.records import load_records, read_jsonl, read_manifest
from kvlab.sweep.checks import check_params
from kvlab.sweep.driver import run_sweep
from kvlab.sweep.lock import SweepLock, SweepLocked
from kvlab.sweep.params import ParamsError, load_params, method_variants, parse_params
from kvlab.sweep.plan import block_order, expand, planned_runs

REPO = Path(__file__).resolve().parent.parent

TINY = {
    "models": "tiny-llama", "weights": "synthetic", "device": "cpu",
    "methods": ["full", "streamingllm", {"method": "quanto", "bits": [4, 2], "q_group_size": 16}],
    "keep": 0.5, "ctx": [32, 64], "batch": 1, "new_tokens": 3, "prompts": 2, "repeats": 1, "threads": 1,
}


def tiny_params(**kw):
    return parse_params({**TINY, **kw})


def this_checkout():
    """The environment of a subprocess that imports this checkout's kvlab (not another install)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}


def ids_in(folder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [r["run_id"] for r in read_jsonl(Path(folder) / "records.jsonl")]


# --- params ----------------------------------------------------------------------------------


def test_the_progress_bar_counts_warm_ups_once_per_variant_and_shape():
    from kvlab.sweep.plan import warmups_planned

    runs = planned_runs(tiny_params())  # 4 variants x 2 ctx x 2 prompts
    assert warmups_planned(runs, 1) == 4 * 2 and warmups_planned(runs, 2) == 16
    assert warmups_planned(runs[:1], 1) == 1 and warmups_planned([], 1) == 0


def test_cpu_sweeps_pin_a_stable_thread_count():
    from kvlab.hostload import cpu_threads
    from kvlab.sweep.driver import pinned_threads

    assert pinned_threads(tiny_params(threads=3)) == 3
    assert pinned_threads(tiny_params(threads=None)) == cpu_threads()
    assert pinned_threads(tiny_params(threads=None, device="cuda")) is None


def test_scalars_become_lists_and_files_validate():
    p = tiny_params(ctx=16384)
    assert p.ctx == [16384] and p.models == ["tiny-llama"] and p.keep == [0.5]
    smoke = load_params(REPO / "params" / "smoke.yaml")
    assert smoke.name == "smoke" and smoke.device == "cpu" and smoke.new_tokens == 8
    assert len(planned_runs(smoke)) == 18 and smoke.repeats == 3  # 3 methods x 2 contexts x 3 repeats (an interval)
    # README block 1's report compares the full cache with eviction and with quantization
    assert {"full", "snapkv", "kvq-int4"} <= set(smoke.methods) and smoke.quality is not None
    seed = load_params(REPO / "params" / "seed-16k.yaml")
    runs = planned_runs(seed)  # validated without a GPU (check_device=False)
    assert len(runs) == 15 * 3 * 5 * 3
    assert {(r.method, r.policy_kwargs.get("keep"), r.policy_kwargs.get("nbits")) for r in runs} >= {
        ("full", None, None), ("snapkv", 0.1, None), ("quanto", None, 2)}
    assert load_params(REPO / "params" / "seed-16k.yaml", ["ctx=16384", "repeats=1"]).ctx == [16384]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"ctxs": [512]}, "unknown key 'ctxs': did you mean 'ctx'?"),
        ({"methods": ["full", "h2o"]}, "methods[1] (h2o): unknown method 'h2o'; methods: full"),
        ({"keep": [0.5, 0]}, "keep (streamingllm): keep=0.0 is outside (0, 1]"),
        ({"methods": [{"method": "quanto", "bits": 3, "q_group_size": 16}]},
         "methods[0] (quanto: q_group_size=16, nbits=3): nbits=3 is not supported by the quanto backend: use one of 2, 4"),
        ({"ctx": [4094]}, "ctx: 4094 + new_tokens 3 is above the maximum context 4096 of tiny-llama; lower ctx to at most 4093"),
        ({"models": ["llama-3.1-8b"], "weights": None}, "models[0]: kvlab has no real weights for 'llama-3.1-8b'; set weights: synthetic"),
        ({"new_tokens": 0}, "new_tokens: Input should be greater than or equal to 1"),
        ({"device": "gpu"}, "device: 'gpu' is not a device; use cpu, cuda or cuda:N"),
    ],
)
def test_bad_params_name_the_key_and_the_fix(change, message):
    with pytest.raises(ParamsError) as err:
        check_params(tiny_params(**change))
    assert message in str(err.value)


def test_missing_key_and_bad_overrides(tmp_path):
    with pytest.raises(ParamsError, match="ctx: required"):
        parse_params({k: v for k, v in TINY.items() if k != "ctx"})
    with pytest.raises(ParamsError, match="write key=value"):
        load_params(REPO / "params" / "smoke.yaml", ["ctx"])
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(TINY))
    p = load_params(path, ["ctx=[8, 16]", "methods=[full, {method: snapkv, keep: 0.25}]", "sdpa_backend=math"])
    assert p.ctx == [8, 16] and p.sdpa_backend == "math" and p.name == "p"
    assert [v.kwargs for _, v in method_variants(p)] == [{}, {"keep": 0.25}]


def test_cuda_device_is_refused_when_torch_has_none():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ParamsError, match="torch sees no CUDA device; use --set device=cpu"):
        check_params(tiny_params(device="cuda"))
    check_params(tiny_params(device="cuda"), check_device=False)


# --- expansion -------------------------------------------------------------------------------


def test_blocks_run_every_variant_once_in_a_seeded_order():
    p = tiny_params(methods=["full", "streamingllm", "snapkv", "tova", "knorm"], ctx=[32], prompts=2, repeats=3)
    runs = expand(p, check_params(p))
    assert len(runs) == 5 * 2 * 3 and len({r.run_id for r in runs}) == len(runs)
    blocks = [runs[i:i + 5] for i in range(0, len(runs), 5)]
    orders = []
    for block in blocks:
        assert sorted(r.method for r in block) == sorted(["full", "streamingllm", "snapkv", "tova", "knorm"])
        assert len({(r.repeat, r.prompt_id) for r in block}) == 1
        orders.append(tuple(r.method for r in block))
    assert len(set(orders)) > 1  # not one fixed order
    assert [r.run_id for r in expand(p, check_params(p))] == [r.run_id for r in runs]
    other = tiny_params(methods=["full", "streamingllm", "snapkv", "tova", "knorm"], ctx=[32], prompts=2,
                        repeats=3, seed=1)
    assert [r.method for r in expand(other, check_params(other))] != [r.method for r in runs]
    assert sorted(block_order(7, 0, "x")) == list(range(7)) and block_order(7, 0, "x") == block_order(7, 0, "x")


# --- the runner ------------------------------------------------------------------------------


def test_sweep_records_every_run_once_and_a_rerun_does_nothing(tmp_path):
    p = tiny_params()
    s = run_sweep(p, tmp_path, progress=False, log=lambda m: None)
    total = 4 * 2 * 2  # variants x ctx x prompts
    assert (s.total, s.ok, s.failed, s.pending) == (total, total, 0, 0) and s.complete
    ids = ids_in(tmp_path)
    assert len(ids) == total and set(ids) == {r.run_id for r in planned_runs(p)}
    df = load_records(tmp_path)
    assert set(df.status) == {"ok"} and set(df.weights) == {"synthetic"} and set(df.kind) == {"perf"}
    assert set(df.card) == {"cpu"} and df.gpu_uuid.isna().all() and df.driver.isna().all()  # the card: cpu
    assert df.ttft_s.notna().all() and (df.cache_logical_tokens == df.ctx).all()
    # the kernel probe (torch.profiler) runs on GPU warm-ups only: on a CPU it costs 4x a run
    assert "sdpa_kernel" not in df.columns or df.sdpa_kernel.isna().all()
    assert set(df.label) == {"full", "streamingllm 50%", "quanto int4", "quanto int2"}
    warm = read_jsonl(tmp_path / "warmup.jsonl")
    assert len(warm) == 4 * 2 and {(w["method"], w["ctx"], w["new_tokens"]) for w in warm} == {
        (r.method, r.ctx, r.new_tokens) for r in planned_runs(p)}
    manifest = read_manifest(tmp_path)
    assert manifest["status"] == "complete" and manifest["params"]["ctx"] == [32, 64]
    inv = manifest["invocations"][0]
    assert inv["env_start"]["packages"]["torch"] and inv["env_end"]["taken_at"]
    assert inv["energy_source"].startswith("none")

    assert set(df.threads) == {1} and df.contended.map(lambda v: v in (True, False, None)).all()
    parquet = pd.read_parquet(tmp_path / "records.parquet")  # the pandas copy, next to the JSONL
    assert sorted(parquet.run_id) == sorted(df.run_id) and "itl_ms" in parquet.columns

    again = run_sweep(p, tmp_path, progress=False, log=lambda m: None)
    assert (again.already_done, again.ok, again.failed, again.pending) == (total, 0, 0, 0)
    assert ids_in(tmp_path) == ids
    assert len(read_manifest(tmp_path)["invocations"]) == 2


def test_failures_are_recorded_the_status_says_so_and_a_rerun_retries_them(tmp_path, monkeypatch):
    import torch

    import kvlab.measure as measure
    from kvlab.policies.quantized import QuantizedPolicy
    from kvlab.sweep.plan import FAILED_ENERGY_SOURCE

    real = measure.measure_generation

    def flaky(*args, **kw):
        if kw["prompt_id"] == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(*args, **kw)

    def broken_build(self, model):
        raise RuntimeError("kernel build failed (simulated)")

    monkeypatch.setattr(measure, "measure_generation", flaky)
    monkeypatch.setattr(QuantizedPolicy, "warmup", broken_build)
    p = tiny_params(methods=["full", {"method": "quanto", "q_group_size": 16}], ctx=[32])
    s = run_sweep(p, tmp_path, progress=False, log=lambda m: None)
    assert (s.ok, s.failed, s.pending, s.failed_recorded) == (1, 3, 0, 3)
    assert s.status == "failed_runs" and not s.complete and "fix the cause and rerun" in s.line()
    assert read_manifest(tmp_path)["status"] == "failed_runs"
    df = load_records(tmp_path).set_index(["method", "prompt_id"])
    assert df.loc[("full", 0), "status"] == "ok"
    assert df.loc[("full", 1), "error"].startswith("OutOfMemoryError: CUDA out of memory (simulated)")
    for prompt in (0, 1):
        err = df.loc[("quanto", prompt), "error"]
        assert "kernel build failed (simulated)" in err and "policy setup failed" in err
    failed = df[df.status == "failed"]
    assert (failed.energy_source == FAILED_ENERGY_SOURCE).all() and df.loc[("full", 0), "energy_source"] != ""
    assert "OutOfMemoryError" in (tmp_path / "errors.log").read_text()

    monkeypatch.setattr(measure, "measure_generation", real)
    kept = run_sweep(tiny_params(methods=p.methods, ctx=[32], retry_failed=False), tmp_path, progress=False,
                     log=lambda m: None)
    assert (kept.ok, kept.failed, kept.status) == (0, 0, "failed_runs")  # failures kept as recorded
    retry = run_sweep(p, tmp_path, progress=False, log=lambda m: None)  # retry_failed is the default
    assert (retry.already_done, retry.ok, retry.failed, retry.status) == (1, 1, 2, "failed_runs")
    monkeypatch.undo()
    fixed = run_sweep(p, tmp_path, progress=False, log=lambda m: None)
    assert (fixed.ok, fixed.failed, fixed.status) == (2, 0, "complete") and fixed.complete
    assert read_manifest(tmp_path)["status"] == "complete"
    latest = load_records(tmp_path).set_index(["method", "prompt_id"])
    assert set(latest.status) == {"ok"} and len(latest) == 4


def test_a_sweep_whose_every_run_failed_is_not_complete(tmp_path):
    def no_weights(name, **kw):
        from kvlab.models import ModelError

        raise ModelError("the embedded SmolLM2 weights are not installed (simulated)")

    p = tiny_params(methods=["full"], ctx=[32])
    s = run_sweep(p, tmp_path, progress=False, loader=no_weights, log=lambda m: None)
    assert (s.ok, s.failed, s.status) == (0, 2, "failed_runs") and not s.complete
    assert read_manifest(tmp_path)["status"] == "failed_runs"
    fixed = run_sweep(p, tmp_path, progress=False, log=lambda m: None)  # the default rerun measures them
    assert (fixed.ok, fixed.status) == (2, "complete")


def test_run_budget_stops_cleanly_and_the_rerun_finishes(tmp_path):
    s = run_sweep(tiny_params(max_runs=3), tmp_path, progress=False, log=lambda m: None)
    assert s.ok == 3 and s.pending == 13 and "max_runs=3" in s.stopped and not s.complete
    assert s.status == read_manifest(tmp_path)["status"] == "incomplete"
    s = run_sweep(tiny_params(time_budget_s=1e-6), tmp_path, progress=False, log=lambda m: None)
    assert s.ok == 0 and "time_budget_s" in s.stopped
    s = run_sweep(tiny_params(), tmp_path, progress=False, log=lambda m: None)
    assert s.ok == 13 and s.complete
    ids = ids_in(tmp_path)
    assert len(ids) == len(set(ids)) == 16


def test_a_part_of_the_plan_keeps_the_whole_plan_in_the_manifest(tmp_path):
    whole = tiny_params()
    run_sweep(tiny_params(max_runs=1), tmp_path, progress=False, log=lambda m: None)  # records the whole plan
    logs = []
    part = run_sweep(tiny_params(methods=["full"]), tmp_path, progress=False, log=logs.append)
    assert part.complete and part.total == 4
    manifest = read_manifest(tmp_path)
    assert manifest["run_ids"] == [r.run_id for r in planned_runs(whole)] and manifest["n_runs"] == 16
    assert manifest["status"] == "incomplete" and manifest["params"]["methods"] == whole.model_dump()["methods"]
    assert manifest["invocations"][-1]["part_of_plan"]["n_runs"] == 4
    assert any("4 of the 16 runs" in m for m in logs)
    rest = run_sweep(whole, tmp_path, progress=False, log=logs.append)
    assert rest.complete and read_manifest(tmp_path)["status"] == "complete"
    assert not any("different plan" in m for m in logs)
    ids = ids_in(tmp_path)
    assert len(ids) == len(set(ids)) == 16


def test_a_live_lock_refuses_and_a_dead_one_is_replaced(tmp_path):
    with SweepLock(tmp_path):
        with pytest.raises(SweepLocked, match=f"pid {os.getpid()}"):
            run_sweep(tiny_params(), tmp_path, progress=False, log=lambda m: None)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    import socket

    (tmp_path / "sweep.lock").write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    lock = SweepLock(tmp_path).acquire()
    assert lock.stale["pid"] == dead.pid
    lock.release()
    assert SweepLock(tmp_path).acquire().stale is None  # a cleanly released lock is not stale


def test_kill_9_midway_then_rerun_has_no_duplicate_and_no_lost_run(tmp_path):
    params = {**TINY, "methods": ["full", "streamingllm"], "ctx": [32], "prompts": 4, "jitter_ms": 300,
              "name": "killme"}
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    out = tmp_path / "out"
    total = len(planned_runs(parse_params(params)))
    proc = subprocess.Popen([sys.executable, "-m", "kvlab", "sweep", str(path), "-o", str(out), "--no-progress"],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=this_checkout())
    deadline = time.monotonic() + 120
    while len(ids_in(out)) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    done_before = len(ids_in(out))
    assert 2 <= done_before < total, "the sweep finished before it could be killed midway"

    logged = []
    s = run_sweep(parse_params(params), out, progress=False, log=logged.append)
    assert s.stale_lock and s.stale_lock["pid"] == proc.pid and "stale lock" in logged[0]
    assert s.already_done == done_before and s.ok == total - done_before and s.complete
    ids = ids_in(out)
    assert len(ids) == len(set(ids)) == total
    assert set(ids) == {r.run_id for r in planned_runs(parse_params(params))}


def test_cli_dry_run_errors_and_lock(tmp_path, capsys):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(TINY))
    assert main(["sweep", str(path), "-o", str(tmp_path / "o"), "--dry-run"]) == 0
    assert "16 runs to do" in capsys.readouterr().out
    assert main(["sweep", str(path), "--set", "keep=0", "--dry-run"]) == 2
    assert "keep (streamingllm): keep=0.0 is outside (0, 1]" in capsys.readouterr().err
    with SweepLock(tmp_path / "o"):
        assert main(["sweep", str(path), "-o", str(tmp_path / "o"), "--no-progress"]) == 2
    assert "being written by another sweep" in capsys.readouterr().err
    assert main(["sweep", str(path), "-o", str(tmp_path / "o"), "--no-progress", "--set", "max_runs=2"]) == 4
    assert "rerun the same command to continue" in capsys.readouterr().out
    assert read_manifest(tmp_path / "o")["status"] == "incomplete"


def test_quality_pass_runs_after_perf_once_and_is_keyed_like_perf(tmp_path):
    import dataclasses

    from toy_tokenizer import ToyTokenizer

    from kvlab.models import load_model

    def loader(name, **kw):
        return dataclasses.replace(load_model(name, **kw), tokenizer=ToyTokenizer())

    quality = {"tasks": ["niah_single"], "lengths": [480], "depths": [0.5], "samples": 1, "max_new_tokens": 4}
    p = tiny_params(ctx=[32], prompts=1, quality=quality)
    logs = []
    s = run_sweep(p, tmp_path, progress=False, loader=loader, log=logs.append)
    assert s.complete and read_manifest(tmp_path)["status"] == "complete"
    df = load_records(tmp_path)
    q = df[df.kind == "quality"]
    assert set(q.label) == {"full", "streamingllm 50%", "quanto int4", "quanto int2"}
    assert set(q.weights) == {"synthetic"} and set(q.sweep) == {tmp_path.name}
    assert q.kl.notna().all() and q.run_id.is_unique
    assert any("meaningless" in m for m in logs)
    assert read_manifest(tmp_path)["quality_done"] == {"tiny-llama": True}
    n = len(read_jsonl(tmp_path / "records.jsonl"))
    run_sweep(p, tmp_path, progress=False, loader=loader, log=logs.append)
    assert len(read_jsonl(tmp_path / "records.jsonl")) == n  # nothing reran


def test_perf_false_runs_the_quality_pass_alone(tmp_path, capsys):
    """``perf: false``: no perf run, no warm-up, the quality records of every method, and ctx (unused)
    defaults to the quality lengths; the dry run says 0 runs."""
    quality = {**QUALITY, "lengths": [480]}
    params = {**TINY, "methods": ["full", "streamingllm"], "perf": False, "quality": quality}
    del params["ctx"]
    p = parse_params(params)
    assert p.ctx == [480] and expand(p, check_params(p, own_loader=True)) == []
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({**params, "models": "smollm2-135m", "weights": "real"}))  # a tokenizer
    assert main(["sweep", str(path), "-o", str(tmp_path / "dry"), "--dry-run"]) == 0
    assert "0 runs to do" in capsys.readouterr().out
    s = run_sweep(p, tmp_path / "o", progress=False, loader=toy_loader, log=lambda line: None)
    assert s.complete and s.total == 0
    records = read_jsonl(tmp_path / "o" / "records.jsonl")
    assert {r["kind"] for r in records} == {"quality"}
    assert {r["label"] for r in records} == {"full", "streamingllm 50%"}
    assert not read_jsonl(tmp_path / "o" / "warmup.jsonl")
    # a method added to the plan runs its quality items on the rerun; the recorded ones are not rerun
    s = run_sweep(parse_params({**params, "methods": ["full", "streamingllm", "tova"]}), tmp_path / "o",
                  progress=False, loader=toy_loader, log=lambda line: None)
    again = read_jsonl(tmp_path / "o" / "records.jsonl")
    assert s.complete and again[:len(records)] == records
    assert {r["label"] for r in again[len(records):]} == {"tova 50%"}


def test_quality_items_the_tokenizer_cannot_build_are_refused_before_any_run(tmp_path, monkeypatch):
    """A sweep builds each model's quality items with its tokenizer alone before the perf runs: a
    length too short for the task's fixed parts is one error, with no model loaded, no folder written."""
    from toy_tokenizer import ToyTokenizer

    import kvlab.models
    from kvlab.errors import UserError

    monkeypatch.setattr(kvlab.models, "load_tokenizer", lambda name: ToyTokenizer())
    monkeypatch.setattr(kvlab.models, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    p = tiny_params(models="smollm2-135m", weights="real", quality={**QUALITY, "lengths": [40]})
    with pytest.raises(UserError, match="quality on smollm2-135m: length 40 is too short for task 'niah_single'"):
        run_sweep(p, tmp_path / "o", progress=False, log=lambda line: None)
    assert not (tmp_path / "o").exists()


def toy_loader(name, **kw):
    import dataclasses

    from toy_tokenizer import ToyTokenizer

    from kvlab.models import load_model

    return dataclasses.replace(load_model(name, **kw), tokenizer=ToyTokenizer())


QUALITY = {"tasks": ["niah_single"], "lengths": [480, 520], "depths": [0.5], "samples": 1, "max_new_tokens": 4}


def quality_ids(folder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [r["run_id"] for r in read_jsonl(Path(folder) / "records.jsonl") if r.get("kind") == "quality"]


def test_a_kill_between_the_quality_records_and_the_done_mark_duplicates_nothing(tmp_path):
    p = tiny_params(ctx=[32], prompts=1, quality=QUALITY)
    run_sweep(p, tmp_path, progress=False, loader=toy_loader, log=lambda m: None)
    ids = quality_ids(tmp_path)
    assert len(ids) == len(set(ids)) == 2 * 4
    manifest = read_manifest(tmp_path)
    del manifest["quality_done"]  # what a kill -9 right before the mark leaves
    manifest["status"] = "incomplete"
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    s = run_sweep(p, tmp_path, progress=False, loader=toy_loader, log=lambda m: None)
    assert quality_ids(tmp_path) == ids and s.complete
    assert read_manifest(tmp_path)["quality_done"] == {"tiny-llama": True}


def test_a_plan_extended_with_a_method_runs_its_quality_items_too(tmp_path):
    """A sweep rerun with more methods (e.g. first keep 0.25, then keep 0.25 and 0.1) adds their
    quality records; the items already recorded ok are not run again."""
    first = tiny_params(ctx=[32], prompts=1, methods=["full", "streamingllm"], keep=[0.5], quality=QUALITY)
    run_sweep(first, tmp_path, progress=False, loader=toy_loader, log=lambda m: None)
    ids = quality_ids(tmp_path)
    assert len(ids) == 2 * 2
    more = tiny_params(ctx=[32], prompts=1, methods=["full", "streamingllm"], keep=[0.5, 0.25], quality=QUALITY)
    s = run_sweep(more, tmp_path, progress=False, loader=toy_loader, log=lambda m: None)
    after = quality_ids(tmp_path)
    assert s.complete and after[:len(ids)] == ids and len(after) == len(set(after)) == 2 * 3


def test_failed_quality_items_make_the_sweep_say_so_and_a_rerun_retries_only_them(tmp_path, monkeypatch):
    import kvlab.quality.run as quality

    real = quality.run_item

    def flaky(loaded, policy, *args, **kw):
        if policy.name == "streamingllm":
            raise RuntimeError("simulated")
        return real(loaded, policy, *args, **kw)

    monkeypatch.setattr(quality, "run_item", flaky)
    p = tiny_params(ctx=[32], prompts=1, quality=QUALITY)
    s = run_sweep(p, tmp_path, progress=False, loader=toy_loader, log=lambda m: None)
    assert s.status == "failed_runs" and s.quality_failed == 1 and "quality pass" in s.line()
    manifest = read_manifest(tmp_path)
    assert manifest["status"] == "failed_runs" and manifest["quality_done"]["tiny-llama"]["failed"] == 2
    monkeypatch.undo()
    s = run_sweep(p, tmp_path, progress=False, loader=toy_loader, log=lambda m: None)
    assert s.complete and read_manifest(tmp_path)["quality_done"] == {"tiny-llama": True}
    ids = quality_ids(tmp_path)
    assert len(ids) == 8 + 2  # only the two failed items were run again
    q = load_records(tmp_path, kind="quality")
    assert len(q) == 8 and set(q.status) == {"ok"} and set(q.card) == {"cpu"}


KILL_QUALITY_SCRIPT = """
import json, sys, time
import kvlab.quality.run as quality
from kvlab.sweep.params import parse_params
from kvlab.sweep.driver import run_sweep
from test_sweep import toy_loader

real_emit = quality.emit

def slow_emit(writer, record):  # gives the test time to kill the pass between two records
    real_emit(writer, record)
    time.sleep(0.5)

quality.emit = slow_emit
run_sweep(parse_params(json.loads(sys.argv[1])), sys.argv[2], progress=False, loader=toy_loader)
"""


def test_kill_9_during_the_quality_pass_then_rerun_has_no_duplicate_and_no_lost_record(tmp_path):
    params = {**TINY, "ctx": [32], "prompts": 1, "quality": QUALITY, "name": "killq"}
    out = tmp_path / "out"
    script = tmp_path / "run.py"
    script.write_text(KILL_QUALITY_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), json.dumps(params), str(out)], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=this_checkout())
    deadline = time.monotonic() + 120
    while len(quality_ids(out)) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    before = quality_ids(out)
    assert 2 <= len(before) < 8, "the quality pass finished before it could be killed midway"
    assert "quality_done" not in (read_manifest(out) or {}) or not read_manifest(out)["quality_done"]

    s = run_sweep(parse_params(params), out, progress=False, loader=toy_loader, log=lambda m: None)
    assert s.complete and read_manifest(out)["status"] == "complete"
    ids = quality_ids(out)
    assert ids[:len(before)] == before and len(ids) == len(set(ids)) == 8


def test_quality_keys_are_validated_before_any_model_loads():
    with pytest.raises(ParamsError, match="quality.lenghts"):
        check_params(tiny_params(quality={"lenghts": [100]}))
