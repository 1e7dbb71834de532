"""Static cost of the decode kernels' inner loop, without a GPU: compile for sm_90, count SASS.

Not a test and not a timing: triton compiles each split-step kernel variant ahead of time for a
given target (its bundled ptxas and cuobjdump; no driver or GPU needed), and this prints the
instructions of the longest loop (the loop over BLOCK_N slots) by opcode, per iteration and per
slot of one KV head. Fewer instructions per byte read is what lets a kernel approach the copy
bandwidth; benchmarks/quant_attention.py measures the real thing on the GPU.

    TRITON_INTERPRET=0 python benchmarks/kernel_sass.py                      # Llama-3.1-8B shape
    python benchmarks/kernel_sass.py --block-n 128 --num-warps 8 --formats int4-g64 fp8
    python benchmarks/kernel_sass.py --kivi k2v2 k4v2 --variants kivi kivi_warp_asm   # KIVI stores (G 32)
    python benchmarks/kernel_sass.py --block-n 128 --num-stages 3 --formats int4-g64 --variants warp_asm --categories

``--categories`` adds, per kernel, the loop's instructions per slot by what they do (:data:`CATEGORY_RULES`:
each SASS instruction of the loop by its opcode and the jit function and source line it comes from, as
nvdisasm's line info names them).

KIVI (``--kivi``): the code loop of :func:`kvlab.kernels.kivi_triton.kivi_decode_kernel` compiled as
its ``split`` variant (``kivi``, one key group of G tokens per iteration) or its ``warp`` variant
(:mod:`kvlab.kernels.kivi_warp`; ``kivi_warp``/``kivi_warp_asm``, ``num_warps`` groups per iteration),
per quantized token; bytes per token are the store's
(:meth:`kvlab.kernels.kivi.KiviSpec.token_bytes`: codes, the key group's scales shared by G tokens,
the token's value scales).

Pointers are compiled 16-byte aligned (as the JIT specializes them at run time).
"""

from __future__ import annotations

import argparse
import ast
import collections
import functools
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

    from kvlab.kernels.decode_entry import decode_kernel, entry_constants

    fmt = parse_format(label)
    slot_bytes = 2 * fmt.bytes_per_token(1, head_dim)
    if variant.startswith("warp"):
        num_warps = warp_count(LaunchConfig(block_n=block_n, num_warps=num_warps))
    kernel = decode_kernel
    consts = entry_constants(variant, fmt, head_dim, gqa, LaunchConfig(block_n=block_n), num_warps)
    signature = {**SIGNATURE, **signature_overrides(fmt), **{k: "constexpr" for k in consts}}
    names = list(kernel.arg_names)
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k, v in signature.items() if v.startswith("*")}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    return compiled.asm["cubin"], slot_bytes, num_warps


KIVI_SIGNATURE = {"q_ptr": "*bf16", "kc_ptr": "*u8", "ks_ptr": "*fp16", "kz_ptr": "*fp16", "vc_ptr": "*u8",
                  "vs_ptr": "*fp16", "vz_ptr": "*fp16", "rk_ptr": "*bf16", "rv_ptr": "*bf16", "len_ptr": "*i32",
                  "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "qk_scale": "fp32", "Hq": "i32", "Hkv": "i32",
                  "TQ": "i32", "NKG": "i32", "W": "i32", "R": "i32", "split_groups": "i32", "num_splits": "i32",
                  "GQ": "i32"}


def kivi_spec(label: str, group: int, value_group: int):
    """``k2v2`` -> :class:`kvlab.kernels.kivi.KiviSpec` with those key and value bits."""
    from kvlab.kernels import kivi

    m = re.fullmatch(r"k([24])v([24])", label)
    if not m:
        raise SystemExit(f"KIVI stores are named k<key bits>v<value bits> (k2v2, k4v2, k4v4), not {label!r}")
    return kivi.KiviSpec(bits=int(m.group(2)), key_bits=int(m.group(1)), group=group, value_group=value_group)


