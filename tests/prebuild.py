"""What a test session will build, built ahead in the background at a low priority (nice 10) (tests/conftest.py
starts it once the tests are collected, and stops it with SIGTERM when they end).

Each kernel tier is a library of its own (kernels/build.py), the aarch64 checks cross-compile the
same sources (tests/kernels/aarch64.py), and the Docker modules need the image built from this tree
(tests/e2e/docker_stack.py): minutes of one core each, the image most on a fresh machine. The tests run
mostly on one core of the two; here the other one builds them while the tests before run (conftest runs the
Docker modules last), and a test that needs one waits on its file lock only for what is not finished yet.

    python -m tests.prebuild avx512 avx2 generic aarch64:armv8-a docker-image

A Docker engine started here (none was running) runs at this priority and stays up for the tests until
SIGTERM; the kernels go first, the image beside them in a thread of its own.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

from kernels import build


def build_kernels(targets: list[str]) -> None:
    for target in targets:
        try:
            if target.startswith("aarch64:"):
                from tests.kernels import aarch64

                aarch64.kernel_archive(target.split(":", 1)[1])
            else:
                build.build(target)
        except Exception as error:  # the test that needs it builds it again and reports the failure
            print(f"prebuild: {target}: {error}", file=sys.stderr)


def main(targets: list[str]) -> None:
    os.nice(10)  # mostly the CPU the tests leave idle
    engines = []

    def stop(*_) -> None:  # the session ended: what is half built is left to its lock's next holder
        for engine in engines:
            engine.close()  # a Docker engine started here
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)

    def build_image() -> None:
        from tests.e2e.docker_stack import Engine, ensure_image

        try:
            engines.append(Engine())
            ensure_image(engines[0])
        except Exception as error:  # the Docker modules say why they skip or fail
            print(f"prebuild: docker-image: {error}", file=sys.stderr)

    image = threading.Thread(target=build_image, daemon=True) if "docker-image" in targets else None
    if image is not None:
        image.start()
    build_kernels([target for target in targets if target != "docker-image"])
    if image is not None:
        image.join()
    while engines and engines[0].process is not None:  # an engine of ours: up for the tests until SIGTERM
        signal.pause()


if __name__ == "__main__":
    main(sys.argv[1:])
