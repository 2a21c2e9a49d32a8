"""The launcher's stop request comes from a signal handler, which Python runs in the main thread between
two of its bytecodes, wherever that thread is: also inside the launcher's own wait on the stop flag."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# In a child process (a deadlock there must not hang the suite): the launcher of a one-worker deployment;
# while its main thread waits on `stopping`, at every line that wait runs (threading's own code included),
# the handler `request_stop` runs, as a SIGTERM arriving at that moment would run it.
CHILD = textwrap.dedent("""
    import sys, time
    from services.launch.deployment import Deployment
    from services.launch.supervisor import Launcher

    launcher = Launcher(Deployment(model="m", num_workers=1, worker_ports=(50001,)))
    inside = [0]

    def tracer(frame, event, arg):
        if event == "line":
            sys.settrace(None)
            launcher.request_stop()  # the signal handler's call
            inside[0] += 1
            sys.settrace(tracer)
        return tracer

    start = time.monotonic()
    sys.settrace(tracer)
    woke = launcher.stopping.wait(30.0)
    sys.settrace(None)
    print(woke, inside[0] > 0, round(time.monotonic() - start, 3))
""")


def test_a_stop_request_in_the_middle_of_the_launchers_wait_stops_it_at_once():
    # with a threading.Event the handler's set() waited forever on the lock its own thread held inside
    # Event.wait: `up` never exited after a SIGTERM (the clean-clone CI of bd62c8a, 1 run in several)
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=20,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    woke, traced, seconds = done.stdout.split()
    assert (woke, traced) == ("True", "True")
    assert float(seconds) < 5.0
