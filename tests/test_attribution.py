"""Per-GPU energy attribution (issue #18) on a FAKE two-GPU sweep with exact counters: windows plus
idle gaps add up; a counter 5% off, records on an unread GPU, a window read from the other GPU's
counter and overlapping windows are each caught; counters.py reads every GPU by UUID."""

import importlib.util
import json
import time
from pathlib import Path

import pytest
from fake_nvml import FakeNvml
from synthetic_gpus import UUIDS, fake_sweep, write_sweep_folder

from kvlab.analysis.attribution import (
    GAP_KINDS,
    attribute,
    counters_from_json,
    main,
    read_counters,
    render,
)
from kvlab.energy import NullSampler, NvmlSampler, norm_uuid

REPO = Path(__file__).resolve().parent.parent
IDLE_W = 100.0


def counters_script():
    spec = importlib.util.spec_from_file_location("counters_script", REPO / "scripts" / "device" / "counters.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def two_gpus(**kw):
    gpus, start, end = fake_sweep({UUIDS[0]: [16384, 4096], UUIDS[1]: [12288, 8192]}, idle_w=IDLE_W, **kw)
    records = [r for g in gpus for r in g.records + g.warmups]
    return gpus, counters_from_json(start), counters_from_json(end), records


def test_windows_plus_idle_gaps_make_each_gpus_counter_total():
    gpus, start, end, records = two_gpus()
    att = attribute(start, end, records)
    assert att.agree and [g.uuid for g in att.gpus] == list(UUIDS)
    for g, fake in zip(att.gpus, gpus, strict=True):
        assert g.counter_j == pytest.approx(fake.counter_j - fake.base_j)
        assert g.n_windows == len(fake.records) + len(fake.warmups)
        assert g.windows_j == pytest.approx(sum(r["energy_j"] for r in fake.records + fake.warmups))
        assert g.idle_w == IDLE_W and "model resident" in g.idle_source
        assert g.residual_j == pytest.approx(0.0, abs=1e-6 * g.counter_j)  # float sums only
        kinds = {gap.kind for gap in g.gaps}
        assert kinds == set(GAP_KINDS)  # two groups: a gap between them, and gaps inside each
        assert sum(gap.seconds for gap in g.gaps) == pytest.approx(g.gap_s)
        assert all(gap.energy_j == pytest.approx(IDLE_W * gap.seconds) for gap in g.gaps)
    text = render(att)
    assert "2/2 GPUs agree within 2%" in text and "NOT confirmed" not in text
    assert "between groups" in text and f"{IDLE_W:.0f} W" in text


def test_a_counter_5_percent_off_is_caught_and_said():
    gpus, start, end, records = two_gpus()
    true_j = end[norm_uuid(UUIDS[1])].energy_j - start[norm_uuid(UUIDS[1])].energy_j
    raw = {"read_at_unix": next(iter(end.values())).at_unix, "gpus": [
        {"index": r.index, "uuid": r.uuid, "energy_j": r.energy_j + (0.05 * true_j if r.uuid == UUIDS[1] else 0.0)}
        for r in end.values()]}
    att = attribute(start, counters_from_json(raw), records)
    good, off = att.gpus
    assert good.agree and not off.agree and not att.agree
    assert off.residual_share == pytest.approx(0.05 / 1.05)
    assert off.problems == []  # every window still lies inside the (larger) counter span
    text = render(att)
    assert "+4.8% of the counter (over 2%)" in text and "1/2 GPUs agree" in text and "NOT confirmed" in text


def test_windows_on_an_unread_gpu_or_on_no_gpu_are_not_attributed():
    gpus, start, end, records = two_gpus()
    stranger = dict(records[0], gpu_uuid="GPU-cccc-2222", run_id="on-an-unread-gpu")
    nameless = dict(records[1], gpu_uuid=None, run_id="names-no-gpu")
    att = attribute(start, end, records + [stranger, nameless])
    assert att.strangers == {"GPU-cccc-2222": 1} and att.unplaced == 1 and not att.agree
    assert all(g.agree for g in att.gpus)  # the stranger did not land on a GPU that was read
    text = render(att)
    assert "GPU GPU-cccc-2222: 1 window(s) but the counters did not read it" in text
    assert "1 window(s) measured energy on a record that names no GPU" in text

    only_start = dict(start)
    del only_start[norm_uuid(UUIDS[1])]
    att = attribute(only_start, end, records)
    assert att.one_end == [UUIDS[1]] and att.strangers == {UUIDS[1]: len(gpus[1].records) + len(gpus[1].warmups)}


def test_a_gpu_no_record_names_is_idle_and_needs_an_idle_reading():
    gpus, start_raw, end_raw = fake_sweep({UUIDS[0]: [8192], UUIDS[1]: []}, idle_w=IDLE_W)
    start, end = counters_from_json(start_raw), counters_from_json(end_raw)
    records = gpus[0].records + gpus[0].warmups
    blind = attribute(start, end, records)
    assert blind.gpus[0].agree and blind.gpus[1].idle_w is None and not blind.gpus[1].agree
    assert "idle power unknown: no verdict" in render(blind)
    idle = counters_from_json({"read_at_unix": 0.0, "gpus": [
        {"index": i, "uuid": u, "energy_j": 0.0, "idle_w": IDLE_W} for i, u in enumerate(UUIDS)]})
    seen = attribute(start, end, records, idle=idle)
    quiet = seen.gpus[1]
    assert seen.agree and quiet.n_windows == 0 and "no process" in quiet.idle_source
    assert [gap.kind for gap in quiet.gaps] == ["no window"] and quiet.gaps[0].seconds == pytest.approx(quiet.span_s)


def test_a_window_read_from_the_other_gpus_counter_and_overlapping_windows_are_problems():
    gpus, start, end, records = two_gpus()
    other = gpus[1]
    misbound = [dict(r, energy_counter_start_j=r["energy_counter_start_j"] + other.base_j - gpus[0].base_j)
                if r["gpu_uuid"] == UUIDS[0] and r is records[0] else r for r in records]
    att = attribute(start, end, misbound)
    assert not att.gpus[0].agree and "bound to another GPU?" in att.gpus[0].problems[0]
    assert att.gpus[1].agree

    first = gpus[0].records[0]
    twin = dict(first, run_id="shared-the-gpu", window_start_unix=first["window_start_unix"] + 0.5,
                energy_counter_start_j=None)
    att = attribute(start, end, records + [twin])
    assert any("overlap on this GPU (runs shared it)" in p for p in att.gpus[0].problems)


def test_records_without_window_placement_still_compare_totals():
    _, start, end, records = two_gpus()
    old = [{k: v for k, v in r.items() if k not in ("window_start_unix", "energy_counter_start_j")} for r in records]
    att = attribute(start, end, old)
    assert att.agree and all(g.gaps == [] for g in att.gpus)
    assert "gaps not split by kind" in render(att)


def test_cli_reads_a_sweep_folder_and_counters_files(tmp_path, capsys):
    gpus, start, end = fake_sweep({UUIDS[0]: [8192], UUIDS[1]: [4096]}, idle_w=IDLE_W)
    write_sweep_folder(tmp_path / "sweep", gpus)
    (tmp_path / "start.json").write_text(json.dumps(start))
    (tmp_path / "end.json").write_text(json.dumps(end))
    args = [str(tmp_path / "sweep"), "--start", str(tmp_path / "start.json"), "--end", str(tmp_path / "end.json")]
    assert main(args) == 0
    assert "2/2 GPUs agree" in capsys.readouterr().out
    assert main(args[:4] + [str(tmp_path / "nowhere.json")]) == 2
    assert "nowhere.json" in capsys.readouterr().err


def test_counters_script_reads_every_gpu_by_uuid_and_its_idle_power(tmp_path):
    counters = counters_script()
    fake = FakeNvml(segments=((0.0, 80.0),))
    snap = counters.snapshot(fake)
    assert [g["uuid"] for g in snap["gpus"]] == fake.uuids and all(g["energy_j"] >= 0 for g in snap["gpus"])
    out = tmp_path / "idle.json"
    assert counters.main(["--idle-s", "0.2", "-o", str(out)], nvml=fake) == 0
    readings = read_counters(out)
    assert set(readings) == {norm_uuid(u) for u in fake.uuids}
    assert all(r.idle_w == pytest.approx(80.0, rel=0.02) for r in readings.values())
    assert fake.inits == 0  # NVML shut down again


def test_energy_windows_say_where_they_sit_on_the_clock_and_the_counter():
    fake = FakeNvml(segments=((0.0, 200.0),), history_s=10.0)
    sampler = NvmlSampler(fake, ("handle", 0), sync=lambda: None)
    before = time.time()
    with sampler.window() as w:
        time.sleep(0.05)
    r = w.result
    assert before <= r.start_unix <= time.time() - r.seconds
    assert r.counter_start_j == pytest.approx(fake.energy_until(r.t0), abs=0.5)  # 2 ms of 200 W, rounded
    with NullSampler("none: test").window() as n:
        pass
    assert n.result.start_unix is not None and n.result.counter_start_j is None
