"""Shared factories: tiny random models (built once per session), engines, requests."""
from __future__ import annotations

import random

import pytest

from services.core.sampling_params import SamplingParams


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """make_model(arch, size, dtype) -> folder, cached for the session."""
    from services.tools.make_model import make_model

    cache = {}

    def build(arch: str = "llama", size: str = "tiny", dtype: str = "float32", **overrides):
        key = (arch, size, dtype, tuple(sorted(overrides.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{arch}-{size}-{dtype}")
            cache[key] = make_model(out, arch=arch, size=size, seed=0, dtype=dtype, **overrides)
        return cache[key]

    return build


@pytest.fixture(scope="session")
def tiny_llama(model_dir):
    return model_dir("llama", "tiny")


def random_prompts(num: int, vocab_size: int, min_len: int = 1, max_len: int = 300, seed: int = 0,
                   shared_prefix: int = 0) -> list[list[int]]:
    """Token-id prompts of varied length; ids avoid the special tokens 0..2."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab_size) for _ in range(shared_prefix)]
    lengths = [min_len, max_len] + [rng.randint(min_len, max_len) for _ in range(num - 2)]
    return [prefix + [rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths[:num]]


# The KV cache of a test's engine, unless the test sizes it (num_gpu_blocks or kv_cache_memory_bytes). The
# default budget, 1 GiB on the CPU, took 2.6 s of each tiny-model engine's start: zeroing it, and listing its
# 131,072 blocks one by one in the block pool; the suite starts hundreds. 128 MiB still holds 16,384 blocks of
# the tiny models (262,144 tokens) and 2,900 tokens of the default model. Outputs do not depend on the size.
TEST_KV_CACHE_BYTES = 128 << 20


def make_llm(model, **engine_args):
    from pagedserve import LLM

    engine_args.setdefault("seed", 0)
    if "num_gpu_blocks" not in engine_args and "kv_cache_memory_bytes" not in engine_args:
        engine_args["kv_cache_memory_bytes"] = TEST_KV_CACHE_BYTES
    return LLM(str(model), **engine_args)


def greedy(max_tokens: int = 16, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


# ---- CPU kernel tiers (kernels/build.py, kernels/cpu_kernels.py) ---------------------------------------------
def _tier_params(engine: bool) -> list:
    from kernels.build import host_tiers, testable_tiers

    return [pytest.param(tier, id=tier) for tier in (host_tiers() if engine else testable_tiers())]


@pytest.fixture(params=_tier_params(engine=False))
def cpu_tier(request):
    """Each kernel tier this CPU executes, active while the test runs (best first; on an AVX-512
    CPU with AVX-512 BF16 also avx512-nobf16, the AVX-512 tier as other AVX-512 CPUs build it)."""
    yield from use_tier(request.param)


@pytest.fixture(params=_tier_params(engine=True))
def engine_tier(request):
    """Each tier an engine can be forced to here (cpu_isa=engine_tier), active while the test runs."""
    yield from use_tier(request.param)


def use_tier(tier: str):
    """Generator for a fixture: `tier` active while it is suspended (skips where it does not build)."""
    from kernels import cpu_kernels

    scope = cpu_kernels.use_isa(tier)
    try:
        scope.__enter__()
    except cpu_kernels.KernelUnavailable as error:
        pytest.skip(f"the {tier} kernels do not build here: {error}")
    try:
        yield tier
    finally:
        scope.__exit__(None, None, None)


# ---- what the session builds, built ahead (tests/prebuild.py) -------------------------------
_AARCH64_MODULES = ("tests/kernels/test_cross_arch.py", "tests/kernels/test_quant_types.py",
                    "tests/kernels/test_quant_dot_aarch64.py")
_DOCKER_MODULES = ("tests/e2e/test_docker.py", "tests/e2e/test_swarm.py")  # the image built from this tree
_prebuild = None
PREBUILD_FROM = 500  # tests collected: the suite, or a large part of it


def pytest_collection_modifyitems(session, config, items):
    """The Docker modules last, so that the background pre-build has the whole session to make their image."""
    items.sort(key=lambda item: item.nodeid.split("::")[0] in _DOCKER_MODULES)  # stable: otherwise in order


def pytest_collection_finish(session):
    """Start building, on the core the tests leave idle, what the collected tests will need: every kernel
    tier where kernel, engine or worker tests run, the aarch64 archives where the aarch64 checks do, the
    Docker image where the Docker modules do (PAGEDSERVE_TEST_PREBUILD=0: nothing)."""
    import os
    import subprocess
    import sys

    global _prebuild
    if session.config.option.collectonly or os.environ.get("PAGEDSERVE_TEST_PREBUILD") == "0":
        return
    paths = {item.nodeid.split("::")[0] for item in session.items}
    targets = []
    if any(path.startswith(("tests/kernels/", "tests/engine/", "tests/worker/")) for path in paths):
        from kernels.build import testable_tiers

        targets += testable_tiers()
        if "avx512" in targets:
            targets.append("avx512-novnni")  # tests/kernels/test_quant_dot.py's
    if paths & set(_AARCH64_MODULES):
        from tests.kernels import aarch64

        if aarch64.MISSING is None:
            targets += [f"aarch64:{march}" for march in aarch64.MARCHES]
    if paths & set(_DOCKER_MODULES):
        targets.append("docker-image")
    if len(session.items) >= PREBUILD_FROM and targets:  # a run of a few modules builds what it needs as it goes
        _prebuild = subprocess.Popen([sys.executable, "-m", "tests.prebuild", *targets], start_new_session=True,
                                     stdout=subprocess.DEVNULL)


def pytest_sessionfinish(session, exitstatus):
    import os
    import signal
    import subprocess

    if _prebuild is not None and _prebuild.poll() is None:
        os.killpg(_prebuild.pid, signal.SIGTERM)  # it stops a Docker engine it started (up to a minute)
        try:
            _prebuild.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(_prebuild.pid, signal.SIGKILL)
            _prebuild.wait()
