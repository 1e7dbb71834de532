"""Policy registry and parameter validation: errors come before any model loads."""

import dataclasses
import json

import pytest
from packaging.version import Version

from kvlab.models import get_spec
from kvlab.policies import POLICIES, Policy, PolicyError, make_policy
from kvlab.policies.pyramidkv import pyramid_budget
from kvlab.policies.quantized import storage

EVICTION = ["streamingllm", "snapkv", "pyramidkv", "tova", "knorm", "random", "expected_attention", "kvzip", "kvzap", "adakv"]
QUANTIZED = ["quanto", "hqq", "fp8", "kvq-fp8", "kvq-int4", "kvq-int2"]
HAS_FP8 = Version(storage.installed_version("transformers")) >= Version(storage.FP8_MIN_TRANSFORMERS)
needs_fp8 = pytest.mark.skipif(not HAS_FP8, reason="transformers < 5.21 has no fp8 cache")


def test_registry_lists_every_method():
    assert set(POLICIES) == {"full", *EVICTION, *QUANTIZED, "decoding", "kivi", "quest", "nvfp4", "turboquant",
                             "kvq-rot", "kivi-rot"}
    for name, cls in POLICIES.items():
        assert issubclass(cls, Policy) and cls.name == name and cls.summary


def test_unknown_method_lists_the_methods():
    with pytest.raises(PolicyError) as err:
        make_policy("h2o", keep=0.5)
    for name in POLICIES:
        assert name in str(err.value)


def test_unknown_parameter_lists_the_allowed_ones():
    with pytest.raises(PolicyError, match="window_size, kernel_size"):
        make_policy("snapkv", keep=0.5, window=8)
    with pytest.raises(PolicyError, match="takes no parameters"):
        make_policy("full", keep=0.5)


@pytest.mark.parametrize("keep", [0, -0.1, 1.01, 2, float("nan"), "0.5", True, None])
@pytest.mark.parametrize("method", EVICTION)
def test_keep_outside_unit_interval_is_refused(method, keep):
    with pytest.raises(PolicyError):
        make_policy(method, keep=keep)


def test_policy_errors_are_value_errors_that_name_the_fix():
    with pytest.raises(ValueError, match=r"outside \(0, 1\]"):
        make_policy("tova", keep=1.5)


@pytest.mark.parametrize("method,nbits", [("quanto", 3), ("quanto", 8), ("hqq", 5), ("hqq", 16)])
def test_unsupported_nbits_for_a_backend(method, nbits):
    with pytest.raises(PolicyError, match=f"nbits={nbits} is not supported by the {method} backend"):
        make_policy(method, nbits=nbits)


def test_unsupported_nbits_in_combined_quant():
    with pytest.raises(PolicyError, match="nbits=3"):
        make_policy("snapkv", keep=0.25, quant={"backend": "quanto", "nbits": 3})
    with pytest.raises(PolicyError, match="unknown quantization backend"):
        make_policy("snapkv", keep=0.25, quant={"backend": "gptq"})
    with pytest.raises(PolicyError, match="bad quant keys"):
        make_policy("snapkv", keep=0.25, quant={"backend": "quanto", "bits": 4})


def test_bad_axis_and_fp8_knobs():
    with pytest.raises(PolicyError, match="axis_key=1"):
        make_policy("quanto", axis_key=1)
    with pytest.raises(PolicyError, match="per tensor"):
        make_policy("snapkv", quant={"backend": "fp8", "q_group_size": 32})


def test_missing_backend_package_names_the_install(monkeypatch):
    real = storage.installed_version
    monkeypatch.setattr(storage, "installed_version", lambda d: None if d in ("optimum-quanto", "hqq") else real(d))
    with pytest.raises(PolicyError, match="pip install 'optimum-quanto"):
        make_policy("quanto")
    with pytest.raises(PolicyError, match="hqq.*not installed"):
        make_policy("hqq")
    with pytest.raises(PolicyError, match="optimum-quanto"):
        make_policy("knorm", keep=0.5, quant={"backend": "quanto"})
    make_policy("knorm", keep=0.5)  # eviction alone needs no backend


def test_fp8_needs_transformers_5_21(monkeypatch):
    real = storage.installed_version
    monkeypatch.setattr(storage, "installed_version", lambda d: "5.17.0" if d == "transformers" else real(d))
    with pytest.raises(PolicyError, match=r"transformers >= 5\.21 \(installed: 5\.17\.0\)"):
        make_policy("fp8")


