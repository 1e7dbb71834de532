"""The byte-budget explorer: plain functions of values -> tables and figures, plus one ipywidgets UI.

Every chart the widgets drive is a function of a :class:`BudgetInputs` (model, bits, group size,
residual length, context, batch, GPU), tested without a browser. :class:`BudgetExplorer` only maps
widget values to those inputs and shows the figures in an ``Output``; widgets do not survive HTML
export, so notebooks also show the same figures for preset inputs.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field

import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio

from kvlab import budget, plots
from kvlab.models import PRESETS, ModelSpec, get_spec
from kvlab.reporting.text import fmt_ctx

GB = 1e9
QUANT_BITS = (8, 4, 2)
GROUP_SIZES = (32, 64, 128)
CONTEXTS = tuple(2**k for k in range(9, 18))  # 512 .. 131072
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
EXPLORER_MODELS = tuple(name for name in PRESETS if name != "tiny-llama")


@dataclass(frozen=True)
class CacheFormat:
    """One way to store the cache: full precision, or ``bits`` per element in groups, with the
    ``residual`` most recent tokens kept at full precision."""

    name: str
    bits: int
    group_size: int | None = None
    residual: int = 0

    def cache_kwargs(self) -> dict:
        return dict(bits=self.bits, group_size=self.group_size, residual=self.residual)


def cache_formats(spec: ModelSpec, bits=QUANT_BITS, group_size: int = 64, residual: int = 128) -> list[CacheFormat]:
    """The full-precision cache first (the baseline), then each quantized width, widest first."""
    full_bits = budget.model_bits(spec)
    out = [CacheFormat(f"{spec.dtype} (full)", full_bits)]
    for b in sorted({budget.check_bits(int(b)) for b in bits}, reverse=True):
        if b < full_bits:
            out.append(CacheFormat(f"int{b} g{group_size} r{residual}", b, group_size, residual))
    return out


def per_token_steps(spec: ModelSpec, bits: int | None = None, group_size: int | None = None) -> pd.DataFrame:
    """The bytes-per-token formula one factor at a time, for the notebook's narration."""
    full_bits = budget.model_bits(spec)
    bits = bits or full_bits
    grouped = group_size if bits < full_bits else None
    eff = budget.effective_bits(bits, grouped, full_bits)
    rows = [
        ("layers", spec.num_layers, "every layer keeps its own K and V"),
        ("KV heads", spec.num_kv_heads, "grouped-query attention: fewer KV heads than query heads"
         f" ({spec.num_attention_heads})"),
        ("head dim", spec.head_dim, "elements per head per token"),
        ("K and V", 2, "one key and one value vector"),
        ("elements per token", budget.kv_elements_per_token(spec), "product of the four lines above"),
        ("bits per element", eff, f"{bits} bits" + (f" + a 16-bit scale and zero per {grouped} elements"
                                                     if grouped else "")),
        ("bytes per token", budget.kv_bytes_per_token(spec, bits, grouped), "elements x bits / 8"),
    ]
    df = pd.DataFrame(rows, columns=["factor", "value", "why"])
    df["value"] = pd.Series([v if isinstance(v, int) or not float(v).is_integer() else int(v)
                             for _, v, _ in rows], dtype=object)
    return df


def context_grid(max_ctx: int, min_ctx: int = 256) -> list[int]:
    """Powers of two from ``min_ctx`` up to ``max_ctx`` (included even when not a power of two)."""
    budget.check_positive("max_ctx", max_ctx)
    grid = [c for c in (2**k for k in range(0, 41)) if min_ctx <= c <= max_ctx]
    return grid if grid and grid[-1] == max_ctx else [*grid, max_ctx]


def cache_table(spec: ModelSpec, formats: list[CacheFormat], ctxs: list[int], batch: int = 1) -> pd.DataFrame:
    rows = [{"format": f.name, "ctx": c, "batch": batch,
             "cache_bytes": budget.cache_bytes(spec, c, batch=batch, **f.cache_kwargs())}
            for f in formats for c in ctxs]
    return pd.DataFrame(rows)


