"""The GPU check can only run on a CUDA machine; here, make sure it is ready to."""
import importlib.util
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_kernel_bench():
    spec = importlib.util.spec_from_file_location("kernel_bench", BENCH / "kernel_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernel_bench"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_gpu_check_script_parses():
    assert subprocess.run(["bash", "-n", str(BENCH / "gpu_check.sh")]).returncode == 0


def test_kernel_bench_sizes_and_report_without_a_gpu():
    bench = load_kernel_bench()
    cases = dict(bench.attention_cases(smoke=False))
    assert len(cases["decode b=256 ctx=4096"]) == 256 and cases["prefill 1x2048"] == [(2048, 2048)]
    # decode, one token at 4096 context in bf16: K and V of 8 heads x 64 dims dominate
    assert bench.attention_bytes([(4096, 1)], 2) == 2 * 32 * 64 * 2 + 4096 * 8 * 64 * 2 * 2 + 256 * 4
    result = bench.Result("paged_attention", "decode b=1 ctx=128", 10**6, 20.0, 100.0, 5.0, 1e-3)
    report = bench.render_markdown([result], {"device": "test"}, 1e12, "cmd", "3 passed")
    assert "| paged_attention | decode b=1 ctx=128 | 1.00 | 20.0 | 100.0 | 5.0 | 5.0 | 4.0 | 1.00e-03 |" in report
    assert "3 passed" in report and '"x_floor": 4.0' in report
