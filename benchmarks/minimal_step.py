"""kvlab's fast decode step beside a minimal graph-captured step built from the same weights (issue #28).

The minimal step is the gpt-fast-style yardstick of shared/reference/h200-measurements.md: bf16
weights as plain tensors (the very tensors kvlab's step uses: its fused q/k/v and gate/up), per layer
``F.rms_norm`` in the model dtype, one QKV matmul, RoPE from a precomputed table, the new K/V written
into static ``[B, Hkv, C, D]`` buffers in place, SDPA with ``enable_gqa=True`` over all ``C`` slots (no
mask, so the flash backend runs; C = ctx + new tokens), one gate/up matmul, SiLU, down matmul; the
LM head in bf16 and argmax into a static token tensor. The whole step is captured once in a CUDA
graph and replayed. kvlab's step is ``FastEngine``'s default (layers compiled inside kvlab's graph,
flash varlen over the static store, float32 norms, ``StepSlots`` lengths, token bookkeeping).

Per batch: ms/step from CUDA events over replays, J/token from the NVML counter over steady windows
of ``--seconds`` (``--repeats`` rounds, the engines alternating within each, same process; a window
follows the timed steps, so it never starts from idle), then torch.profiler's kernel table of
``--profile-steps`` replays of each step (kernels per step, µs per step, side by side), the same
grouped by what each kernel is for (:func:`work_of`, with the difference per step), the kernels
that differ most, and one eager step of each (the ops, with the host's share), so the extra work
per step shows. ``--variants`` then measures kvlab's step again with other
:class:`kvlab.engine.fast.FastEngine` options (``flash_splits=8``: flash's split-KV count;
``attention=cudnn``: cuDNN's attention instead of flash's), each built beside kvlab's step and
alternated with it in every round of energy windows (its ratio to kvlab's step carries an interval
from 3 rounds up); a variant whose store does not fit beside it (or ``--variants-apart``) is
measured after it, alone, and its row says ``alternated: false``.

On the H200 (Llama-3.1-8B shape, synthetic weights, 16k, batch 1 and 16; ~2 min):

    python benchmarks/minimal_step.py --batch 1 16 --ctx 16384 --seconds 5 --repeats 2 --kv-fill random \
        --out $OUT/minimal_step.json

Both steps read the same K/V: the minimal step's buffers are kvlab's store (the same layout), so
batch 16 at 16k holds one store (50 GB with the weights), not two.
``--kv-fill zeros`` (the default) leaves them zero; ``random`` fills them with normal values, as a
prefilled cache holds: the kernels read the same bytes either way, but the power drawn depends on
the data (a zero cache draws less), and the engine's own runs (``engines.py``) read a prefilled one.
``--device cpu --model tiny-llama --ctx 32`` smoke-tests the script (no graph, no energy).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_timing import graph_of  # noqa: E402


class MinimalStep:
    """One decode step, gpt-fast style, over the weights of a :class:`kvlab.engine.llama.LlamaFamilyStep`.

    ``kv_keys``/``kv_values``: per layer ``[B, Hkv, C, D]`` static buffers (``kv``: per layer ``(keys,
    values)`` to use instead, e.g. kvlab's dense store, whose layout this is); ``token [B, 1]``; ``pos
    [1]`` (the slot and position of the token, the same for every row). ``step()`` writes the next
    token into ``token`` and advances ``pos``; it returns the logits ``[B, V]`` (model dtype)."""

    def __init__(self, fam, batch: int, capacity: int, device, dtype, kv=None):
        self.fam = fam
        inner = fam.layers
        self.hq, self.hkv, self.d = fam.heads
        self.hidden = fam.embed.weight.shape[1]
        self.embed_w = fam.embed.weight
        self.ln1 = [la.input_layernorm.weight for la in inner]
        self.ln2 = [la.post_attention_layernorm.weight for la in inner]
        self.wo = [la.self_attn.o_proj.weight for la in inner]
        self.wdown = [la.mlp.down_proj.weight for la in inner]
        self.wqkv = [w for w, _ in fam.qkv]
        self.wgu = [w for w, _ in fam.gate_up]
        if any(b is not None for _, b in fam.qkv + fam.gate_up):
            raise ValueError("the minimal step has no biases: use a model without q/k/v or MLP biases")
        self.eps = fam.eps
        self.norm_w, self.norm_eps = fam.norm.weight, fam.eps[-1][1]
        self.head_w = fam.lm_head.weight
        self.scale = fam.scaling
        shape = (batch, self.hkv, capacity, self.d)
        if kv is not None and any(k.shape != shape or v.shape != shape for k, v in kv):
            raise ValueError(f"the minimal step's K/V buffers are {list(shape)} per layer")
        self.kv_keys = [k for k, _ in kv] if kv else [torch.zeros(shape, dtype=dtype, device=device) for _ in inner]
        self.kv_values = [v for _, v in kv] if kv else [torch.zeros(shape, dtype=dtype, device=device) for _ in inner]
        positions = torch.arange(capacity, device=device)
        dummy = torch.zeros(1, 1, self.hidden, dtype=dtype, device=device)
        cos, sin = fam.rotary(dummy, positions[None])  # [1, C, D], the model's own RoPE (scaling included)
        self.cos, self.sin = cos[0].to(dtype), sin[0].to(dtype)
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)

    @staticmethod
    def _rope(x, cos, sin):
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def step(self) -> torch.Tensor:
        b = self.token.shape[0]
        x = F.embedding(self.token, self.embed_w)  # [B, 1, H]
        cos = self.cos.index_select(0, self.pos).view(1, 1, 1, self.d)
        sin = self.sin.index_select(0, self.pos).view(1, 1, 1, self.d)
        for i in range(len(self.wqkv)):
            h = F.rms_norm(x, (self.hidden,), self.ln1[i], self.eps[i][0])
            q, k, v = F.linear(h, self.wqkv[i]).split((self.hq * self.d, self.hkv * self.d, self.hkv * self.d), -1)
            q = self._rope(q.view(b, 1, self.hq, self.d).transpose(1, 2), cos, sin)
            k = self._rope(k.view(b, 1, self.hkv, self.d).transpose(1, 2), cos, sin)
            self.kv_keys[i].index_copy_(2, self.pos, k)
            self.kv_values[i].index_copy_(2, self.pos, v.view(b, 1, self.hkv, self.d).transpose(1, 2))
            o = F.scaled_dot_product_attention(q, self.kv_keys[i], self.kv_values[i], scale=self.scale,
                                               enable_gqa=True)
            x = x + F.linear(o.transpose(1, 2).reshape(b, 1, -1), self.wo[i])
            h = F.rms_norm(x, (self.hidden,), self.ln2[i], self.eps[i][1])
            gate, up = F.linear(h, self.wgu[i]).chunk(2, -1)
            x = x + F.linear(F.silu(gate) * up, self.wdown[i])
        logits = F.linear(F.rms_norm(x[:, -1], (self.hidden,), self.norm_w, self.norm_eps), self.head_w)
        self.token.copy_(logits.argmax(-1, keepdim=True))
        self.pos.add_(1)
        return logits


def capture(fn, device):
    """``fn`` captured in a CUDA graph after 3 warm-up calls on a side stream (None on CPU)."""
    return graph_of(fn, device) if str(device).startswith("cuda") else None


class Runner:
    """``run(n)``: n decode steps of one engine, from its first slot (steps beyond its room wrap)."""

    def __init__(self, name, one_step, reset, room, graph=None):
        self.name, self.one_step, self.reset, self.room, self.graph = name, one_step, reset, room, graph

    def run(self, n: int) -> None:
        done = 0
        while done < n:
            self.reset()
            k = min(self.room, n - done)
            for _ in range(k):
                self.graph.replay() if self.graph is not None else self.one_step()
            done += k


def kvlab_runner(loaded, batch, ctx, new_tokens, name="kvlab fast", fill="zeros", **options):
    """kvlab's fast step (``options``: :class:`~kvlab.engine.fast.FastEngine` keyword arguments), its
    store's K/V filled per :func:`fill_kv` after the capture (every variant gets the same values)."""
    from kvlab.engine.engines import make_engine
    from kvlab.policies import make_policy

    engine = make_engine("fast", loaded, **options)
    decoder = engine.decoder(make_policy("full"), batch, ctx, new_tokens)  # captured here on CUDA
    fill_kv(decoder.store.keys + decoder.store.values, fill)

    def reset():
        decoder.store.step.zero_()
        decoder.position.fill_(ctx)

    step = decoder._step
    return engine, decoder, Runner(name, step, reset, new_tokens - 1, decoder.graph)


def minimal_runner(step, batch, ctx, new_tokens, device, dtype, kv=None):
    """The minimal step over ``step``'s weights; ``kv``: its K/V buffers (kvlab's store: both steps read
    the same bytes, and one store's memory, not two, at batch 16)."""
    m = MinimalStep(step, batch, ctx + new_tokens, device, dtype, kv)

    def reset():
        m.pos.fill_(ctx)

    with torch.no_grad():
        graph = capture(m.step, device)
    return m, Runner("minimal", m.step, reset, new_tokens - 1, graph)


KV_FILLS = ("zeros", "random")


def fill_kv(buffers: list[torch.Tensor], fill: str, seed: int = 0) -> None:
    """``zeros`` leaves the buffers as allocated; ``random`` fills them with normal values (what a
    prefilled cache holds, as far as the power drawn reading it goes)."""
    if fill not in KV_FILLS:
        raise ValueError(f"kv fill {fill!r}: use one of {', '.join(KV_FILLS)}")
    if fill == "zeros":
        return
    gen = torch.Generator(device=buffers[0].device).manual_seed(seed)
    for t in buffers:
        t.copy_(torch.randn(t.shape, generator=gen, device=t.device, dtype=torch.float32))


def time_ms(runner: Runner, steps: int, device) -> float:
    """ms per step over ``steps`` steps (CUDA events; perf_counter on CPU)."""
    runner.run(min(steps, 8))  # warm
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        runner.run(steps)
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / steps
    t0 = time.perf_counter()
    runner.run(steps)
    return (time.perf_counter() - t0) * 1e3 / steps


def energy(runner: Runner, sampler, ms_step: float, seconds: float, batch: int) -> dict:
    """J/token over a steady window of about ``seconds`` (None where there is no counter)."""
    steps = max(1, int(seconds * 1e3 / max(ms_step, 1e-3)))
    runner.run(min(steps, max(1, int(0.5e3 / max(ms_step, 1e-3)))))  # the window starts in steady state
    with sampler.window() as w:
        runner.run(steps)
    res = w.result
    j = res.energy_j
    return {"window_steps": steps, "window_s": res.seconds, "energy_j": j, "energy_source": res.source,
            "j_per_token": None if j is None else j / (steps * batch),
            "mean_power_w": None if j is None else j / res.seconds}


def energy_rounds(runners: dict, ms: dict, sampler, seconds: float, batch: int, repeats: int) -> dict:
    """Each runner's windows over ``repeats`` rounds, the runners alternating within a round (drift in
    the card's temperature lands on both): per runner the pooled J/token and W, and each window's."""
    windows = {key: [] for key in runners}
    for _ in range(max(1, repeats)):
        for key, runner in runners.items():
            windows[key].append(energy(runner, sampler, ms[key], seconds, batch))
    out = {}
    for key, ws in windows.items():
        j = None if any(w["energy_j"] is None for w in ws) else sum(w["energy_j"] for w in ws)
        steps, secs = sum(w["window_steps"] for w in ws), sum(w["window_s"] for w in ws)
        out[key] = {"window_steps": steps, "window_s": secs, "energy_j": j, "energy_source": ws[0]["energy_source"],
                    "j_per_token": None if j is None else j / (steps * batch),
                    "mean_power_w": None if j is None else j / secs,
                    "windows": [{k: w[k] for k in ("window_s", "j_per_token", "mean_power_w")} for w in ws]}
    return out


def kernel_table(runner: Runner, steps: int, device) -> dict[str, dict[str, float]]:
    """Per kernel name: calls and µs per step over ``steps`` profiled steps (graph replays on CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if str(device).startswith("cuda") else [])
    runner.run(2)
    with profile(activities=acts) as prof:
        runner.run(steps)
        if str(device).startswith("cuda"):
            torch.cuda.synchronize()
    table: dict[str, dict[str, float]] = defaultdict(lambda: {"calls": 0.0, "us": 0.0})
    for e in prof.events():
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA or not str(device).startswith("cuda"):
            if not str(device).startswith("cuda") and e.cpu_parent is not None:
                continue  # CPU: top-level ops only
            t = table[e.name]
            t["calls"] += 1 / steps
            t["us"] += e.time_range.elapsed_us() / steps
    return dict(table)


def eager_ops(runner: Runner, device, rows: int) -> str:
    """torch.profiler's op table of one eager (not captured) step: the host's view of the work."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if str(device).startswith("cuda") else [])
    runner.reset()
    runner.one_step()
    with profile(activities=acts) as prof:
        runner.reset()
        runner.one_step()
        if str(device).startswith("cuda"):
            torch.cuda.synchronize()
    sort = "cuda_time_total" if str(device).startswith("cuda") else "cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=rows)


def print_kernels(tables: dict[str, dict], rows: int) -> list[dict]:
    names = list(tables)
    print(f"\n  kernels per step ({' | '.join(names)}): calls, µs")
    totals = {n: (sum(t["calls"] for t in tables[n].values()), sum(t["us"] for t in tables[n].values()))
              for n in names}
    for n in names:
        print(f"    {n:12s} {totals[n][0]:7.1f} kernels  {totals[n][1] / 1e3:8.3f} ms busy")
    keys = sorted({k for t in tables.values() for k in t}, key=lambda k: -max(t.get(k, {}).get("us", 0)
                                                                           for t in tables.values()))
    out = []
    for k in keys[:rows]:
        cells = [tables[n].get(k, {"calls": 0.0, "us": 0.0}) for n in names]
        print("    " + "  ".join(f"{c['calls']:6.1f}x {c['us']:9.1f}" for c in cells) + f"   {k[:100]}")
        out.append({"kernel": k, **{n: c for n, c in zip(names, cells, strict=True)}})
    return out


# What each kernel of either step is for, by name, first match wins (kernel names carry no owner in a
# graph replay). Integer elementwise kernels are the step's bookkeeping (slots, lengths, positions).
WORK: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(r"splitkv_combine|lean_reduction|merge_partials"), "attention: combine splits"),
    (re.compile(r"flash|fmha|sdpa|attention|_decode_(split|fold)", re.I), "attention: read K/V"),
    (re.compile(r"splitKreduce"), "GEMMs: split-K reduce"),
    (re.compile(r"nvjet|gemm|gemv|cutlass|xmma|cublas|^aten::(linear|mm|addmm|matmul)$", re.I), "GEMMs: weights"),
    (re.compile(r"argmax|ArgMax|MaxOps|_max_"), "greedy token"),
    (re.compile(r"index_copy|scatter|index_put"), "cache writes"),
    (re.compile(r"indexSelect|embedding"), "embedding, table lookups"),
    (re.compile(r"<long>|<int>|long, |int64"), "bookkeeping (ints)"),
    (re.compile(r"direct_copy"), "copies"),
    (re.compile(r"triton_|elementwise|layer_norm|rms|silu|neg_|CatArray|reduce_kernel"),
     "norms, RoPE, residuals, SiLU"),
)


