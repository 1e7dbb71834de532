"""The Ray carry for the lent GPU machine (``build-carry.sh ray``) deletes the packages listed in
scripts/device/ray-prune.txt: with every one of them made unimportable (in the driver and, through
PYTHONPATH, in Ray's own processes and workers), a local cluster still runs a ray sweep."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PRUNE = REPO / "scripts" / "device" / "ray-prune.txt"


def pruned_modules() -> list[str]:
    """The Python packages the list deletes (paths under ``ray/`` that hold an ``__init__.py`` in
    the installed ray), as dotted names."""
    ray = pytest.importorskip("ray")
    root = Path(ray.__file__).parent.parent
    names = []
    for line in PRUNE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and line.startswith("ray/") and (root / line / "__init__.py").is_file():
            names.append(line.replace("/", "."))
    return names


def test_the_prune_list_names_real_packages_and_keeps_the_core():
    names = pruned_modules()
    assert "ray.rllib" in names and "ray.tune" in names and "ray.autoscaler.aws" in names
    kept = ("ray._private", "ray.dashboard", "ray.util", "ray.autoscaler", "ray.experimental", "ray.dag")
    assert not any(n == k for n in names for k in kept)


@pytest.mark.slow(reason="starts a local Ray cluster in a fresh interpreter")
@pytest.mark.xdist_group("ray")  # one local Ray cluster at a time: pytest -n runs these on one worker
def test_a_ray_sweep_runs_without_the_pruned_packages(tmp_path):
    blocked = pruned_modules()
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import sys
        BLOCKED = {blocked!r}
        class Pruned:
            def find_spec(self, name, path=None, target=None):
                if any(name == b or name.startswith(b + ".") for b in BLOCKED):
                    raise ModuleNotFoundError(f"No module named {{name!r}} (pruned from the Ray carry)")
                return None
        sys.meta_path.insert(0, Pruned())
    """))
    script = textwrap.dedent(f"""
        import importlib, sys
        from kvlab.sweep.params import parse_params
        from kvlab.records import read_manifest
        from kvlab.sweep.driver import run_sweep
        try:
            importlib.import_module({blocked[0]!r})
            sys.exit("the blocker is not active")
        except ModuleNotFoundError:
            pass
        params = parse_params({{"name": "carry", "models": "tiny-llama", "weights": "synthetic", "device": "cpu",
                               "methods": ["full"], "ctx": [32], "batch": 1, "new_tokens": 2, "prompts": 1,
                               "threads": 1, "executor": "ray"}})
        s = run_sweep(params, {str(tmp_path / "out")!r}, progress=False, log=lambda m: None)
        assert s.complete and s.failed == 0, s
        print("workers", read_manifest({str(tmp_path / "out")!r})["invocations"][0]["workers"])
    """)
    # RAY_ADDRESS=local: a cluster of its own, whose workers inherit the blocker, even while the session's
    # shared cluster (tests/conftest.py's ray_fake_gpus) runs on this machine
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO), str(REPO / "tests")]),
               RAY_USAGE_STATS_ENABLED="0", RAY_ADDRESS="local")
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "workers [{" in proc.stdout
