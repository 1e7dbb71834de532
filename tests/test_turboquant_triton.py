"""The fused rotated-codebook decode kernel in the Triton interpreter against the torch reference."""

import pytest
import torch

from kvlab.kernels import turboquant as tq  # TRITON_INTERPRET=1 is set by conftest before triton loads


@pytest.mark.parametrize("variant", ["4bit", "k3v4", "3bit"])
def test_fused_decode_matches_the_reference(variant):
    from kvlab.kernels.turboquant_triton import fused_rotated_decode

    gen = torch.Generator().manual_seed(0)
    b, hq, hkv, cap, d = 2, 4, 2, 37, 32
    kbook, vbook = tq.VARIANTS[variant]
    rot = tq.rotations(hkv, d, seed=3)
    k, v = torch.randn(b, hkv, cap, d, generator=gen), torch.randn(b, hkv, cap, d, generator=gen)
    q = torch.randn(b, hq, 1, d, generator=gen)
    kparts, vparts = kbook.encode(tq.rotate(k, rot)), vbook.encode(tq.rotate(v, rot))
    used = torch.tensor([29])
    want = tq.rotated_decode(q, kbook.decode(*kparts), vbook.decode(*vparts), used, rot, 0.3)
    got = fused_rotated_decode(q, kparts, vparts, used, rot, 0.3, kbook, vbook)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_the_fast_store_reads_through_the_kernel_as_the_reference_does():
    """The same prompt through the fast engine with the kernel (interpreter) and with the reference."""
    from kernel_paths import fast_decode_by_backend

    from kvlab.policies import make_policy

    out = fast_decode_by_backend(make_policy("turboquant", variant="k3v4"))
    assert out["triton"][1] == "fused" and out["auto"][1] == "reference"
    assert torch.equal(out["triton"][0], out["auto"][0])
