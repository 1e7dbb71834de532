"""The notebooks: committed clean (python3 kernel, one literal-only parameters cell, no outputs, no
def/class), and each executes under papermill on CPU with small parameters (slow)."""

import ast
import json
from pathlib import Path

import nbformat
import pytest
from browser import drawn_plots, dump_dom, require_chromium

from kvlab import report

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
NAMES = [p.stem for p in NOTEBOOKS]


def test_the_four_notebooks_exist():
    assert set(NAMES) >= {"byte_budget", "sweep", "report", "anatomy"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=NAMES)
def test_notebook_is_committed_clean(path):
    raw = json.loads(path.read_text())
    # nbformat 4.5 cells carry ids: without, reading warns MissingIDFieldWarning (kvlab report did, issue 30)
    assert all(c.get("id") for c in raw["cells"]), "every cell has an id (nbformat.validator.normalize adds them)"
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    assert "papermill" not in nb.metadata and "widgets" not in nb.metadata
    code = [c for c in nb.cells if c.cell_type == "code"]
    for c in code:
        assert c.outputs == [] and c.execution_count is None, "commit notebooks without outputs"
        tree = ast.parse(c.source)
        defs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
                                                        | ast.Lambda)]
        assert not defs, f"logic belongs in kvlab, not in a notebook cell:\n{c.source}"
    tagged = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1
    for stmt in ast.parse(tagged[0].source).body:
        assert isinstance(stmt, ast.Assign), ast.unparse(stmt)
        ast.literal_eval(stmt.value)  # plain values only: derived values are not recomputed


@pytest.mark.parametrize("path", NOTEBOOKS, ids=NAMES)
def test_papermill_sees_the_parameters(path):
    import papermill as pm

    params = pm.inspect_notebook(str(path))
    assert params, "no parameters inferred"
    assert all(p["help"] for p in params.values()), "each parameter has a trailing comment"


def test_sweep_notebook_declares_every_sweep_key():
    """papermill warns "Passed unknown parameter" for a -f/-p key the notebook does not declare."""
    import papermill as pm

    from kvlab.sweep.params import SweepParams

    declared = set(pm.inspect_notebook(str(ROOT / "notebooks" / "sweep.ipynb")))
    assert set(SweepParams.model_fields) <= declared


def execute(name, dest, **parameters):
    out = dest / f"{name}.ipynb"
    return report.execute_notebook(ROOT / "notebooks" / f"{name}.ipynb", out, parameters, cwd=ROOT,
                                   timeout=900), out


def outputs_text(nb) -> str:
    parts = []
    for c in nb.cells:
        for o in c.get("outputs", []):
            parts.append(o.get("text", ""))
            parts.extend(str(v) for v in o.get("data", {}).values())
    return "\n".join(parts)


@pytest.mark.slow(reason="a Jupyter kernel runs the notebook: kernel start, torch and plotly imports")
def test_byte_budget_executes(tmp_path):
    nb, _ = execute("byte_budget", tmp_path, model="mistral-7b", ctx=8192, bits=[4])
    text = outputs_text(nb)
    assert "application/vnd.jupyter.widget-view+json" in json.dumps(nb.cells[-1].outputs)
    assert "int4 g64 r128" in text and "131072" in text  # the per-token table and the formats
    assert "requests in flight" in text  # step 6: over a context-length distribution
    assert text.count("Plotly.newPlot") == 4  # the static figures
    assert text.count("window.PlotlyConfig") == 1  # plotly.js embedded once
    # the explorer's Output widget holds the summary table and the four charts as widget state
    state = nb.metadata.widgets["application/vnd.jupyter.widget-state+json"]["state"]
    outputs = [m["state"]["outputs"] for m in state.values() if m["model_name"] == "OutputModel"]
    assert len(outputs) == 1
    assert [("application/vnd.plotly.v1+json" in o["data"]) for o in outputs[0]] == [False] + [True] * 4