def work_of(kernel: str) -> str:
    """What a kernel is for (:data:`WORK`), ``other`` when no rule names it."""
    return next((label for pattern, label in WORK if pattern.search(kernel)), "other")


def work_table(tables: dict[str, dict]) -> dict[str, dict[str, dict[str, float]]]:
    """Per runner and :func:`work_of` label: kernels and µs per step."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, table in tables.items():
        by = out.setdefault(name, {})
        for kernel, cell in table.items():
            acc = by.setdefault(work_of(kernel), {"calls": 0.0, "us": 0.0})
            acc["calls"] += cell["calls"]
            acc["us"] += cell["us"]
    return out


def print_work(tables: dict[str, dict]) -> dict:
    """The two steps' kernels grouped by what they are for, side by side, with the difference (first
    minus second) per step: where one step's extra time is."""
    work = work_table(tables)
    a, b = list(tables)[:2]
    labels = sorted({w for t in work.values() for w in t}, key=lambda w: -max(t.get(w, {}).get("us", 0)
                                                                              for t in work.values()))
    print(f"\n  work per step ({a} | {b} | {a} - {b}): kernels, µs")
    zero = {"calls": 0.0, "us": 0.0}
    for w in labels:
        x, y = work[a].get(w, zero), work[b].get(w, zero)
        print(f"    {x['calls']:6.1f}x {x['us']:9.1f}   {y['calls']:6.1f}x {y['us']:9.1f}   "
              f"{x['calls'] - y['calls']:+7.1f}x {x['us'] - y['us']:+9.1f}   {w}")
    return work


