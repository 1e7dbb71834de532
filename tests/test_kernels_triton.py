"""The Triton kernels (decode attention, quantize-on-write) against the torch reference: compiled on a GPU,
interpreted on CPU.

Without a GPU, tests/conftest.py sets ``TRITON_INTERPRET=1`` before anything imports triton (triton
reads it then); the numerics are then the interpreter's (numpy), not the GPU's, and
benchmarks/quant_attention.py checks the compiled kernels on the device across larger shapes.
Skipped where triton is not installed.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvlab.kernels import (
    FormatError,
    LaunchConfig,
    decode_attention,
    decode_attention_reference,
    kernel_variant,
    make_format,
    make_workspace,
    quantize_write,
)

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not 1 (set it before triton is imported)", allow_module_level=True)

TOL = {"atol": 3e-3, "rtol": 1e-2}  # float16 products, float32 accumulation

# The split kernel loops over slots with bounds read from memory; triton 3.6's interpreter cannot
# (TypeError: only 0-dimensional arrays can be converted to Python scalars), 3.9's can, and compiled
# triton always could. The write kernel runs interpreted on both.
_TRITON = tuple(int(x) for x in __import__("triton").__version__.split(".")[:2])
decode_kernel = pytest.mark.skipif(DEVICE == "cpu" and _TRITON < (3, 9),
                                   reason="the split kernel needs triton >= 3.9 to run interpreted")


def stores(name, batch, kv_heads, capacity, dim, group=None, seed=0):
    fmt = make_format(name, group=group)
    gen = torch.Generator().manual_seed(seed)
    k, v = (fmt.alloc(batch, kv_heads, capacity, dim, device=DEVICE) for _ in range(2))
    slots = torch.arange(capacity, device=DEVICE)
    fmt.write(k, torch.randn(batch, kv_heads, capacity, dim, generator=gen).to(DEVICE) * 2, slots)
    fmt.write(v, torch.randn(batch, kv_heads, capacity, dim, generator=gen).to(DEVICE), slots)
    return k, v


def check(name, batch, kv_heads, gqa, dim, capacity, lengths, group=None, q_dtype=torch.float32, workspace=None,
          variant=None):
    k, v = stores(name, batch, kv_heads, capacity, dim, group=group, seed=len(lengths) + dim)
    q = torch.randn(batch, kv_heads * gqa, dim, generator=torch.Generator().manual_seed(7)).to(DEVICE, q_dtype)
    lengths = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    scale = dim ** -0.5
    if variant is not None:
        workspace = make_workspace(q.shape[1], k, config=LaunchConfig(variant=variant))
        assert kernel_variant(workspace.config, k) == variant  # the case runs the kernel it names
    got = decode_attention(q, k, v, lengths, scale, backend="triton", workspace=workspace)
    assert got.dtype == q_dtype and got.shape == q.shape
    want = decode_attention_reference(q, k, v, lengths, scale)
    torch.testing.assert_close(got.float(), want, **TOL)
    return got


VARIANT_FORMATS = [("split", "bf16", None), ("split", "fp8", None), ("split", "int4", 64), ("split", "int2", 32),
                   ("fold", "bf16", None), ("fold", "fp8", None), ("fold", "int4", 32), ("fold", "int2", 64),
                   ("warp", "fp8", None), ("warp", "int4", 32), ("warp", "int4", 64),
                   ("warp2", "fp8", None), ("warp2", "int4", 32), ("warp2", "int4", 64)]


@decode_kernel
@pytest.mark.parametrize("variant,name,group", VARIANT_FORMATS)
def test_kernel_matches_reference(variant, name, group):
    # Odd lengths, a row of length 0, GQA 4 (padded to 16 rows), several splits (CPU plans for 8 SMs).
    check(name, batch=3, kv_heads=2, gqa=4, dim=64, capacity=141, lengths=[141, 0, 77], group=group,
          variant=variant)


@pytest.mark.slow(reason="the Triton CPU interpreter over the full format x group x shape grid "
                         "(test_kernel_matches_reference covers every format per kernel in the "
                         "fast suite)")
@decode_kernel
@pytest.mark.parametrize("variant", ["split", "fold", "warp", "warp2"])
@pytest.mark.parametrize("name,group", [("bf16", None), ("fp8", None), ("int4", 32), ("int4", 64),
                                        ("int4", 128), ("int2", 64), ("int2", 128)])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("batch,kv_heads,gqa,capacity,lengths", [
    (1, 1, 1, 1, [1]),
    (1, 2, 8, 130, [129]),
    (2, 1, 3, 64, [64, 63]),
    (4, 2, 2, 300, [1, 7, 300, 65]),
    (2, 1, 5, 200, [200, 133]),  # GQA 5: 8 rows per group (fold: 32 rows at group 32, head dim 128)
])
def test_kernel_matches_reference_across_shapes(variant, name, group, dim, batch, kv_heads, gqa, capacity,
                                                lengths):
    if group is not None and dim % group:
        pytest.skip("group larger than head_dim")
    if variant.startswith("warp") and name not in ("fp8", "int4"):
        pytest.skip("the warp kernel reads int4 and fp8 (fold runs the others)")
    check(name, batch, kv_heads, gqa, dim, capacity, lengths, group=group, variant=variant)


@decode_kernel
@pytest.mark.parametrize("name,group,dim", [("int4", 64, 128), ("int4", 128, 128), ("int4", 32, 64),
                                            ("fp8", None, 64)])
@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("block_n,num_warps", [(32, 2), (64, 4), (128, 8)])
@pytest.mark.parametrize("variant", ["warp", "warp2"])
def test_warp_kernel_over_block_shapes(name, group, dim, gqa, block_n, num_warps, variant):
    """The warp kernel's own edges: 16 slots per warp (128 slots on 8 warps), a masked last block
    where whole warps see no slot, rows that end inside a block, an empty row, GQA 1 (one row per group)."""
    if variant == "warp2" and name == "fp8":
        pytest.skip("warp2 runs warp's code on fp8")
    k, v = stores(name, 3, 2, 203, dim, group=group, seed=gqa + block_n)
    q = torch.randn(3, 2 * gqa, dim, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    lengths = torch.tensor([203, 0, 41], dtype=torch.int32, device=DEVICE)
    ws = make_workspace(2 * gqa, k, config=LaunchConfig(block_n=block_n, num_warps=num_warps, variant=variant))
    assert kernel_variant(ws.config, k) == variant and ws.num_splits > 1
    got = decode_attention(q, k, v, lengths, dim ** -0.5, backend="triton", workspace=ws)
    torch.testing.assert_close(got.float(), decode_attention_reference(q, k, v, lengths, dim ** -0.5), **TOL)


@decode_kernel
@pytest.mark.parametrize("variant", ["split", "fold", "warp", "warp2"])
@pytest.mark.parametrize("name,group", [("fp8", None), ("int4", 64)])
def test_small_value_scales_keep_the_long_tail(variant, name, group):
    """Values of range 1e-3 (tiny scales) and one dominant key among many weak ones: the fold kernel's
    float16 products of probability and scale must not flush the weak tokens' mass to zero."""
    fmt = make_format(name, group=group)
    capacity, dim = 700, 64
    gen = torch.Generator().manual_seed(21)
    k, v = fmt.alloc(1, 1, capacity, dim, device=DEVICE), fmt.alloc(1, 1, capacity, dim, device=DEVICE)
    slots = torch.arange(capacity, device=DEVICE)
    keys = torch.randn(1, 1, capacity, dim, generator=gen) * 0.3
    keys[0, 0, 5] = 0.375  # q . k_5 = 12 dominates: the others get p ~ e^-12 (1e-4..1e-7) of it
    fmt.write(k, keys.to(DEVICE), slots)
    values = torch.randn(1, 1, capacity, dim, generator=gen) * 1e-3 + 1e-3
    values[0, 0, 5] = 0.0
    fmt.write(v, values.to(DEVICE), slots)
    q = torch.full((1, 4, dim), 0.5).to(DEVICE)
    lengths = torch.tensor([capacity], dtype=torch.int32, device=DEVICE)
    ws = make_workspace(4, k, config=LaunchConfig(variant=variant))
    got = decode_attention(q, k, v, lengths, 1.0, backend="triton", workspace=ws)
    want = decode_attention_reference(q, k, v, lengths, 1.0)
    assert want.abs().max() > 1e-6  # the tail carries the whole answer (v_5 = 0)
    torch.testing.assert_close(got.float(), want, atol=1e-3 * float(want.abs().max()), rtol=2e-2)


