"""KVzap: the surrogate's scores on each layer's attention input select the exact top-k per KV head."""

import pytest
import torch
from tiny_models import load_tiny_d32

from kvlab.engine.generation import prefill
from kvlab.policies import PolicyError, kept_positions, make_policy
from kvlab.policies.kvzap import read_surrogate, save_surrogate

N = 64


@pytest.fixture(scope="module")
def lm():
    return load_tiny_d32()


def attention_inputs(model, ids):
    """Each layer's attention input (after input_layernorm), from a plain forward."""
    seen = {}
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda m, a, k, i=i: seen.__setitem__(i, k["hidden_states"].clone()), with_kwargs=True)
        for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    return [seen[i] for i in range(len(seen))]


@pytest.fixture
def surrogate_file(lm, tmp_path):
    spec = lm.spec
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(spec.num_layers, spec.num_kv_heads, spec.hidden_size, generator=gen)
    bias = torch.randn(spec.num_layers, spec.num_kv_heads, generator=gen)
    path = tmp_path / "s.safetensors"
    save_surrogate(path, weight, bias, {"model": "tiny"})
    return path, weight, bias


def selection(lm, policy, ids):
    with policy.attach(lm, warm=False):
        cache = policy.make_cache(lm.model)
        prefill(lm.model, ids, cache, policy.prefill_chunk)
    return kept_positions(cache)


def test_kvzap_keeps_the_top_k_of_the_linear_surrogate_on_each_attention_input(lm, surrogate_file):
    path, weight, bias = surrogate_file
    ids = torch.randint(3, 500, (2, N), generator=torch.Generator().manual_seed(1))
    kept = selection(lm, make_policy("kvzap", keep=0.25, surrogate=str(path), n_sink=0), ids)
    inputs = attention_inputs(lm.model, ids)
    n_kept = int(N * 0.25)
    for layer, hidden in enumerate(inputs):
        scores = torch.einsum("bnd,hd->bhn", hidden, weight[layer]) + bias[layer][None, :, None]
        want = scores.topk(n_kept, dim=-1).indices.sort(dim=-1).values
        assert torch.equal(kept[layer], want)
    assert not torch.equal(kept[0][0, 0], kept[0][0, 1])  # heads choose their own positions


def test_sinks_and_window_are_kept_whatever_their_scores(lm, surrogate_file):
    path, _, _ = surrogate_file
    ids = torch.randint(3, 500, (1, N), generator=torch.Generator().manual_seed(1))
    for chunk in (None, 16):
        kept = selection(lm, make_policy("kvzap", keep=0.25, surrogate=str(path), n_sink=2, window=3,
                                         prefill_chunk=chunk), ids)
        for layer in kept:
            assert layer.shape[-1] == 16
            for position in (0, 1, N - 3, N - 2, N - 1):
                assert (layer == position).any(-1).all()


def test_chunked_kvzap_keeps_the_one_shot_selection(lm, surrogate_file):
    """A position's score depends on its own hidden state only, and that is the same whatever the chunking
    in the first layer (deeper layers see the kept rows only, so their inputs change)."""
    path, _, _ = surrogate_file
    ids = torch.randint(3, 500, (1, N), generator=torch.Generator().manual_seed(2))
    one = selection(lm, make_policy("kvzap", keep=0.25, surrogate=str(path)), ids)
    chunked = selection(lm, make_policy("kvzap", keep=0.25, surrogate=str(path), prefill_chunk=16), ids)
    assert torch.equal(one[0], chunked[0])


def test_a_surrogate_of_another_shape_is_refused_before_any_forward(lm, tmp_path):
    path = tmp_path / "wrong.safetensors"
    save_surrogate(path, torch.zeros(30, 3, 576), torch.zeros(30, 3), {})
    with pytest.raises(PolicyError, match="is for"):
        make_policy("kvzap", surrogate=str(path)).check(lm.model)
    with pytest.raises(PolicyError, match="no KVzap surrogate is packaged"):
        make_policy("kvzap").check(lm.model)


def test_the_packaged_smollm2_surrogate_fits_smollm2():
    from kvlab.models import get_spec

    policy = make_policy("kvzap", keep=0.25)
    policy.check(get_spec("smollm2-135m"))
    surrogate = policy.load_surrogate(get_spec("smollm2-135m"))
    assert surrogate.weight.shape == (30, 3, 576) and torch.isfinite(surrogate.weight).all()


@pytest.mark.parametrize("value,match", [("", "surrogate must be"), (3, "surrogate must be"),
                                         ("/no/such.safetensors", "is not a file")])
def test_bad_surrogate_values(value, match):
    with pytest.raises(PolicyError, match=match):
        make_policy("kvzap", surrogate=value)


def test_a_file_that_is_not_a_surrogate_is_refused(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"not safetensors")
    with pytest.raises(PolicyError, match="cannot read"):
        read_surrogate(str(path))