def print_diff(tables: dict[str, dict], rows: int) -> list[dict]:
    """The kernels whose µs per step differ most between the two steps (present in one only, or not)."""
    a, b = list(tables)[:2]
    zero = {"calls": 0.0, "us": 0.0}
    keys = sorted(set(tables[a]) | set(tables[b]),
                  key=lambda k: -abs(tables[a].get(k, zero)["us"] - tables[b].get(k, zero)["us"]))
    print(f"\n  largest differences per step ({a} - {b}): kernels, µs, what for")
    out = []
    for k in keys[:rows]:
        x, y = tables[a].get(k, zero), tables[b].get(k, zero)
        d_calls, d_us = x["calls"] - y["calls"], x["us"] - y["us"]
        print(f"    {d_calls:+7.1f}x {d_us:+9.1f}   {work_of(k):30s} {k[:80]}")
        out.append({"kernel": k, "work": work_of(k), "calls": d_calls, "us": d_us})
    return out


def energy_per_step(row: dict, batch: int) -> dict | None:
    """J per step of each step and their difference, from the pooled windows (None without a counter)."""
    k, m = row.get("kvlab_j_per_token"), row.get("minimal_j_per_token")
    if k is None or m is None:
        return None
    out = {"kvlab_j_step": k * batch, "minimal_j_step": m * batch, "delta_j_step": (k - m) * batch}
    print(f"b{batch} J/step: kvlab {out['kvlab_j_step']:.3f}, minimal {out['minimal_j_step']:.3f}, "
          f"difference {out['delta_j_step']:+.3f} ({out['delta_j_step'] / out['minimal_j_step']:+.1%})", flush=True)
    return out