@pytest.mark.slow(reason="a Jupyter kernel runs a serving sweep on the tiny model and draws its figures")
def test_serving_notebook_takes_its_rates_and_trace_from_papermill(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0.0,14,3\n0.1,10,2\n0.2,12,3\n")
    params = tmp_path / "serve.yaml"
    params.write_text("models: [tiny-llama]\nweights: synthetic\nthreads: 1\nmethods: [full, kvq-fp8]\nctx: [32]\n"
                      "traffic: {arrival: poisson, rate: [5], requests: 3, lengths: {kind: fixed, input: 8, output: 2},"
                      " server: {num_blocks: 16, block_size: 4}, slo: {ttft: 10, tpot: 5}}\n")
    out = tmp_path / "runs"
    nb, _ = execute("serving", tmp_path, params_file=str(params), out=str(out), rate=[50, 100], trace=str(trace),
                    method="kvq-fp8 ")
    rows = [json.loads(line) for line in (out / "serve_runs.jsonl").read_text().splitlines()]
    assert sorted({r["rate"] for r in rows}) == [50.0, 100.0] and all(r["status"] == "complete" for r in rows)
    records = [json.loads(line) for line in (out / rows[0]["run"] / "requests.jsonl").read_text().splitlines()]
    assert sorted(r["input_tokens"] for r in records) == [10, 12, 14]  # the trace's lengths, not the file's 8
    state = nb.metadata.widgets["application/vnd.jupyter.widget-state+json"]["state"]
    outputs = [m["state"]["outputs"] for m in state.values() if m["model_name"] == "OutputModel"]
    assert len(outputs) == 1 and "kvq-fp8" in json.dumps(outputs[0])


# The report notebook on CPU-like records runs in tests/test_report.py
# (test_kvlab_report_on_cpu_records_prints_no_warning): one kernel start covers both.


@pytest.mark.slow(reason="a Jupyter kernel profiles decode steps of three methods (torch.profiler)")
def test_anatomy_executes_on_the_tiny_model(tmp_path):
    pytest.importorskip("optimum.quanto")
    nb, _ = execute("anatomy", tmp_path, model="tiny-llama", weights="synthetic", ctx=64, steps=4, warmup=1,
                    policy_params={"quanto": {"nbits": 4, "q_group_size": 16, "residual_length": 2}})
    text = outputs_text(nb)
    assert "dequantize" in text and "CPU/launch gap" in text
    assert "quanto int4" in text


@pytest.fixture(scope="session")  # a module fixture ended whenever the worker ran another module in between
def smoke_sweep(tmp_path_factory):
    """The sweep notebook on the smoke params (reduced: 3 methods, ctx 256, 4 new tokens)."""
    tmp = tmp_path_factory.mktemp("smoke")
    nb, out = execute("sweep", tmp, params_file="params/smoke.yaml", ctx=256, new_tokens=4,
                      methods=["full", "streamingllm", "quanto"], out_dir=str(tmp / "records"))
    return tmp, nb


# Both smoke-sweep tests share one session fixture: one xdist worker runs them, so the notebook runs once.
@pytest.mark.xdist_group("smoke-sweep-notebook")
@pytest.mark.slow(reason="a Jupyter kernel loads SmolLM2 and runs a reduced smoke sweep")
def test_sweep_notebook_runs_the_smoke_sweep(smoke_sweep):
    tmp, nb = smoke_sweep
    from kvlab.records import load_records

    perf = load_records(tmp / "records", kind="perf")
    assert set(perf["ctx"]) == {256} and set(perf["status"]) == {"ok"}
    assert {"full", "streamingllm", "quanto"} <= set(perf["method"])
    assert "ms/token (median)" in outputs_text(nb)  # the summary table


@pytest.mark.xdist_group("smoke-sweep-notebook")
@pytest.mark.slow(reason="renders the report (a kernel) and draws it in headless Chromium")
def test_smoke_sweep_report_draws_offline_in_chromium(smoke_sweep):
    """The done-when path: sweep notebook -> kvlab report -> HTML that draws with no network."""
    require_chromium()
    from kvlab.cli import main

    tmp, _ = smoke_sweep
    assert main(["report", str(tmp / "records"), "-o", str(tmp / "site" / "smoke.html")]) == 0
    dom = dump_dom(tmp / "site" / "smoke.html", tmp / "chromium-profile")
    counts = drawn_plots(dom)
    # a CPU smoke has no energy: those sections are one sentence each, every figure left draws
    assert counts["graph_divs"] >= 4 and counts["drawn"] == counts["graph_divs"], counts
    assert counts["main_svg"] >= counts["graph_divs"]
    assert 'href="smoke.html"' in (tmp / "site" / "index.html").read_text()


def test_papermill_engine_kvlab_runs_the_kernel_over_ipc(monkeypatch):
    """`papermill --engine kvlab` (README): ipykernel's TCP warning is not kvlab's; IPC avoids it."""
    import tomllib

    from papermill import engines

    from kvlab.reporting.papermill_engine import IPCEngine

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["entry-points"]["papermill.engine"]["kvlab"] == \
        "kvlab.reporting.papermill_engine:IPCEngine"
    seen = {}

    class Client:
        def __init__(self, nb_man, **kwargs):
            seen.update(kwargs)

        def execute(self):
            return None

    monkeypatch.setattr(engines, "PapermillNotebookClient", Client)
    IPCEngine.execute_managed_notebook(None, "python3")
    assert seen["kernel_manager_class"]().transport == "ipc"


def test_execute_notebook_gives_the_kernel_five_minutes_to_start(monkeypatch, tmp_path):
    """CI (stop 32) failed with "Kernel didn't respond in 60 seconds" (papermill's default) while
    parallel tests kept its two cores busy; kvlab's runs wait for the kernel, then time its cells."""
    import papermill as pm

    seen = {}

    def fake_execute(src, dst, **kwargs):
        seen.update(kwargs)
        nbformat.write(nbformat.v4.new_notebook(), dst)

    monkeypatch.setattr(pm, "execute_notebook", fake_execute)
    report.execute_notebook(ROOT / "notebooks" / "sweep.ipynb", tmp_path / "out.ipynb")
    assert seen["start_timeout"] == 300 and seen["execution_timeout"] == 1800


def test_ipc_kernels_started_together_get_sockets_of_their_own(tmp_path, monkeypatch):
    """jupyter_client's default IPC address is the relative ``kernel-ipc`` numbered by which files
    exist: two kernels started at once in one folder shared sockets (the notebook tests' "Invalid
    Signature" and "Kernel didn't respond" under xdist). Each of kvlab's kernels has its own paths."""
    from kvlab.reporting.render import ipc_kernel_manager

    monkeypatch.chdir(tmp_path)
    managers = [ipc_kernel_manager()(kernel_name="python3") for _ in range(2)]
    for km in managers:
        km.connection_file = str(tmp_path / f"{id(km)}.json")
        km.write_connection_file()  # chooses the socket numbers, as the start does
    paths = [{f"{km.ip}-{getattr(km, p)}" for p in ("shell_port", "iopub_port", "stdin_port",
                                                    "control_port", "hb_port")} for km in managers]
    assert all(len(p) == 5 for p in paths) and not paths[0] & paths[1]
    assert all(Path(km.ip).is_absolute() and Path(km.ip).parent != tmp_path for km in managers)
    assert all(km.transport == "ipc" for km in managers)