def capacity_table(spec: ModelSpec, formats: list[CacheFormat], ctx: int, gpu: budget.GPU,
                   reserve_bytes: float = budget.DEFAULT_RESERVE_BYTES) -> pd.DataFrame:
    rows = [{"format": f.name, "ctx": ctx, "gpu": gpu.name,
             "cache_bytes_per_seq": budget.cache_bytes(spec, ctx, **f.cache_kwargs()),
             "max_batch": budget.max_batch(spec, ctx, gpu.memory_bytes, reserve_bytes, **f.cache_kwargs())}
            for f in formats]
    return pd.DataFrame(rows)


def decode_table(spec: ModelSpec, formats: list[CacheFormat], ctx: int, batch: int = 1,
                 gpu: budget.GPU | None = None) -> pd.DataFrame:
    rows = []
    for f in formats:
        step = budget.decode_bytes(spec, ctx, batch, **f.cache_kwargs())
        rows.append({"format": f.name, "ctx": ctx, "batch": batch, "weight_bytes": step.weights,
                     "kv_bytes": step.kv, "total_bytes": step.total,
                     "floor_ms": step.floor_s(gpu.bandwidth_bytes_per_s) * 1e3 if gpu else float("nan")})
    return pd.DataFrame(rows)


def compression_table(spec: ModelSpec, formats: list[CacheFormat], ctxs: list[int], batch: int = 1) -> pd.DataFrame:
    """Real ratio (residual buffer included) and the nominal one (bits and group overhead only)."""
    full_bits = budget.model_bits(spec)
    rows = []
    for f in formats:
        if f.bits >= full_bits:
            continue
        nominal = full_bits / budget.effective_bits(f.bits, f.group_size, full_bits)
        for c in ctxs:
            rows.append({"format": f.name, "ctx": c, "nominal": nominal,
                         "ratio": budget.compression_ratio(spec, c, batch=batch, **f.cache_kwargs())})
    return pd.DataFrame(rows, columns=["format", "ctx", "nominal", "ratio"])


@dataclass(frozen=True)
class BudgetInputs:
    """What the explorer's widgets set; validated on construction with the budget's own checks."""

    model: str = "llama-3.1-8b"
    bits: tuple[int, ...] = QUANT_BITS
    group_size: int = 64
    residual: int = 128
    ctx: int = 16384
    batch: int = 1
    gpu: str = "rtx-a6000"
    reserve_bytes: float = budget.DEFAULT_RESERVE_BYTES

    def __post_init__(self):
        budget.check_positive("ctx", self.ctx)
        budget.check_positive("batch", self.batch)
        if self.residual < 0:
            raise budget.BudgetError(f"residual length must be >= 0, got {self.residual}")
        for b in self.bits:
            budget.check_bits(int(b))
        budget.get_gpu(self.gpu)
        budget.check_group_size(self.spec, self.group_size)

    @property
    def spec(self) -> ModelSpec:
        return get_spec(self.model)


@dataclass
class BudgetViews:
    """Everything the explorer shows for one set of inputs."""

    inputs: BudgetInputs
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    figures: dict[str, go.Figure] = field(default_factory=dict)
    summary: pd.DataFrame | None = None
    fit: list[str] = field(default_factory=list)  # what does not fit on the GPU, in sentences


def budget_summary(inputs: BudgetInputs) -> pd.DataFrame:
    """One row per format at the chosen context/batch/GPU: the numbers behind every chart."""
    spec, gpu = inputs.spec, budget.get_gpu(inputs.gpu)
    rows = []
    for f in cache_formats(spec, inputs.bits, inputs.group_size, inputs.residual):
        kw = f.cache_kwargs()
        step = budget.decode_bytes(spec, inputs.ctx, inputs.batch, **kw)
        problem = budget.fit_problem(spec, inputs.ctx, inputs.batch, gpu.memory_bytes, inputs.reserve_bytes,
                                     gpu.name, **kw)
        rows.append({
            "format": f.name,
            f"fits on {gpu.name}": "yes" if problem is None else "NO",
            "bytes/token": budget.kv_bytes_per_token(spec, f.bits, f.group_size),
            "cache GB": budget.cache_bytes(spec, inputs.ctx, inputs.batch, **kw) / GB,
            "compression": budget.compression_ratio(spec, inputs.ctx, batch=inputs.batch, **kw),
            f"max batch on {gpu.name}": budget.max_batch(spec, inputs.ctx, gpu.memory_bytes,
                                                         inputs.reserve_bytes, **kw),
            "step reads GB": step.total / GB,
            "step floor ms": step.floor_s(gpu.bandwidth_bytes_per_s) * 1e3,
        })
    return pd.DataFrame(rows)


