"""Host counters: parsing /proc text and the deltas a record carries."""

import pytest

from kvlab.hostload import (
    HostCounters,
    host_delta,
    parse_nonvoluntary,
    parse_steal_s,
    rapl_delta_j,
    rapl_status,
    read_counters,
    read_rapl_uj,
)

PROC_STAT = """cpu  4705 356 584 3699176 23060 0 277 1234 0 0
cpu0 1393 280 209 923545 6017 0 207 600 0 0
intr 114930548 113199788 3 0 5 263 0 4 [...]
"""
STATUS = "Name:\tpython\nvoluntary_ctxt_switches:\t150\nnonvoluntary_ctxt_switches:\t545\n"


def test_steal_comes_from_the_aggregate_cpu_line():
    assert parse_steal_s(PROC_STAT, ticks_per_s=100) == pytest.approx(12.34)
    assert parse_steal_s("cpu  1 2 3 4\n", 100) is None  # a kernel too old to report steal
    assert parse_steal_s("intr 5\n", 100) is None


def test_nonvoluntary_switches_from_status():
    assert parse_nonvoluntary(STATUS) == 545
    assert parse_nonvoluntary("Name:\tpython\n") is None


def test_delta_over_an_interval():
    a = HostCounters(wall_s=10.0, process_cpu_s=1.0, steal_s=12.0, nonvoluntary_switches=500)
    b = HostCounters(wall_s=12.0, process_cpu_s=2.5, steal_s=12.25, nonvoluntary_switches=545)
    assert host_delta(a, b) == {"host_process_cpu_ms": 1500.0, "host_process_cpu_share": 0.75,
                                "host_steal_ms": 250.0, "host_nonvoluntary_switches": 45}
    c = HostCounters(wall_s=12.0, process_cpu_s=2.5)  # counters unreadable: None, not an error
    assert host_delta(a, c)["host_steal_ms"] is None and host_delta(a, c)["host_nonvoluntary_switches"] is None


def test_reading_this_machine():
    """On Linux every counter reads; 0.2 s of busy Python shows up as this process's CPU time."""
    import time

    before = read_counters()
    end = time.perf_counter() + 0.2
    while time.perf_counter() < end:
        pass
    delta = host_delta(before, read_counters())
    assert delta["host_process_cpu_ms"] > 0 and delta["host_process_cpu_share"] > 0
    assert delta["host_steal_ms"] is not None and delta["host_nonvoluntary_switches"] is not None


def test_contention_flags_the_busy_runs_of_issue_15_and_not_the_quiet_ones():
    from functools import partial

    from kvlab.hostload import contention

    spinning = partial(contention, waits_passively=False)  # libgomp's default: idle threads spin
    quiet_cpu = {"host_process_cpu_share": 2.0, "host_nonvoluntary_switches": 3, "host_steal_ms": 0.0}
    busy_cpu = {"host_process_cpu_share": 1.0, "host_nonvoluntary_switches": 1764, "host_steal_ms": 0.0}
    assert spinning(quiet_cpu, decode_s=0.3, threads=2) == (False, "")
    flagged, why = spinning(busy_cpu, decode_s=6.0, threads=2)
    assert flagged and "switches/s" in why and "CPU share 1.00 with 2 threads" in why
    # a half-busy CPU counts with some preemption, never on a GPU (the host thread waits on kernels),
    # and not alone: a serial code path leaves a thread idle on a quiet machine too
    half = {"host_process_cpu_share": 1.0, "host_nonvoluntary_switches": 8, "host_steal_ms": 0.0}
    assert spinning(half, decode_s=1.0, threads=2) == (True, "CPU share 1.00 with 2 threads")
    assert spinning(half, decode_s=1.0, threads=2, device="cuda")[0] is False
    assert spinning({**half, "host_nonvoluntary_switches": 1}, decode_s=1.0, threads=2)[0] is False
    # an H200 run of 2026-12-02: 42 switches over 21 s, 1.3 CPU share, a little steal
    h200 = {"host_process_cpu_share": 1.3, "host_nonvoluntary_switches": 42, "host_steal_ms": 23.0}
    assert contention(h200, decode_s=21.0, threads=16, device="cuda") == (False, "")
    assert contention({"host_steal_ms": 500.0}, decode_s=1.0)[0] is True
    assert contention({}, decode_s=1.0) == (None, "no host counters")
    assert contention(quiet_cpu, decode_s=None)[0] is None


