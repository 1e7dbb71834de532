"""`kvlab budget` and `kvlab models` through the real entry point."""

import json
import subprocess
import sys

from kvlab.cli import main


def test_budget_json_done_when(capsys):
    assert main(["budget", "--model", "llama-3.1-8b", "--ctx", "16384", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bytes_per_token"] == 131072
    assert out["cache_bytes"] == 2147483648
    for key in ("weights_bytes", "compression_ratio", "decode_bytes_per_step"):
        assert key in out
    assert "decode_floor_ms" not in out and "max_batch" not in out


def test_budget_with_gpu_has_floor_and_capacity(capsys):
    assert main(["budget", "--model", "llama-3.1-8b", "--ctx", "8192", "--batch", "32", "--gpu", "rtx-4090", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["max_batch"] < 32 and out["fits"] is False
    assert out["decode_floor_ms"] > 0


def test_budget_table_and_bad_input(capsys):
    assert main(["budget", "--model", "llama-3.1-8b", "--ctx", "512", "--bits", "4"]) == 0
    assert "compression ratio" in capsys.readouterr().out
    assert main(["budget", "--model", "llama-3.1-8b", "--ctx", "0"]) == 2
    assert "positive" in capsys.readouterr().err
    assert main(["budget", "--model", "llama-3.1-8b", "--ctx", "100", "--keep", "0"]) == 2
    assert main(["budget", "--model", "llama-3.1-8b", "--ctx", "100", "--bits", "4", "--group-size", "48"]) == 2
    assert "does not divide" in capsys.readouterr().err
    assert main(["budget", "--model", "nope", "--ctx", "100"]) == 2
    assert "presets" in capsys.readouterr().err


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "kvlab", "models", "--json"], capture_output=True, text=True, check=True)
    rows = {r["model"]: r for r in json.loads(out.stdout)}
    assert rows["llama-3.1-8b"]["kv_bytes_per_token_bf16"] == 131072
    assert rows["smollm2-135m"]["kv_bytes_per_token_bf16"] == 23040
