"""Kernel tiers: which ones this CPU runs, forcing one, and what each build compiled."""
from __future__ import annotations

import pytest
import torch

from kernels import build, cpu_kernels
from kernels.linear import invariant_linear, prepack
from services.core.config import CPU_ISAS, WorkerConfig
from services.core.errors import InvalidArgument
from tests.conftest import greedy, make_llm

COMPILED = {"avx512": ("avx512", "avx512+bf16"), "avx512-nobf16": ("avx512",), "avx2": ("avx2",),
            "generic": ("generic", "generic-neon")}


def test_the_config_names_every_tier():
    assert CPU_ISAS == ("auto", *build.TIERS)


def test_each_tier_compiles_its_own_code_path(cpu_tier):
    assert cpu_kernels.compiled_path() in COMPILED[cpu_tier]
    assert cpu_kernels.active_tier() == cpu_tier


def test_host_tiers_follow_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(build.platform, "machine", lambda: "x86_64")
    zen3 = "flags : fpu sse2 avx avx2 fma bmi1 bmi2 f16c movbe abm xsave"
    monkeypatch.setattr(build, "_cpu_flags", lambda: zen3)
    assert build.host_tiers() == ("avx2", "generic")
    monkeypatch.setattr(build, "_cpu_flags", lambda: zen3 + " avx512f avx512bw avx512cd avx512dq avx512vl")
    assert build.host_tiers() == ("avx512", "avx2", "generic")
    monkeypatch.setattr(build.platform, "machine", lambda: "aarch64")
    assert build.host_tiers() == ("generic",)


def test_forcing_a_tier_this_cpu_cannot_execute_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(build, "_cpu_flags", lambda: "flags : fpu sse2 avx avx2 fma bmi1 bmi2 f16c movbe abm xsave")
    monkeypatch.setattr(build.platform, "machine", lambda: "x86_64")
    with pytest.raises(ValueError, match="cpu_isa: .* cannot execute the avx512 kernels; it runs avx2, generic"):
        with cpu_kernels.use_isa("avx512"):
            pass
    with pytest.raises(ValueError, match="cpu_isa: must be one of"):
        cpu_kernels.select_isa("sse9")


def test_use_isa_restores_the_tier_before():
    before = cpu_kernels.active_tier()
    with cpu_kernels.use_isa("generic"):
        assert cpu_kernels.active_tier() == "generic"
    assert cpu_kernels.active_tier() == before


def test_bf16_linear_runs_on_every_tier(cpu_tier):
    """bf16 never reaches a library that cannot run it: every tier packs it for its own GEMM."""
    dense = torch.randn(96, 64).to(torch.bfloat16)
    weight = prepack(dense)
    assert not isinstance(weight, torch.Tensor)
    x = torch.randn(3, 64).to(torch.bfloat16)
    want = x.double() @ dense.double().T
    torch.testing.assert_close(invariant_linear(x, weight, None).double(), want, rtol=1 / 128, atol=1e-2)


def test_engine_arg_forces_the_tier(tiny_llama, engine_tier):
    llm = make_llm(tiny_llama, cpu_isa=engine_tier)
    assert cpu_kernels.active_tier() == engine_tier
    out = llm.generate([[5, 6, 7]], greedy(4), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_bad_cpu_isa_names_the_field(tiny_llama):
    with pytest.raises(InvalidArgument, match="cpu_isa"):
        make_llm(tiny_llama, cpu_isa="avx9")
    with pytest.raises(InvalidArgument, match="cpu_isa"):
        WorkerConfig(model="m", cpu_isa="neon")


def test_worker_flag_and_environment(monkeypatch):
    from services.worker.__main__ import build_configs, parse_args

    assert build_configs(parse_args(["--cpu-isa", "avx2"]))[0].cpu_isa == "avx2"
    monkeypatch.setenv("PAGEDSERVE_CPU_ISA", "generic")
    assert build_configs(parse_args([]))[0].cpu_isa == "generic"


def test_the_kernels_are_built_in_the_kernel_cache_dir_setting_not_under_home(tmp_path, monkeypatch):
    from services.core.config import DEFAULT_KERNEL_CACHE_DIR, WorkerConfig

    monkeypatch.setattr(build, "_build_dir", build._build_dir)  # put back after the test
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert WorkerConfig().kernel_cache_dir == DEFAULT_KERNEL_CACHE_DIR
    build.set_build_dir(str(tmp_path / "kernels"))
    assert build._default_build_dir() == tmp_path / "kernels"
    assert not (tmp_path / "home").exists()
