"""kvlab.analysis.executors (issue #17's local-vs-ray table) on FAKE records: wall-time overhead split at
the first and last record, per-configuration CIs and ratios, and the agreement verdict."""

import json
from datetime import UTC, datetime

import pytest
from synthetic_records import fake_perf_records

from kvlab.analysis.executors import compare, main, wall_summary

T0 = datetime(2026, 12, 3, 6, 0, 0, tzinfo=UTC).timestamp()


def write_sweep(folder, records, executor, first_s, step_s, scale=1.0):
    """A sweep folder whose records are stamped first_s, first_s + step_s, ... after T0."""
    folder.mkdir(parents=True)
    with open(folder / "records.jsonl", "w") as f:
        for i, r in enumerate(records):
            stamp = datetime.fromtimestamp(T0 + first_s + i * step_s, UTC).isoformat(timespec="seconds")
            r = dict(r, created_at=stamp, itl_mean_ms=r["itl_mean_ms"] * scale)
            f.write(json.dumps(r) + "\n")
    manifest = {"sweep": "fake", "status": "complete", "invocations": [
        {"executor": executor, "started_at": "2026-12-03T06:00:00+00:00", "finished_at": "2026-12-03T06:02:00+00:00",
         "workers": [{"host": "h", "pid": 1, "gpu_uuid": "GPU-fake", "cuda_visible_devices": "0",
                      "energy_source": "nvml-counter"}]}]}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def fake_pair(tmp_path, ray_scale=1.0):
    recs = [r for r in fake_perf_records(ctxs=(8192,), repeats=4) if r["status"] == "ok"]
    write_sweep(tmp_path / "local", recs, "local", first_s=30, step_s=6)
    write_sweep(tmp_path / "ray", recs, "ray", first_s=45, step_s=6, scale=ray_scale)
    n = len(recs)
    walls = [{"executor": "local", "start": T0, "end": T0 + 30 + 6 * (n - 1) + 3, "rc": 0},
             {"executor": "ray", "start": T0, "end": T0 + 45 + 6 * (n - 1) + 5, "rc": 0}]
    (tmp_path / "walls.jsonl").write_text("".join(json.dumps(w) + "\n" for w in walls))
    return n


def test_the_overhead_splits_into_startup_and_per_run_costs(tmp_path):
    n = fake_pair(tmp_path)
    import pandas as pd

    frames = {ex: pd.read_json(tmp_path / ex / "records.jsonl", lines=True, dtype=False) for ex in ("local", "ray")}
    w = wall_summary({r["executor"]: r for r in map(json.loads, (tmp_path / "walls.jsonl").read_text().splitlines())},
                     frames, "local", "ray")
    local_wall = 30 + 6 * (n - 1) + 3
    assert w["local"]["wall_s"] == pytest.approx(local_wall)
    assert w["overhead_s"] == pytest.approx(17)  # 15 s more before the first record, 2 s more after the last
    assert w["overhead"] == pytest.approx(17 / local_wall)
    assert w["startup_overhead_s"] == pytest.approx(15)
    assert w["per_run_overhead_s"] == pytest.approx(0)


def test_same_measurements_agree_and_a_slower_executor_does_not(tmp_path):
    fake_pair(tmp_path / "same")
    text = compare(tmp_path / "same")
    assert "ray overhead: +17.0 s" in text and "over the 5% target" in text
    assert "+15 s: starting ray" in text
    assert "worker host h, pid 1, gpu_uuid GPU-fake" in text
    assert "ms/step" in text and "J/token" in text and "TTFT s" in text
    methods = {"full", "quanto", "streamingllm"}
    assert f"{len(methods)}/{len(methods)} configurations agree" in text

    fake_pair(tmp_path / "slow", ray_scale=1.5)  # ms/step 1.5x on ray: every ratio CI excludes 1
    text = compare(tmp_path / "slow")
    assert f"0/{len(methods)} configurations agree" in text
    assert "1.5 [" in text


def test_main_says_which_folder_is_missing(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "no records in" in capsys.readouterr().err
    fake_pair(tmp_path)
    assert main([str(tmp_path), "--target", "0.5"]) == 0
    assert "within the 50% target" in capsys.readouterr().out


def test_missing_wall_times_are_said_not_guessed(tmp_path):
    fake_pair(tmp_path)
    (tmp_path / "walls.jsonl").unlink()
    text = compare(tmp_path)
    assert "overhead: unknown (walls.jsonl lacks a wall time)" in text and "configurations agree" in text


def test_a_cluster_started_before_the_sweep_is_timed_apart(tmp_path):
    n = fake_pair(tmp_path)
    with open(tmp_path / "walls.jsonl", "a") as f:
        f.write(json.dumps({"executor": "ray-cluster", "start": T0 - 10, "end": T0 - 4, "rc": 0}) + "\n")
    local_wall = 30 + 6 * (n - 1) + 3
    text = compare(tmp_path)
    assert "ray overhead: +17.0 s" in text  # the sweep through the running cluster
    share = 100 * (17 + 6) / local_wall
    assert f"ray's cluster was started before the sweep joined it: 6.0 s; counting that start, ray's overhead is +23.0 s = +{share:.1f}%" in text


def test_the_comparison_runs_without_plotly(tmp_path):
    """The GPU box that runs ray_compare.sh has no notebook stack: the comparison (and the report
    tables it uses) must not import plotly. A subprocess where `import plotly` fails shows it."""
    import subprocess
    import sys

    fake_pair(tmp_path)
    code = ("import sys; sys.modules['plotly'] = None; from kvlab.analysis.executors import main; "
            f"raise SystemExit(main([{str(tmp_path)!r}]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "ray overhead" in done.stdout
