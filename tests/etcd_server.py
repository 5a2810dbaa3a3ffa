"""A real etcd server for tests: the `etcd` binary from PATH (Debian's etcd-server package;
scripts/install.sh tries to install it), its data in a temporary folder, its client and peer
URLs on free loopback ports. ETCD is None where there is none."""
from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request

from kungfu._ports import free_ports

ETCD = shutil.which("etcd")
START_DEADLINE = 30.0  # seconds for etcd to answer after it starts


def _post(url, body, timeout=2.0):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class Etcd:
    def __init__(self, data_dir):
        client_port, peer_port = free_ports(2)
        self.client_url = f"http://127.0.0.1:{client_port}"
        self.host_port = f"127.0.0.1:{client_port}"
        peer_url = f"http://127.0.0.1:{peer_port}"
        self.log_path = os.path.join(data_dir, "etcd.log")
        # Flags, not ETCD_* variables from the caller's environment, configure this etcd.
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("ETCD_") or k == "ETCD_UNSUPPORTED_ARCH"}
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [ETCD, "--name", "kungfu-test", "--data-dir", os.path.join(data_dir, "data"),
             "--listen-client-urls", self.client_url, "--advertise-client-urls", self.client_url,
             "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
             "--initial-cluster", f"kungfu-test={peer_url}",
             "--initial-cluster-state", "new"],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)

    def log(self):
        with open(self.log_path, "rb") as f:
            return f.read()[-3000:].decode(errors="replace")

    def wait_ready(self, deadline=START_DEADLINE):
        end = time.monotonic() + deadline
        last = None
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}:\n{self.log()}")
            try:
                # A read through the same gateway EtcdStore uses: answers once etcd has a leader.
                _post(self.client_url + "/v3/kv/range", {"key": base64.b64encode(b"x").decode()})
                return
            except (urllib.error.URLError, OSError, ValueError) as e:
                last = e
            time.sleep(0.1)
        raise RuntimeError(f"etcd did not answer at {self.client_url} within {deadline:.0f}s "
                           f"({last}):\n{self.log()}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()
