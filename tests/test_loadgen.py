"""The load generator's own parts: the counter's interpolation, a workload as replay rows, the
records' keys (those of in-process serving, so kvlab.serve.metrics reads both), the steady-state
cost, Prometheus parsing."""

from __future__ import annotations

import pytest

from kvlab.errors import UserError
from kvlab.loadgen.external import prometheus_values
from kvlab.loadgen.meter import CounterReader, CounterTrace
from kvlab.loadgen.run import load_metrics
from kvlab.loadgen.trace import fixed_items, items_from_workload
from kvlab.serve.traffic import parse_traffic
from kvlab.serve.workload import build_workload


def rec(arrival, times, status="ok"):
    return {"status": status, "arrival_s": arrival, "token_times": times, "input_tokens": 4,
            "output_tokens": len(times), "finish_s": times[-1] if times else arrival}


def test_counter_trace_interpolates_between_readings():
    trace = CounterTrace(CounterReader(lambda: 0.0, "J", "test"))
    trace.ts, trace.values = [0.0, 1.0, 2.0], [10.0, 20.0, 40.0]
    assert trace.at(0.5) == 15.0 and trace.at(1.5) == 30.0 and trace.at(2.0) == 40.0
    assert trace.at(-1) is None and trace.at(3) is None and trace.delta(0.5, 1.5) == 15.0


def test_metrics_over_http_records_count_refusals_and_cost_the_steady_state():
    records = [rec(i * 1.0, [i + 0.5, i + 1.0, i + 1.5]) for i in range(10)]
    records += [rec(3.0, [], status="refused"), rec(4.0, [], status="failed")]
    counter = CounterTrace(CounterReader(lambda: 0.0, "cpu_s", "cpu-time test"))
    counter.ts = [100.0 + t for t in range(13)]
    counter.values = [2.0 * t for t in range(13)]  # 2 CPU seconds per second
    m = load_metrics(records, 11.0, counter, t0=100.0)
    assert (m["requests"], m["completed"], m["refused"], m["failed"]) == (12, 10, 1, 1)
    assert m["ttft_p50_s"] == pytest.approx(0.5) and m["tpot_p50_s"] == pytest.approx(0.5)
    assert m["peak_concurrency"] == 2  # each request lives 1.5 s, one arrives per second
    start, end = m["steady_window_s"]
    assert (start, end) == (1.5, 7.5)  # ML.ENERGY: the B-th first token to the (N-B)-th, B = 2
    tokens = sum(start < t <= end for r in records for t in r["token_times"])
    assert m["energy_per_output_token"] == pytest.approx(2.0 * (end - start) / tokens)
    assert m["energy_per_request"] == pytest.approx(m["energy_per_output_token"] * 3)
    assert m["energy_unit"] == "cpu_s"


def test_workload_rows_keep_the_traffic_arrivals_and_lengths():
    spec = parse_traffic({"arrival": "poisson", "rate": 5.0, "requests": 20, "seed": 3,
                          "lengths": {"kind": "fixed", "input": 16, "output": 4}})
    workload = build_workload(spec, 5.0, None, 1000)
    items = items_from_workload(workload)
    assert [i.arrival_s for i in items] == [w.arrival_s for w in workload.items]
    assert all(len(i.prompt) == 16 and i.max_tokens == 4 for i in items)
    assert items == fixed_items(20, 5.0, 16, 4, seed=3, vocab_size=1000)
    assert all(i.arrival_s == 0.0 for i in fixed_items(5, None, 4, 2))
    closed = parse_traffic({"arrival": "closed", "users": 2, "requests": 4,
                            "lengths": {"kind": "fixed", "input": 4, "output": 2}})
    with pytest.raises(UserError, match="closed loop"):
        items_from_workload(build_workload(closed, None, None, 1000))


def test_prometheus_text_sums_label_sets():
    text = ('# HELP x\nvllm:prompt_tokens_total{model_name="smol"} 96.0\n'
            'vllm:request_success_total{finished_reason="length",model_name="smol"} 3\n'
            'vllm:request_success_total{finished_reason="stop",model_name="smol"} 2\nkvlab_up 1\n')
    v = prometheus_values(text)
    assert v["vllm:prompt_tokens_total"] == 96.0 and v["vllm:request_success_total"] == 5 and v["kvlab_up"] == 1


def test_several_tokens_in_a_chunk_count_by_usage():
    two = rec(0.0, [1.0, 2.0, 3.0])
    two["output_tokens"] = 6  # the server's usage: two tokens per chunk
    m = load_metrics([two, rec(0.0, [1.0, 2.0, 3.0])], 4.0, None, t0=0.0)
    assert m["chunks"] == 6 and m["output_tokens"] == 9 and m["output_throughput"] == 9 / 4.0
    assert m["tpot_mean_s"] == pytest.approx((2.0 / 5 + 2.0 / 2) / 2)


def test_the_run_files_name_the_counters_card(tmp_path):
    """A server's CPU time: card ``cpu``; no counter (a remote server's hardware unseen): every card
    field null; both in run.json and in every request line."""
    import json
    import os

    from kvlab.card import CARD_FIELDS
    from kvlab.loadgen.meter import cpu_time_reader
    from kvlab.serve.run import RunLog

    assert cpu_time_reader(os.getpid()).card["card"] == "cpu"
    for card, want in ((cpu_time_reader(os.getpid()).card, "cpu"), (None, None)):
        folder = tmp_path / str(want)
        log = RunLog(folder, {"target": "http://x"}, card=card)
        log.request(rec(0.0, [0.5]))
        log.write_status("complete", {})
        run = json.loads((folder / "run.json").read_text())
        line = json.loads((folder / "requests.jsonl").read_text())
        assert run["card"] == line["card"] == want and set(CARD_FIELDS) <= set(run) & set(line)
        assert all(run[k] is None for k in CARD_FIELDS if k != "card")
