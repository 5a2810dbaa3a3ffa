"""Importing kungfu.tensorflow connects to no peer; the first use does.

A worker is started as kungfu-run starts rank 1 of 2, its peer at a port where this test listens
and counts connections (or where nothing listens). The import finishes with no connection made;
the first op, collective or kf.Optimizer step then connects, and fails naming the peer, which
never answers as a kungfu peer would.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

import pytest

from conftest import REPO_ROOT, free_ports

pytest.importorskip("tensorflow")

SCRIPT = r"""
import sys
import kungfu.tensorflow as kft
import kungfu as kf
from kungfu import _peer
print("imported", _peer.started(), kf.rank(), kf.size(), flush=True)
sys.stdin.readline()  # the test has counted the connections so far
use = sys.argv[1]
try:
    if use == "op":
        import tensorflow as tf
        kft.ops.all_reduce(tf.constant([1.0]))
    elif use == "collective":
        import numpy as np
        kf.allreduce(np.ones(2, np.float32))
    elif use == "optimizer":
        import keras
        import tensorflow as tf
        v = tf.Variable([1.0])
        kf.Optimizer(keras.optimizers.SGD(0.1)).apply([tf.constant([1.0])], [v])
except Exception as e:  # noqa: BLE001
    print("failed:", type(e).__name__, e, flush=True)
    sys.exit(3)
print("no failure", flush=True)
"""


class Listener:
    """A peer's address that accepts and counts connections and says nothing: its TCP port and
    the abstract Unix socket the runtime dials for a peer on the same host."""

    def __init__(self):
        tcp = socket.socket()
        tcp.bind(("127.0.0.1", 0))
        self.port = tcp.getsockname()[1]
        local = socket.socket(socket.AF_UNIX)
        local.bind(f"\0kungfu-127.0.0.1:{self.port}")
        self.socks = [tcp, local]
        self.accepted = 0
        self.held = []
        for s in self.socks:
            s.listen(16)
            threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def _accept(self, sock):
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            self.accepted += 1
            self.held.append(conn)

    def close(self):
        for c in self.socks + self.held:
            c.close()


def _start(use: str, peer_port: int):
    me = free_ports(1)[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUNGFU_")}
    env.update(PYTHONPATH=REPO_ROOT, TF_CPP_MIN_LOG_LEVEL="3",
               KUNGFU_SELF_SPEC=f"127.0.0.1:{me}",
               KUNGFU_INIT_PEERS=f"127.0.0.1:{peer_port},127.0.0.1:{me}",
               KUNGFU_CONNECT_TIMEOUT="4s", KUNGFU_PEER_TIMEOUT="4s")
    return subprocess.Popen([sys.executable, "-c", SCRIPT, use], env=env, cwd=REPO_ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _first_use(p) -> tuple:
    """Lets the started worker go on to its first use; its stdout and stderr once it ended."""
    try:
        p.stdin.write("go\n")
        p.stdin.flush()
        return p.communicate(timeout=90)
    finally:
        if p.poll() is None:
            p.kill()


@pytest.mark.parametrize("use", ["op", "collective", "optimizer"])
@pytest.mark.timeout(120)
def test_import_connects_to_no_peer_first_use_does(use):
    peer = Listener()
    p = _start(use, peer.port)
    try:
        line = p.stdout.readline()
        assert line.split() == ["imported", "False", "1", "2"], line + p.stderr.read()
        assert peer.accepted == 0, "importing kungfu.tensorflow connected to the peer"
        out, err = _first_use(p)
    finally:
        if p.poll() is None:
            p.kill()
        peer.close()
    assert p.returncode == 3, out + err
    assert peer.accepted >= 1, "the first use did not connect"
    assert f"127.0.0.1:{peer.port}" in out, out  # the failure names the peer


@pytest.mark.timeout(120)
def test_first_use_names_a_peer_that_is_not_there():
    [gone] = free_ports(1)  # nothing listens there
    p = _start("collective", gone)
    line = p.stdout.readline()
    if line.split()[:2] != ["imported", "False"]:
        p.kill()
        pytest.fail(line + p.stderr.read())
    out, err = _first_use(p)
    assert p.returncode == 3 and f"127.0.0.1:{gone}" in out, out + err
