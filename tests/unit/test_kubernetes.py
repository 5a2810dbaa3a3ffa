"""kungfu-run in the pods of a Kubernetes Indexed Job (kungfu/_launch/kubernetes.py), and the
manifest of docs/kubernetes.md (examples/kubernetes/digits.yaml): loaded, checked for what the
doc says it carries, and each of its pods' kungfu-run planned from the environment the manifest
and Kubernetes give it. No cluster runs here."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kungfu._hosts import UsageError
from kungfu._launch import flags, kubernetes, plan

MANIFEST = Path(__file__).resolve().parents[2] / "examples" / "kubernetes" / "digits.yaml"


def _parse(argv, environ, hostname, monkeypatch):
    for name in [k for k in kubernetes.os.environ
                 if k.startswith(("SLURM", "KUNGFU_", "JOB_COMPLETION"))]:
        monkeypatch.delenv(name)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("HOSTNAME", hostname)
    return flags.parse_args(argv)


POD = {"JOB_COMPLETION_INDEX": "2", "KUNGFU_K8S_PODS": "3", "KUNGFU_K8S_SERVICE": "svc"}


def test_a_pod_takes_the_jobs_pods_by_their_dns_names(monkeypatch):
    opts = _parse(["-np", "5", "python", "x.py"], POD, "train-2", monkeypatch)
    assert opts.hosts == "train-0.svc:2,train-1.svc:2,train-2.svc:2"
    assert opts.self_host == "train-2.svc"
    assert opts.manager.startswith("Kubernetes job train: 5 workers on 3 hosts")


def test_np_defaults_to_a_worker_per_pod_or_per_gpu(monkeypatch):
    assert _parse(["python", "x.py"], POD, "train-2", monkeypatch).np == 3
    opts = _parse(["python", "x.py"], {**POD, "KUNGFU_K8S_GPUS": "2"}, "train-2", monkeypatch)
    assert opts.np == 6 and opts.hosts.endswith("train-2.svc:2")


def test_elastic_pods_use_pod_zeros_store(monkeypatch):
    opts = _parse(["-w", "python", "x.py"], POD, "train-2", monkeypatch)
    assert opts.config_server == f"http://train-0.svc:{kubernetes.STORE_PORT}"
    first = _parse(["-w", "python", "x.py"], {**POD, "JOB_COMPLETION_INDEX": "0"}, "train-0",
                   monkeypatch)
    assert first.builtin_config_port == kubernetes.STORE_PORT and first.config_server is None


def test_a_job_not_written_for_kungfu_changes_nothing(monkeypatch):
    opts = _parse(["python", "x.py"], {"JOB_COMPLETION_INDEX": "1"}, "other-1", monkeypatch)
    assert (opts.hosts, opts.self_host, opts.manager) == (None, None, None)


@pytest.mark.parametrize("environ, hostname, problem", [
    ({**POD, "KUNGFU_K8S_PODS": "x"}, "train-2", "KUNGFU_K8S_PODS must be a number >= 1"),
    (POD, "train-7", "hostname 'train-7' is not <job>-2"),
    ({**POD, "JOB_COMPLETION_INDEX": "3", "KUNGFU_K8S_PODS": "3"}, "train-3",
     "JOB_COMPLETION_INDEX 3 is not below KUNGFU_K8S_PODS 3"),
])
def test_a_pod_kungfu_run_cannot_place_is_a_usage_error(monkeypatch, environ, hostname, problem):
    with pytest.raises(UsageError, match=problem):
        _parse(["python", "x.py"], environ, hostname, monkeypatch)


def _manifest():
    docs = list(yaml.safe_load_all(MANIFEST.read_text()))
    kinds = {d["kind"]: d for d in docs}
    assert sorted(kinds) == ["Job", "Service"], kinds
    return kinds["Service"], kinds["Job"]


def test_the_manifest_carries_what_the_doc_says():
    service, job = _manifest()
    name = job["metadata"]["name"]
    spec = job["spec"]
    pod = spec["template"]["spec"]
    [container] = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    # A headless Service that publishes pods before they are ready, selecting the Job's pods.
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {"job-name": name}
    assert [p["port"] for p in service["spec"]["ports"]] == [kubernetes.STORE_PORT]
    # An Indexed Job, all pods at once, told its size and its Service, under that Service.
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == int(env["KUNGFU_K8S_PODS"]["value"])
    assert pod["subdomain"] == service["metadata"]["name"] == env["KUNGFU_K8S_SERVICE"]["value"]
    # The secret from a Kubernetes Secret, never written in the manifest.
    assert set(env["KUNGFU_JOB_TOKEN"]["valueFrom"]["secretKeyRef"]) == {"name", "key"}
    assert container["command"][0] == "kungfu-run"


def test_each_pod_of_the_manifest_starts_its_own_workers(monkeypatch):
    """kungfu-run planned in each pod as Kubernetes would start it: together the pods start
    every rank once, each on its own pod's DNS name."""
    service, job = _manifest()
    [container] = job["spec"]["template"]["spec"]["containers"]
    environ = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    environ["KUNGFU_JOB_TOKEN"] = "ab" * 16  # what the Secret would hold
    pods = job["spec"]["completions"]
    started = {}
    for i in range(pods):
        opts = _parse(container["command"][1:], {**environ, "JOB_COMPLETION_INDEX": str(i)},
                      f"{job['metadata']['name']}-{i}", monkeypatch)
        for w in plan.prepare(opts).mine:
            assert w.host == f"digits-{i}.{service['metadata']['name']}", w
            started[w.rank] = w.host
    assert sorted(started) == list(range(8))  # -np 8 in the manifest's command