def test_threads_that_wait_passively_count_as_one_busy_thread():
    from kvlab.hostload import contention

    # block 1 on a fresh clone, 2026-12-03 (OMP_WAIT_POLICY=PASSIVE, 2 threads): a quiet run keeps one
    # thread busy; a run whose CPU other processes took keeps half of one
    quiet = {"host_process_cpu_share": 0.98, "host_nonvoluntary_switches": 3, "host_steal_ms": 0.0}
    assert contention(quiet, decode_s=0.4, threads=2, waits_passively=True) == (False, "")
    assert contention(quiet, decode_s=0.4, threads=2, waits_passively=False)[0] is True  # the old rule's false alarm
    starved = {"host_process_cpu_share": 0.5, "host_nonvoluntary_switches": 3, "host_steal_ms": 0.0}
    assert contention(starved, decode_s=0.4, threads=2, waits_passively=True) == (
        True, "CPU share 0.50 with 2 threads (waiting passively: one busy)")


def test_cpu_threads_is_a_positive_stable_number():
    from kvlab.hostload import cpu_threads

    assert cpu_threads() >= 1 and cpu_threads() == cpu_threads()


def test_peak_rss_is_read_from_vmhwm_and_resets_to_the_current_rss():
    from kvlab.hostload import parse_peak_rss, peak_rss_bytes, reset_peak_rss

    assert parse_peak_rss("VmPeak:\t 999 kB\nVmHWM:\t  2048 kB\nVmRSS:\t 1024 kB\n") == 2048 * 1024
    assert parse_peak_rss("Name: x\n") is None
    if not reset_peak_rss():
        pytest.skip("no /proc/self/clear_refs here")
    import mmap

    before = peak_rss_bytes()
    # 64 MiB of fresh anonymous pages, touched: a bytearray can reuse pages the process already holds
    # (after a long test session the heap had them: VmHWM did not move)
    block = mmap.mmap(-1, 64 * 1024 * 1024)
    block[::4096] = b"x" * len(block[::4096])
    grown = peak_rss_bytes()
    block.close()
    assert grown - before >= 60 * 1024 * 1024
    assert reset_peak_rss() and peak_rss_bytes() < grown


def _omp_wait_policy_after(code: str, **env: str) -> str:
    import os
    import subprocess
    import sys

    clean = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", f"{code}; import os; print(os.environ.get('OMP_WAIT_POLICY'))"],
                         env={**clean, **env}, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_importing_kvlab_before_torch_makes_openmp_threads_wait_passively_unless_the_user_chose():
    assert _omp_wait_policy_after("import kvlab") == "PASSIVE"
    assert _omp_wait_policy_after("import kvlab", OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"
    # torch already loaded libgomp: setting it now would claim a policy that is not in force
    assert _omp_wait_policy_after("import torch; import kvlab") == "None"


def fake_powercap(root, zones):
    """A FAKE /sys/class/powercap tree: {folder: (name, energy_uj or None for root-only, max range)}."""
    for folder, (name, energy, span) in zones.items():
        z = root / folder
        z.mkdir(parents=True)
        (z / "name").write_text(name + "\n")
        (z / "energy_uj").write_text(f"{energy}\n" if energy is not None else "")
        (z / "max_energy_range_uj").write_text(f"{span}\n")
    return root


def test_rapl_status_without_powercap_says_so(tmp_path):
    assert rapl_status(tmp_path / "none") == f"none: no {tmp_path / 'none'}"
    assert rapl_status(tmp_path) == f"none: no intel-rapl zone in {tmp_path}"
    assert read_rapl_uj(tmp_path / "none") == {}


def test_rapl_reads_top_level_zones_and_a_wrapped_counter(tmp_path):
    root = fake_powercap(tmp_path, {"intel-rapl:0": ("package-0", 999_000_000, 1_000_000_000),
                                    "intel-rapl:0:0": ("core", 5, 1_000_000_000),  # a subzone: not counted twice
                                    "intel-rapl:1": ("dram", 10_000_000, 1_000_000_000)})
    before = read_rapl_uj(root)
    assert before == {"package-0": 999_000_000, "dram": 10_000_000}
    assert rapl_status(root) == "readable: package-0, dram"
    (root / "intel-rapl:0" / "energy_uj").write_text("2000000\n")  # wrapped at 1000 J
    (root / "intel-rapl:1" / "energy_uj").write_text("12500000\n")
    assert rapl_delta_j(before, read_rapl_uj(root), root) == pytest.approx({"package-0": 3.0, "dram": 2.5})


def test_rapl_readable_only_by_root_is_unreadable(tmp_path):
    root = fake_powercap(tmp_path, {"intel-rapl:0": ("package-0", None, 1)})
    assert rapl_status(root) == "unreadable: package-0 (energy_uj needs root)"


def test_the_manifest_records_rapl():
    from kvlab.env import snapshot

    assert snapshot("cpu")["rapl"].split(":")[0] in {"none", "readable", "unreadable"}
