"""kvq-rot's fused path: kvq's decode kernel (Triton interpreter) over rotated codes, against the
rotated reference (decode the codes, attend in the rotated basis, rotate back)."""

import pytest
import torch

from kvlab.kernels import turboquant as tq  # TRITON_INTERPRET=1 is set by conftest before triton loads
from kvlab.storage.rotated_kvq import KVQCodes, rotated_kvq_decode


@pytest.mark.parametrize("fmt, d", [("int4-g32", 32), ("int2-g32", 64), ("fp8", 32)])
def test_the_kernel_over_rotated_codes_matches_the_rotated_reference(fmt, d):
    gen = torch.Generator().manual_seed(0)
    b, hq, hkv, cap = 2, 4, 2, 37
    rot = tq.rotations(hkv, d, seed=1)
    codes = KVQCodes(fmt)
    k, v = torch.randn(b, hkv, cap, d, generator=gen), torch.randn(b, hkv, cap, d, generator=gen)
    kparts, vparts = codes.encode(tq.rotate(k, rot)), codes.encode(tq.rotate(v, rot))
    q = torch.randn(b, hq, 1, d, generator=gen)
    used = torch.tensor([29])
    want = tq.rotated_decode(q, codes.decode(*kparts), codes.decode(*vparts), used, rot, 0.3)
    got = rotated_kvq_decode(q, kparts, vparts, used, rot, 0.3, codes=codes)
    torch.testing.assert_close(got, want, atol=3e-3, rtol=1e-2)  # the kernel's float16 products, as kvq's tests


def test_the_fast_store_reads_through_the_kernel_as_the_reference_does():
    from kernel_paths import fast_decode_by_backend

    from kvlab.policies import make_policy

    out = fast_decode_by_backend(make_policy("kvq-rot", format="int4-g32"))
    assert out["triton"][1] == "fused" and out["auto"][1] == "reference"
    assert torch.equal(out["triton"][0], out["auto"][0])