@needs_fp8
def test_fp8_is_available_on_the_installed_transformers():
    assert make_policy("fp8").bits == 8


def test_odd_kernel_and_positive_knobs():
    with pytest.raises(PolicyError, match="odd"):
        make_policy("snapkv", kernel_size=4)
    with pytest.raises(PolicyError, match="window_size"):
        make_policy("pyramidkv", window_size=0)
    with pytest.raises(PolicyError, match="n_sink"):
        make_policy("streamingllm", n_sink=-1)
    with pytest.raises(PolicyError, match="beta"):
        make_policy("pyramidkv", beta=0)


def _sliding_spec():
    return dataclasses.replace(get_spec("tiny-llama"), name="tiny-sliding", sliding_window=64)


@pytest.mark.parametrize("method,params", [("quanto", {}), ("hqq", {}), pytest.param("fp8", {}, marks=needs_fp8),
                                           ("snapkv", {"keep": 0.5}), ("streamingllm", {"keep": 0.5})])
def test_sliding_window_models_are_refused_before_loading(method, params):
    with pytest.raises(PolicyError, match="sliding_attention"):
        make_policy(method, **params).check(_sliding_spec())
    make_policy("full").check(_sliding_spec())


def test_sliding_window_config_is_refused():
    from transformers import AutoConfig

    config = AutoConfig.for_model("mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, sliding_window=32)
    with pytest.raises(PolicyError, match="QuantizedCache"):
        make_policy("quanto", q_group_size=16).check(config)


def test_group_size_must_divide_head_dim():
    with pytest.raises(PolicyError, match="does not divide"):
        make_policy("quanto").check(get_spec("tiny-llama"))  # head_dim 16, default group 64
    make_policy("quanto", q_group_size=16).check(get_spec("tiny-llama"))
    make_policy("quanto").check(get_spec("llama-3.1-8b"))


def test_params_are_json_safe_and_identify_the_run():
    for name in POLICIES:
        if name == "fp8" and not HAS_FP8:
            continue
        policy = make_policy(name)
        params = policy.params()
        assert json.loads(json.dumps(params)) == params
        assert params["method"] == name and "keep" in params and "bits" in params
    combined = make_policy("snapkv", keep=0.25, quant={"backend": "quanto", "nbits": 4})
    assert combined.params() == {
        "method": "snapkv", "keep": 0.25, "window_size": 64, "kernel_size": 5, "bits": 4,
        "quant": {"backend": "quanto", "nbits": 4, "q_group_size": 64, "residual_length": 128,
                  "axis_key": 0, "axis_value": 0},
    }
    assert combined.label == "snapkv 25% + quanto int4"
    assert make_policy("quanto", nbits=2).label == "quanto int2"
    assert make_policy("full").params() == {"method": "full", "keep": 1.0, "bits": None}


def test_describe_gives_typed_defaults():
    rows = {r["name"]: r for r in POLICIES["snapkv"].describe()}
    assert rows["window_size"]["default"] == 64 and rows["window_size"]["type"] == "int"
    assert rows["keep"]["default"] == 0.5 and rows["keep"]["help"]


@pytest.mark.parametrize("n", [1, 7, 100, 1000, 4096, 32768])
@pytest.mark.parametrize("keep", [0.1, 0.25, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("layers", [1, 2, 30, 32, 80])
def test_pyramid_budget_mean_matches_keep(n, keep, layers):
    budgets = [pyramid_budget(n, keep, 64, 20, i, layers) for i in range(layers)]
    assert all(1 <= b <= n for b in budgets)
    assert budgets == sorted(budgets, reverse=True)
    assert abs(sum(budgets) / layers - max(1, n * keep)) <= 1


def test_pyramid_budget_shape_and_fallback():
    # 8k prompt at keep 0.5: first layer keeps ~2m - m/20, last m/20, m = 4096
    first, last = pyramid_budget(8192, 0.5, 64, 20, 0, 32), pyramid_budget(8192, 0.5, 64, 20, 31, 32)
    assert (first, last) == (round(2 * 4096 - 4096 / 20), round(4096 / 20))
    # short prompt: the pyramid does not fit, every layer keeps SnapKV's floor(n x keep)
    assert {pyramid_budget(1000, 0.25, 64, 20, i, 30) for i in range(30)} == {250}
