"""kungfu-run under a real Slurm (Debian's slurmctld and slurmd): two nodes, each a network
namespace of its own (slurm_cluster.sh), and jobs submitted as a user submits them: an sbatch
script whose one srun line starts a kungfu-run per node, which take the job's hosts from Slurm
(kungfu/_launch/slurm.py). The digits example trains to the same weights on both nodes."""
from __future__ import annotations

import importlib.util
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO_ROOT

HERE = Path(__file__).resolve().parent
TOOLS = ("slurmctld", "slurmd", "srun", "sbatch", "scontrol", "ip", "nsenter", "unshare")

pytestmark = [
    pytest.mark.skipif(any(shutil.which(t) is None for t in TOOLS) or os.geteuid() != 0,
                       reason="needs root and Slurm (scripts/install.sh installs slurmctld, "
                              "slurmd and slurm-client with apt-get)"),
    pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("tensorflow", "sklearn")),
                       reason="the example needs tensorflow and scikit-learn"),
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    folder = tmp_path_factory.mktemp("slurm")
    tag = str(100 + os.getpid() % 150)  # the namespaces', bridge's and subnet's
    script = str(HERE / "slurm_cluster.sh")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    r = subprocess.run(["bash", script, "start", str(folder), tag], capture_output=True,
                       text=True, env=env, timeout=120, check=False)
    try:
        assert r.returncode == 0, f"the Slurm cluster did not start:\n{r.stdout}\n{r.stderr}"
        yield folder
    finally:
        subprocess.run(["bash", script, "stop", str(folder), tag], env=env, timeout=120,
                       check=False)


def _env(cluster: Path, token: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM", "KUNGFU_"))}
    bin_dir = os.path.dirname(sys.executable)
    env.update(SLURM_CONF=str(cluster / "slurm.conf"), KUNGFU_JOB_TOKEN=token,
               PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
               PYTHONPATH=REPO_ROOT, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
    return env


def _sbatch(cluster: Path, tmp_path: Path, body: str, timeout: float = 240) -> str:
    """Submits a batch script of two nodes, waits for it and returns its output."""
    script = tmp_path / "job.sh"
    out = tmp_path / "job.out"
    script.write_text("#!/bin/bash\n#SBATCH -N 2\n#SBATCH --ntasks-per-node=1\n"
                      f"#SBATCH -o {out}\n#SBATCH -t 5\nset -e\ncd {REPO_ROOT}\n{body}\n")
    env = _env(cluster, secrets.token_hex(16))
    start = time.monotonic()
    r = subprocess.run(["sbatch", "--wait", str(script)], capture_output=True, text=True,
                       env=env, timeout=timeout, check=False)
    text = out.read_text() if out.exists() else ""
    assert r.returncode == 0, (f"sbatch exited with {r.returncode} after "
                               f"{time.monotonic() - start:.0f}s\n{r.stdout}\n{r.stderr}\n{text}")
    return text


def _digests(text: str) -> dict:
    """rank -> final weights digest, from keras_digits.py's lines."""
    found = re.findall(r"rank (\d+)\S* final weights digest ([0-9a-f]{16})", text)
    return {int(r): d for r, d in found}


@pytest.mark.timeout(300)
def test_one_srun_line_trains_over_two_nodes(cluster, tmp_path):
    text = _sbatch(cluster, tmp_path, "srun kungfu-run -np 2 python examples/keras_digits.py "
                   "--epochs 2")
    assert "Slurm job" in text and "2 workers on 2 hosts (10." in text, text
    digests = _digests(text)
    assert sorted(digests) == [0, 1] and len(set(digests.values())) == 1, text
    # Each node ran its own worker: the launchers said which node they are.
    assert "this one n1" in text and "this one n2" in text, text


@pytest.mark.timeout(300)
def test_an_elastic_job_finds_its_store_on_the_first_node(cluster, tmp_path):
    text = _sbatch(cluster, tmp_path, "srun kungfu-run -w -np 2 python examples/keras_digits.py "
                   "--epochs 1")
    assert "the config store on n1" in text, text
    digests = _digests(text)
    assert sorted(digests) == [0, 1] and len(set(digests.values())) == 1, text


@pytest.mark.timeout(120)
def test_a_step_without_the_jobs_secret_is_refused_saying_how_to_make_one(cluster):
    env = _env(cluster, "")
    del env["KUNGFU_JOB_TOKEN"]
    r = subprocess.run(["srun", "-N", "2", "--ntasks-per-node=1", "kungfu-run", "-np", "2",
                        "true"], capture_output=True, text=True, env=env, cwd=REPO_ROOT,
                       timeout=100, check=False)
    assert r.returncode != 0, r.stdout + r.stderr
    assert r.stderr.count("needs one secret on every host") == 2, r.stderr
    assert "secrets.token_hex(32)" in r.stderr and "export it before srun" in r.stderr, r.stderr


@pytest.mark.timeout(60)
def test_the_clusters_scontrol_expands_node_lists(cluster, monkeypatch):
    """kungfu-run expands SLURM_STEP_NODELIST with the cluster's own scontrol: the same names in a
    step, and a list only Slurm reads (two space-separated parts) read as Slurm reads it."""
    from kungfu._launch import slurm

    monkeypatch.setenv("SLURM_CONF", str(cluster / "slurm.conf"))
    assert slurm.expand_nodelist("n[1-2]") == ["n1", "n2"]
    assert slurm.expand_nodelist("n[1-2] n[10-11]") == ["n1", "n2", "n10", "n11"]
    assert slurm.expand_hostlist("n[1-2] n[10-11]") != ["n1", "n2", "n10", "n11"]
    env = _env(cluster, "")
    r = subprocess.run(["srun", "-N", "2", "--ntasks-per-node=1", sys.executable, "-c",
                        "import os; from kungfu._launch import slurm; "
                        "print(slurm.expand_nodelist(os.environ['SLURM_STEP_NODELIST']))"],
                       capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=50,
                       check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["['n1', 'n2']"] * 2, r.stdout
