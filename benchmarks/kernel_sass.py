"""Static cost of the decode kernels' inner loop, without a GPU: compile for sm_90, count SASS.

Not a test and not a timing: triton compiles each split-step kernel variant ahead of time for a
given target (its bundled ptxas and cuobjdump; no driver or GPU needed), and this prints the
instructions of the longest loop (the loop over BLOCK_N slots) by opcode, per iteration and per
slot of one KV head. Fewer instructions per byte read is what lets a kernel approach the copy
bandwidth; benchmarks/quant_attention.py measures the real thing on the GPU.

    TRITON_INTERPRET=0 python benchmarks/kernel_sass.py                      # Llama-3.1-8B shape
    python benchmarks/kernel_sass.py --block-n 128 --num-warps 8 --formats int4-g64 fp8

Pointers are compiled 16-byte aligned (as the JIT specializes them at run time).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["TRITON_INTERPRET"] = "0"  # before triton is imported: compile, never interpret

from kvlab.kernels.decode import warp_count  # noqa: E402
from kvlab.kernels.formats import FMT_BF16, FMT_FP8, LaunchConfig, parse_format  # noqa: E402

SIGNATURE = {"q_ptr": "*bf16", "kc_ptr": "*u8", "ks_ptr": "*fp16", "kz_ptr": "*fp16", "vc_ptr": "*u8",
             "vs_ptr": "*fp16", "vz_ptr": "*fp16", "len_ptr": "*i32", "part_out_ptr": "*fp32",
             "part_lse_ptr": "*fp32", "qk_scale": "fp32", "Hq": "i32", "Hkv": "i32", "T": "i32", "split_len": "i32",
             "num_splits": "i32", "G": "i32"}
FP8_SCALES = {"ks_ptr": "*fp32", "kz_ptr": "*i32", "vs_ptr": "*fp32", "vz_ptr": "*i32"}


def signature_overrides(fmt) -> dict[str, str]:
    """The pointer types of a format's stores where they differ from :data:`SIGNATURE` (int's)."""
    if fmt.kernel == FMT_FP8:
        return FP8_SCALES
    if fmt.kernel == FMT_BF16:
        return {"kc_ptr": "*bf16", "vc_ptr": "*bf16", **FP8_SCALES}
    return {}


def compile_variant(variant: str, label: str, head_dim: int, gqa: int, block_n: int, num_warps: int,
                    num_stages: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvlab.kernels.decode_fold import decode_fold_kernel
    from kvlab.kernels.decode_split import decode_split_kernel
    from kvlab.kernels.decode_warp import decode_warp_kernel

    fmt = parse_format(label)
    slot_bytes = 2 * fmt.bytes_per_token(1, head_dim)
    gp = 1 << max(0, gqa - 1).bit_length()
    group = fmt.group_size(head_dim)
    if variant == "split":
        kernel = decode_split_kernel
        consts = {"D": head_dim, "BLOCK_H": max(16, gp), "BLOCK_N": block_n, "FMT": fmt.kernel, "BITS": fmt.bits,
                  "PACK": fmt.pack, "QGROUP": group}
    elif variant.startswith("warp"):
        kernel = decode_warp_kernel
        ng = head_dim // group
        num_warps = warp_count(LaunchConfig(block_n=block_n, num_warps=num_warps))
        consts = {"D": head_dim, "BLOCK_M": 1 << max(0, ng * gp - 1).bit_length(), "GP": gp, "NG": ng,
                  "BLOCK_N": block_n, "FMT": fmt.kernel, "ASM": variant == "warp_asm", "W": num_warps}
    else:
        kernel = decode_fold_kernel
        ng = head_dim // group
        consts = {"D": head_dim, "BLOCK_M": max(16, 1 << max(0, ng * gp - 1).bit_length()), "GP": gp, "NG": ng,
                  "BLOCK_N": block_n, "FMT": fmt.kernel, "BITS": fmt.bits, "PACK": fmt.pack,
                  "ASM": variant == "fold_asm" and fmt.asm_unpack}
    signature = {**SIGNATURE, **signature_overrides(fmt), **{k: "constexpr" for k in consts}}
    names = list(kernel.arg_names)
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k, v in signature.items() if v.startswith("*")}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    return compiled.asm["cubin"], slot_bytes, num_warps


def loop_opcodes(cubin: bytes, tmp: Path) -> tuple[collections.Counter, int]:
    """Opcode counts of the longest backward-branch loop in the cubin's SASS, and the kernel's length."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    tmp.write_bytes(cubin)
    sass = subprocess.run([str(tool), "-sass", str(tmp)], capture_output=True, text=True, check=True).stdout
    lines = [(int(m.group(1), 16), m.group(2).strip()) for m in
             (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", ln) for ln in sass.splitlines()) if m]
    index = {addr: i for i, (addr, _) in enumerate(lines)}
    loops = []
    for i, (addr, ins) in enumerate(lines):
        target = re.search(r"0x([0-9a-f]+)", ins) if "BRA" in ins else None
        if target and int(target.group(1), 16) < addr and int(target.group(1), 16) in index:
            loops.append((index[int(target.group(1), 16)], i))
    if not loops:
        return collections.Counter(), len(lines)
    start, end = max(loops, key=lambda se: se[1] - se[0])
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0].split(".")[0]
                              for _, ins in lines[start:end + 1])
    return ops, len(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", nargs="+", default=["bf16", "fp8", "int4-g64", "int4-g32", "int2-g64"])
    ap.add_argument("--variants", nargs="+", default=["split", "fold", "fold_asm", "warp", "warp_asm"])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--gqa", type=int, default=4)
    ap.add_argument("--block-n", type=int, default=64)
    ap.add_argument("--num-warps", type=int, default=4)
    ap.add_argument("--num-stages", type=int, default=2)
    args = ap.parse_args()
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvlab-kernel-{os.getpid()}.cubin"
    print(f"sm_90, head dim {args.head_dim}, GQA {args.gqa}, block_n {args.block_n}, {args.num_warps} warps, "
          f"{args.num_stages} stages: SASS instructions of the slot loop")
    print(f"{'format':<10} {'kernel':<9} {'per iter':>8} {'per slot':>8} {'B/instr':>7}  top opcodes (per warp per iter)")
    for label in args.formats:
        for variant in args.variants:
            fmt = parse_format(label)
            if variant == "fold_asm" and not fmt.asm_unpack or variant.startswith("warp") and not fmt.warp_reads(
                    args.head_dim):
                continue  # runs fold there: counted as fold
            try:
                cubin, slot_bytes, warps = compile_variant(variant, label, args.head_dim, args.gqa, args.block_n,
                                                           args.num_warps, args.num_stages)
                ops, _ = loop_opcodes(cubin, tmp)
            except Exception as err:  # noqa: BLE001 - one failure must not hide the others
                print(f"{label:<10} {variant:<9} FAILED {type(err).__name__}: {str(err)[:200]}")
                continue
            per_iter = sum(ops.values())
            per_slot = per_iter * warps / args.block_n  # warp instructions per slot (all warps)
            print(f"{label:<10} {variant:<9} {per_iter:>8} {per_slot:>8.1f} {slot_bytes / per_slot:>7.2f}  "
                  + ", ".join(f"{k} {v}" for k, v in ops.most_common(8)))
    tmp.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
