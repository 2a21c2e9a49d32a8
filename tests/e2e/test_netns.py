"""tests/netns.py, the namespace "hosts" the multi-host tests stand on: each has its own address, they
reach each other and the test process over the bridge, loopback stays each host's own, a power cut
kills every process inside, and nothing is left after the `with`."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.netns import Hosts, NETNS_DIR, ip, why_not

REASON = why_not()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no network namespaces here: {REASON}")

SERVE = ("import socket, sys\n"
         "s = socket.create_server((sys.argv[1], 7000)); print('up', flush=True)\n"
         "while True:\n"
         "    c, peer = s.accept(); c.sendall(peer[0].encode()); c.close()\n")
DIAL = ("import socket, sys\n"
        "try:\n"
        "    print(socket.create_connection((sys.argv[1], 7000), timeout=3).recv(100).decode())\n"
        "except OSError as e:\n"
        "    print(type(e).__name__)\n")


def test_hosts_have_their_own_addresses_reach_each_other_and_are_gone_after():
    with Hosts(["ta", "tb"], prefix="ps25-", subnet="10.225.0.240/28", bridge="tbr") as hosts:
        a, b = hosts["ta"], hosts["tb"]
        assert (a.address, b.address, hosts.gateway) == ("10.225.0.242", "10.225.0.243", "10.225.0.241")
        assert f"inet {a.address}/28" in a.run(["ip", "-o", "addr", "show", "eth0"]).stdout
        server = a.popen([sys.executable, "-c", SERVE, a.address], stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline() == "up\n"
        # b dials a's address and a sees b's: the packets crossed the bridge
        assert b.run([sys.executable, "-c", DIAL, a.address]).stdout.strip() == b.address
        # this machine (outside every host) reaches a over the bridge, from the gateway address
        with socket.create_connection((a.address, 7000), timeout=3) as conn:
            assert conn.recv(100).decode() == hosts.gateway
        # loopback is each host's own: a's server is not on b's 127.0.0.1
        assert b.run([sys.executable, "-c", DIAL, "127.0.0.1"]).stdout.strip() == "ConnectionRefusedError"
        # cable out: b no longer reaches a; back in: it does
        a.link(False)
        assert b.run([sys.executable, "-c", DIAL, a.address]).stdout.strip() in ("TimeoutError", "OSError")
        a.link(True)
        assert b.run([sys.executable, "-c", DIAL, a.address]).stdout.strip() == b.address
        # a power cut: every process in a, the server included, is gone
        assert server.pid in a.kill_all() or server.poll() is not None
        assert server.wait(5) == -9 and a.pids() == []
    assert not (NETNS_DIR / "ps25-ta").exists() and not (NETNS_DIR / "ps25-tb").exists()
    assert ip("link", "show", "ps25-tbr", check=False).returncode != 0
    assert ip("link", "show", "ps25-ta", check=False).returncode != 0


def test_a_failing_test_inside_still_tears_everything_down():
    with pytest.raises(ZeroDivisionError):
        with Hosts(["tc"], prefix="ps25-", subnet="10.225.0.240/28", bridge="tbr") as hosts:
            hosts["tc"].popen(["sleep", "600"])
            1 / 0
    assert not (NETNS_DIR / "ps25-tc").exists()
    assert ip("link", "show", "ps25-tbr", check=False).returncode != 0
