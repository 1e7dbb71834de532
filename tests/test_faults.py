"""Faults end as Ctrl-C does: SIGTERM (local and process executors), a full disk and a file-size
limit, a report into a read-only folder, and notebooks given bad papermill parameters. Each ends with
one kvlab line, the right exit status, nothing measured lost or duplicated, and a resume that
completes the plan. Parser bounds: a YAML bomb and a 10 MB list are refused in under a second."""

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from kvlab.cli import main
from kvlab.records import read_records

ROOT = Path(__file__).resolve().parents[1]
TINY = {"models": "tiny-llama", "weights": "synthetic", "device": "cpu", "methods": ["full"], "ctx": [32],
        "new_tokens": 3, "threads": 1, "warmup_runs": 0}


def write_params(tmp: Path, **more) -> Path:
    path = tmp / "p.yaml"
    path.write_text(yaml.safe_dump({**TINY, **more}))
    return path


def kvlab(*args, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.Popen([sys.executable, "-m", "kvlab", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **popen)


def wait_for_records(out: Path, n: int, proc: subprocess.Popen, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the sweep ended before it was signalled: {proc.communicate()}")
        path = out / "records.jsonl"
        if path.is_file() and path.read_text().count("\n") >= n:
            return
        time.sleep(0.2)
    raise AssertionError("no records within the timeout")


def children(pid: int) -> list[int]:
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
        except OSError:
            continue
        if fields.get("PPid", "").strip() == str(pid):
            found.append(int(status.parent.name))
    return found


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/status").read_text().split("State:\t", 1)[1][0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def ok_ids(out: Path) -> list[str]:
    return [r["run_id"] for r in read_records(out / "records.jsonl") if r.get("status") == "ok"]


def assert_resumes_to_the_full_plan(params: Path, out: Path, runs: int) -> str:
    """Rerun the sweep; it completes the plan with each run recorded ok once. Returns its stderr."""
    proc = kvlab("sweep", params, "-o", out, "--no-progress")
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr
    assert "status complete" in stdout
    ids = ok_ids(out)
    assert len(ids) == len(set(ids)) == runs  # nothing lost, nothing measured twice
    assert json.loads((out / "manifest.json").read_text())["status"] == "complete"
    assert not (out / "sweep.lock").exists()
    return stderr


@pytest.mark.slow(reason="two sweeps in subprocesses (torch imports)")
@pytest.mark.parametrize("executor", ["local", "process"])
def test_sigterm_keeps_records_marks_the_manifest_incomplete_and_exits_143(tmp_path, executor):
    params, out = write_params(tmp_path, repeats=400), tmp_path / "out"
    proc = kvlab("sweep", params, "-o", out, "--no-progress", "--executor", executor)
    wait_for_records(out, 3, proc)
    workers = children(proc.pid)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr
    lines = [line for line in stderr.splitlines() if not line.startswith("kvlab sweep: loaded")]
    assert lines == ["kvlab sweep: terminated (SIGTERM); every record written so far is kept (rerun to continue)"]
    assert json.loads((out / "manifest.json").read_text())["status"] == "incomplete"
    kept = ok_ids(out)
    assert len(kept) >= 3 and len(kept) == len(set(kept))
    time.sleep(0.5)
    assert not [pid for pid in workers if alive(pid)], "a worker outlived the sweep"
    assert_resumes_to_the_full_plan(params, out, 400)


@pytest.mark.slow(reason="a sweep in a subprocess (torch imports)")
def test_a_process_group_sigterm_leaves_no_worker_and_no_broken_pipe(tmp_path):
    """kill -TERM -PGID (systemd, Slurm): the driver and its worker both get it; the worker leaves the
    ending to the driver, which records what it has and stops the worker."""
    params, out = write_params(tmp_path, repeats=400), tmp_path / "out"
    proc = kvlab("sweep", params, "-o", out, "--no-progress", "--executor", "process", start_new_session=True)
    wait_for_records(out, 3, proc)
    workers = children(proc.pid)
    os.killpg(proc.pid, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr
    time.sleep(0.5)
    assert not [pid for pid in workers if alive(pid)]


@pytest.mark.slow(reason="two sweeps in subprocesses (torch imports)")
def test_a_file_size_limit_is_one_line_naming_the_folder_and_the_fix(tmp_path):
    """ulimit -f: the record writer's failed write is one kvlab line, not a chained OSError from close;
    the torn last line is skipped on resume, which completes the plan."""
    params, out = write_params(tmp_path, repeats=40), tmp_path / "out"

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))

    proc = kvlab("sweep", params, "-o", out, "--no-progress", preexec_fn=limit)
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 2, stderr
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last == (f"kvlab sweep: error: cannot write {out}/records.jsonl: File too large; raise the file-size limit "
                    f"(ulimit -f unlimited), or write to another folder, then rerun the same command to continue")
    assert json.loads((out / "manifest.json").read_text())["status"] == "incomplete"
    assert 0 < len(ok_ids(out)) < 40
    assert "records.jsonl" in assert_resumes_to_the_full_plan(params, out, 40)  # the torn line, skipped with a warning


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 64 KiB tmpfs (root only); skipped where it cannot be mounted (the ulimit test covers the writer)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.slow(reason="a sweep in a subprocess (torch imports)")
@pytest.mark.parametrize("executor", ["local", "process"])
def test_a_full_disk_is_one_line_and_keeps_every_record(small_tmpfs, tmp_path, executor):
    params, out = write_params(tmp_path, repeats=300), small_tmpfs / "out"
    proc = kvlab("sweep", params, "-o", out, "--no-progress", "--executor", executor)
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 2 and "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1].startswith(
        f"kvlab sweep: error: cannot write {out}/records.jsonl: No space left on device; free space on the disk "
        f"that holds {out}")
    kept = ok_ids(out)
    assert kept and len(kept) == len(set(kept))
    assert json.loads((out / "manifest.json").read_text())["status"] == "incomplete"
    assert not (out / "sweep.lock").exists()


@pytest.fixture
def read_only_sweep(tmp_path):
    """A finished sweep folder that cannot be written: a read-only bind mount as root, else chmod."""
    src = tmp_path / "src"
    assert main(["sweep", str(write_params(tmp_path)), "-o", str(src), "--no-progress"]) == 0
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() == 0:
        if subprocess.run(["mount", "--bind", str(src), str(ro)], capture_output=True).returncode != 0:
            pytest.skip("cannot bind-mount here")
        subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], check=True)
        yield ro
        subprocess.run(["umount", "-l", str(ro)], check=False)
    else:
        src.chmod(0o555)
        yield src
        src.chmod(0o755)


