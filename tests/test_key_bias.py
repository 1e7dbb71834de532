"""The outlier-key warning as a preflight: k_proj biases read from the weight files (safetensors or
GGUF) before any model loads, warned once per store that quantizes keys per token without an offset."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import kvlab.models
from kvlab.cli import main
from kvlab.errors import UserError
from kvlab.key_bias import files_key_bias, gguf_key_bias, outlier_layers
from kvlab.models import weight_files
from kvlab.policies import make_policy
from kvlab.preflight import outlier_keys_warnings

NO_OFFSET = "{method: kvq-int4, key_offset: none}"


@pytest.fixture(scope="module")
def biased_folder(tmp_path_factory):
    """A two-layer Qwen2 (k_proj with a bias) saved as a local folder; layer 0's bias has a -300 channel."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=512, max_position_embeddings=512)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.bias[7] = -300.0
    folder = tmp_path_factory.mktemp("biased-qwen2")
    model.save_pretrained(folder)
    return folder


def test_the_bias_is_read_from_the_safetensors_alone(biased_folder):
    files = weight_files(str(biased_folder))
    assert [f.suffix for f in files] == [".safetensors"]
    biases = files_key_bias(files)
    assert sorted(biases) == [0, 1] and biases[0] == 300.0 and biases[1] < 32
    assert outlier_layers(biases) == {0: 300.0}


def test_the_bias_is_read_from_a_gguf(tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "m.gguf"
    writer = GGUFWriter(str(path), "qwen2")
    writer.add_tensor("blk.0.attn_k.bias", np.array([1.0, -354.0, 2.0], dtype=np.float32))
    writer.add_tensor("blk.1.attn_k.bias", np.array([3.0, -4.0], dtype=np.float16))
    writer.add_tensor("blk.0.attn_q.bias", np.array([999.0], dtype=np.float32))  # not a key bias
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_key_bias(path) == {0: 354.0, 1: 4.0}
    assert weight_files(str(path)) == [path]  # no converted copy: the GGUF itself


def test_only_per_token_key_stores_without_an_offset_are_warned(biased_folder):
    stores = [make_policy("kvq-int4"), make_policy("kvq-int4", key_offset="none"),
              make_policy("kvq-fp8", key_offset="none"), make_policy("kivi"), make_policy("full"),
              make_policy("snapkv", quant={"backend": "quanto", "nbits": 4}), make_policy("kivi-rot"),
              make_policy("turboquant"), make_policy("nvfp4"), make_policy("kvq-rot")]
    lines = outlier_keys_warnings(str(biased_folder), None, stores)
    assert len(lines) == 6
    assert all(line.startswith("this model has outlier key channels (|k_proj.bias| up to 300, layers 0) and ")
               and line.endswith("use kvq-int4/kvq-fp8 with key_offset=prompt-mean (their default) or kivi "
                                 "(per-channel keys)") for line in lines)
    assert [line.split(" and ")[1].split(" quantizes")[0] for line in lines] == [
        "kvq int4-g64", "kvq fp8", "snapkv 50% + quanto int4", "turboquant k3v4", "nvfp4", "kvq-rot int4-g64"]
    assert outlier_keys_warnings(str(biased_folder), "synthetic", stores) == []
    assert outlier_keys_warnings(str(biased_folder), None, stores[:1]) == []


def test_smollm2_has_no_key_bias_and_gets_no_warning():
    try:
        kvlab.models.smollm2_gguf_path()
    except UserError:
        pytest.skip("the embedded SmolLM2 weights are not installed")
    assert files_key_bias(weight_files("smollm2-135m")) == {}
    assert outlier_keys_warnings("smollm2-135m", None, [make_policy("kvq-int4", key_offset="none")]) == []


@pytest.fixture
def no_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise UserError("the model was loaded")
    monkeypatch.setattr(kvlab.models, "load_model", refuse)
    monkeypatch.setattr(kvlab.models, "load_tokenizer", lambda source: object())
    monkeypatch.setattr("kvlab.cli.quality_run.items_problem", lambda *a: None)


@pytest.mark.parametrize("command", [
    ["generate", "--method", "kvq-int4", "--key-offset", "none", "--prompt-tokens", "8", "--max-new-tokens", "1"],
    ["quality", "--methods", "full", NO_OFFSET, "kvq-int4", "--tasks", "niah_single", "--lengths", "128"],
])
def test_the_cli_warns_before_the_model_loads(biased_folder, tmp_path, no_load, capsys, command):
    out = ["-o", str(tmp_path / "q")] if command[0] == "quality" else []
    with warnings.catch_warnings():
        assert main([command[0], "--model", str(biased_folder), *command[1:], *out]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[1].endswith("error: the model was loaded")
    assert err[0].startswith(f"kvlab {command[0]}: warning: this model has outlier key channels (|k_proj.bias| up "
                             f"to 300, layers 0) and kvq int4-g64 quantizes keys per token")


def test_a_sweep_dry_run_warns_per_model(biased_folder, tmp_path, capsys):
    params = tmp_path / "p.yaml"
    params.write_text(f"models: ['{biased_folder}']\ndevice: cpu\nmethods: [full, kvq-int4, {NO_OFFSET}]\n"
                      f"ctx: [64]\nbatch: [1]\nnew_tokens: 2\n")
    assert main(["sweep", str(params), "-o", str(tmp_path / "s"), "--dry-run"]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert err == [f"kvlab sweep: warning: models {biased_folder}: this model has outlier key channels "
                   f"(|k_proj.bias| up to 300, layers 0) and kvq int4-g64 quantizes keys per token without a key "
                   f"offset: expect garbage output; use kvq-int4/kvq-fp8 with key_offset=prompt-mean (their "
                   f"default) or kivi (per-channel keys)"]


def test_a_line_printed_before_the_load_is_not_warned_again_after_it(biased_folder, capsys):
    from kvlab.models import load_model
    from kvlab.preflight import print_warnings

    policy = make_policy("kvq-int4", key_offset="none")
    loaded = load_model(str(biased_folder))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        policy.check(loaded.model)  # no preflight: the loaded model's check warns
        print_warnings("kvlab x", outlier_keys_warnings(str(biased_folder), None, [policy]))
        policy.check(loaded.model)
    assert [str(w.message)[:36] for w in seen] == ["this model has outlier key channels "]
    assert capsys.readouterr().err.startswith("kvlab x: warning: this model has outlier key channels")
