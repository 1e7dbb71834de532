"""Model specs, presets and offline loading."""

import pytest
import torch

from kvlab.models import PRESETS, ModelError, count_params, get_spec, load_model, preset_config


@pytest.mark.parametrize("name", list(PRESETS))
def test_param_count_matches_a_meta_model(name):
    from transformers import AutoModelForCausalLM

    config = preset_config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert count_params(config) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_spec_without_transformers_matches_the_transformers_config(name):
    from kvlab.models import spec_from_config

    assert get_spec(name) == spec_from_config(preset_config(name), name=name)


def test_kvlab_budget_imports_neither_torch_nor_transformers_nor_pandas():
    import subprocess
    import sys

    code = ("import sys; from kvlab.cli import main; main(['budget', '--model', 'llama-3.1-8b', '--ctx', '16384', "
            "'--gpu', 'h200']); print(sorted(m for m in ('torch', 'transformers', 'pandas') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("[]")


def test_llama8b_spec():
    spec = get_spec("llama-3.1-8b")
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.num_attention_heads) == (32, 8, 128, 32)
    assert spec.max_context == 131072 and spec.sliding_window is None


def test_unknown_model_lists_presets():
    with pytest.raises(ModelError, match="presets: llama-3.1-8b"):
        get_spec("gpt-5")


def test_preset_without_weights_names_three_options():
    with pytest.raises(ModelError) as err:
        load_model("llama-3.1-8b")
    text = str(err.value)
    assert "weights='synthetic'" in text and "local folder" in text and "smollm2-135m" in text


def test_missing_local_path_is_clear(tmp_path):
    with pytest.raises(ModelError, match="does not exist|no weights"):
        load_model(str(tmp_path / "nothing-here"))


def test_synthetic_is_seeded_and_marked():
    a = load_model("tiny-llama", weights="synthetic", seed=3)
    b = load_model("tiny-llama", weights="synthetic", seed=3)
    assert a.weights == "synthetic" and a.tokenizer is None
    assert a.provenance()["weights"] == "synthetic"
    pa, pb = next(a.model.parameters()), next(b.model.parameters())
    assert torch.equal(pa, pb)
    ids = torch.randint(0, a.spec.vocab_size, (1, 8))
    assert a.model(ids).logits.shape == (1, 8, a.spec.vocab_size)


def test_local_folder_loads_offline(tmp_path, tiny):
    tiny.model.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.weights == "real" and loaded.spec.num_layers == 2
    ids = torch.arange(6).unsqueeze(0)
    assert torch.allclose(loaded.model(ids).logits, tiny.model(ids).logits, atol=1e-5)


@pytest.mark.slow(reason="loads SmolLM2's real weights and generates")
def test_smollm2_answers_offline(smollm2):
    tok = smollm2.tokenizer
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = smollm2.model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids["input_ids"].shape[1]:])
    assert smollm2.spec.num_kv_heads == 3 and smollm2.weights == "real"


def test_cache_root_follows_kvlab_cache_then_xdg(monkeypatch, tmp_path):
    from kvlab.models import cache_root

    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path / "k"))
    assert cache_root() == tmp_path / "k"
    monkeypatch.delenv("KVLAB_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_root() == tmp_path / "x" / "kvlab"


@pytest.mark.slow(reason="converts SmolLM2's GGUF to safetensors and loads the copy")
def test_the_converted_gguf_holds_exactly_what_transformers_reads_from_the_gguf(monkeypatch, tmp_path):
    """SmolLM2 loads from a safetensors copy after its first load: same weights, same tokenizer as
    transformers read from the GGUF. The conversion's own GGUF reads are the reference (captured as they
    return), so the GGUF is parsed once, not again for the comparison (about 20 s on 2 cores)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvlab.models import converted_gguf, smollm2_gguf_path

    read, gguf_reads = {}, []
    model_from, tokenizer_from = AutoModelForCausalLM.from_pretrained, AutoTokenizer.from_pretrained

    def model_spy(*args, **kwargs):
        model = model_from(*args, **kwargs)
        if kwargs.get("gguf_file"):
            read["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
            gguf_reads.append("model")
        return model

    def tokenizer_spy(*args, **kwargs):
        tokenizer = tokenizer_from(*args, **kwargs)
        if kwargs.get("gguf_file"):
            read["tokenizer"] = tokenizer
            gguf_reads.append("tokenizer")
        return tokenizer

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", model_spy)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", tokenizer_spy)
    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))
    gguf = smollm2_gguf_path()
    assert converted_gguf(gguf, convert=False) is None
    folder = converted_gguf(gguf)
    assert folder is not None and folder.parent == tmp_path / "gguf"
    assert converted_gguf(gguf, convert=False) == folder  # the second load reads the copy
    assert sorted(gguf_reads) == ["model", "tokenizer"]  # transformers read the GGUF, once each
    copy = load_model("smollm2-135m")
    ref, got = read["state"], copy.model.state_dict()
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    text = "The KV cache grows with every token: 12345 tokens later."
    assert read["tokenizer"].encode(text) == copy.tokenizer.encode(text)
    assert len(gguf_reads) == 2  # the copy's load did not read the GGUF


def test_model_shape_reads_the_same_spec_from_a_loaded_model_its_module_its_config_and_its_spec(tiny):
    from kvlab.policies.base import model_shape

    shapes = [model_shape(m) for m in (tiny, tiny.model, tiny.model.config, tiny.spec)]
    numbers = {(s.head_dim, s.num_layers, s.layer_types) for s in shapes}
    assert numbers == {(tiny.spec.head_dim, tiny.spec.num_layers, ("full_attention",) * tiny.spec.num_layers)}
    assert shapes[0].spec is tiny.spec and shapes[0].name == tiny.spec.name


def test_a_gguf_folder_with_a_converted_copy_is_read_from_its_config_json(monkeypatch, tmp_path, capsys):
    """``kvlab budget`` / ``kvlab models`` on a GGUF folder read the converted copy's config.json (no
    GGUF parse, no transformers import): this GGUF is not even a GGUF, so a parse would fail."""
    import dataclasses
    import json

    from kvlab.cli import main
    from kvlab.models import PRESETS, get_spec

    folder = tmp_path / "m"
    folder.mkdir()
    gguf = folder / "qwen.gguf"
    gguf.write_bytes(b"not a gguf")
    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path / "cache"))
    stat = gguf.stat()
    copy = tmp_path / "cache" / "gguf" / f"qwen-{stat.st_size}-{stat.st_mtime_ns}"
    copy.mkdir(parents=True)
    (copy / "model.safetensors").write_bytes(b"")
    (copy / "config.json").write_text(json.dumps(PRESETS["qwen2.5-coder-1.5b"]))
    assert get_spec(str(folder)) == dataclasses.replace(get_spec("qwen2.5-coder-1.5b"), name=str(folder))
    assert main(["models", str(folder)]) == 0
    row = capsys.readouterr().out.strip().splitlines()[-1].split()
    assert row[:4] == [str(folder), "28", "2", "128"] and row[-2:] == ["real", "(local)"]
