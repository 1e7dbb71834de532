"""`kvlab policies` and `kvlab generate`."""

import json

import pytest
from packaging.version import Version

from kvlab.cli import main
from kvlab.policies import POLICIES
from kvlab.policies.quantized.storage import FP8_MIN_TRANSFORMERS, installed_version

TINY = ["--model", "tiny-llama", "--weights", "synthetic", "--prompt-tokens", "80", "--max-new-tokens", "4"]
METHOD_ARGS = {
    "full": [],
    "streamingllm": ["--keep", "0.5"],
    "snapkv": ["--keep", "0.5", "--window-size", "8"],
    "pyramidkv": ["--keep", "0.5", "--window-size", "8"],
    "tova": ["--keep", "0.5"],
    "knorm": ["--keep", "0.5"],
    "random": ["--keep", "0.5", "--policy-seed", "3"],
    "quanto": ["--bits", "2", "--group-size", "16"],
    "hqq": ["--bits", "4", "--group-size", "16"],
    "fp8": [],
}


HAS_FP8 = Version(installed_version("transformers")) >= Version(FP8_MIN_TRANSFORMERS)


def run_json(capsys, args):
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)


def test_policies_lists_methods_and_parameters(capsys):
    assert main(["policies"]) == 0
    text = capsys.readouterr().out
    for name in POLICIES:
        assert name in text
    assert "window_size" in text and "residual_length" in text
    table = run_json(capsys, ["policies", "--json"])
    assert set(table) == set(POLICIES)
    assert {r["name"] for r in table["pyramidkv"]["params"]} >= {"keep", "window_size", "kernel_size", "beta"}


@pytest.mark.parametrize("method", list(METHOD_ARGS))
def test_generate_json_for_every_method(capsys, method):
    if method == "fp8" and not HAS_FP8:
        assert main(["generate", *TINY, "--method", "fp8"]) == 2
        assert "transformers >= 5.21" in capsys.readouterr().err
        return
    out = run_json(capsys, ["generate", *TINY, "--method", method, *METHOD_ARGS[method], "--json"])
    assert out["method"] == method and out["new_tokens"] == 4 and len(out["token_ids"]) == 4
    after = out["cache_after_prefill"]
    assert after["logical_tokens"] == 80
    assert after["physical_tokens"] == (40 if "--keep" in METHOD_ARGS[method] else 80)
    assert after["bytes"] > 0 and out["cache_final"]["logical_tokens"] == 83
    assert out["policy_params"]["method"] == method


def test_generate_evict_then_quantize(capsys):
    out = run_json(capsys, ["generate", *TINY, "--method", "snapkv", "--keep", "0.25", "--window-size", "8",
                            "--bits", "4", "--backend", "quanto", "--group-size", "16", "--json"])
    assert out["label"] == "snapkv 25% + quanto int4"
    assert out["policy_params"]["quant"]["nbits"] == 4
    assert out["cache_after_prefill"]["physical_tokens"] == 20


def test_generate_adakv_flags_and_any_policy_parameter(capsys):
    """adakv's scorer and alpha_safeguard have flags; --param KEY=VALUE reaches every other parameter."""
    out = run_json(capsys, ["generate", *TINY, "--method", "adakv", "--keep", "0.5", "--scorer", "expected_attention",
                            "--alpha-safeguard", "0.1", "--param", "scorer_params={epsilon: 0.01}", "--json"])
    params = out["policy_params"]
    assert (params["scorer"], params["alpha_safeguard"], params["scorer_params"]) == ("expected_attention", 0.1,
                                                                                       {"epsilon": 0.01})
    assert out["label"] == "adakv(expected_attention) 50%"
    assert out["cache_after_prefill"]["logical_tokens"] == 80
    flag = run_json(capsys, ["generate", *TINY, "--method", "snapkv", "--keep", "0.5", "--window-size", "8", "--json"])
    param = run_json(capsys, ["generate", *TINY, "--method", "snapkv", "--param", "keep=0.5", "--param",
                              "window-size=8", "--json"])
    assert param["policy_params"] == flag["policy_params"] and param["token_ids"] == flag["token_ids"]


def test_generate_text_output(capsys):
    assert main(["generate", *TINY, "--method", "tova", "--keep", "0.5"]) == 0
    text = capsys.readouterr().out
    assert "tova 50%" in text and "physical 40 tokens" in text and "cache at the end" in text


@pytest.mark.parametrize("args,message", [
    (["--method", "snapkv", "--keep", "1.5"], "outside (0, 1]"),
    (["--method", "h2o"], "methods: full, streamingllm"),
    (["--method", "quanto", "--bits", "3"], "nbits=3 is not supported by the quanto backend"),
    (["--method", "full", "--bits", "4"], "--method quanto"),
    (["--method", "tova", "--window-size", "8"], "unknown parameter"),
    (["--method", "quanto"], "does not divide"),  # default group 64 vs head_dim 16
    (["--method", "snapkv", "--scorer", "tova"], "unknown parameter"),
    (["--method", "adakv", "--alpha-safeguard", "2"], "alpha_safeguard must be a number in [0, 1]"),
    (["--method", "adakv", "--scorer", "h2o"], "adakv scorer 'h2o' is not supported"),
    (["--method", "snapkv", "--param", "window_size"], "write KEY=VALUE"),
    (["--method", "snapkv", "--param", "keep=0.5", "--keep", "0.5"], "already set by its own flag"),
    (["--method", "snapkv", "--param", "nope=1"], "unknown parameter"),
])
def test_generate_bad_input_fails_before_loading(capsys, args, message):
    assert main(["generate", *TINY, *args]) == 2
    assert message in capsys.readouterr().err


def test_generate_text_prompt_needs_a_tokenizer(capsys, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("hello")
    args = ["generate", "--model", "tiny-llama", "--weights", "synthetic", "--prompt-file", str(prompt)]
    assert main(args) == 2
    assert "--prompt-tokens" in capsys.readouterr().err
    assert main(["generate", "--model", "smollm2-135m", "--prompt-file", str(tmp_path / "missing.txt")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.slow(reason="the CLI loads SmolLM2's real weights and generates")
def test_generate_smollm2_prompt_file(capsys, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("What is the capital of France? Answer in one word.")
    out = run_json(capsys, ["generate", "--model", "smollm2-135m", "--method", "quanto", "--bits", "4",
                            "--prompt-file", str(prompt), "--chat", "--max-new-tokens", "8", "--json"])
    assert "paris" in out["answer"].lower()
    assert out["weights"] == "real" and out["cache_after_prefill"]["physical_tokens"] == out["prompt_tokens"]
    assert 0 <= out["reply_kl"] < 1 and out["fidelity"].startswith("KL ")  # the reply checked against full
