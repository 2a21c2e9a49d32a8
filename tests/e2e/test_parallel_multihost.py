"""A worker group spanning two "hosts" (network namespaces on a bridge, tests/netns.py): rank 0 in this
process (outside the namespaces, on the bridge's address), rank 1 a `python -m services.worker
--group-rank 1 --group-address ...` in its own namespace. The ranks meet over the bridge only, and
give the tokens and logprobs of one process."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import make_llm, random_prompts
from tests.e2e.parallel_batch import ENGINE, MODEL, batch_params
from tests.netns import Hosts, why_not

REASON = why_not()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=f"no network namespaces here: {REASON}")]
ROOT = Path(__file__).resolve().parents[2]
PORT = 7261


def test_a_tp2_group_across_two_hosts_gives_the_bits_of_one_process(model_dir, tmp_path, monkeypatch):
    folder = model_dir(**MODEL)
    prompts = random_prompts(4, 512, min_len=5, max_len=40, seed=4)
    params = batch_params(max_tokens=12)[:4]
    with make_llm(folder, **ENGINE) as llm:
        want = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]
    with Hosts(["r1"], prefix="ps26-", subnet="10.226.0.0/24") as hosts:
        address = f"{hosts.gateway}:{PORT}"  # rank 0: this process, on the bridge
        argv = [sys.executable, "-m", "services.worker", "--model", str(folder), "--tensor-parallel-size", "2",
                "--group-rank", "1", "--group-address", address, "--dtype", "float32",
                "--num-gpu-blocks", str(ENGINE["num_gpu_blocks"]), "--block-size", str(ENGINE["block_size"]),
                "--num-threads", "1"]
        log = tmp_path / "rank1.log"
        with open(log, "w") as out:  # gloo binds the namespace's one interface
            rank1 = hosts["r1"].popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                      env={**os.environ, "GLOO_SOCKET_IFNAME": "eth0"})
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", hosts.bridge)
        try:
            with make_llm(folder, **ENGINE, tensor_parallel_size=2, group_address=address) as llm:
                got = [(o.outputs[0].token_ids, o.outputs[0].logprobs)
                       for o in llm.generate(prompts, params, use_tqdm=False)]
            assert rank1.wait(timeout=60) == 0, log.read_text()[-3000:]  # told to stop by rank 0
        finally:
            rank1.kill()
    assert got == want