def test_report_into_a_read_only_folder_is_one_line(read_only_sweep, capsys):
    assert main(["report", str(read_only_sweep)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"kvlab report: error: the report's folder {read_only_sweep}: cannot write there (")
    assert err.rstrip().endswith("pass -o a writable path, e.g. -o /tmp/report.html")


def test_a_clean_finish_removes_the_lock(tmp_path):
    out = tmp_path / "out"
    assert main(["sweep", str(write_params(tmp_path)), "-o", str(out), "--no-progress"]) == 0
    assert not (out / "sweep.lock").exists()


def test_sigterm_in_any_command_is_one_line_and_status_143(monkeypatch, capsys):
    import kvlab.cli.budget_cmd as budget_cmd

    def terminated(args):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises here
        raise AssertionError("SIGTERM was not handled")

    monkeypatch.setattr(budget_cmd, "run", terminated)
    before = signal.getsignal(signal.SIGTERM)
    assert main(["budget", "--model", "tiny-llama", "--ctx", "8"]) == 143
    assert capsys.readouterr().err.strip() == ("kvlab budget: terminated (SIGTERM); every record written so far is "
                                               "kept (rerun to continue)")
    assert signal.getsignal(signal.SIGTERM) == before  # the command's handler is gone with it


@pytest.mark.parametrize("text, limit", [
    ("".join(f"{c}: &{c} [" + ", ".join([f"*{p}"] * 10 if p else ["1"] * 10) + "]\n"
             for p, c in zip(["", *"abcdefgh"], "abcdefghi", strict=True)) + "ctx: *i\n", "100,000 values"),
    ("ctx: [" + "4096, " * 1_666_000 + "4096]\n", "at most 1 MB"),
])
def test_a_params_file_that_would_hang_is_refused_in_under_a_second(tmp_path, text, limit):
    from kvlab.sweep.params import ParamsError, load_params

    path = tmp_path / "p.yaml"
    path.write_text(text)
    started = time.monotonic()
    with pytest.raises(ParamsError, match=limit):
        load_params(path)
    assert time.monotonic() - started < 1.0


def test_a_lognormal_clipped_to_the_window_gets_a_note(tmp_path, capsys):
    params = write_params(tmp_path, ctx={"dist": "lognormal", "median": 3000, "sigma": 2, "samples": 5})
    assert main(["sweep", str(params), "--dry-run"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "note" in line]
    assert notes == ["kvlab sweep: note: ctx: 2 of 5 lognormal lengths (up to 28,526) are above 4093 (tiny-llama's "
                     "window 4096 minus new_tokens 3) and run at 4093; add max: 4093 to ctx to say so, or lower "
                     "median or sigma"]


# --- notebooks: parameters papermill passes -------------------------------------------------------


def test_notebook_parameters_unknown_names_text_lists_and_baseline(tmp_path):
    from kvlab import report
    from kvlab.reporting import ReportError

    params = write_params(tmp_path)
    with pytest.raises(ReportError, match=r"no parameter 'ctxx' \(did you mean 'ctx'\?\)"):
        report.notebook_sweep_params(str(params), {"ctxx": 64, "In": [], "report": report})
    got = report.notebook_sweep_params(str(params), {"methods": '["full", "snapkv"]', "keep": "[0.5]", "ctx": 64})
    assert got.methods == ["full", "snapkv"] and got.keep == [0.5] and got.ctx == [64]
    out = tmp_path / "out"
    assert main(["sweep", str(params), "-o", str(out), "--no-progress"]) == 0
    with pytest.raises(ReportError, match="baseline 'nope' is no method in .*: its records hold full"):
        report.notebook_study({"records_dir": str(out), "baseline": "nope"})
    assert report.notebook_study({"records_dir": str(out), "baseline": "full", "study": None}).records is not None
    records = out / "records.jsonl"  # a folder without full runs renders under the default baseline
    text = records.read_text()
    records.write_text(text.replace('"method":"full"', '"method":"kvq-int4"').replace('"label":"full"', '"label":"kvq"'))
    assert '"method":"full"' in text and '"full"' not in records.read_text()
    assert report.notebook_study({"records_dir": str(out), "baseline": "full"}).records is not None


def papermill(tmp: Path, notebook: str, *params: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [a for i in range(0, len(params), 2) for a in ("-p", params[i], params[i + 1])]
    return subprocess.run([sys.executable, "-m", "papermill", str(ROOT / "notebooks" / f"{notebook}.ipynb"),
                           str(tmp / f"{notebook}-out.ipynb"), *args], capture_output=True, text=True, env=env,
                          cwd=tmp, timeout=600)


@pytest.mark.slow(reason="papermill starts a Jupyter kernel per notebook")
def test_papermill_bad_parameters_print_kvlabs_line_before_the_traceback(tmp_path):
    params = write_params(tmp_path)
    run = papermill(tmp_path, "sweep", "params_file", str(params), "ctxx", "64")
    assert run.returncode != 0
    first = run.stderr.index("kvlab: error: notebooks/sweep.ipynb has no parameter 'ctxx' (did you mean 'ctx'?)")
    assert first < run.stderr.index("Traceback")
    out = tmp_path / "out"
    assert main(["sweep", str(params), "-o", str(out), "--no-progress"]) == 0
    run = papermill(tmp_path, "report", "records_dir", str(out), "baseline", "nope")
    assert run.returncode != 0
    assert run.stderr.index("kvlab: error: baseline 'nope' is no method in") < run.stderr.index("Traceback")


@pytest.mark.parametrize("notebook", ["sweep", "report", "serving"])
def test_the_names_a_notebook_assigns_are_known_as_its_own(notebook):
    """A rerun in JupyterLab finds them in globals(): they must not read as unknown parameters."""
    import ast

    from kvlab.reporting.notebook_params import NOTEBOOK_OWN_NAMES

    cells = json.loads((ROOT / "notebooks" / f"{notebook}.ipynb").read_text())["cells"]
    assigned = set()
    for cell in cells:
        if cell["cell_type"] != "code" or "parameters" in cell["metadata"].get("tags", []):
            continue
        for node in ast.walk(ast.parse("".join(cell["source"]))):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                assigned.add(node.id)
    assert assigned == NOTEBOOK_OWN_NAMES[notebook]
