"""The project installed as setup.sh installs it (editable, --no-deps): the `pagedserve` console
command and the public package work from any directory, and run this checkout's code.

The venv is built in a temporary folder from the base interpreter; a .pth file lends it the
test environment's pinned packages, so nothing is downloaded.
"""
from __future__ import annotations

import os
import signal
import site
import subprocess
import sys
import threading
import time
import venv
from pathlib import Path

import pytest

from services.launch.deployment import free_ports
from tests.e2e.test_launcher import FAKE_SERVICE, up_args

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A venv with the project installed editable; returns its bin/ folder."""
    home = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=False).create(home)
    python = home / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    (Path(purelib) / "lent.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                    "--no-build-isolation", "--no-index", "-e", str(ROOT)], check=True, cwd=home, timeout=300)
    return home / "bin"


@pytest.mark.slow
def test_the_public_package_and_the_services_resolve_to_this_checkout_from_elsewhere(installed, tmp_path):
    code = ("import pagedserve, services, kernels; from pagedserve import LLM, SamplingParams, Client, AsyncClient; "
            "print(pagedserve.__file__, services.__file__, kernels.__file__)")
    out = subprocess.run([installed / "python", "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120, env=_clean_env())
    assert out.returncode == 0, out.stderr
    assert [Path(p).parents[1] for p in out.stdout.split()] == [ROOT] * 3
    # what `up` runs for each service (`python -m services.<name>`) resolves there too
    health = subprocess.run([installed / "python", "-m", "services.launch.healthcheck", "--help"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60, env=_clean_env())
    assert health.returncode == 0, health.stderr


@pytest.mark.slow
def test_the_pagedserve_command_runs_up_from_another_directory(installed, tmp_path):
    listing = subprocess.run([installed / "pagedserve", "--help"], cwd=tmp_path, capture_output=True, text=True,
                             timeout=60, env=_clean_env())
    assert listing.returncode == 0, listing.stderr
    assert "up" in listing.stdout and "diverge" in listing.stdout
    # `up` with stand-in services (as tests/e2e/test_launcher.py runs it): ready, then Ctrl-C stops it with 0
    fake_python = tmp_path / "python"
    fake_python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_SERVICE}" "$@"\n')
    fake_python.chmod(0o755)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    proc = subprocess.Popen([installed / "pagedserve", "up", *up_args(model, free_ports(3), workers=1),
                             "--python", str(fake_python)], cwd=tmp_path, text=True, env=_clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        deadline = time.monotonic() + 120
        while not any(line.startswith("ready:") for line in lines):
            assert proc.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()


def _clean_env() -> dict[str, str]:
    """No PYTHONPATH: only the install can make the packages importable from elsewhere."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
