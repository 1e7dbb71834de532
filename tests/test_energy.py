"""kvlab.energy against exact math and a fake NVML with a known power trace."""

import threading
import time

import pytest
from fake_nvml import FakeNvml

from kvlab.energy import NullSampler, NvmlSampler, find_handle, make_sampler
from kvlab.energy.idle import median_power
from kvlab.energy.integrate import integrate_hold, integrate_linear, split_energy
from kvlab.energy.poller import THREAD_NAME


def no_sync():
    pass


def sampler_threads():
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


# --- pure math -------------------------------------------------------------------------------


def test_integrate_linear_is_exact_for_a_ramp_and_interpolates_edges():
    ts, ps = [0.0, 1.0, 2.0], [0.0, 100.0, 100.0]
    assert integrate_linear(ts, ps, 0.0, 2.0) == pytest.approx(50 + 100)
    # edges between samples: P(0.5)=50, P(1.5)=100 -> 0.5*(50+100)/2 + 0.5*100
    assert integrate_linear(ts, ps, 0.5, 1.5) == pytest.approx(37.5 + 50)
    # beyond the samples the ends are held flat
    assert integrate_linear(ts, ps, 2.0, 4.0) == pytest.approx(200)
    assert integrate_linear(ts, ps, -1.0, 0.0) == pytest.approx(0)
    assert integrate_linear([], [], 0, 1) is None


def test_integrate_hold_sums_samples_times_their_period():
    ts = [0.0, 0.1, 0.2, 0.3]
    ps = [100.0, 200.0, 300.0, 400.0]
    assert integrate_hold(ts, ps, 0.0, 0.4) == pytest.approx(0.1 * (100 + 200 + 300 + 400))
    # a window inside one period uses the sample taken before it
    assert integrate_hold(ts, ps, 0.12, 0.17) == pytest.approx(0.05 * 200)
    # a window starting before the first sample uses the first value
    assert integrate_hold(ts, ps, -0.1, 0.1) == pytest.approx(0.2 * 100)


def test_split_energy_scales_power_shares_to_the_counter_total():
    ts, ps = [0.0, 1.0, 1.0000001, 3.0], [100.0, 100.0, 300.0, 300.0]
    parts = split_energy(1000.0, ts, ps, [0.0, 1.0, 3.0])
    # integral: 100 J in phase 1, ~600 J in phase 2 -> shares 1/7 and 6/7 of the counter's 1000 J
    assert parts[0] == pytest.approx(1000 / 7, rel=1e-4)
    assert parts[1] == pytest.approx(6000 / 7, rel=1e-4)
    assert sum(parts) == pytest.approx(1000.0)
    assert split_energy(10.0, [], [], [0, 1]) is None
    assert split_energy(10.0, [0.0, 1.0], [0.0, 0.0], [0, 1]) is None


def test_median_power_ignores_one_outlier():
    ts = [0, 1, 2, 3, 4]
    js = [0, 80, 160, 400, 480]  # one sub-window caught a spike
    assert median_power(ts, js) == pytest.approx(80)


# --- the sampler with a fake NVML --------------------------------------------------------------


def make(fake, **kw):
    s = make_sampler("cuda:0", nvml=fake, uuid="aaaa-0000", sync=no_sync, **kw)
    assert isinstance(s, NvmlSampler), s.source
    return s


def test_counter_window_matches_the_known_trace_and_edges():
    fake = FakeNvml(segments=[(0.0, 200.0)])
    s = make(fake)
    with s.window() as w:
        time.sleep(0.25)
    r = w.result
    assert r.source == "nvml-counter"
    # the counter is read right after t0 and right before t1: energy is 200 W over the window
    assert r.energy_j == pytest.approx(200.0 * r.seconds, rel=0.01)
    assert r.energy_instant_j == pytest.approx(200.0 * r.seconds, rel=1e-6)
    assert r.n_samples >= 5  # 15 ms polls over 250 ms, plus one before and one after
    assert r.peak_mem_nvml_bytes == fake.memory_used
    assert r.temp_start_c == 41


def test_phase_split_follows_the_power_step():
    # 100 W for the first 0.2 s after the fake's origin, then 400 W
    fake = FakeNvml(segments=[(0.0, 100.0), (0.2, 400.0)])
    s = make(fake, interval_s=0.005)
    with s.window("prefill") as w:
        time.sleep(max(0.0, fake.origin + 0.2 - time.perf_counter()))
        w.mark("decode")
        time.sleep(0.2)
    r = w.result
    t_mark = r.phase_edges[1]
    exact_prefill = fake.energy_between(r.t0, t_mark)
    exact_decode = fake.energy_between(t_mark, r.t1)
    assert r.energy_j == pytest.approx(exact_prefill + exact_decode, rel=0.01)
    assert r.phase_j["prefill"] + r.phase_j["decode"] == pytest.approx(r.energy_j)
    # the split is as good as the poll spacing around the step (5 ms at 300 W = 1.5 J at most)
    assert r.phase_j["prefill"] == pytest.approx(exact_prefill, abs=2.0)
    assert r.phase_j["decode"] == pytest.approx(exact_decode, abs=2.0)
    assert set(r.phase_s()) == {"prefill", "decode"}


