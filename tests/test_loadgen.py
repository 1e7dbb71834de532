"""The load generator's pure parts: latencies from raw chunk times (vLLM's definitions), the
steady-state window, the counter's interpolation, cost per token and request, Prometheus parsing."""

from __future__ import annotations

import pytest

from kvlab.loadgen.external import prometheus_values
from kvlab.loadgen.meter import CounterReader, CounterTrace
from kvlab.loadgen.metrics import request_latencies, steady_window, summarize, tokens_in, window_cost
from kvlab.loadgen.trace import from_rows, poisson_trace


def rec(send, times, status="ok", out=None):
    return {"status": status, "send_s": send, "token_times_s": times, "output_tokens": out or len(times),
            "end_s": times[-1] if times else send}


def test_latencies_follow_vllms_definitions():
    lat = request_latencies(rec(1.0, [1.5, 1.6, 1.8, 2.1]))
    assert lat["ttft_s"] == pytest.approx(0.5) and lat["e2e_s"] == pytest.approx(1.1)
    assert lat["tpot_s"] == pytest.approx(0.6 / 3) and lat["itl_s"] == pytest.approx([0.1, 0.2, 0.3])
    assert request_latencies(rec(0.0, [0.4]))["tpot_s"] is None  # one token: no TPOT
    assert request_latencies(rec(0.0, [], status="refused"))["ttft_s"] is None
    # a server that streams two tokens per chunk: TPOT divides by tokens, ITL stays per chunk
    two = request_latencies(rec(0.0, [1.0, 2.0, 3.0], out=6))
    assert two["tpot_s"] == pytest.approx(2.0 / 5) and two["itl_s"] == [1.0, 1.0]


def test_summary_counts_every_request_and_pools_itl():
    records = [rec(0.0, [0.1, 0.2, 0.3]), rec(0.1, [0.5, 0.7]), rec(0.2, [], status="refused"),
               rec(0.3, [], status="failed")]
    s = summarize(records, 2.0)
    assert (s["requests"], s["completed"], s["refused"], s["failed"]) == (4, 2, 1, 1)
    assert s["output_tokens"] == 5 and s["output_throughput"] == 2.5 and s["request_throughput"] == 1.0
    assert s["itl_p50_ms"] == pytest.approx(100.0) and s["ttft_mean_ms"] == pytest.approx(250.0)


def test_steady_window_leaves_out_ramp_up_and_drain():
    records = [rec(float(i), [i + 0.5, i + 1.0, i + 1.5]) for i in range(20)]
    start, end = steady_window(records, trim=0.1)
    assert start == 2.5 and end == 18.5  # the 3rd arrival's first token to the 3rd-from-last's last
    assert steady_window(records[:2]) is None
    assert tokens_in(records, start, end) == sum(start <= t <= end for r in records for t in r["token_times_s"])


def test_counter_trace_interpolates_and_costs_split_by_tokens():
    trace = CounterTrace(CounterReader(lambda: 0.0, "J", "test"))
    trace.ts, trace.values = [0.0, 1.0, 2.0], [10.0, 20.0, 40.0]
    assert trace.at(0.5) == 15.0 and trace.at(1.5) == 30.0 and trace.at(2.0) == 40.0
    assert trace.at(-1) is None and trace.at(3) is None and trace.delta(0.5, 1.5) == 15.0
    records = [rec(0.0, [0.1, 0.2, 0.3, 0.4]), rec(0.0, [0.2, 0.3, 0.9, 1.5])]
    cost = window_cost(records, 12.0, (0.2, 0.3), "J")
    assert cost["window_tokens"] == 4 and cost["j_per_output_token"] == 3.0 and cost["j_per_request"] == 12.0
    assert window_cost(records, 1.0, (0.2, 0.3), "cpu_s")["cpu_s_per_output_token"] == 0.25


def test_traces_are_seeded_and_exact():
    a, b = poisson_trace(50, 5.0, 32, 8, seed=1), poisson_trace(50, 5.0, 32, 8, seed=1)
    assert a == b and a[0].arrival_s == 0.0 and all(len(x.prompt) == 32 and x.max_tokens == 8 for x in a)
    assert sorted(x.arrival_s for x in a) == [x.arrival_s for x in a]
    assert all(x.arrival_s == 0.0 for x in poisson_trace(5, None, 4, 2))
    rows = from_rows([(0.0, 10, 3), (0.5, 20, 4)])
    assert [(r.arrival_s, len(r.prompt), r.max_tokens) for r in rows] == [(0.0, 10, 3), (0.5, 20, 4)]
    with pytest.raises(ValueError):
        poisson_trace(5, -1.0, 4, 2)


def test_prometheus_text_sums_label_sets():
    text = ('# HELP x\nvllm:prompt_tokens_total{model_name="smol"} 96.0\n'
            'vllm:request_success_total{finished_reason="length",model_name="smol"} 3\n'
            'vllm:request_success_total{finished_reason="stop",model_name="smol"} 2\nkvlab_up 1\n')
    v = prometheus_values(text)
    assert v["vllm:prompt_tokens_total"] == 96.0 and v["vllm:request_success_total"] == 5 and v["kvlab_up"] == 1