def compile_kivi(variant: str, spec, head_dim: int, gqa: int, num_warps: int, num_stages: int):
    """The cubin of the KIVI decode kernel compiled as one variant, and how many quantized tokens one
    iteration of its code loop reads (all warps)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvlab.kernels.kivi_triton import launch_constants

    resolved = "split" if variant == "kivi" else variant.removeprefix("kivi_")
    kernel, consts, warps, per_iter = launch_constants(resolved, spec, head_dim, gqa, num_warps)
    signature = {**KIVI_SIGNATURE, **{k: "constexpr" for k in consts}}
    names = list(kernel.arg_names)
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k, v in signature.items() if v.startswith("*")}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": num_stages})
    return compiled.asm["cubin"], warps, per_iter


def ring_function(variant: str):
    """The jit helper only a KIVI variant's ring loop calls."""
    from kvlab.kernels import kivi_triton, kivi_warp

    return kivi_triton.ring_plane if variant == "kivi" else kivi_warp.ring_tile


def kivi_rows(args, tmp: Path) -> None:
    """The ``--kivi`` table: SASS of each KIVI variant's code loop per quantized token."""
    print(f"sm_90 KIVI, head dim {args.head_dim}, GQA {args.gqa}, G {args.group}, value group {args.value_group}, "
          f"{args.num_warps} warps, {args.num_stages} stages: SASS instructions of the code loop")
    print(f"{'store':<6} {'kernel':<14} {'per iter':>8} {'per slot':>8} {'B/instr':>7}  top opcodes (per warp per iter)")
    for label in args.kivi:
        spec = kivi_spec(label, args.group, args.value_group)
        for variant in args.variants:
            try:
                cubin, warps, per_iter_slots = compile_kivi(variant, spec, args.head_dim, args.gqa, args.num_warps,
                                                            args.num_stages)
                ops = code_loop(cubin, tmp, ring_function(variant))
            except Exception as err:  # noqa: BLE001 - one failure must not hide the others
                print(f"{label:<6} {variant:<14} FAILED {type(err).__name__}: {str(err)[:300]}")
                continue
            per_iter = sum(ops.values())
            per_slot = per_iter * warps / per_iter_slots
            slot_bytes = spec.token_bytes(args.head_dim)
            print(f"{label:<6} {variant:<14} {per_iter:>8} {per_slot:>8.1f} {slot_bytes / per_slot:>7.2f}  "
                  + ", ".join(f"{k} {v}" for k, v in ops.most_common(8)))


def source_lines(fn) -> tuple[str, range]:
    """The file and line range of a jit function's source (to tell its loop's SASS from another's)."""
    import inspect

    lines, first = inspect.getsourcelines(fn.fn)
    return inspect.getsourcefile(fn.fn), range(first, first + len(lines))


