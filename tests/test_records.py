"""Records: stable run ids, fsync'd appends that survive torn lines, manifests, DataFrame/Parquet."""

import json
import subprocess
import sys

import pandas as pd
import pytest

from kvlab.records import (
    PERF_COLUMNS,
    RecordsError,
    RecordWriter,
    load_records,
    make_run_id,
    open_text,
    read_json,
    read_jsonl,
    read_manifest,
    recorded_run_ids,
    to_parquet,
    write_manifest,
    write_parquet,
)


def test_run_id_is_stable_and_depends_on_params_and_repeat():
    a = make_run_id({"method": "snapkv", "ctx": 4096, "policy_kwargs": {"keep": 0.5, "window": 32}}, 0)
    b = make_run_id({"policy_kwargs": {"window": 32, "keep": 0.5}, "ctx": 4096, "method": "snapkv"}, 0)
    assert a == b and len(a) == 16
    assert make_run_id({"method": "snapkv", "ctx": 4096, "policy_kwargs": {"keep": 0.5, "window": 32}}, 1) != a
    assert make_run_id({"method": "snapkv", "ctx": 8192, "policy_kwargs": {"keep": 0.5, "window": 32}}, 0) != a
    # the same in a fresh interpreter (no per-process hash seed involved)
    code = ("from kvlab.records import make_run_id;"
            "print(make_run_id({'method': 'snapkv', 'ctx': 4096, 'policy_kwargs': {'keep': 0.5, 'window': 32}}, 0))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == a


def test_writer_fsyncs_every_record(tmp_path, monkeypatch):
    import kvlab.records as records

    synced = []
    real_fsync = records.os.fsync
    monkeypatch.setattr(records.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    with RecordWriter(tmp_path / "records.jsonl") as w:
        w.append({"run_id": "a", "x": 1.5})
        w.append({"run_id": "b", "x": float("nan"), "y": float("inf")})
    assert len(synced) == 2
    rows = read_jsonl(tmp_path / "records.jsonl")
    assert rows == [{"run_id": "a", "x": 1.5}, {"run_id": "b", "x": None, "y": None}]


def test_a_torn_last_line_is_skipped_and_not_glued_to_the_next(tmp_path):
    path = tmp_path / "records.jsonl"
    with RecordWriter(path) as w:
        w.append({"run_id": "a", "status": "ok"})
    with open(path, "a") as f:
        f.write('{"run_id": "b", "stat')  # a crash mid-write
    with RecordWriter(path) as w:
        w.append({"run_id": "c", "status": "ok"})
    with pytest.warns(UserWarning, match="torn"):
        rows = read_jsonl(path)
    assert [r["run_id"] for r in rows] == ["a", "c"]
    with pytest.warns(UserWarning):
        assert recorded_run_ids(tmp_path) == {"a", "c"}


def test_recorded_run_ids_by_status(tmp_path):
    with RecordWriter(tmp_path / "records.jsonl") as w:
        w.append({"run_id": "a", "status": "ok"})
        w.append({"run_id": "b", "status": "failed"})
    assert recorded_run_ids(tmp_path) == {"a", "b"}
    assert recorded_run_ids(tmp_path, statuses={"ok"}) == {"a"}
    assert recorded_run_ids(tmp_path / "nothing-here") == set()


def test_manifest_roundtrip_is_atomic(tmp_path):
    write_manifest(tmp_path, {"sweep": "s", "params": {"ctx": [1, 2]}, "nan": float("nan")})
    assert read_manifest(tmp_path) == {"sweep": "s", "params": {"ctx": [1, 2]}, "nan": None}
    assert not list(tmp_path.glob("*.tmp"))
    assert read_manifest(tmp_path / "missing") is None


def _perf(run_id, status="ok", **kw):
    rec = {"run_id": run_id, "kind": "perf", "status": status, "method": "full", "ctx": 512,
           "policy_params": {"method": "full", "keep": 1.0}, "itl_ms": [1.0, 2.0], "energy_j": None}
    rec.update(kw)
    return rec


def test_load_records_orders_columns_keeps_the_latest_and_reads_nested_folders(tmp_path):
    a, b = tmp_path / "sweep-a", tmp_path / "sweep-b"
    with RecordWriter(a / "records.jsonl") as w:
        w.append(_perf("r1", status="failed", error="OutOfMemoryError: ..."))
        w.append(_perf("r2", extra_column=3))
        w.append(_perf("r1"))  # the retried run succeeded
        w.append({"run_id": "q1", "kind": "quality", "status": "ok", "score": 0.5})
    with RecordWriter(b / "records.jsonl") as w:
        w.append(_perf("r1", method="snapkv"))
    df = load_records(tmp_path)
    assert len(df) == 4
    assert list(df.columns[:3]) == ["run_id", "kind", "status"]
    assert set(df.columns) >= {"folder", "extra_column", "score"}
    in_a = df[(df.folder == str(a)) & (df.run_id == "r1")]
    assert list(in_a.status) == ["ok"]
    assert load_records(a, kind="perf").shape[0] == 2
    assert load_records(a, latest=False).shape[0] == 4
    assert df.loc[df.run_id == "r2", "itl_ms"].iloc[0] == [1.0, 2.0]
    assert isinstance(df.loc[df.run_id == "r2", "policy_params"].iloc[0], dict)


@pytest.mark.parametrize("suffix", [".xz", ".gz"])
def test_readers_open_a_compressed_twin_in_place_of_the_plain_file(tmp_path, suffix):
    """Archived report folders store records, warm-ups and JSON compressed; every reader names the
    plain file and gets the same rows, and a folder of sweeps mixes both forms."""
    import gzip
    import lzma

    opener = {".xz": lzma.open, ".gz": gzip.open}[suffix]
    rows = [{"run_id": "a", "kind": "perf", "status": "ok", "ctx": 256},
            {"run_id": "b", "kind": "perf", "status": "ok", "ctx": 512}]
    packed = tmp_path / "packed"
    packed.mkdir()
    with opener(packed / f"records.jsonl{suffix}", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with opener(packed / f"bench.json{suffix}", "wt") as f:
        json.dump({"copy_GBps": 3.2}, f)
    with RecordWriter(tmp_path / "plain" / "records.jsonl") as w:
        w.append({"run_id": "c", "kind": "perf", "status": "ok", "ctx": 1024})

    assert read_jsonl(packed / "records.jsonl") == rows
    assert read_json(packed / "bench.json") == {"copy_GBps": 3.2}
    assert read_jsonl(packed / f"records.jsonl{suffix}") == rows  # named by its own name too
    df = load_records(tmp_path)
    assert sorted(df["run_id"]) == ["a", "b", "c"]
    assert sorted(load_records(packed / f"records.jsonl{suffix}")["ctx"]) == [256, 512]
    assert recorded_run_ids(packed) == {"a", "b"}
    with pytest.raises(FileNotFoundError, match=r"absent\.json"):
        open_text(tmp_path / "absent.json")
    with pytest.raises(RecordsError, match="decompress it first"):  # a resume must not hide the archive
        RecordWriter(packed / "records.jsonl")


def test_load_records_of_an_empty_folder_has_the_documented_columns(tmp_path):
    df = load_records(tmp_path)
    assert df.empty and list(df.columns) == list(PERF_COLUMNS)
    with pytest.raises(FileNotFoundError, match="sweep folder"):
        load_records(tmp_path / "missing")


def test_parquet_export_keeps_lists_and_serializes_dicts(tmp_path):
    with RecordWriter(tmp_path / "records.jsonl") as w:
        w.append(_perf("r1"))
        w.append(_perf("r2", method="snapkv", policy_params={"method": "snapkv", "keep": 0.25, "window": 64}))
    path = write_parquet(tmp_path)
    back = pd.read_parquet(path)
    assert list(back.run_id) == ["r1", "r2"]
    assert list(back.itl_ms.iloc[0]) == [1.0, 2.0]
    assert json.loads(back.policy_params.iloc[1]) == {"keep": 0.25, "method": "snapkv", "window": 64}
    # the source frame is left untouched
    df = load_records(tmp_path)
    to_parquet(df, tmp_path / "copy.parquet")
    assert isinstance(df.policy_params.iloc[0], dict)


def test_provenance_snapshot_and_gpu_state_from_a_fake_nvml():
    from fake_nvml import FakeNvml

    from kvlab.env import gpu_state, snapshot

    snap = snapshot("cpu")
    assert snap["packages"]["torch"] and snap["python"] and snap["gpu"] == {}
    assert "git_sha" in snap and "taken_at" in snap
    fake = FakeNvml(uuids=["GPU-zzzz", "GPU-aaaa-0000"])
    gpu = gpu_state("cuda:0", nvml=fake, uuid="aaaa-0000")
    assert gpu["gpu_name"] == "Fake H200" and gpu["gpu_uuid"] == "GPU-aaaa-0000"
    assert gpu["power_limit_w"] == 700.0 and gpu["temperature_c"] == 41
    assert gpu["driver"] == "580.95.05" and gpu["sm_clock_max_mhz"] == 1980
    assert gpu["pstate"] is None  # not in the fake: unreadable facts are None, never an error
    assert fake.inits == 0
    assert "nvml_error" in gpu_state("cuda:0", nvml=FakeNvml(init_error="no driver"), uuid="x")


def test_the_card_fields_from_a_fake_nvml_and_on_cpu(monkeypatch):
    from fake_nvml import FakeNvml

    import kvlab.energy.device as dev
    from kvlab.card import CARD_FIELDS, device_card
    from kvlab.energy import make_sampler

    assert device_card("cpu") == {"card": "cpu", **dict.fromkeys(CARD_FIELDS[1:])}
    sampler = make_sampler("cuda:0", nvml=FakeNvml(), uuid="GPU-bbbb-1111", sync=lambda: None)
    card = device_card("cuda:0", gpu=sampler.gpu)
    assert card == {"card": "Fake H200", "gpu_name": "Fake H200", "gpu_uuid": "GPU-bbbb-1111",
                    "driver": "580.95.05", "power_limit_w": 700.0, "sm_clock_max_mhz": 1980,
                    "mem_clock_max_mhz": 3201}
    sampler.close()
    fake = FakeNvml(uuids=["GPU-zzzz", "GPU-yyyy"])  # read through NVML itself, found by torch's UUID
    monkeypatch.setattr(dev, "torch_uuid_or_none", lambda device: "yyyy")
    assert device_card("cuda:0", nvml=fake)["gpu_uuid"] == "GPU-yyyy" and fake.inits == 0