def test_fold_variant_falls_back_where_it_cannot_read():
    config = LaunchConfig(variant="fold")
    assert kernel_variant(config, make_format("int2", group=32).alloc(1, 1, 4, 128)) == "split"  # depth 8
    assert kernel_variant(config, make_format("int4", group=32).alloc(1, 1, 4, 256)) == "split"  # 16 slices
    assert kernel_variant(config, make_format("int4", group=32).alloc(1, 1, 4, 128)) == "fold"
    assert kernel_variant(LaunchConfig(variant="split"), make_format("fp8").alloc(1, 1, 4, 64)) == "split"
    with pytest.raises(FormatError, match="variant must be one of"):
        LaunchConfig(variant="fast")


def test_warp_variant_reads_int4_and_fp8_and_falls_back_to_fold():
    config = LaunchConfig(variant="warp")
    assert kernel_variant(config, make_format("int4", group=32).alloc(1, 1, 4, 128)) == "warp"
    assert kernel_variant(config, make_format("fp8").alloc(1, 1, 4, 64)) == "warp"
    assert kernel_variant(config, make_format("bf16").alloc(1, 1, 4, 64)) == "fold"
    assert kernel_variant(config, make_format("int2", group=64).alloc(1, 1, 4, 128)) == "fold"
    assert kernel_variant(config, make_format("int2", group=32).alloc(1, 1, 4, 128)) == "split"
    assert kernel_variant(LaunchConfig(variant="warp2"), make_format("int4", group=64).alloc(1, 1, 4, 128)) == "warp2"
    assert kernel_variant(LaunchConfig(variant="warp2"), make_format("bf16").alloc(1, 1, 4, 64)) == "fold"


