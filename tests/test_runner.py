"""Executors (kvlab.runner): the same sweep through local, process and ray gives the same runs; a
worker that dies costs its run in flight, recorded with the cause; energy binds the given GPU."""

import dataclasses
import functools
import signal
import sys
import warnings
from pathlib import Path

import pytest
from fake_nvml import FakeNvml
from sweep_workers import crashing_loader

from kvlab.cli import main
from kvlab.energy import NvmlSampler, make_sampler, visible_device_uuid
from kvlab.records import read_jsonl, read_manifest
from kvlab.runner import make_executor
from kvlab.runner.drive import InFlightGroup, charged_runs, shape_groups
from kvlab.runner.process import exit_cause
from kvlab.sweep.checks import check_params
from kvlab.sweep.driver import run_sweep
from kvlab.sweep.params import ParamsError, parse_params
from kvlab.sweep.plan import FAILED_ENERGY_SOURCE, MAX_ERROR_CHARS, failure_record, planned_runs

REPO = Path(__file__).resolve().parent.parent

SMALL = {
    "name": "small", "models": "tiny-llama", "weights": "synthetic", "device": "cpu", "methods": ["full", "streamingllm"],
    "keep": 0.5, "ctx": [32, 64], "batch": 1, "new_tokens": 3, "prompts": 2, "threads": 1,
}


def small(**kw):
    return parse_params({**SMALL, **kw})


def quiet(message):
    pass


