"""Cards in reports: records without a uuid get theirs from the manifest; no ratio crosses cards."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from kvlab import report
from kvlab.reporting.cards import cards_note, manifest_uuid, with_cards
from kvlab.reporting.study import load_study

REPORTS = Path(__file__).resolve().parents[1] / "reports"

MANIFEST = {"invocations": [
    {"started_at": "2026-12-02T14:00:00+00:00", "finished_at": "2026-12-02T15:00:00+00:00",
     "env_start": {"gpu": {"gpu_name": "NVIDIA H200", "gpu_uuid": "GPU-aaaa1111-0000"}}},
    {"started_at": "2026-12-02T16:00:00+00:00", "finished_at": "2026-12-02T17:00:00+00:00",
     "env_start": {"gpu": {"gpu_name": "NVIDIA H200", "gpu_uuid": "GPU-bbbb2222-0000"}}},
]}


def run(method, j, at, batch=16, uuid=None):
    return {"kind": "perf", "status": "ok", "model": "m", "engine": "hf", "ctx": 16384, "batch": batch,
            "method": method, "label": "quanto int4" if method == "quanto" else "full", "j_per_token": j,
            "created_at": at, "device": "cuda", "gpu_name": "NVIDIA H200", "gpu_uuid": uuid}


def test_old_records_take_their_card_from_the_invocation_that_ran_them():
    assert manifest_uuid(MANIFEST, "2026-12-02T16:30:00+00:00") == ("GPU-bbbb2222-0000", "NVIDIA H200")
    assert manifest_uuid(MANIFEST, "2026-12-02T15:30:00+00:00") == (None, None)
    df = with_cards(pd.DataFrame([run("full", 1.0, "2026-12-02T14:10:00+00:00"),
                                  run("quanto", 1.3, "2026-12-02T16:10:00+00:00"),
                                  run("full", 1.0, "2026-12-02T16:20:00+00:00", uuid="GPU-cccc3333-0000")]),
                    manifest=MANIFEST)
    assert df["card"].tolist() == ["NVIDIA H200 aaaa1111", "NVIDIA H200 bbbb2222", "NVIDIA H200 cccc3333"]
    assert df["card_from"].tolist() == ["manifest", "manifest", "record"]
    cpu = with_cards(pd.DataFrame([{**run("full", 1.0, None), "device": "cpu", "gpu_name": None}]))
    assert cpu["card"].tolist() == ["cpu"]


def test_a_ratio_never_crosses_cards_and_the_report_says_which_it_left_out():
    rows = [run("full", 1.0, f"2026-12-02T14:1{i}:00+00:00") for i in range(3)]  # full on card a only
    rows += [run("quanto", 1.3, f"2026-12-02T16:1{i}:00+00:00") for i in range(3)]  # quanto on card b only
    rows += [run("full", 2.0, f"2026-12-02T14:2{i}:00+00:00", batch=1) for i in range(3)]
    rows += [run("quanto", 2.4, f"2026-12-02T14:3{i}:00+00:00", batch=1) for i in range(3)]  # both on a
    df = with_cards(pd.DataFrame(rows), manifest=MANIFEST)
    rel = report.relative_to_baseline(df)
    assert rel[["label", "batch"]].values.tolist() == [["quanto int4", 1]]  # batch 16 would cross cards
    assert rel["ratio"].iloc[0] == pytest.approx(1.2) and rel["card"].iloc[0] == "NVIDIA H200 aaaa1111"
    pays = report.compression_pays(df)
    assert pays.set_index("batch").loc[16, "verdict"] == "no full run in this cell"
    note = cards_note(df)
    assert note.startswith("2 cards measured these runs (NVIDIA H200 aaaa1111: 9, NVIDIA H200 bbbb2222: 3)")
    assert "quanto int4 (engine hf, ctx 16384, batch 16) on NVIDIA H200 bbbb2222, full on NVIDIA H200 aaaa1111" in note
    assert cards_note(df[df["batch"] == 1]) is None  # one card: nothing to say


def test_the_committed_two_card_folders_say_so():
    for folder in ("h200-2026-12-02", "h200-2026-12-03b"):
        perf = load_study(REPORTS / folder).perf
        assert perf["card"].nunique() == 2 and perf["card"].str.startswith("NVIDIA H200 ").all()
        assert cards_note(perf).startswith("2 cards measured these runs")