def loops_with_lines(cubin: bytes, tmp: Path) -> list[tuple[collections.Counter, set]]:
    """Each backward-branch loop of the cubin's SASS (nvdisasm, with line info): its opcode counts
    and the ``(file, line)`` pairs its instructions come from."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    tmp.write_bytes(cubin)
    text = subprocess.run([str(tool), "--print-line-info", "-c", str(tmp)], capture_output=True, text=True,
                          check=True).stdout.splitlines()
    labels = {m.group(1): i for i, ln in enumerate(text) if (m := re.match(r"^(\.L_x_\d+):", ln))}
    loops = []
    for i, ln in enumerate(text):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", ln)
        if not (m and labels.get(m.group(1), i) < i):
            continue
        ops, where, here = collections.Counter(), set(), None
        for body in text[labels[m.group(1)]:i + 1]:
            f = re.search(r'File "(.*?)", line (\d+)', body)
            if f:
                here = (f.group(1), int(f.group(2)))
                continue
            ins = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", body)
            if ins:
                ops[ins.group(1)] += 1
                where.add(here)
        loops.append((ops, where))
    return loops


def code_loop(cubin: bytes, tmp: Path, ring_fn) -> collections.Counter:
    """Opcodes of the longest loop that runs none of ``ring_fn`` (a KIVI kernel's code loop, not its ring's)."""
    path, span = source_lines(ring_fn)
    loops = [ops for ops, where in loops_with_lines(cubin, tmp)
             if not any(w and w[0] == path and w[1] in span for w in where)]
    return max(loops, key=lambda ops: sum(ops.values()), default=collections.Counter())


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


UNPACK_FUNCTIONS = r"word|plane|unit|codes|unpack"  # jit helpers that turn code words into float16 operands
SCALE_FUNCTIONS = r"scale|zero|top|group_score|by_row|row_values|half|weights|row_sum|by_group|row_vec"
INT_OPS = r"IMAD|IADD3|IADD|LEA|VIADD|VIMNMX|SHF|MOV|LOP3|IABS|ULEA|UIMAD|USHF|ULOP3|UMOV|S2R|S2UR|R2UR|SGXT|IMNMX"

# (category, opcode, jit function, source line): regular expressions, None matches anything; the first rule
# an instruction matches names its category. Function and line are those of the instruction's innermost
# kvlab frame (:func:`kvlab_frame`): tl.sum's butterfly counts where it is called, an inline PTX
# instruction where its asm is called.
CATEGORY_RULES = (
    ("global loads", r"LDG|LDGSTS|LDGDEPBAR|DEPBAR", None, None),  # LDGSTS: cp.async of the pipelined loads
    ("shared memory", r"LDS|LDSM|STS|BAR", None, None),  # LDSM: ldmatrix of the code words
    ("shuffles", r"SHFL", None, None),  # reductions over slots (max, sums), the p^T exchange
    ("mma", r"HMMA|IMMA|HGMMA", None, None),
    ("loop/predicates", r".*", None, r"^\s*for "),  # the loop's own counters and branch
    ("address/int", INT_OPS, None, r"load\(|ptr"),  # offsets of loads
    ("unpack", r".*", UNPACK_FUNCTIONS, None),  # LOP3/SHF/IMAD.SHL/PRMT/F2FP... of the code words
    ("unpack", r"F2FP\.F16\.E[45]M[23]", None, None),  # fp8 codes to float16 (ptxas may place it on the next line)
    ("scales/zeros", r".*", SCALE_FUNCTIONS, None),  # group scales and zeros: converts, products, 1 / top
    ("scales/zeros", r"F\w+|HADD2", None, r"_sc\b|_group_score"),  # fp8 key scale, the groups' scores summed
    ("p -> operand", r"F2FP|PRMT", None, r"dot\("),  # p to float16 and into the value product's layout
    ("acc rescale", r"FMUL|FFMA", None, r"\bacc"),  # accumulators times alpha (and unit)
    ("softmax", r"MUFU|FMNMX|F\w+|HADD2|HMUL2|HFMA2", None, None),  # max, exp2, sums (FADD/FFMA butterflies)
    ("loop/predicates", r"BRA|ISETP|UISETP|SEL|USEL|UIADD3|PLOP3|NOP|P2R|R2P|WARPSYNC", None, None),
    ("address/int", INT_OPS, None, None),  # other index math and moves
    ("other", r".*", None, None),
)


@functools.cache
def function_lines(path: str) -> dict[int, str]:
    """Line -> name of the innermost function defined around it, for a source file (empty when unreadable)."""
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError):
        return {}
    names = {}
    for node in sorted((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)), key=lambda n: n.lineno):
        names.update(dict.fromkeys(range(node.lineno, node.end_lineno + 1), node.name))
    return names


@functools.cache
def source_line(path: str, line: int) -> str:
    try:
        return Path(path).read_text().splitlines()[line - 1]
    except (OSError, IndexError):
        return ""


def kvlab_frame(frames: tuple[tuple[str, int], ...]) -> tuple[str, str]:
    """``(function, source text)`` of the innermost frame outside the triton package whose function its
    caller's line calls (ptxas numbers an inline asm's instructions as lines after the call, which lands
    them in whatever follows it), else empty strings."""
    ours = [(function_lines(path).get(line, ""), source_line(path, line)) for path, line in frames
            if "/triton/" not in path]
    for (fn, text), (_, caller) in zip(ours, ours[1:] + [("", "")], strict=True):
        if fn and (not caller or re.search(rf"\b{fn}\(", caller)):
            return fn, text
    return ours[-1] if ours else ("", "")


def categorize(opcode: str, function: str, text: str) -> str:
    """The :data:`CATEGORY_RULES` category of one SASS instruction (full opcode, e.g. ``IMAD.SHL.U32``)."""
    for name, op, fn, line in CATEGORY_RULES:
        if (re.match(rf"(?:{op})\b", opcode) and (fn is None or re.search(fn, function))
                and (line is None or re.search(line, text))):
            return name
    return "other"


def loop_instructions(cubin: bytes, tmp: Path) -> list[tuple[str, tuple[tuple[str, int], ...]]]:
    """The longest backward-branch loop of the cubin's SASS (nvdisasm with inlining line info): each
    instruction's full opcode and its source frames, innermost first."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    tmp.write_bytes(cubin)
    text = subprocess.run([str(tool), "--print-line-info-inline", "-c", str(tmp)], capture_output=True, text=True,
                          check=True).stdout.splitlines()
    labels = {m.group(1): i for i, ln in enumerate(text) if (m := re.match(r"^(\.L_x_\d+):", ln))}
    spans = [(labels[m.group(1)], i) for i, ln in enumerate(text)
             if (m := re.search(r"BRA `\((\.L_x_\d+)\)", ln)) and labels.get(m.group(1), i) < i]
    if not spans:
        return []
    start, end = max(spans, key=lambda se: se[1] - se[0])
    out, frames, fresh = [], [], True
    for ln in text[start:end + 1]:
        f = re.match(r'\s*//## File "(.*?)", line (\d+)', ln)
        if f:  # one line per frame, innermost first ("line 105 inlined at ..., line 125", then line 125's)
            frames, fresh = ([] if fresh else frames) + [(f.group(1), int(f.group(2)))], False
            continue
        ins = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", ln)
        if ins:
            out.append((ins.group(1), tuple(frames)))
            fresh = True
    return out


