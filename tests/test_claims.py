"""Claims are data: every number README.md, reports/RESULTS.md and ARCHITECTURE.md state is
recomputed from committed files (reports/claims.yaml, kvlab.reporting.claims) and must match the
text at its printed precision; a measured number with no entry fails too."""

from pathlib import Path

import pytest
import yaml

from kvlab.records import stored_path
from kvlab.reporting import claims as C

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ("README.md", "reports/RESULTS.md", "ARCHITECTURE.md")
SPEC = yaml.safe_load((ROOT / "reports" / "claims.yaml").read_text())
CLAIMS = SPEC["claims"]
EXEMPT = SPEC.get("not_measurements") or []


@pytest.mark.parametrize("claim", CLAIMS, ids=[c["id"] for c in CLAIMS])
def test_a_claim_is_recomputed_from_committed_data_and_printed_as_stated(claim):
    for rel in claim["data"]:
        path = ROOT / rel
        assert path.exists() or stored_path(path) is not None, f"{claim['id']}: {rel} is not committed"
    assert C.recompute(ROOT, claim) == C.flat(claim["printed"]), (
        f"{claim['id']}: the data give {C.recompute(ROOT, claim)!r}, the entry prints {claim['printed']!r}")
    for rel in claim["files"]:
        assert rel in TEXTS, f"{claim['id']}: {rel} is not one of the checked texts"
        assert C.flat(claim["printed"]) in C.flat((ROOT / rel).read_text()), f"{claim['id']}: {rel} does not print it"


@pytest.mark.parametrize("rel", TEXTS)
def test_every_measured_number_in_the_texts_has_a_claim(rel):
    printed = [c["printed"] for c in CLAIMS if rel in c["files"]]
    exempt = [e["text"] for e in EXEMPT if e["file"] == rel]
    missing = C.uncovered_numbers((ROOT / rel).read_text(), printed, exempt)
    assert not missing, f"{rel} states numbers with no entry in reports/claims.yaml: {missing}"


def test_the_checks_catch_a_changed_number_and_an_unlisted_one(tmp_path):
    """The mechanism on a fake claim: a text that rounds differently from the data fails, and a
    measured number outside every entry is reported (code spans, counts and keep ratios are not)."""
    claim = {"id": "t", "printed": "0.50x (n=2 a side)", "format": "{ratio:.2f}x ({runs} a side)",
             "data": ["x.json"], "compute": "json_value", "args": {"path": ["r"]}}
    (tmp_path / "x.json").write_text('{"r": 0.4951}')
    claim["format"] = "{value:.2f}x (n=2 a side)"
    assert C.recompute(tmp_path, claim) == "0.50x (n=2 a side)"
    (tmp_path / "x.json").write_text('{"r": 0.4949}')
    assert C.recompute(tmp_path, claim) != claim["printed"]
    text = ("It uses 0.50x (n=2 a\nside) and +12% more, in `3.5 ms` code, over 3 repeats [0.4, 0.6]; "
            "keep 0.25 reads 0.77 of it.")
    assert C.uncovered_numbers(text, [claim["printed"]]) == ["+12%", "[0.4, 0.6]", "0.77"]


def test_no_interval_is_printed_from_fewer_than_three_runs_a_side():
    fields = C.ratio_fields(*C.interval([1.0, 1.1], [2.0, 2.1]), 2, 2)
    assert fields["lo"] is None and fields["runs"] == "n=2"
    with pytest.raises(TypeError):
        "{lo_pct:+.0f}%".format(**fields)


def test_a_ratio_across_two_cards_is_refused(tmp_path):
    from kvlab.records import RecordWriter

    with RecordWriter(tmp_path / "sweep" / "records.jsonl") as w:
        for i, (label, card) in enumerate([("full", "GPU-a"), ("full", "GPU-a"), ("int4", "GPU-b"), ("int4", "GPU-a")]):
            w.append({"run_id": f"r{i}", "kind": "perf", "status": "ok", "label": label, "gpu_uuid": card,
                      "decode_j_per_token": 1.0 + i})
    with pytest.raises(ValueError, match="cross cards"):
        C.records_ratio(tmp_path, ["sweep"], "decode_j_per_token", {"label": "int4"}, {"label": "full"})
    one_card = C.records_ratio(tmp_path, ["sweep"], "decode_j_per_token", {"label": "int4", "gpu_uuid": "GPU-a"},
                               {"label": "full"})
    assert one_card["ratio"] == pytest.approx(4.0 / 1.5) and one_card["runs"] == "n=1 vs 2"