def test_10hz_power_usage_under_counts_a_step_like_the_study():
    # idle 100 W, then a 600 W load from 1.0 s: the 1 s trailing average lags the step
    fake = FakeNvml(segments=[(0.0, 100.0), (1.0, 600.0)])
    s = make(fake)
    time.sleep(max(0.0, fake.origin + 1.0 - time.perf_counter()))
    with s.window() as w:
        time.sleep(0.5)
    r = w.result
    assert r.energy_j == pytest.approx(600 * r.seconds, rel=0.02)
    # the averaged reading climbs from ~100 W: about half the step is missing over 0.5 s
    assert r.energy_10hz_j < 0.7 * r.energy_j
    assert r.energy_10hz_j > 0.3 * r.energy_j


def test_counter_granularity_shows_in_short_windows():
    fake = FakeNvml(segments=[(0.0, 300.0)], counter_period_s=0.1)
    s = make(fake)
    with s.window() as w:
        time.sleep(0.03)
    r = w.result
    # a 30 ms window sees either zero or one 100 ms counter step
    assert r.energy_j == pytest.approx(0.0, abs=1e-9) or r.energy_j == pytest.approx(30.0, abs=0.01)
    assert r.energy_instant_j == pytest.approx(300 * r.seconds, rel=1e-6)


def test_threads_start_and_stop_with_the_window_even_on_error():
    fake = FakeNvml()
    s = make(fake)
    before = len(sampler_threads())
    with s.window():
        assert len(sampler_threads()) == before + 1
    assert len(sampler_threads()) == before
    with pytest.raises(RuntimeError, match="boom"):
        with s.window():
            raise RuntimeError("boom")
    assert len(sampler_threads()) == before
    s.close()
    assert fake.inits == 0


def test_idle_baseline_from_the_counter():
    fake = FakeNvml(segments=[(0.0, 85.0)])
    s = make(fake)
    assert s.measure_idle(0.4, sub_s=0.1) == pytest.approx(85.0, rel=0.02)
    assert s.measure_idle(0) is None


def test_device_is_matched_by_uuid_not_index():
    fake = FakeNvml(uuids=["GPU-aaaa", "GPU-bbbb", "GPU-cccc"])
    assert find_handle(fake, "cccc") == ("handle", 2)
    assert find_handle(fake, "GPU-BBBB") == ("handle", 1)
    assert find_handle(fake, "dddd") is None


@pytest.mark.parametrize(
    "kwargs, device, expect",
    [
        ({}, "cpu", "none: device 'cpu'"),
        ({"init_error": "driver not loaded"}, "cuda:0", "NVML init failed (driver not loaded)"),
        ({"counter_error": "Not Supported"}, "cuda:0", "energy counter unavailable (Not Supported)"),
        ({"uuids": ["GPU-zzzz"]}, "cuda:0", "device not found"),
    ],
)
def test_no_nvml_gives_a_null_sampler_with_the_reason(kwargs, device, expect):
    fake = FakeNvml(**kwargs)
    s = make_sampler(device, nvml=fake, uuid="aaaa-0000", sync=no_sync)
    assert isinstance(s, NullSampler)
    assert s.source.startswith("none: ") and expect in s.source
    with s.window("prefill") as w:
        w.mark("decode")
    r = w.result
    assert r.energy_j is None and r.phase_j == {"prefill": None, "decode": None}
    assert r.seconds >= 0
    assert s.measure_idle(1.0) is None
    assert fake.inits == 0  # an init that succeeded was shut down again


def test_missing_power_fields_keep_the_counter_and_drop_the_split():
    fake = FakeNvml(segments=[(0.0, 150.0)], fields_supported=False)
    s = make(fake)
    with s.window("a") as w:
        time.sleep(0.05)
        w.mark("b")
        time.sleep(0.05)
    r = w.result
    assert r.energy_j == pytest.approx(150 * r.seconds, rel=0.02)
    assert r.energy_instant_j is None
    assert r.phase_j == {"a": None, "b": None}


def test_marking_misuse_is_an_error():
    s = NullSampler("cpu")
    with s.window("prefill") as w:
        with pytest.raises(ValueError, match="already marked"):
            w.mark("prefill")
    with pytest.raises(ValueError, match="closed"):
        w.mark("late")