def category_counts(cubin: bytes, tmp: Path) -> collections.Counter:
    """Instructions of the slot loop per :data:`CATEGORY_RULES` category (per warp per iteration)."""
    return collections.Counter(categorize(op, *kvlab_frame(frames)) for op, frames in loop_instructions(cubin, tmp))


def print_categories(rows: list[tuple[str, collections.Counter, float]]) -> None:
    """The ``--categories`` table: a column per kernel (``(label, counts, slots per warp instruction)``)."""
    names = list(dict.fromkeys(name for name, *_ in CATEGORY_RULES))
    print("SASS per slot by category (CATEGORY_RULES in benchmarks/kernel_sass.py)")
    print(f"{'category':<16}" + "".join(f" {label:>18}" for label, _, _ in rows))
    for name in names + ["total"]:
        cells = [(sum(c.values()) if name == "total" else c[name]) * per for _, c, per in rows]
        if name == "total" or any(cells):
            print(f"{name:<16}" + "".join(f" {x:>18.2f}" for x in cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", nargs="+", default=["bf16", "fp8", "int4-g64", "int4-g32", "int2-g64"])
    ap.add_argument("--variants", nargs="+", default=["split", "fold", "fold_asm", "warp", "warp_asm"])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--gqa", type=int, default=4)
    ap.add_argument("--block-n", type=int, default=64)
    ap.add_argument("--num-warps", type=int, default=4)
    ap.add_argument("--num-stages", type=int, default=2)
    ap.add_argument("--kivi", nargs="+", metavar="STORE",
                    help="count KIVI stores instead (k2v2, k4v2, k4v4); variants kivi, kivi_warp, kivi_warp_asm")
    ap.add_argument("--group", type=int, default=32, help="KIVI key group (tokens)")
    ap.add_argument("--value-group", type=int, default=32, help="KIVI value group (head-dim elements)")
    ap.add_argument("--categories", action="store_true",
                    help="also print each kernel's loop instructions per slot by category (unpack, mma, softmax, ...)")
    args = ap.parse_args()
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvlab-kernel-{os.getpid()}.cubin"
    if args.kivi:
        if args.variants == ap.get_default("variants"):
            args.variants = ["kivi", "kivi_warp", "kivi_warp_asm"]
        kivi_rows(args, tmp)
        tmp.unlink(missing_ok=True)
        return
    print(f"sm_90, head dim {args.head_dim}, GQA {args.gqa}, block_n {args.block_n}, {args.num_warps} warps, "
          f"{args.num_stages} stages: SASS instructions of the slot loop")
    print(f"{'format':<10} {'kernel':<9} {'per iter':>8} {'per slot':>8} {'B/instr':>7}  top opcodes (per warp per iter)")
    categories = []
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
            if args.categories:
                categories.append((f"{label} {variant}", category_counts(cubin, tmp), warps / args.block_n))
    if categories:
        print()
        print_categories(categories)
    tmp.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