@decode_kernel
def test_fold_fallback_still_matches_reference():
    check("int2", batch=2, kv_heads=1, gqa=4, dim=128, capacity=90, lengths=[90, 41], group=32,
          workspace=make_workspace(4, make_format("int2", group=32).alloc(2, 1, 90, 128, device=DEVICE),
                                   config=LaunchConfig(variant="fold")))


@decode_kernel
@pytest.mark.parametrize("variant", ["split", "fold", "warp", "warp2"])
def test_kernel_writes_q_dtype_and_into_out(variant):
    got = check("int4", batch=2, kv_heads=1, gqa=2, dim=128, capacity=90, lengths=[90, 33], q_dtype=torch.bfloat16,
                variant=variant)
    k, v = stores("int4", 2, 1, 90, 128, seed=2 + 128)
    q = torch.randn(2, 2, 128, generator=torch.Generator().manual_seed(7)).to(DEVICE, torch.bfloat16)
    out = torch.empty_like(q)
    lengths = torch.tensor([90, 33], dtype=torch.int32, device=DEVICE)
    ws = make_workspace(2, k, config=LaunchConfig(variant=variant))
    assert decode_attention(q, k, v, lengths, 128 ** -0.5, out=out, backend="triton", workspace=ws) is out
    assert torch.equal(out, got)