def print_runner(batch: int, name: str, ms: float, e: dict, t0: float) -> None:
    j = e.get("j_per_token")
    windows = " ".join(f"{w['mean_power_w']:.0f}" for w in e.get("windows", []) if w["mean_power_w"] is not None)
    print(f"b{batch} {name:12s} {ms:7.3f} ms/step  {'-' if j is None else round(j, 4)} J/token  "
          f"{e.get('mean_power_w') or 0:.0f} W (windows: {windows or '-'}) [{time.time() - t0:.0f}s]", flush=True)


def compare_batch(loaded, batch: int, args, sampler, t0: float) -> dict:
    """kvlab's step and the minimal step at one batch, over the same K/V: time, energy, kernels."""
    from kvlab.budget import DecodeBytes

    model, param = loaded.model, next(loaded.model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    engine, decoder, fast = kvlab_runner(loaded, batch, args.ctx, args.new_tokens, fill=args.kv_fill)
    kv = list(zip(decoder.store.keys, decoder.store.values, strict=True))
    m, minimal = minimal_runner(engine.step, batch, args.ctx, args.new_tokens, param.device, param.dtype, kv)
    kv_bytes = 2 * batch * args.ctx * len(m.kv_keys) * m.hkv * m.d * param.element_size()
    row = {"batch": batch, "ctx": args.ctx, "kv_fill": args.kv_fill, "weight_bytes": weight_bytes,
           "kv_bytes": kv_bytes, "kvlab_cuda_graph": decoder.graph is not None,
           "minimal_cuda_graph": minimal.graph is not None}
    row["greedy_equals_argmax"] = greedy_check(batch, model.config.vocab_size, param.device, param.dtype)
    runners = {"kvlab": fast, "minimal": minimal}
    # variants built beside kvlab's step join its rounds (ABAB...: drift lands on both); one whose
    # store does not fit beside it is measured after, alone, and its row says not alternated
    beside = {} if args.variants_apart else {spec: variant_runner(loaded, batch, spec, args) for spec in args.variants}
    runners.update({f"kvlab {spec}": built[2] for spec, built in beside.items() if isinstance(built, tuple)})
    ms = {key: time_ms(r, args.steps, args.device) for key, r in runners.items()}
    energies = energy_rounds(runners, ms, sampler, args.seconds, batch, args.repeats)
    for key, r in runners.items():
        if key in ("kvlab", "minimal"):
            row[f"{key}_ms_step"] = ms[key]
            row.update({f"{key}_{k}": v for k, v in energies[key].items()})
        print_runner(batch, r.name, ms[key], energies[key], t0)
    row["energy_per_step"] = energy_per_step(row, batch)
    if args.device.startswith("cuda"):
        bw = copy_bandwidth(args.device)
        floor = DecodeBytes(weight_bytes, kv_bytes).floor_s(bw) * 1e3
        row.update(copy_bandwidth_Bps=bw, floor_ms=floor, kvlab_x_floor=row["kvlab_ms_step"] / floor,
                   minimal_x_floor=row["minimal_ms_step"] / floor)
        print(f"b{batch} byte floor {floor:.2f} ms (weights + KV at the copy bandwidth); kvlab "
              f"{row['kvlab_ms_step'] / floor:.2f}x, minimal {row['minimal_ms_step'] / floor:.2f}x", flush=True)
    tables = {"kvlab": kernel_table(fast, args.profile_steps, args.device),
              "minimal": kernel_table(minimal, args.profile_steps, args.device)}
    alternated = []
    for spec, built in beside.items():
        if isinstance(built, tuple):
            name = f"kvlab {spec}"
            alternated.append(variant_row(spec, built[2], ms[name], energies[name], energies["kvlab"], tables["kvlab"],
                                          args, alternated=True))
    row["kernels"] = print_kernels(tables, args.rows)
    row["kernel_totals"] = totals(tables)
    row["work"] = print_work(tables)
    row["kernel_diff"] = print_diff(tables, args.rows)
    for name, r in runners.items():
        text = eager_ops(r, args.device, args.rows)
        row[f"{name}_eager_ops"] = text
        print(f"\n  one eager step, {name}:\n{text}", flush=True)
    kvlab_energy = energies["kvlab"]
    del runners, engine, decoder, fast, m, minimal, kv, beside  # before a variant's store: one store at a time
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    done = {v["variant"] for v in alternated}
    row["variants"] = alternated + [engine_variant(loaded, batch, spec, args, sampler, tables["kvlab"], t0, kvlab_energy)
                                    for spec in args.variants if spec not in done]
    return row


def greedy_check(batch: int, vocab: int, device, dtype, rounds: int = 8) -> bool:
    """Whether kvlab's two-stage greedy token (:func:`kvlab.engine.llama.greedy_tokens`) is torch's
    argmax on this device, over random logits rows in the model dtype (ties between chunks included)."""
    from kvlab.engine.llama import greedy_tokens

    gen = torch.Generator(device=device).manual_seed(0)
    same = True
    for i in range(rounds):
        logits = torch.randn(batch, vocab, generator=gen, device=device).to(dtype)
        if i % 2:
            logits = logits.round()  # few distinct values: the maximum in many chunks
        same &= bool(torch.equal(greedy_tokens(logits), logits.argmax(-1, keepdim=True)))
    print(f"b{batch} greedy token == argmax on {str(device)}: {same}", flush=True)
    return same


def totals(tables: dict[str, dict]) -> dict:
    return {n: {"kernels": sum(t["calls"] for t in tab.values()), "busy_ms": sum(t["us"] for t in tab.values()) / 1e3}
            for n, tab in tables.items()}


def engine_options(spec: str) -> dict:
    """``"attention=cudnn,flash_splits=8"`` -> FastEngine keyword arguments (integers where they parse)."""
    out = {}
    for part in filter(None, spec.split(",")):
        key, _, value = part.partition("=")
        out[key.strip()] = int(value) if value.strip().lstrip("-").isdigit() else value.strip()
    return out


def variant_runner(loaded, batch: int, spec: str, args):
    """``(engine, decoder, runner)`` of kvlab's step built with other engine options (``spec``:
    :func:`engine_options`), or an error row where it is refused, its kernel cannot take the call or
    its store does not fit."""
    from kvlab.engine import EngineError

    name = f"kvlab {spec}"
    try:
        return kvlab_runner(loaded, batch, args.ctx, args.new_tokens, name=name, fill=args.kv_fill,
                            **engine_options(spec))
    except (EngineError, ValueError, RuntimeError) as err:  # RuntimeError: torch's OutOfMemoryError too
        print(f"b{batch} {name}: {type(err).__name__}: {err}", flush=True)
        if str(args.device).startswith("cuda"):
            torch.cuda.empty_cache()
        return {"variant": spec, "error": f"{type(err).__name__}: {str(err)[:300]}"}


def variant_row(spec: str, runner, ms: float, e: dict, base: dict, default: dict, args, alternated: bool) -> dict:
    """A variant's time, energy (its windows' J/token over kvlab's default step's, with the interval
    of :mod:`kvlab.intervals`) and kernels grouped by work against the default step's."""
    from kvlab.intervals import ratio_interval

    name = f"kvlab {spec}"
    tables = {name: kernel_table(runner, args.profile_steps, args.device), "kvlab": default}
    ratio = ratio_interval([w["j_per_token"] for w in e.get("windows", [])],
                           [w["j_per_token"] for w in base.get("windows", [])])
    return {"variant": spec, "alternated": alternated, "ms_step": ms, **e, "j_per_token_vs_kvlab": ratio.to_dict(),
            "kernel_totals": totals(tables)[name], "work": print_work(tables)[name]}


def engine_variant(loaded, batch: int, spec: str, args, sampler, default: dict, t0: float, base: dict) -> dict:
    """A variant whose store did not fit beside kvlab's step (or ``--variants-apart``), measured alone
    after it over the same rounds: e.g. fewer flash splits (a shorter combine pass, maybe a slower
    K/V read) or ``attention=cudnn`` (another kernel). Its ratio to kvlab's step is not alternated."""
    built = variant_runner(loaded, batch, spec, args)
    if not isinstance(built, tuple):
        return built
    engine, decoder, runner = built
    name = f"kvlab {spec}"
    ms = time_ms(runner, args.steps, args.device)
    e = energy_rounds({name: runner}, {name: ms}, sampler, args.seconds, batch, args.repeats)[name]
    print_runner(batch, name, ms, e, t0)
    out = variant_row(spec, runner, ms, e, base, default, args, alternated=False)
    del engine, decoder, runner
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--weights", default="synthetic")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--new-tokens", type=int, default=256, help="room per decoder (steps wrap around it)")
    ap.add_argument("--steps", type=int, default=200, help="steps timed by CUDA events")
    ap.add_argument("--seconds", type=float, default=8.0, help="steady energy window per engine, batch and round")
    ap.add_argument("--repeats", type=int, default=5,
                    help="rounds of energy windows, the steps alternating within each (an interval needs 3)")
    ap.add_argument("--kv-fill", choices=KV_FILLS, default="zeros", help="what the K/V both steps read hold")
    ap.add_argument("--variants", nargs="*", default=[], metavar="K=V[,K=V]",
                    help="kvlab's step again with these FastEngine options each, e.g. attention=cudnn flash_splits=8; "
                         "built beside kvlab's step and alternated with it in every round")
    ap.add_argument("--variants-apart", action="store_true",
                    help="measure the variants after kvlab's step, one store at a time (not alternated: for "
                         "shapes where two stores do not fit)")
    ap.add_argument("--profile-steps", type=int, default=10)
    ap.add_argument("--rows", type=int, default=25, help="rows of each profiler table")
    ap.add_argument("--out", default="minimal_step.json")
    args = ap.parse_args(argv)

    from kvlab.card import device_card
    from kvlab.energy import make_sampler
    from kvlab.models import load_model

    t0 = time.time()
    loaded = load_model(args.model, weights=args.weights, device=args.device)
    sampler = make_sampler(args.device)
    result = {"args": vars(args), "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
              "card": device_card(args.device), "batches": []}
    print(f"{args.model} on {result['gpu'] or 'cpu'}, torch {torch.__version__} [{time.time() - t0:.0f}s]", flush=True)
    for batch in args.batch:
        with torch.no_grad():
            result["batches"].append(compare_batch(loaded, batch, args, sampler, t0))
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    print_summary(result["batches"])
    print(f"wrote {args.out} [{time.time() - t0:.0f}s]")
    return 0