def budget_views(inputs: BudgetInputs) -> BudgetViews:
    """The four byte-budget charts and their tables for one set of inputs (the widget callback)."""
    spec, gpu = inputs.spec, budget.get_gpu(inputs.gpu)
    formats = cache_formats(spec, inputs.bits, inputs.group_size, inputs.residual)
    ctxs = context_grid(max(inputs.ctx, spec.max_context))
    free = budget.free_bytes_for_cache(spec, gpu.memory_bytes, inputs.reserve_bytes)
    no_room = None if free > 0 else budget.fit_problem(spec, inputs.ctx, inputs.batch, gpu.memory_bytes,
                                                       inputs.reserve_bytes, gpu.name)
    tables = {
        "cache": cache_table(spec, formats, ctxs, inputs.batch),
        "capacity": capacity_table(spec, formats, inputs.ctx, gpu, inputs.reserve_bytes),
        "decode": decode_table(spec, formats, inputs.ctx, inputs.batch, gpu),
        "compression": compression_table(spec, formats, ctxs, inputs.batch),
    }
    figures = {
        "cache": plots.cache_vs_context(tables["cache"], free_bytes=free if free > 0 else None, gpu_name=gpu.name,
                                        note=no_room),
        "capacity": (plots.capacity(tables["capacity"], gpu.name, inputs.ctx) if no_room is None
                     else plots.empty_figure(f"Capacity on {gpu.name} at {fmt_ctx(inputs.ctx)} context",
                                             no_room)),
        "decode": plots.decode_split(tables["decode"], gpu.name),
        "compression": plots.compression_vs_context(tables["compression"]),
    }
    batch = f" x batch {inputs.batch}" if inputs.batch > 1 else ""
    figures["cache"].update_layout(title=f"{spec.name}: KV cache size vs context{batch}")
    figures["decode"].update_layout(title=f"{spec.name} at {inputs.ctx:,} tokens{batch}: what a decode step reads")
    return BudgetViews(inputs, tables, figures, budget_summary(inputs), fit_lines(inputs))


def fit_text(views: BudgetViews) -> str:
    """The fit verdict as text for the notebook: what does not fit, or that every format fits."""
    i = views.inputs
    return "\n".join(views.fit) or (f"every cache format fits on {budget.get_gpu(i.gpu).name} at "
                                    f"{i.ctx:,} tokens x batch {i.batch}")


def fit_lines(inputs: BudgetInputs) -> list[str]:
    """One sentence per cache format that does not fit on the GPU at the chosen setting (the
    weights-alone case once): what the explorer says above its charts."""
    spec, gpu = inputs.spec, budget.get_gpu(inputs.gpu)
    lines = []
    for f in cache_formats(spec, inputs.bits, inputs.group_size, inputs.residual):
        problem = budget.fit_problem(spec, inputs.ctx, inputs.batch, gpu.memory_bytes, inputs.reserve_bytes,
                                     gpu.name, **f.cache_kwargs())
        if problem is None:
            continue
        if "at any context" in problem or "no room" in problem:
            return [problem]
        lines.append(f"{f.name}: {problem}")
    return lines