def records(folder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return read_jsonl(Path(folder) / "records.jsonl")


def same_folder_contents(a, b):
    """Run ids (each once), record keys and the manifest's plan agree between two sweep folders."""
    ra, rb = records(a), records(b)
    ok_ids = [r["run_id"] for r in rb if r["status"] == "ok"]  # a retried failure has an earlier record
    assert sorted(r["run_id"] for r in ra) == sorted(ok_ids)
    assert {k for r in ra for k in r} == {k for r in rb for k in r}  # one record schema
    ma, mb = read_manifest(a), read_manifest(b)
    for key in ("run_ids", "n_runs", "status", "sweep"):
        assert ma[key] == mb[key], key
    how = ("retry_failed", "max_runs")  # how a folder was filled in, not what it holds
    assert {k: v for k, v in ma["params"].items() if k not in how} == {
        k: v for k, v in mb["params"].items() if k not in how}


# --- pure parts --------------------------------------------------------------------------------


def test_cuda_visible_devices_resolves_to_the_given_gpu_never_gpu_0(monkeypatch):
    fake = FakeNvml()  # GPU-aaaa-0000 at NVML index 0, GPU-bbbb-1111 at 1
    assert visible_device_uuid(fake, "cuda", {"CUDA_VISIBLE_DEVICES": "1"}) == "GPU-bbbb-1111"
    assert visible_device_uuid(fake, "cuda:0", {"CUDA_VISIBLE_DEVICES": "GPU-bbbb-1111"}) == "GPU-bbbb-1111"
    assert visible_device_uuid(fake, "cuda", {"CUDA_VISIBLE_DEVICES": "GPU-bbbb"}) == "GPU-bbbb-1111"  # a prefix
    assert visible_device_uuid(fake, "cuda:1", {"CUDA_VISIBLE_DEVICES": "1,0"}) == "GPU-aaaa-0000"
    assert visible_device_uuid(fake, "cuda:1", {}) == "GPU-bbbb-1111"  # unset: NVML index N
    assert visible_device_uuid(fake, "cuda", {"CUDA_VISIBLE_DEVICES": "GPU-ffff"}) is None
    assert visible_device_uuid(fake, "cuda:2", {"CUDA_VISIBLE_DEVICES": "0,1"}) is None

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # what Ray sets in a worker given the second GPU
    sampler = make_sampler("cuda", nvml=FakeNvml(), sync=lambda: None)
    assert isinstance(sampler, NvmlSampler) and sampler.handle == ("handle", 1)
    assert sampler.gpu["gpu_uuid"] == "GPU-bbbb-1111"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-ffff-9999")
    missing = make_sampler("cuda", nvml=FakeNvml(), sync=lambda: None)
    assert missing.source.startswith("none: device not found") and "GPU-ffff-9999" in missing.source


def test_a_dead_worker_is_charged_for_what_it_was_doing():
    p = small(ctx=[32])
    runs = planned_runs(p)
    assert [len(g) for g in shape_groups(planned_runs(small()))] == [4, 4]
    group = InFlightGroup(runs, recorded={runs[0].run_id})
    group.stage = ("run", runs[1].run_id)
    failed, rest, doing = charged_runs(group)
    assert failed == [runs[1]] and rest == runs[2:] and "measured run" in doing
    group.stage = ("warmup", runs[1].run_id)
    failed, rest, doing = charged_runs(group)
    assert {r.method for r in failed} == {runs[1].method} and runs[1] in failed and "warm-up" in doing
    ids = lambda rs: {r.run_id for r in rs}  # noqa: E731
    assert ids(failed) | ids(rest) == ids(runs[1:]) and not ids(failed) & ids(rest)
    group.stage = ("load", runs[0].run_id)
    assert charged_runs(group)[0] == runs[1:]
    assert "SIGKILL" in exit_cause(-signal.SIGKILL) and "out-of-memory" in exit_cause(-9)
    assert "status 3" in exit_cause(3)


def test_a_failure_record_keeps_the_identity_and_at_most_max_error_chars_of_its_cause():
    run = planned_runs(small(ctx=[32]))[0]
    rec = failure_record(run, "s", "worker died during model load: " + "x" * 5000)
    assert rec["run_id"] == run.run_id and rec["status"] == "failed" and rec["energy_source"] == FAILED_ENERGY_SOURCE
    assert len(rec["error"]) == MAX_ERROR_CHARS and rec["error"].startswith("worker died during model load")
    assert failure_record(run, "s", "short")["error"] == "short"


def test_a_failure_record_names_its_card():
    """CPU: ``cpu`` and null GPU fields; a GPU its worker named: that card; a GPU nobody named:
    every card field null (not known), never the driver's own GPU guessed."""
    from kvlab.card import CARD_FIELDS

    run = planned_runs(small(ctx=[32]))[0]
    rec = failure_record(run, "s", "model load failed")
    assert rec["card"] == "cpu" and all(rec[k] is None for k in CARD_FIELDS if k != "card")
    gpu_run = dataclasses.replace(run, device="cuda:0")
    named = {"card": "NVIDIA H100 80GB HBM3", "gpu_name": "NVIDIA H100 80GB HBM3", "gpu_uuid": "GPU-1",
             "driver": "550.1", "power_limit_w": 700.0, "sm_clock_max_mhz": 1980, "mem_clock_max_mhz": 2619}
    assert {k: failure_record(gpu_run, "s", "died", named)[k] for k in CARD_FIELDS} == named
    assert all(failure_record(gpu_run, "s", "died")[k] is None for k in CARD_FIELDS)
    assert all(failure_record(gpu_run, "s", "died", {"host": "h"})[k] is None for k in CARD_FIELDS)


def test_a_failed_model_load_records_its_runs_with_the_card(tmp_path):
    def broken_loader(name, **kw):
        raise OSError("weights unreadable")

    s = run_sweep(small(ctx=[32]), tmp_path, progress=False, loader=broken_loader, log=quiet)
    recs = records(tmp_path)
    assert s.failed == len(recs) > 0
    assert all(r["status"] == "failed" and "weights unreadable" in r["error"] for r in recs)
    assert all(r["card"] == "cpu" and r["gpu_uuid"] is None and "driver" in r for r in recs)


def test_executor_keys_are_validated_and_the_ray_extra_is_named(monkeypatch, capsys, tmp_path):
    with pytest.raises(ParamsError, match="ray_address: only used with executor: ray"):
        check_params(small(ray_address="auto"))
    with pytest.raises(ParamsError, match="executor"):
        small(executor="slurm")
    monkeypatch.setitem(sys.modules, "ray", None)  # as if the extra were not installed
    with pytest.raises(ParamsError, match=r"pip install 'kvlab\[ray\]'"):
        check_params(small(executor="ray"))
    with pytest.raises(ImportError, match=r"pip install 'kvlab\[ray\]'"):
        make_executor("ray")
    path = tmp_path / "p.yaml"
    path.write_text("\n".join(f"{k}: {v!r}".replace("'", '"') for k, v in SMALL.items()))
    assert main(["sweep", str(path), "--executor", "process", "--dry-run", "-o", str(tmp_path / "o")]) == 0
    assert "8 runs to do" in capsys.readouterr().out
    assert main(["sweep", str(path), "--ray-address", "ray://head:10001", "--dry-run"]) == 2
    assert "only used with executor: ray" in capsys.readouterr().err
    with pytest.raises(ValueError, match="needs a module-level function"):
        run_sweep(small(executor="process"), tmp_path / "p", progress=False, loader=lambda name, **kw: None,
                  log=quiet)
    assert not (tmp_path / "p").exists()  # refused before the folder was touched


# --- the process executor ----------------------------------------------------------------------


@pytest.mark.slow(reason="two spawned worker processes, each importing torch and loading a model")
def test_process_executor_matches_local_and_resumes_a_local_sweep(tmp_path):
    local, mixed = tmp_path / "local", tmp_path / "mixed"
    assert run_sweep(small(), local, progress=False, log=quiet).complete
    first = run_sweep(small(max_runs=3), mixed, progress=False, log=quiet)  # stopped by its budget
    assert first.ok == 3 and not first.complete
    rest = run_sweep(small(executor="process"), mixed, progress=False, log=quiet)
    assert rest.already_done == 3 and rest.ok == 5 and rest.complete
    same_folder_contents(local, mixed)
    invocations = read_manifest(mixed)["invocations"]
    assert [i["executor"] for i in invocations] == ["local", "process"]
    workers = invocations[1]["workers"]
    assert len(workers) == 2 and all(w["executor"] == "process" and w["host"] for w in workers)
    assert len({w["pid"] for w in workers}) == 2  # a fresh child per (ctx, batch) group
    warm = read_jsonl(mixed / "warmup.jsonl")
    assert {(w["method"], w["ctx"]) for w in warm} >= {("full", 64), ("streamingllm", 64)}


def test_a_killed_process_worker_costs_its_run_and_the_sweep_goes_on(tmp_path):
    loader = functools.partial(crashing_loader, method="full", prompt_id=0, signum=signal.SIGKILL)
    logged = []
    s = run_sweep(small(executor="process", ctx=[32]), tmp_path, progress=False, loader=loader,
                  log=logged.append)
    assert (s.ok, s.failed, s.pending) == (3, 1, 0) and s.status == "failed_runs"
    by = {(r["method"], r["prompt_id"]): r for r in records(tmp_path)}
    dead = by[("full", 0)]
    assert dead["status"] == "failed" and "worker died during the measured run full ctx=32" in dead["error"]
    assert "SIGKILL" in dead["error"]
    assert dead["card"] == "cpu"  # the card the dead worker named
    assert all(r["status"] == "ok" for k, r in by.items() if k != ("full", 0))
    assert "SIGKILL" in (tmp_path / "errors.log").read_text() and any("worker died" in m for m in logged)
    assert len(read_manifest(tmp_path)["invocations"][0]["workers"]) == 2  # prompt 1 went to a fresh child
    again = run_sweep(small(ctx=[32], retry_failed=True), tmp_path, progress=False, log=quiet)
    assert (again.ok, again.failed) == (1, 0)  # retried in the driver: failures resume across executors


# --- the ray executor (a local cluster) -------------------------------------------------------




@pytest.mark.slow(reason="starts a local Ray cluster and three sweeps on its workers")
@pytest.mark.xdist_group("ray")  # one local Ray cluster at a time: pytest -n runs these on one worker
def test_ray_executor_matches_local_survives_a_killed_worker_and_resumes(tmp_path, ray_fake_gpus):
    local, mixed = tmp_path / "local", tmp_path / "mixed"
    run_sweep(small(), local, progress=False, log=quiet)
    run_sweep(small(executor="process", max_runs=2), mixed, progress=False, log=quiet)
    loader = functools.partial(crashing_loader, method="streamingllm", prompt_id=1)
    s = run_sweep(small(executor="ray"), mixed, progress=False, loader=loader, log=quiet)
    assert s.status == "failed_runs" and s.failed == 2 and s.ok == 4  # streamingllm prompt 1 died at ctx 32 and 64
    dead = [r for r in records(mixed) if r["status"] == "failed"]
    assert {(r["method"], r["prompt_id"]) for r in dead} == {("streamingllm", 1)}
    assert all("worker died during the measured run" in r["error"] for r in dead)
    again = run_sweep(small(executor="ray", retry_failed=True), mixed, progress=False, log=quiet)
    assert (again.ok, again.failed) == (2, 0)
    same_folder_contents(local, mixed)
    inv = read_manifest(mixed)["invocations"]
    assert [i["executor"] for i in inv] == ["process", "ray", "ray"]
    assert all(w["executor"] == "ray" and w["host"] for w in inv[1]["workers"])


@pytest.mark.slow(reason="runs a sweep on a local Ray cluster's workers (shared with tests/test_multigpu.py)")
@pytest.mark.xdist_group("ray")  # one local Ray cluster at a time: pytest -n runs these on one worker
def test_ray_gives_each_task_a_gpu_and_its_sampler_binds_that_gpu(ray_gpu_sweep):
    s, folder = ray_gpu_sweep
    assert s.complete and s.failed == 0
    uuids = FakeNvml().uuids
    workers = read_manifest(folder)["invocations"][0]["workers"]
    for w in workers:  # Ray's CUDA_VISIBLE_DEVICES (an index) -> that fake GPU's UUID, per worker
        assert w["gpu_uuid"] == uuids[int(w["cuda_visible_devices"])] and w["energy_source"] == "nvml-counter"
    assert {w["gpu_uuid"] for w in workers} == set(uuids)  # the two groups ran on both GPUs at once
    recs = records(folder)
    assert {r["gpu_uuid"] for r in recs} == set(uuids) and all(r["energy_j"] is not None for r in recs)


def test_a_ray_gpu_task_takes_its_share_of_the_cpus():
    """Ray gives a task OMP_NUM_THREADS = num_cpus; a host-bound GPU step needs its CPU share."""
    from types import SimpleNamespace

    from kvlab.runner.ray_cluster import slots_for, task_resources

    gpu = SimpleNamespace(device="cuda", threads=None)
    assert task_resources(gpu, {"CPU": 16.0, "GPU": 1.0}) == {"num_gpus": 1, "num_cpus": 16}
    assert task_resources(gpu, {"CPU": 32.0, "GPU": 4.0}) == {"num_gpus": 1, "num_cpus": 8}
    assert task_resources(SimpleNamespace(device="cuda", threads=4), {"CPU": 32.0, "GPU": 4.0})["num_cpus"] == 4
    assert task_resources(SimpleNamespace(device="cpu", threads=None), {"CPU": 8.0}) == {"num_cpus": 1}
    four = task_resources(gpu, {"CPU": 32.0, "GPU": 4.0})
    assert slots_for(four, {"CPU": 32.0, "GPU": 4.0}) == 4


@pytest.mark.xdist_group("ray")
def test_xdist_groups_reach_the_workers(request):
    """The Ray tests rely on --dist loadgroup to share one worker (one local cluster at a time). pytest
    9.2's structured node ids silently dropped the group (pytest-xdist issue 1386; pyproject pins
    pytest < 9.2): under xdist with loadgroup, a grouped test's id carries its group."""
    if not getattr(request.config.option, "loadgroup", False):  # set on an xdist worker under --dist loadgroup
        pytest.skip("runs under pytest-xdist with --dist loadgroup (the default addopts)")
    assert request.node.nodeid.endswith("@ray"), request.node.nodeid