def print_summary(rows: list[dict]) -> None:
    def f(x, p=3):
        return "-" if x is None else f"{x:.{p}f}"

    print("\nbatch  kvlab ms  minimal ms  kvlab J/tok  minimal J/tok  kvlab W  minimal W  dJ/step")
    for r in rows:
        d = (r.get("energy_per_step") or {}).get("delta_j_step")
        print(f"{r['batch']:5d} {f(r['kvlab_ms_step']):>9} {f(r['minimal_ms_step']):>11} {f(r['kvlab_j_per_token'], 4):>12} "
              f"{f(r['minimal_j_per_token'], 4):>14} {f(r['kvlab_mean_power_w'], 0):>8} "
              f"{f(r['minimal_mean_power_w'], 0):>10} {f(d, 3):>8}")
        for v in r.get("variants", []):
            if "error" not in v:
                print(f"{'':5s} {f(v['ms_step']):>9}  (kvlab {v['variant']})  "
                      f"{f(v['j_per_token'], 4):>12} {'':14s} {f(v['mean_power_w'], 0):>8}")


def copy_bandwidth(device, gib: int = 2) -> float:
    """Bytes read + written per second by a ``gib`` GiB device-to-device copy (mean of 5)."""
    bufs = [torch.empty(gib * 2**30, dtype=torch.uint8, device=device) for _ in range(2)]
    for _ in range(2):
        bufs[1].copy_(bufs[0])
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(5):
        bufs[1].copy_(bufs[0])
    b.record()
    torch.cuda.synchronize()
    ms = a.elapsed_time(b) / 5
    bufs.clear()
    torch.cuda.empty_cache()
    return 2 * gib * 2**30 / (ms * 1e-3)


if __name__ == "__main__":
    raise SystemExit(main())