@decode_kernel
def test_one_workspace_serves_every_length():
    """The graph-capture contract: fixed grid and buffers, lengths read on the device, stale partials ignored."""
    k, v = stores("fp8", 2, 1, 250, 64, seed=11)
    ws = make_workspace(2, k, num_splits=4, config=LaunchConfig())  # 64-slot blocks (fp8's tuned config: 128)
    assert (ws.num_splits, ws.split_len) == (4, 64)
    q = torch.randn(2, 2, 64, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    for lengths in ([250, 250], [130, 1], [0, 193], [128, 249]):
        lengths = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
        got = decode_attention(q, k, v, lengths, 0.125, backend="triton", workspace=ws)
        torch.testing.assert_close(got, decode_attention_reference(q, k, v, lengths, 0.125), **TOL)


@decode_kernel
def test_launch_config_changes_the_plan_not_the_result():
    k, v = stores("int4", 2, 2, 200, 64, seed=13)
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    lengths = torch.tensor([200, 97], dtype=torch.int32, device=DEVICE)
    ws = make_workspace(4, k, config=LaunchConfig(block_n=32, num_warps=2, num_stages=3))
    assert (ws.num_splits, ws.split_len) == (7, 32)  # 8 "SMs" on CPU want 8 splits; 200 slots hold 7 blocks
    got = decode_attention(q, k, v, lengths, 0.125, backend="triton", workspace=ws)
    torch.testing.assert_close(got, decode_attention_reference(q, k, v, lengths, 0.125), **TOL)
    with pytest.raises(FormatError, match="block_n must be"):
        LaunchConfig(block_n=48)
    small = stores("int4", 2, 2, 100, 64)[0]
    with pytest.raises(FormatError, match="build it with make_workspace"):
        decode_attention(q, k, v, lengths, 0.125, backend="triton", workspace=make_workspace(4, small))


def test_kernel_refuses_what_it_cannot_read():
    fmt = make_format("int2", group=32)
    k, v = fmt.alloc(1, 1, 8, 32, device=DEVICE), fmt.alloc(1, 1, 8, 32, device=DEVICE)
    q = torch.zeros(1, 1, 32, device=DEVICE)
    lengths = torch.tensor([8], dtype=torch.int32, device=DEVICE)
    with pytest.raises(FormatError, match="head_dim / 4 >= 16"):
        decode_attention(q, k, v, lengths, 1.0, backend="triton")
    k8 = make_format("fp8").alloc(1, 1, 8, 32, device=DEVICE)
    with pytest.raises(FormatError, match="K and V in one format"):
        decode_attention(q, k8, v, lengths, 1.0, backend="triton")


def mismatches(got, want):
    """Elements (codes, scales, zeros) that differ bit-wise between two stores."""
    return sum(int((a.view(torch.uint8) != b.view(torch.uint8)).sum()) if a.dtype == torch.float8_e4m3fn
               else int((a != b).sum()) for a, b in zip(got.tensors(), want.tensors(), strict=True))


# The interpreter runs the kernel's float32 steps exactly as torch does: bit for bit. On a GPU a fused
# multiply-add may move a code that sits exactly on a rounding tie by one.
ALLOWED = 0 if DEVICE == "cpu" else 4


@pytest.mark.parametrize("name,group,scale_dtype,per_row", [
    ("bf16", None, None, False), ("fp8", None, None, True), ("int4", 64, torch.float16, False),
    ("int4", 32, torch.float32, True), ("int2", 128, torch.float16, True), ("int2", 32, torch.float16, False)])
def test_write_kernel_matches_the_torch_write(name, group, scale_dtype, per_row):
    fmt = make_format(name, group=group, **({"scale_dtype": scale_dtype} if scale_dtype else {}))
    want, got = (fmt.alloc(2, 3, 10, 128, device=DEVICE) for _ in range(2))
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(2, 3, 4, 128, generator=gen) * 3 + torch.randn(2, 3, 4, 1, generator=gen) * 20).to(DEVICE)
    x[0, 0, 0, :64] = 0.0  # a flat group
    x[1, 2, 3] = 0.0  # an all-zero token
    positions = torch.tensor([[1, 5, 9, 0], [2, 3, 4, 7]] if per_row else [6, 1, 9, 3], device=DEVICE)
    fmt.write(want, x, positions)
    quantize_write(got, x.transpose(1, 2).contiguous().transpose(1, 2), positions, backend="triton")  # strided x
    assert mismatches(got, want) <= ALLOWED
    assert got.dequantize().abs().sum() > 0


