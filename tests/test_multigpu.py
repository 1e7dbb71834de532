"""Issue #18's report (kvlab.analysis.multigpu) on a FAKE device folder: the wall-time ratio, the GPU
of every record, per-GPU attribution for both sweeps, and each configuration on the two GPUs; and
the params file the device script runs validates and splits over two GPUs."""

import json
import subprocess
from pathlib import Path

import pytest
from synthetic_gpus import METHODS, UUIDS, fake_sweep, write_sweep_folder

from kvlab.analysis.multigpu import main, report
from kvlab.runner.drive import shape_groups
from kvlab.sweep.checks import check_params
from kvlab.sweep.params import load_params
from kvlab.sweep.plan import expand

REPO = Path(__file__).resolve().parent.parent
CTXS = [16384, 12288, 8192, 4096]


def device_folder(tmp_path, slower_gpu1: float = 1.0) -> dict[str, float]:
    """What ray_multigpu.sh leaves: both sweeps, their walls and counters. Returns the walls."""
    two, start2, end2 = fake_sweep({UUIDS[0]: CTXS[0::2], UUIDS[1]: CTXS[1::2]},
                                   gpu_scale={UUIDS[1]: slower_gpu1})
    one, start1, end1 = fake_sweep({UUIDS[0]: CTXS, UUIDS[1]: []})
    write_sweep_folder(tmp_path / "gpu2", two)
    write_sweep_folder(tmp_path / "gpu1", one)
    counters = tmp_path / "counters"
    counters.mkdir()
    idle = {"read_at_unix": 0.0, "gpus": [{"index": i, "uuid": u, "energy_j": 0.0, "idle_w": 100.0}
                                          for i, u in enumerate(UUIDS)]}
    for name, data in {"idle": idle, "gpu2-start": start2, "gpu2-end": end2, "gpu1-start": start1,
                       "gpu1-end": end1}.items():
        (counters / f"{name}.json").write_text(json.dumps(data))
    walls = {"gpu2": end2["read_at_unix"] - start2["read_at_unix"], "gpu1": end1["read_at_unix"] - start1["read_at_unix"]}
    with open(tmp_path / "walls.jsonl", "w") as f:
        for sweep, start in (("gpu2", start2), ("gpu1", start1)):
            f.write(json.dumps({"sweep": sweep, "gpus": int(sweep[-1]), "start": start["read_at_unix"],
                                "end": start["read_at_unix"] + walls[sweep], "rc": 0, "cluster_start_s": 8.0}) + "\n")
    return walls


def test_the_report_sets_every_verdict_of_issue_18(tmp_path):
    walls = device_folder(tmp_path)
    text = report(tmp_path)
    ratio = walls["gpu2"] / walls["gpu1"]
    assert f"ratio {ratio:.3f} (target <= 0.55: {'met' if ratio <= 0.55 else 'NOT met'})" in text
    assert f"with it the ratio is {(walls['gpu2'] + 8) / (walls['gpu1'] + 8):.3f}" in text
    assert text.count("every one names its GPU") == 2
    assert text.count("2/2 GPUs agree within 2%") == 2  # the 1-GPU sweep's idle GPU too (idle.json)
    configs = len(METHODS) * len(CTXS) // 2  # the methods x the ctx groups each GPU ran
    assert "the two GPUs side by side, their agreement" in text and "the control, the same GPU" in text
    assert text.count(f"{configs}/{configs} configurations agree") == 2
    assert f"worker host fake, pid 101, gpu_uuid {UUIDS[1]}" in text


def test_a_slower_gpu_shows_in_the_side_by_side_table_not_in_the_control(tmp_path):
    device_folder(tmp_path, slower_gpu1=1.2)
    text = report(tmp_path)
    side_by_side = text.split("their agreement")[1]
    control = text.split("the control, the same GPU")[1].split("configurations the 2-GPU sweep ran on")[0]
    configs = len(METHODS) * len(CTXS) // 2
    assert f"0/{configs} configurations agree" in side_by_side and "1.2 [" in side_by_side
    assert f"{configs}/{configs} configurations agree" in control


def test_main_names_a_missing_sweep(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "no records in" in capsys.readouterr().err


def test_the_h200x2_params_validate_and_split_over_two_gpus():
    params = load_params(REPO / "params" / "h200x2-ray.yaml")
    runs = expand(params, check_params(params, check_device=False))
    groups = shape_groups(runs)
    assert len(groups) >= 4 and len(groups) % 2 == 0  # at least two groups per GPU
    sizes = {len(g) for g in groups}
    assert len(sizes) == 1 and sizes.pop() >= 2 * 2  # every group the same runs, at least 2 methods x 2 repeats
    ctxs = [g[0].ctx for g in groups]
    assert ctxs == sorted(ctxs, reverse=True)  # longest first: Ray's queue is LPT, the GPUs end together
    assert params.device == "cuda" and params.idle_s > 0  # records carry the idle baseline attribution uses
    assert all(e == "hf" for e in params.engine)


def test_the_device_script_parses():
    done = subprocess.run(["bash", "-n", str(REPO / "scripts" / "device" / "ray_multigpu.sh")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr




@pytest.mark.slow(reason="runs a sweep on a local Ray cluster's workers (shared with tests/test_runner.py)")
@pytest.mark.xdist_group("ray")  # one local Ray cluster at a time: pytest -n runs these on one worker
def test_ray_places_every_window_on_its_gpu(ray_gpu_sweep):
    from kvlab.analysis.attribution import (
        CounterReading,
        binding_problems,
        sweep_records,
        windows_from_records,
    )

    s, folder = ray_gpu_sweep
    assert s.complete
    records = sweep_records(folder)
    windows, nameless = windows_from_records(records)
    assert nameless == 0 and len(windows) == len(records)  # runs and warm-ups alike
    assert all(w.start_unix is not None and w.counter_start_j is not None for w in windows)
    by_gpu = {}
    for w in windows:
        by_gpu.setdefault(w.gpu_uuid, []).append(w)
    assert len(by_gpu) == 2
    wide = CounterReading("any", energy_j=0.0, at_unix=0.0), CounterReading("any", energy_j=1e12, at_unix=1e12)
    for ws in by_gpu.values():
        ws.sort(key=lambda w: w.start_unix)
        assert binding_problems(ws, *wide) == []  # no two windows overlap on one GPU
