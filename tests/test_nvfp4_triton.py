"""The fused NVFP4 decode kernel in the Triton interpreter against the torch reference."""

import pytest
import torch

from kvlab.kernels import nvfp4  # TRITON_INTERPRET=1 is set by conftest before triton loads
from kvlab.storage.slots import sdpa_decode


def test_the_kernels_e4m3_decoder_equals_torchs_float8_for_every_finite_code():
    from kvlab.kernels.nvfp4_triton import e4m3_decode

    bits = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)  # 0x7F, 0xFF: NaN
    want = bits.view(torch.float8_e4m3fn).float()
    assert torch.equal(e4m3_decode(bits), want)


@pytest.mark.parametrize("four_over_six", [False, True])
@pytest.mark.parametrize("used", [[29], [37, 5]])
def test_fused_decode_matches_the_reference(four_over_six, used):
    from kvlab.kernels.nvfp4_triton import fused_nvfp4_decode

    gen = torch.Generator().manual_seed(0)
    b, hq, hkv, cap, d = 2, 4, 2, 37, 32
    k = torch.randn(b, hkv, cap, d, generator=gen) * torch.linspace(0.1, 8, d)  # channels of unequal range
    v = torch.randn(b, hkv, cap, d, generator=gen)
    q = torch.randn(b, hq, 1, d, generator=gen)
    kparts, vparts = nvfp4.quantize(k, four_over_six), nvfp4.quantize(v, four_over_six)
    used = torch.tensor(used)
    want = torch.stack([sdpa_decode(q[r:r + 1], nvfp4.dequantize(*kparts)[r:r + 1], nvfp4.dequantize(*vparts)[r:r + 1],
                                    used[min(r, len(used) - 1)], 0.3)[0] for r in range(b)])
    got = fused_nvfp4_decode(q, kparts, vparts, used, None, 0.3)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_a_rotation_is_refused():
    from kvlab.kernels.nvfp4_triton import fused_nvfp4_decode

    parts = nvfp4.quantize(torch.randn(1, 1, 4, 16))
    with pytest.raises(ValueError, match="unrotated"):
        fused_nvfp4_decode(torch.randn(1, 1, 1, 16), parts, parts, torch.tensor([4]), torch.eye(16), 1.0)


def test_the_fast_store_reads_through_the_kernel_as_the_reference_does():
    """The same prompt through the fast engine with the kernel (interpreter) and with the reference."""
    from kernel_paths import fast_decode_by_backend

    from kvlab.policies import make_policy

    out = fast_decode_by_backend(make_policy("nvfp4"))
    assert out["triton"][1] == "fused" and out["auto"][1] == "reference"
    assert torch.equal(out["triton"][0], out["auto"][0])
