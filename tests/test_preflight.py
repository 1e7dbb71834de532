"""The checks commands run before any model loads (pure, no weights)."""

import pytest

from kvlab.errors import UserError
from kvlab.models import get_spec
from kvlab.preflight import (
    cache_floor_bytes,
    check_out_dir,
    device_problem,
    memory_problem,
    require,
    weights_problem,
)

GiB = 1024**3


def test_memory_is_refused_only_when_even_the_most_compressed_method_cannot_fit():
    spec = get_spec("llama-3.1-8b")  # 16 GB of bf16 weights, 128 KiB of bf16 KV per token
    shape = dict(device="cuda", dtype="bfloat16", ctx=16384, batch=64, new_tokens=64)
    full = memory_problem(spec, **shape, available=141 * 10**9)
    assert full.startswith("batch: llama-3.1-8b at ctx 16384 x batch 64") and "lower batch or ctx" in full
    # snapkv at 10% fits: the sweep runs, and records the full cache failing (a capacity result)
    assert memory_problem(spec, **shape, compressions=[(None, None), (0.1, None)], available=141 * 10**9) is None
    assert cache_floor_bytes(spec, 1000, 1, 0, bits=4) == cache_floor_bytes(spec, 1000, 1, 0) / 4
    assert cache_floor_bytes(spec, 1000, 2, 0, keep=0.5) == cache_floor_bytes(spec, 1000, 1, 0)


def test_unknown_memory_makes_no_claim(monkeypatch):
    import kvlab.preflight as preflight

    monkeypatch.setattr(preflight, "available_memory_bytes", lambda device: None)
    assert memory_problem(get_spec("llama-3.1-70b"), "cpu", None, ctx=131000, batch=512, new_tokens=1) is None


def test_cpu_memory_counts_float32_weights():
    spec = get_spec("smollm2-135m")
    problem = memory_problem(spec, "cpu", None, ctx=128, batch=100000, new_tokens=8, available=8 * GiB)
    assert "in float32" in problem and "cpu has 8.0 GiB available" in problem
    assert memory_problem(spec, "cpu", None, ctx=128, batch=1, new_tokens=8, available=8 * GiB) is None
    # a command with no batch is told to lower its context flag; weights alone too big: the model
    long = memory_problem(spec, "cpu", None, ctx=8000, batch=1, new_tokens=8, available=int(0.6 * GiB),
                          ctx_key="--prompt-tokens")
    assert long.startswith("--prompt-tokens: smollm2-135m at ctx 8000 x batch 1") and long.endswith("lower --prompt-tokens")
    big = memory_problem(spec, "cpu", None, ctx=8, batch=1, new_tokens=8, available=GiB // 4, ctx_key="--ctx")
    assert big.startswith("--model: smollm2-135m's weights alone need") and big.endswith("or --dtype bfloat16")


def test_devices_and_weights():
    assert device_problem("tpu") == "--device: 'tpu' is not a device; use cpu, cuda or cuda:N"
    assert device_problem("cuda:0", check_available=False) is None and device_problem("cpu") is None
    assert "no real weights for 'mistral-7b'" in weights_problem("mistral-7b", None)
    assert weights_problem("mistral-7b", "synthetic") is None
    assert weights_problem("/some/local/folder", None) is None  # its load says what is missing


def test_output_folders(tmp_path):
    assert check_out_dir(tmp_path / "a" / "b").is_dir()
    (tmp_path / "f").write_text("x")
    for bad, message in [(tmp_path / "f", "is a file, not a folder"), (tmp_path / "f" / "sub", "cannot write there"),
                         ("/proc/kvlab-test", "cannot write there")]:
        with pytest.raises(UserError, match=message):
            check_out_dir(bad)
    assert check_out_dir(tmp_path / "never", create=False) == tmp_path / "never"
    assert not (tmp_path / "never").exists()


def test_require_raises_the_first_problem():
    require(None, None)
    with pytest.raises(UserError, match="^first$"):
        require(None, "first", "second")