@pytest.mark.parametrize("name,group", [("fp8", None), ("int4", 32), ("bf16", None)])
def test_write_kernel_writes_a_row_slice_of_a_store(name, group):
    """The fast engine loads a batch prefilled in row groups through ``store.rows(...)``: views at an
    offset into the same buffers, which the kernel must write and nothing around them."""
    fmt = make_format(name, group=group)
    want, got = (fmt.alloc(4, 2, 6, 64, device=DEVICE) for _ in range(2))
    x = torch.randn(2, 2, 3, 64, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    slots = torch.tensor([0, 5, 2], device=DEVICE)
    fmt.write(want.rows(slice(1, 3)), x, slots)
    quantize_write(got.rows(slice(1, 3)), x, slots, backend="triton")
    assert mismatches(got, want) <= ALLOWED
    assert got.dequantize()[1:3].abs().sum() > 0 and not got.dequantize()[[0, 3]].any()


def test_write_kernel_rounds_to_fp8_and_bf16_like_torch():
    """Every e4m3 value, the midpoints between neighbours (ties to even), subnormals, signs and -0."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid) & (grid.abs() <= 448)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    values = torch.cat([grid, mids, mids.nextafter(torch.tensor(-1e9)), mids.nextafter(torch.tensor(1e9)),
                        torch.tensor([-0.0, 2**-12, -(2**-11), 447.9, 1.5e-3, -3.3e-2])])
    rows = -(-values.numel() // 127)
    x = torch.zeros(rows * 127)
    x[:values.numel()] = values
    x = torch.cat([torch.full((rows, 1), 448.0), x.view(rows, 127)], 1)  # amax 448: the scale is exactly 1
    x = x.view(1, 1, rows, 128).to(DEVICE)
    for name in ("fp8", "bf16"):
        fmt = make_format(name)
        want, got = (fmt.alloc(1, 1, rows, 128, device=DEVICE) for _ in range(2))
        slots = torch.arange(rows, device=DEVICE)
        fmt.write(want, x, slots)
        quantize_write(got, x, slots, backend="triton")
        assert mismatches(got, want) == 0, name


def test_write_kernel_rejects_what_it_cannot_write():
    fmt = make_format("int4")
    store = fmt.alloc(1, 1, 4, 64, device=DEVICE)
    with pytest.raises(FormatError, match="positions must be"):
        quantize_write(store, torch.zeros(1, 1, 2, 64, device=DEVICE), torch.zeros(3, dtype=torch.int64, device=DEVICE),
                       backend="triton")
    with pytest.raises(FormatError, match="unit stride along D"):
        quantize_write(store, torch.zeros(1, 1, 64, 2, device=DEVICE).transpose(2, 3),
                       torch.zeros(2, dtype=torch.int64, device=DEVICE), backend="triton")


def _truncating_dot(bits):
    """The interpreter's ``tl.dot`` as a tensor core that sums each 16-deep step (16 exact products and the
    accumulator) aligned to the largest term and truncated ``bits`` bits below it (toward zero): the
    mechanism that costs a kernel the bits of any constant offset its operands carry (an H100 keeps more
    than ``bits``; fewer make the loss show at test sizes)."""
    import numpy as np
    from triton.runtime.interpreter import TensorHandle

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        x, y, acc = a.data.astype(np.float64), b.data.astype(np.float64), d.data.astype(np.float64)
        for k0 in range(0, x.shape[-1], 16):
            terms = x[..., :, k0:k0 + 16, None] * y[..., None, k0:k0 + 16, :]  # [..., M, 16, N]
            top = np.maximum(np.abs(terms).max(-2), np.abs(acc))
            ulp = np.exp2(np.floor(np.log2(np.where(top > 0, top, 1.0))) - bits + 1)
            acc = np.trunc((terms.sum(-2) + acc) / ulp) * ulp
        return TensorHandle(acc.astype(d.data.dtype), d.dtype.scalar)
    return create_dot


@pytest.mark.skipif(DEVICE != "cpu", reason="patches the CPU interpreter's tl.dot")
@decode_kernel
def test_warp2_loses_no_more_to_truncated_accumulation_than_warp(monkeypatch):
    """Under a tensor core that truncates its sums (:func:`_truncating_dot`, 14 bits), warp2's in-place
    quarters keep warp's precision: their codes reach the products as c * 2**-k with no 1 to take off later
    (``1 + c / 1024`` lost 10 of the 14 bits, ``1 + c / 16`` (warp) 4). Numpy's exact sums cannot tell."""
    from triton.runtime.interpreter import InterpreterBuilder

    monkeypatch.setattr(InterpreterBuilder, "create_dot", _truncating_dot(14))
    k, v = stores("int4", 1, 1, 512, 128, group=64, seed=3)
    q = torch.randn(1, 4, 128, generator=torch.Generator().manual_seed(4))
    lengths = torch.tensor([512], dtype=torch.int32)
    want = decode_attention_reference(q, k, v, lengths, 128 ** -0.5)
    err = {}
    for variant in ("warp", "warp2"):
        ws = make_workspace(4, k, config=LaunchConfig(variant=variant, block_n=128, num_warps=4))
        got = decode_attention(q, k, v, lengths, 128 ** -0.5, backend="triton", workspace=ws)
        err[variant] = float((got.float() - want).norm() / want.norm())
    assert err["warp"] < 2e-2, err  # the model leaves warp usable
    assert err["warp2"] <= 1.5 * err["warp"], err
