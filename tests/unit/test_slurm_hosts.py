"""kungfu-run in a Slurm job step (kungfu/_launch/slurm.py): Slurm's host lists, and the hosts,
this host, -np and -w's store taken from a step's environment. A real Slurm runs the job end to
end in tests/integration/test_slurm.py."""
from __future__ import annotations

import shutil

import pytest

from kungfu._hosts import UsageError
from kungfu._launch import flags, plan, slurm


@pytest.mark.parametrize("text, names", [
    ("n1", ["n1"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("r[1-2]-c[1-2]", ["r1-c1", "r1-c2", "r2-c1", "r2-c2"]),
    ("a[1,3]x,b[2]", ["a1x", "a3x", "b2"]),
    ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
])
def test_host_lists_expand_in_slurms_order(text, names):
    assert slurm.expand_hostlist(text) == names


@pytest.mark.parametrize("text, problem", [
    ("n[1-3", "'[' without ']'"),
    ("n1-3]", "']' without '['"),
    ("n[a-b]", "'a-b' is not a number"),
    ("n[3-1]", "runs backwards"),
    ("n1,,n2", "an empty name"),
    ("n[1-[2]]", "nested brackets"),
])
def test_a_bad_host_list_is_refused_naming_the_problem(text, problem):
    with pytest.raises(ValueError, match=problem.replace("[", r"\[").replace("]", r"\]")):
        slurm.expand_hostlist(text)


STEP = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "n[1-2],gpu7", "SLURMD_NODENAME": "n2",
        "SLURM_STEP_NUM_TASKS": "3", "SLURM_CPUS_ON_NODE": "8"}
ADDR = {"n1": "10.0.0.1", "n2": "10.0.0.2", "gpu7": "10.0.0.7"}


def _parse(argv, environ, addresses=lambda nodes: dict(ADDR), monkeypatch=None):
    for name in [k for k in slurm.os.environ if k.startswith(("SLURM", "KUNGFU_"))]:
        monkeypatch.delenv(name)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(slurm, "node_addresses", addresses)  # scontrol's NodeAddr
    return flags.parse_args(argv)


def test_a_step_gives_the_hosts_this_host_and_one_worker_per_node(monkeypatch):
    opts = _parse(["python", "train.py"], STEP, monkeypatch=monkeypatch)
    assert (opts.np, opts.hosts, opts.self_host) == (
        3, "10.0.0.1:1,10.0.0.2:1,10.0.0.7:1", "10.0.0.2")
    assert "Slurm job 4242: 3 workers on 3 hosts" in opts.manager and "this one n2" in opts.manager
    # The plan places rank 1 here, as -H and -self would.
    job = plan.prepare(_with_token(opts, monkeypatch))
    assert [(w.rank, w.host) for w in job.mine] == [(1, "10.0.0.2")]


def _with_token(opts, monkeypatch):
    monkeypatch.setenv("KUNGFU_JOB_TOKEN", "ab" * 16)
    return opts


def test_np_spreads_over_the_nodes_host_major(monkeypatch):
    opts = _parse(["-np", "5", "python", "train.py"], STEP, monkeypatch=monkeypatch)
    assert opts.hosts == "10.0.0.1:2,10.0.0.2:2,10.0.0.7:2"
    job = plan.prepare(_with_token(opts, monkeypatch))
    assert [w.rank for w in job.mine] == [2, 3]


def test_gpus_give_a_worker_each(monkeypatch):
    env = {**STEP, "SLURM_GPUS_ON_NODE": "4"}
    opts = _parse(["python", "train.py"], env, monkeypatch=monkeypatch)
    assert opts.np == 12 and opts.hosts == "10.0.0.1:4,10.0.0.2:4,10.0.0.7:4"


def test_elastic_jobs_get_the_nodes_cpus_as_slots_and_the_first_node_hosts_the_store(monkeypatch):
    opts = _parse(["-w", "-np", "3", "python", "train.py"], STEP, monkeypatch=monkeypatch)
    port = slurm.STORE_PORTS[0] + 4242 % (slurm.STORE_PORTS[1] - slurm.STORE_PORTS[0])
    assert opts.hosts == "10.0.0.1:8,10.0.0.2:8,10.0.0.7:8"
    assert opts.config_server == f"http://10.0.0.1:{port}" and opts.builtin_config_port is None
    first = _parse(["-w", "-np", "3", "python", "train.py"], {**STEP, "SLURMD_NODENAME": "n1"},
                   monkeypatch=monkeypatch)
    assert first.builtin_config_port == port and first.config_server is None


def test_names_stand_for_addresses_when_scontrol_does_not_answer(monkeypatch):
    opts = _parse(["python", "train.py"], STEP, addresses=lambda nodes: {},
                  monkeypatch=monkeypatch)
    assert (opts.hosts, opts.self_host) == ("n1:1,n2:1,gpu7:1", "n2")


@pytest.mark.parametrize("environ", [
    {},  # not under Slurm
    {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-2]", "SLURMD_NODENAME": "n1"},  # batch shell
])
def test_outside_a_step_nothing_changes(monkeypatch, environ):
    opts = _parse(["-np", "2", "python", "train.py"], environ, monkeypatch=monkeypatch)
    assert (opts.hosts, opts.self_host, opts.manager) == (None, None, None)


def test_given_hosts_win(monkeypatch):
    opts = _parse(["-H", "10.1.1.1:2", "-self", "10.1.1.1", "python", "x.py"], STEP,
                  monkeypatch=monkeypatch)
    assert (opts.hosts, opts.self_host, opts.manager) == ("10.1.1.1:2", "10.1.1.1", None)


@pytest.mark.parametrize("argv, environ, problem", [
    (["python", "x.py"], {**STEP, "SLURM_STEP_NUM_TASKS": "6"},
     "runs 6 tasks on 3 nodes: one kungfu-run per node"),
    (["-self", "10.0.0.2", "python", "x.py"], STEP, "give -self or -nic only with -H"),
    (["python", "x.py"], {**STEP, "SLURMD_NODENAME": "n9"}, "n9, SLURMD_NODENAME) is not one"),
    (["python", "x.py"], {**STEP, "SLURM_STEP_NODELIST": "n[1-2"}, "SLURM_STEP_NODELIST: host"),
])
def test_a_step_kungfu_run_cannot_use_is_a_usage_error(monkeypatch, argv, environ, problem):
    with pytest.raises(UsageError, match=problem.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[")):
        _parse(argv, environ, monkeypatch=monkeypatch)


def test_nodes_that_share_an_address_are_refused(monkeypatch):
    with pytest.raises(UsageError, match="share addresses"):
        _parse(["python", "x.py"], STEP, addresses=lambda nodes: {n: "127.0.0.1" for n in nodes},
               monkeypatch=monkeypatch)


@pytest.mark.skipif(shutil.which("scontrol") is None,
                    reason="needs Slurm's scontrol (scripts/install.sh installs slurm-client)")
def test_slurm_itself_expands_the_node_list_where_scontrol_answers(monkeypatch, tmp_path):
    # scontrol reads host lists without a controller, given a configuration.
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=kft\nSlurmctldHost=localhost\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    # A list of two space-separated parts, which scontrol reads and the fallback does not:
    # the names come from Slurm.
    assert slurm.expand_nodelist("n[1-2] gpu[09-10]") == ["n1", "n2", "gpu09", "gpu10"]
    assert slurm.expand_hostlist("n[1-2] gpu[09-10]") != ["n1", "n2", "gpu09", "gpu10"]
    assert slurm.expand_nodelist("node[01-03,07],gpu5") == [
        "node01", "node02", "node03", "node07", "gpu5"]
    # A list scontrol refuses (it says so on stderr, exit code 0) gets the fallback's error.
    with pytest.raises(ValueError, match="runs backwards"):
        slurm.expand_nodelist("n[3-1]")
    # Where there is no scontrol, the fallback reads the list.
    monkeypatch.setenv("PATH", str(tmp_path))
    assert slurm.expand_nodelist("n[1-2] gpu[09-10]") == slurm.expand_hostlist(
        "n[1-2] gpu[09-10]")
    assert slurm.expand_nodelist("n[8-10]") == ["n8", "n9", "n10"]
