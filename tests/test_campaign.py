"""scripts/device/campaign.sh runs a preset's parts (scripts/device/presets/*.sh) in the preset's
order, only those asked for, each under its limit, and packs the preset's folder: checked with fake
``python3`` and ``nvidia-smi`` that print what they were asked to run (no GPU, nothing measured)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PRESETS = sorted(p.stem for p in (REPO / "scripts" / "device" / "presets").glob("*.sh"))


def run_campaign(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[str, Path]:
    work = tmp_path / "work"
    shutil.copytree(REPO / "scripts", work / "scripts")
    fakes = tmp_path / "bin"
    fakes.mkdir()
    for name in ("python3", "nvidia-smi"):
        (fakes / name).write_text('#!/bin/sh\necho "RAN ' + name + ' $*"\n')
        (fakes / name).chmod(0o755)
    out = tmp_path / "out"
    full_env = {**os.environ, "PATH": f"{fakes}:{os.environ['PATH']}", "OUT": str(out), **(env or {})}
    done = subprocess.run(["bash", "scripts/device/campaign.sh", *args], cwd=work, env=full_env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout, work


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_parses_and_runs_its_default_parts(tmp_path, preset):
    text = (REPO / "scripts" / "device" / "presets" / f"{preset}.sh").read_text()
    assert subprocess.run(["bash", "-n", str(REPO / "scripts" / "device" / "presets" / f"{preset}.sh")]).returncode == 0
    defaults = next((line.split("=", 1)[1].strip('"').split() for line in text.splitlines()
                     if line.startswith("DEFAULT_PARTS=")), [])
    stdout, work = run_campaign(tmp_path, preset)
    started = [line.split()[2] for line in stdout.splitlines() if line.startswith("== [") and "(limit" in line]
    assert started == [p for p in started if p in defaults] and set(started) <= set(defaults)
    assert (tmp_path / "out" / f"{preset}.tgz").is_file()
    for part in started:
        assert (work / "outputs" / preset / f"{part}.log").is_file()


def test_only_the_asked_parts_run_in_the_presets_order_under_their_limits(tmp_path):
    stdout, work = run_campaign(tmp_path, "methods-16k", "kernels", "m1", env={"LIMIT_m1": "100"})
    started = [line.split()[2] for line in stdout.splitlines() if "(limit" in line]
    assert started == ["m1", "kernels"]  # the preset's order, not the command line's
    assert "(limit 100s)" in stdout
    m1 = (work / "outputs" / "methods-16k" / "m1.log").read_text()
    assert "params/h200-methods.yaml -o outputs/methods-16k/methods-b1 --set time_budget_s=75" in m1


def test_a_sweep_step_runs_under_the_default_preset(tmp_path):
    stdout, work = run_campaign(tmp_path, "sweep:h200-reads@ctx=[16384]")
    assert "RAN python3 -m kvlab sweep params/h200-reads.yaml -o outputs/study/h200-reads" in stdout
    assert "--set ctx=[16384]" in stdout
    assert (tmp_path / "out" / "study.tgz").is_file()