class BudgetExplorer:
    """ipywidgets controls -> :func:`budget_views` -> figures in an Output widget.

    ``state`` (the latest :class:`BudgetViews`) and ``message`` update synchronously when a control's
    value changes, so tests drive it by setting ``.value`` with no browser or kernel.
    """

    def __init__(self, inputs: BudgetInputs | None = None):
        import ipywidgets as W

        inputs = inputs or BudgetInputs()
        style = {"description_width": "110px"}
        self.controls = {
            "model": W.Dropdown(options=EXPLORER_MODELS, value=inputs.model, description="model", style=style),
            "bits": W.SelectMultiple(options=QUANT_BITS, value=tuple(inputs.bits), description="quant bits",
                                     rows=3, style=style),
            "group_size": W.Dropdown(options=GROUP_SIZES, value=inputs.group_size, description="group size",
                                     style=style),
            "residual": W.IntSlider(value=inputs.residual, min=0, max=1024, step=32, description="residual",
                                    style=style),
            "ctx": W.SelectionSlider(options=_with(CONTEXTS, inputs.ctx), value=inputs.ctx,
                                     description="context", style=style),
            "batch": W.SelectionSlider(options=_with(BATCHES, inputs.batch), value=inputs.batch,
                                       description="batch", style=style),
            "gpu": W.Dropdown(options=tuple(budget.GPUS), value=inputs.gpu, description="GPU", style=style),
        }
        self.reserve_bytes = inputs.reserve_bytes
        self.message = W.HTML()
        self.output = W.Output()
        self.state: BudgetViews | None = None
        for control in self.controls.values():
            control.observe(self.update, names="value")
        self.ui = W.VBox([W.HBox([W.VBox(list(self.controls.values())[:4]),
                                  W.VBox(list(self.controls.values())[4:])]),
                          self.message, self.output])
        self.update()

    def inputs(self) -> BudgetInputs:
        values = {name: c.value for name, c in self.controls.items()}
        values["bits"] = tuple(values["bits"])
        return BudgetInputs(**values, reserve_bytes=self.reserve_bytes)

    def update(self, change=None) -> None:
        """Recompute from the current control values; bad combinations show their message instead."""
        try:
            self.state = budget_views(self.inputs())
        except budget.BudgetError as err:
            self.state = None
            self.message.value = f"<b style='color:#b00'>{err}</b>"
        else:
            self.message.value = _summary_html(self.state)
        self.render()

    def render(self) -> None:
        """Put the current table and figures into the Output widget (inside IPython only: with no
        frontend there is nothing to draw).

        The outputs are set as widget state, not printed inside ``with output:``: nbclient
        (papermill) mirrors printed Output-widget messages back to the kernel on the shell channel
        while the cell runs, which can deadlock (a known nbclient/papermill problem upstream).
        """
        from IPython import get_ipython

        shell = get_ipython()
        if shell is None:
            return
        shown = [] if self.state is None else [self.state.summary.round(3), *self.state.figures.values()]
        outputs = []
        for obj in shown:
            if isinstance(obj, go.Figure):  # JupyterLab draws the plotly mimetype (plotly.js not re-sent)
                data, metadata = pio.renderers["plotly_mimetype"].to_mimebundle(obj.to_dict()), {}
            else:
                data, metadata = shell.display_formatter.format(obj)
            outputs.append({"output_type": "display_data", "data": data, "metadata": metadata})
        self.output.outputs = tuple(outputs)

    def _repr_mimebundle_(self, **kwargs):
        return self.ui._repr_mimebundle_(**kwargs)


def budget_explorer(**inputs) -> BudgetExplorer:
    """The byte-budget UI; keyword arguments set the starting values (see :class:`BudgetInputs`)."""
    return BudgetExplorer(BudgetInputs(**inputs))


def _with(options: tuple[int, ...], value: int) -> tuple[int, ...]:
    return tuple(sorted({*options, value}))


def _summary_html(views: BudgetViews) -> str:
    s = views.summary
    full, last = s.iloc[0], s.iloc[-1]
    i = views.inputs
    warn = "".join(f"<b style='color:#b00'>{html.escape(line)}</b><br>" for line in views.fit)
    return warn + (f"{i.model} at {i.ctx:,} tokens x batch {i.batch}: full cache {full['cache GB']:.2f} GB, "
                   f"{last['format']} {last['cache GB']:.2f} GB ({last['compression']:.2f}x); "
                   f"a decode step reads {full['step reads GB']:.2f} GB -> {last['step reads GB']:.2f} GB "
                   f"(floor {full['step floor ms']:.2f} -> {last['step floor ms']:.2f} ms on {i.gpu}).")
