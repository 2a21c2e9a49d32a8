"""A script that creates a tensor parallel LLM at module level, without `if __name__ == "__main__":`,
fails at once with the fix in the message. Each spawned rank re-imports the script, which fails in
multiprocessing's bootstrap; rank 0 used to wait at the rendezvous for the group's whole timeout
(120 s per start) before saying anything."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.slow  # a rank process imports torch: a few seconds


def test_an_unguarded_script_asking_for_two_ranks_fails_at_once_with_the_fix(model_dir, tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(f"""\
        from pagedserve import LLM

        llm = LLM({str(model_dir("llama", "tiny"))!r}, tensor_parallel_size=2, num_threads=1)
        print("served")
        """))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100, env=env,
                          cwd=tmp_path)
    took = time.monotonic() - start
    assert done.returncode != 0 and "served" not in done.stdout
    assert 'must do so under `if __name__ == "__main__":`' in done.stderr, done.stderr[-3000:]
    assert "tensor_parallel_size x pipeline_parallel_size = 2" in done.stderr
    assert took < 60, f"{took:.0f} s: rank 0 waited at the rendezvous"
