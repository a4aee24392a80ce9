# SPDX-License-Identifier: Apache-2.0
"""Lifecycle of a `vllm serve` process for the serving benchmarks (loopback only)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def vllm_exe() -> list[str]:
    """The `vllm` command, or the same CLI through this Python."""
    if shutil.which("vllm"):
        return ["vllm"]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def wait_for_health(
    server: subprocess.Popen, base: str, deadline: float, log_path: Path | str
) -> float:
    """Poll ``base``/health until it answers; seconds waited. Raises if the
    server exits (RuntimeError) or ``deadline`` (time.time()) passes first
    (TimeoutError); both name the server log."""
    start = time.time()
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"server exited with {server.returncode} (see {log_path})")
        try:
            urllib.request.urlopen(base + "/health", timeout=5)
            return time.time() - start
        except OSError:
            if time.time() > deadline:
                raise TimeoutError(
                    f"no /health after {time.time() - start:.0f}s (see {log_path})"
                ) from None
            time.sleep(2)


def stop_server(server: subprocess.Popen) -> None:
    """SIGTERM the server's process group, then SIGKILL if it lingers (the
    server was started with start_new_session=True)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if server.poll() is not None:
            return
        try:
            os.killpg(server.pid, sig)
            server.wait(timeout=30)
            return
        except Exception:
            continue
