"""kungfu-run's command line: host lists, peer lists, ports, durations, and every bad flag.

The bad-flag cases run the launcher as a subprocess (`python -m kungfu.cmd`) and check the exit
code 2 and the one-line message; the rest call the parsing functions directly.
"""
from __future__ import annotations

import os
import queue
import secrets
import shlex
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from kungfu import _env
from kungfu import _hosts
from kungfu._launch import flags, plan, processes
from kungfu._launch.launcher import Launcher
from kungfu._ports import free_port_range, free_ports

REPO = Path(__file__).resolve().parents[2]
STRONG_TOKEN = secrets.token_hex(32)
pytestmark = pytest.mark.timeout(60)


def launcher(*args: str, timeout: float = 30, env_extra=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "KUNGFU_JOB_TOKEN"}
    env.update(env_extra or {})
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    return subprocess.run(
        [sys.executable, "-m", "kungfu.cmd", *args],
        capture_output=True, text=True, env=env, timeout=timeout, check=False,
    )


# --- host lists ------------------------------------------------------------------------------


def test_parse_hosts_slots_default_to_one():
    hosts = _hosts.parse_hosts("10.0.0.1:2,node-b,node-c.example.org:4")
    assert hosts == [
        _hosts.HostSpec("10.0.0.1", 2),
        _hosts.HostSpec("node-b", 1),
        _hosts.HostSpec("node-c.example.org", 4),
    ]


def test_parse_hosts_allows_spaces_around_entries():
    assert _hosts.parse_hosts(" a:1 , b:3") == [_hosts.HostSpec("a", 1), _hosts.HostSpec("b", 3)]


@pytest.mark.parametrize(
    "text",
    ["", "a:2,,b", "a:0", "a:-1", "a:x", "a:1:2", "1.2.3.256", "10.0.0", "-bad", "a_b:2",
     "a:1,a:2", ":3"],
)
def test_parse_hosts_rejects(text):
    with pytest.raises(_hosts.UsageError):
        _hosts.parse_hosts(text)


# --- peer list and ports ---------------------------------------------------------------------


def specs(workers):
    return [w.spec for w in workers]


def test_plan_is_host_major_in_h_order():
    hosts = _hosts.parse_hosts("10.0.0.2:2,10.0.0.1:3")
    workers = _hosts.plan_workers(5, hosts, (7000, 7010))
    assert specs(workers) == [
        "10.0.0.2:7000", "10.0.0.2:7001",
        "10.0.0.1:7000", "10.0.0.1:7001", "10.0.0.1:7002",
    ]
    assert [w.rank for w in workers] == [0, 1, 2, 3, 4]
    assert [w.local_rank for w in workers] == [0, 1, 0, 1, 2]


def test_plan_stops_at_np_and_leaves_later_hosts_empty():
    hosts = _hosts.parse_hosts("a:4,b:4,c:4")
    workers = _hosts.plan_workers(6, hosts, (10000, 11000))
    assert specs(workers) == ["a:10000", "a:10001", "a:10002", "a:10003", "b:10000", "b:10001"]


def test_plan_np_equal_to_slots_uses_every_slot():
    workers = _hosts.plan_workers(3, _hosts.parse_hosts("h1,h2,h3"), (5000, 5000))
    assert specs(workers) == ["h1:5000", "h2:5000", "h3:5000"]


def test_plan_rejects_more_workers_than_slots():
    with pytest.raises(_hosts.UsageError, match="more than the 3 slots"):
        _hosts.plan_workers(4, _hosts.parse_hosts("a:1,b:2"), (10000, 11000))


def test_plan_rejects_port_range_smaller_than_slots():
    with pytest.raises(_hosts.UsageError, match="2 ports"):
        _hosts.plan_workers(1, _hosts.parse_hosts("a:3"), (9000, 9001))


@pytest.mark.parametrize(
    "text,expected",
    [("10000-11000", (10000, 11000)), ("5-5", (5, 5)), (" 1 - 65535 ", (1, 65535))],
)
def test_port_range(text, expected):
    assert _hosts.parse_port_range(text) == expected


@pytest.mark.parametrize("text", ["", "10000", "10-5", "0-10", "1-65536", "a-b", "1-2-3", "-5"])
def test_port_range_rejects(text):
    with pytest.raises(_hosts.UsageError):
        _hosts.parse_port_range(text)


def test_default_plan_is_local_with_default_ports():
    opts = flags.parse_args(["-np", "3", "prog"])
    hosts = [_hosts.HostSpec("127.0.0.1", opts.np)]
    assert specs(_hosts.plan_workers(opts.np, hosts, opts.port_range)) == [
        "127.0.0.1:10000", "127.0.0.1:10001", "127.0.0.1:10002",
    ]


# --- durations and strategies ----------------------------------------------------------------


@pytest.mark.parametrize(
    "text,seconds",
    [("90", 90.0), ("1.5", 1.5), ("30s", 30.0), ("500ms", 0.5), ("2m", 120.0), ("1.5m", 90.0),
     ("2h", 7200.0), ("1h30m", 5400.0), ("1m30s", 90.0), ("1M", 60.0)],
)
def test_parse_duration(text, seconds):
    assert _env.parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "s", "5x", "1m 30s", "-5s", "1.5.2s", "ms5"])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError):
        _env.parse_duration(text)


@pytest.mark.parametrize("name", flags.strategy_names())
def test_strategy_names_case_insensitive(name):
    assert flags.parse_strategy(name.lower()) == name
    assert flags.parse_strategy(name.title()) == name


def test_strategy_names_match_the_runtime():
    """The launcher's list is exactly the set of names the native runtime accepts."""
    code = (
        "from kungfu import _kungfu\nfrom kungfu._launch import flags\n"
        "names = set()\n"
        "for i in range(64):\n"
        "    n = _kungfu.strategy_name(i)\n"
        "    if n != 'UNKNOWN':\n"
        "        assert _kungfu.parse_strategy(n) == i\n"
        "        names.add(n)\n"
        "for n in flags.strategy_names():\n"
        "    _kungfu.parse_strategy(n)\n"
        "try:\n"
        "    _kungfu.parse_strategy('NOT_A_STRATEGY')\n"
        "except ValueError:\n"
        "    print(sorted(names) == sorted(flags.strategy_names()), sorted(names))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=30, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("True "), out.stdout


# --- parse_args ------------------------------------------------------------------------------


def test_command_starts_at_first_non_flag():
    opts = flags.parse_args(["-np", "2", "python", "train.py", "-np", "7", "--lr=0.1"])
    assert opts.np == 2
    assert opts.command == ["python", "train.py", "-np", "7", "--lr=0.1"]


def test_double_dash_ends_flags():
    opts = flags.parse_args(["-q", "--", "-weird-program", "x"])
    assert opts.quiet
    assert opts.command == ["-weird-program", "x"]


def test_single_double_dash_and_equals_forms():
    a = flags.parse_args(["-np", "4", "-H", "a:2,b:2", "-self", "a", "-strategy", "ring",
                          "-port-range", "100-200", "-logdir", "d", "-timeout", "1m", "-q",
                          "-timeline", "t", "cmd"])
    b = flags.parse_args(["--np=4", "--H=a:2,b:2", "--self=a", "--strategy=RING",
                          "--port-range", "100-200", "--logdir=d", "--timeout", "60s", "--q",
                          "--timeline=t", "cmd"])
    for o in (a, b):
        assert (o.np, o.hosts, o.self_host, o.strategy, o.port_range, o.logdir, o.timeout,
                o.quiet, o.timeline, o.command) == (4, "a:2,b:2", "a", "RING", (100, 200), "d",
                                                    60.0, True, "t", ["cmd"])


def test_defaults():
    o = flags.parse_args(["cmd"])
    assert (o.np, o.hosts, o.self_host, o.nic, o.port_range, o.strategy, o.logdir, o.quiet,
            o.timeout) == (1, None, None, None, (10000, 11000), "AUTO", None, False, None)


def test_later_flag_wins():
    assert flags.parse_args(["-np", "2", "-np", "3", "cmd"]).np == 3


# --- which hosts are local -------------------------------------------------------------------


def test_local_hosts_single_host_is_this_one():
    opts = flags.parse_args(["-H", "10.1.2.3:4", "cmd"])
    assert plan.local_hosts(opts, _hosts.parse_hosts(opts.hosts)) == ["10.1.2.3"]


def test_local_hosts_all_loopback_runs_everything_here():
    opts = flags.parse_args(["-H", "127.0.0.1:2,127.0.0.2:2,localhost", "cmd"])
    assert plan.local_hosts(opts, _hosts.parse_hosts(opts.hosts)) == ["127.0.0.1", "127.0.0.2",
                                                             "localhost"]


def test_local_hosts_self_picks_one():
    opts = flags.parse_args(["-H", "10.0.0.1:2,10.0.0.2:2", "-self", "10.0.0.2", "cmd"])
    assert plan.local_hosts(opts, _hosts.parse_hosts(opts.hosts)) == ["10.0.0.2"]


def test_local_hosts_self_matches_a_host_name_by_address():
    opts = flags.parse_args(["-H", "10.0.0.9:2,localhost:2", "-self", "127.0.0.1", "cmd"])
    assert plan.local_hosts(opts, _hosts.parse_hosts(opts.hosts)) == ["localhost"]


def test_local_hosts_nic_loopback():
    assert plan.nic_ipv4("lo") == "127.0.0.1"
    opts = flags.parse_args(["-H", "10.0.0.1:2,127.0.0.1:2", "-nic", "lo", "cmd"])
    assert plan.local_hosts(opts, _hosts.parse_hosts(opts.hosts)) == ["127.0.0.1"]


def test_several_hosts_without_self_are_the_ssh_start(monkeypatch):
    # The hosts of -H that are this machine run here; the others' launchers start over ssh.
    monkeypatch.delenv("KUNGFU_JOB_TOKEN", raising=False)
    opts = flags.parse_args(["-np", "3", "-H", "10.0.0.1,127.0.0.1:2", "cmd"])
    assert "127.0.0.1" in plan.this_machine()
    assert plan.local_hosts(opts, _hosts.parse_hosts(opts.hosts)) == ["127.0.0.1"]
    job = plan.prepare(opts)
    assert [h.host for h in job.remote] == ["10.0.0.1"]
    assert [w.rank for w in job.mine] == [1, 2] and len(opts.job_token) == 64
    # A host past -np gets no launcher; with -self each launcher runs its own host.
    opts = flags.parse_args(["-np", "2", "-H", "127.0.0.1:2,10.0.0.1", "-port-range", "7000-7001",
                             "cmd"])
    assert plan.prepare(opts).remote == []
    monkeypatch.setenv("KUNGFU_JOB_TOKEN", STRONG_TOKEN)
    opts = flags.parse_args(["-H", "10.0.0.1,127.0.0.1", "-self", "127.0.0.1", "cmd"])
    assert plan.prepare(opts).remote == []


def test_the_ssh_start_runs_the_other_launchers_with_the_jobs_flags(monkeypatch):
    from kungfu._launch import ssh

    opts = flags.parse_args(["-np", "3", "-H", "10.0.0.1,10.0.0.2:2", "-strategy", "ring", "-v",
                             "-logdir", "/tmp/x", "-show-ranks", "0", "-ssh-port", "2222",
                             "-ssh-identity-file", "/k/id", "-timeout", "5m", "--", "python",
                             "t.py", "--lr", "0.1 x"])
    environ = {"KUNGFU_OP_TIMEOUT": "9s", "KUNGFU_JOB_TOKEN": "secret", "PATH": "/bin",
               "KUNGFU_SELF_SPEC": "a:1", "PYTHONPATH": "/r p", "KUNGFU_SSH": "ssh -F none"}
    remote = ssh.remote_command(opts, "10.0.0.2", "/w d", environ)
    words = shlex.split(remote)
    assert words[:4] == ["cd", "/w d", "&&", "exec"]
    # The settings of the job, never its secret (stdin) nor this host's own.
    assert words[4:7] == ["env", "KUNGFU_OP_TIMEOUT=9s", "PYTHONPATH=/r p"]
    assert words[7:10] == [sys.executable, "-m", "kungfu.cmd"]
    again = flags.parse_args(words[10:])
    assert (again.stdin_control, again.self_host, again.np, again.hosts, again.strategy) == (
        True, "10.0.0.2", 3, "10.0.0.1,10.0.0.2:2", "RING")
    assert again.verbose and again.command == ["python", "t.py", "--lr", "0.1 x"]
    # Output, -logdir and -timeout stay with the launcher that started the job.
    assert (again.logdir, again.show_ranks, again.timeout, again.ssh_port) == (None,) * 4
    monkeypatch.setenv("KUNGFU_SSH", "myssh -F none")
    argv = ssh.ssh_command(opts, "10.0.0.2", remote)
    assert argv[:3] == ["myssh", "-F", "none"] and argv[-2:] == ["10.0.0.2", remote]
    assert "BatchMode=yes" in argv and argv[argv.index("-p") + 1] == "2222"
    assert argv[argv.index("-i") + 1] == "/k/id"


def test_the_ssh_start_of_an_elastic_job(monkeypatch):
    # -w: every other host of -H gets a launcher (a host with no worker yet may get some), each
    # following the starter's store with the same rules; -spares is per host.
    from kungfu._launch import ssh

    monkeypatch.delenv("KUNGFU_JOB_TOKEN", raising=False)
    opts = flags.parse_args(["-w", "-np", "2", "-H", "127.0.0.1:2,10.0.0.1,10.0.0.2",
                             "-builtin-config-port", "auto", "-min-np", "2", "-max-restarts", "5",
                             "-replace=false", "-host-cooldown", "90s", "-spares", "1", "cmd"])
    job = plan.prepare(opts)
    assert [h.host for h in job.remote] == ["10.0.0.1", "10.0.0.2"]
    assert [w.rank for w in job.mine] == [0, 1] and len(opts.job_token) == 64
    words = shlex.split(ssh.remote_command(opts, "10.0.0.2", "/w", {},
                                           store="http://10.0.0.9:4242"))
    again = flags.parse_args(words[words.index("kungfu.cmd") + 1:])
    assert (again.elastic, again.config_server, again.builtin_config_port) == (
        True, "http://10.0.0.9:4242", None)
    assert (again.min_np, again.max_restarts, again.replace, again.host_cooldown,
            again.spares) == (2, 5, False, 90.0, 1)
    # Unset rules stay unset (the remote launcher's defaults).
    opts = flags.parse_args(["-w", "-H", "10.0.0.1,10.0.0.2", "-config-server",
                             "etcd://10.0.0.9:2379", "cmd"])
    words = shlex.split(ssh.remote_command(opts, "10.0.0.2", "/w", {}, store=opts.config_server))
    again = flags.parse_args(words[words.index("kungfu.cmd") + 1:])
    assert (again.min_np, again.max_restarts, again.replace, again.host_cooldown,
            again.spares, again.config_server) == (None, None, None, None, 0,
                                                   "etcd://10.0.0.9:2379")


@pytest.mark.parametrize("text, ranks", [("0", {0}), ("0,2", {0, 2}), ("1-3,7", {1, 2, 3, 7}),
                                         (" 4 , 0-1", {0, 1, 4})])
def test_show_ranks(text, ranks):
    assert flags.parse_args(["-show-ranks", text, "cmd"]).show_ranks == ranks


@pytest.mark.parametrize("typo, hint", [
    ("-nps", "did you mean -np?"), ("--logdr", "did you mean -logdir?"),
    ("-stratgy", "did you mean -strategy?"), ("-show-rank", "did you mean -show-ranks?"),
    ("--nproc-per-nodes", "did you mean -H HOST:SLOTS (workers per host)"),
    ("--nproc_per_node", "did you mean -H HOST:SLOTS (workers per host)"),
    ("-n", "did you mean -np N"), ("-max-restart", "did you mean -max-restarts?"),
])
def test_a_near_miss_gets_a_suggestion(typo, hint):
    with pytest.raises(_hosts.UsageError, match="unknown flag") as e:
        flags.parse_args([typo, "2", "cmd"])
    assert hint in str(e.value), str(e.value)


def test_a_flag_far_from_every_flag_gets_no_suggestion():
    with pytest.raises(_hosts.UsageError) as e:
        flags.parse_args(["-bogus", "cmd"])
    assert "did you mean" not in str(e.value)


# --- the command line as a user sees it ------------------------------------------------------


BAD = [
    (["-np", "0", "true"], "-np"),
    (["-np", "-3", "true"], "-np"),
    (["-np", "two", "true"], "-np"),
    (["-np"], "needs a value"),
    (["-np", "5", "-H", "127.0.0.1:2,127.0.0.2:2", "true"], "slots"),
    (["-H", "127.0.0.1:2,,127.0.0.2", "true"], "-H"),
    (["-H", "127.0.0.1:0", "true"], "-H"),
    (["-H", "127.0.0.1:x", "true"], "-H"),
    (["-H", "10.0.0.300:2", "true"], "-H"),
    (["-H", "bad_host:2", "true"], "-H"),
    (["-H", "127.0.0.1,127.0.0.1", "true"], "more than once"),
    (["-H", "10.0.0.1", "-self", "10.0.0.1", "-stdin-control", "-w", "-builtin-config-port",
      "auto", "true"], "-stdin-control"),
    (["-ssh-port", "22", "true"], "for the ssh start"),
    (["-H", "10.0.0.1,10.0.0.2", "-self", "10.0.0.1", "-ssh-identity-file", "k", "true"],
     "for the ssh start"),
    (["-ssh-port", "70000", "true"], "-ssh-port"),
    (["-show-ranks", "1-", "true"], "-show-ranks"),
    (["-show-ranks", "3-1", "true"], "-show-ranks"),
    (["-stdin-control", "true"], "-stdin-control"),
    (["-H", "127.0.0.1:2", "-self", "10.9.9.9", "true"], "not one of the hosts"),
    (["-nic", "kfnosuch0", "true"], "interface"),
    (["-self", "127.0.0.1", "-nic", "lo", "true"], "only one of"),
    (["-port-range", "11000-10000", "true"], "-port-range"),
    (["-port-range", "10000", "true"], "-port-range"),
    (["-port-range", "70000-70010", "true"], "-port-range"),
    (["-np", "4", "-port-range", "10000-10002", "true"], "-port-range"),
    (["-strategy", "FASTEST", "true"], "strategy"),
    (["-strategy", "", "true"], "strategy"),
    (["-timeout", "soon", "true"], "-timeout"),
    (["-timeout", "0s", "true"], "-timeout"),
    (["-np", "2"], "no command"),
    (["-np", "2", "--"], "no command"),
    ([], "no command"),
    (["-bogus", "true"], "unknown flag"),
    (["--n", "2", "true"], "unknown flag"),
    (["-q=maybe", "true"], "-q"),
    (["-logdir", "/proc/self/kf-no/dir", "true"], "-logdir"),
    (["-timeline", "/proc/self/kf-no/dir", "true"], "-timeline"),
    (["-timeline=", "true"], "-timeline"),
]


@pytest.mark.parametrize("args,needle", BAD, ids=[" ".join(a) or "(none)" for a, _ in BAD])
def test_bad_flags_exit_2_with_one_line(args, needle):
    r = launcher(*args)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("kungfu-run: "), r.stderr
    assert needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    assert r.stdout == ""


@pytest.mark.parametrize("flag", ["-h", "-help", "--help"])
def test_help(flag):
    r = launcher(flag)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    text = r.stdout
    for f in ["-np", "-H", "-self", "-nic", "-port-range", "-strategy", "-logdir", "-q",
              "-timeout", "-timeline", "-show-ranks", "-ssh-port", "-ssh-identity-file",
              "-stdin-control"]:
        assert f"\n  {f} " in text, f
    for fact in ["10000-11000", "127.0.0.1:N", "AUTO", "124", "rank-r.log", "kungfu-run -np 4",
                 "default 1", "The ssh start", "KUNGFU_SSH", "within 30s", *flags.strategy_names()]:
        assert fact in text, fact


def test_help_wins_over_other_flags():
    r = launcher("-np", "2", "-help")
    assert r.returncode == 0 and "usage: kungfu-run" in r.stdout


def test_nothing_to_run_on_a_host_without_workers():
    r = launcher("-np", "2", "-H", "10.0.0.1:2,10.0.0.2:2", "-self", "10.0.0.2", "true",
                 env_extra={"KUNGFU_JOB_TOKEN": STRONG_TOKEN})
    assert r.returncode == 0, r.stderr
    assert "nothing to run" in r.stderr


def _secret_file(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text(STRONG_TOKEN + "\n")
    secret.chmod(0o600)
    return secret


def test_a_job_on_several_hosts_needs_one_secret(tmp_path):
    args = ("-np", "2", "-H", "10.0.0.1:1,10.0.0.2:1", "-self", "10.0.0.2", "true")
    r = launcher(*args)
    assert r.returncode == 2 and "same -job-token-file" in r.stderr, r.stderr
    # A host this is not (10.0.0.2 here): its launcher cannot bind its worker's port.
    r = launcher("-job-token-file", str(_secret_file(tmp_path)), *args)
    assert r.returncode == 2, r.stderr
    assert "cannot listen on 10.0.0.2:10000" in r.stderr and "not an address of this host" \
        in r.stderr, r.stderr
    args = ("-np", "2", "-H", "127.0.0.1:1,127.0.0.2:1", "-self", "127.0.0.2",
            "-port-range", free_port_range(1, hosts=("127.0.0.2",)), "true")
    # Two launchers on loopback "hosts" (-self): also two secrets unless one is given.
    r = launcher("-np", "2", "-H", "127.0.0.1:1,127.0.0.2:1", "-self", "127.0.0.2", "true")
    assert r.returncode == 2 and "same -job-token-file" in r.stderr, r.stderr
    empty, secret = tmp_path / "empty", _secret_file(tmp_path)
    empty.write_text("\n")
    empty.chmod(0o600)
    r = launcher("-job-token-file", str(empty), *args)
    assert r.returncode == 2 and "is empty" in r.stderr, r.stderr
    r = launcher("-job-token-file", str(tmp_path / "missing"), *args)
    assert r.returncode == 2 and "cannot read -job-token-file" in r.stderr, r.stderr
    r = launcher("-job-token-file", str(secret), *args)
    assert r.returncode == 0, r.stderr
    # A secret other users can read is theirs too (probe 3, 4i: 0644 was taken without a word).
    for mode in (0o644, 0o640, 0o604):
        secret.chmod(mode)
        r = launcher("-job-token-file", str(secret), *args)
        assert r.returncode == 2, r.stderr
        assert "open to other users" in r.stderr and f"chmod 600 {secret}" in r.stderr, r.stderr
        assert STRONG_TOKEN not in r.stderr


def test_workers_get_the_job_token_and_it_is_never_printed(tmp_path):
    show = ("import os; t = os.environ['KUNGFU_JOB_TOKEN']; "
            "print(len(t), os.environ['KUNGFU_WATCHDOG_FD'].isdigit())")
    r = launcher("-np", "2", sys.executable, "-c", show)
    assert r.returncode == 0, r.stderr
    lines = sorted(r.stdout.splitlines())
    assert lines == ["[0] 64 True", "[1] 64 True"], r.stdout  # one random 32-byte secret
    r = launcher("-np", "1", sys.executable, "-c",
                 "import os; print(os.environ['KUNGFU_JOB_TOKEN'] == os.environ['WANT'])",
                 env_extra={"KUNGFU_JOB_TOKEN": STRONG_TOKEN, "WANT": STRONG_TOKEN})
    assert r.stdout.strip() == "[0] True", r.stdout + r.stderr
    assert STRONG_TOKEN not in r.stderr


@pytest.mark.parametrize("token", ["4821", "etcd-test", "multihost-test-secret",
                                   "0123456789abcdef0123456789abcde",  # 31 hex digits
                                   "x" * 19])
def test_weak_job_tokens_are_refused(tmp_path, token):
    """The probe (3f): a stranger gets one HMAC proof of the token from any listener and
    guesses offline; KUNGFU_JOB_TOKEN=4821 fell in 0.02 s. Tokens under 128 bits (by length and
    alphabet) are refused, from the environment and from a file, and never shown."""
    weak = tmp_path / "weak"
    weak.write_text(token + "\n")
    weak.chmod(0o600)
    for how in ({"env_extra": {"KUNGFU_JOB_TOKEN": token}}, {"args": ("-job-token-file", str(weak))}):
        r = launcher(*how.get("args", ()), "-np", "1", sys.executable, "-c", "print('ran')",
                     env_extra=how.get("env_extra"))
        assert r.returncode == 2, r.stderr
        assert "ran" not in r.stdout
        assert "too weak" in r.stderr and "fewer than 128" in r.stderr, r.stderr
        assert "secrets.token_hex(32)" in r.stderr, r.stderr
        assert token not in r.stderr.replace("kungfu-run", "")
    assert "-job-token-file" in r.stderr  # names where it came from


@pytest.mark.parametrize("token,bits", [
    ("4821", 4 * 3.3219), ("0123456789abcdef" * 2, 128), ("ABCDEF0123456789" * 2, 128),
    ("a" * 22, 22 * 4), ("qM1diGAPy6NCpTjsYetKNQ", 132), ("a-b_c=d/e+f" * 2, 22 * 6),
    ("a b!c" * 4, 20 * 6.5699), ("1" * 39, 39 * 3.3219)])
def test_token_strength_is_length_times_alphabet(token, bits):
    assert _env.token_bits(token) == pytest.approx(bits, rel=1e-3)
    assert (_env.token_bits(token) >= 128) == (bits >= 128)


def test_importing_the_launcher_loads_neither_tensorflow_nor_the_runtime():
    code = (
        "import sys, kungfu, kungfu.cmd\n"
        "bad = [m for m in sys.modules if m.startswith('tensorflow') or m == 'kungfu._kungfu']\n"
        "print(bad)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=30, check=True)
    assert out.stdout.strip() == "[]"


def test_elastic_flags():
    o = flags.parse_args(["-w", "-np", "2", "-builtin-config-port", "9100", "python", "t.py"])
    assert o.elastic and o.builtin_config_port == 9100 and o.config_server is None
    o = flags.parse_args(["-w", "-config-server", "etcd://10.0.0.1:2379", "python", "t.py"])
    assert o.elastic and o.config_server == "etcd://10.0.0.1:2379"


@pytest.mark.parametrize("argv,message", [
    (["-w", "python"], "exactly one of"),
    (["-w", "-builtin-config-port", "9100", "-config-server", "http://a:1", "python"],
     "exactly one of"),
    (["-builtin-config-port", "9100", "python"], "elastic jobs (-w)"),
    (["-w", "-builtin-config-port", "port", "python"], "port number"),
    (["-w", "-builtin-config-port", "70000", "python"], "port number"),
    (["-w", "-config-server", "ftp://a:1", "python"], "http://HOST:P, etcd://HOST:P or etcds://HOST:P"),
])
def test_elastic_flags_rejected(argv, message):
    with pytest.raises(_hosts.UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        flags.parse_args(argv)


def test_the_earliest_failure_is_blamed_whatever_order_exits_are_reported_in():
    # Rank 0 died of the PeerFailedError that rank 1's exit caused, and its exit was reported
    # first: the launcher must still blame rank 1 (exits carry the time each was reaped).
    opts = flags.parse_args(["-np", "2", "true"])
    launcher = Launcher(opts, [], [])
    rank0 = ("exit", 0, 3, 10.05)
    launcher.events.put(("exit", 1, 1, 10.00))
    launcher.events.put(("signal", 15))
    assert launcher._first_failure(rank0) == ("exit", 1, 1, 10.00)
    rest = [launcher.events.get_nowait() for _ in range(2)]
    assert ("signal", 15) in rest and rank0 in rest  # nothing is lost


def test_the_worker_that_noted_its_exit_first_is_blamed_even_if_it_exits_later():
    # Rank 0 failed and noted its exit at 9.0 (before its goodbye), but finishes exiting only
    # after rank 1, which its goodbye took down, was reaped at 10.0; beyond the blame window.
    opts = flags.parse_args(["-np", "2", "true"])
    launcher = Launcher(opts, [], [])
    launcher.running = {r: types.SimpleNamespace(proc=types.SimpleNamespace(pid=100 + r),
                                                 returncode=None) for r in (0, 1)}
    launcher._exit_noted = {100: 9.0}
    rank0 = ("exit", 0, 3, 10.5)
    later = threading.Timer(0.4, launcher.events.put, args=(rank0,))
    later.start()
    assert launcher._first_failure(("exit", 1, 1, 10.0)) == rank0
    assert launcher.events.get_nowait() == ("exit", 1, 1, 10.0)  # handled after the culprit
    # A note after the failure began is no cause: the blame window alone, then rank 1.
    launcher._exit_noted = {100: 10.2}
    t0 = time.monotonic()
    assert launcher._first_failure(("exit", 1, 1, 10.0)) == ("exit", 1, 1, 10.0)
    assert time.monotonic() - t0 < processes.EXITING_WAIT


def test_a_death_by_signal_wins_over_notes_just_before_its_reap():
    # Rank 1 was SIGKILLed: no note; ranks 0 and 2 failed of it and noted their exits at 9.97
    # and 9.98, before the launcher reaped rank 1 at 10.0 (probe 1b: a survivor was blamed).
    opts = flags.parse_args(["-np", "3", "true"])
    launcher = Launcher(opts, [], [])
    launcher.running = {r: types.SimpleNamespace(proc=types.SimpleNamespace(pid=100 + r),
                                                 returncode=None) for r in (0, 1, 2)}
    launcher._exit_noted = {100: 9.97, 102: 9.98}
    killed = ("exit", 1, -9, 10.0)
    launcher.events.put(killed)
    launcher.events.put(("exit", 2, 3, 10.02))
    assert launcher._first_failure(("exit", 0, 3, 9.99)) == killed
    # A failure noted longer than SIGNAL_SLACK before the reap came first.
    launcher._exit_noted = {100: 10.0 - processes.SIGNAL_SLACK - 0.1}
    launcher.events = queue.SimpleQueue()
    launcher.events.put(killed)
    assert launcher._first_failure(("exit", 0, 3, 10.0)) == ("exit", 0, 3, 10.0)


def test_failure_flags_of_elastic_jobs():
    opts = flags.parse_args(["-w", "-builtin-config-port", "9", "-min-np", "2", "-max-restarts",
                             "0", "-replace=false", "-host-cooldown", "1m30s", "prog"])
    assert (opts.min_np, opts.max_restarts, opts.replace, opts.host_cooldown) == (2, 0, False, 90)
    opts = flags.parse_args(["-w", "-builtin-config-port", "9", "-host-cooldown", "0", "prog"])
    assert opts.host_cooldown == 0
    opts = flags.parse_args(["-w", "-builtin-config-port", "9", "prog"])
    assert (opts.min_np, opts.max_restarts, opts.replace) == (None, None, None)  # env defaults
    assert opts.host_cooldown is None  # the launcher's default
    assert opts.spares == 0
    assert flags.parse_args(["-w", "-builtin-config-port", "9", "-spares", "3", "prog"]).spares == 3


@pytest.mark.parametrize("args, message", [
    (["-min-np", "0"], "-min-np must be at least 1"),
    (["-min-np", "x"], "-min-np needs a positive integer"),
    (["-max-restarts", "-1"], "-max-restarts needs a number >= 0"),
    (["-replace=maybe"], "replace"),
    (["-host-cooldown", "-5"], "-host-cooldown"),
    (["-host-cooldown", "soon"], "-host-cooldown: "),
    (["-spares", "-1"], "-spares needs a number >= 0"),
    (["-spares", "two"], "-spares needs a number >= 0"),
])
def test_failure_flags_reject(args, message):
    with pytest.raises(_hosts.UsageError, match=message):
        flags.parse_args(["-w", "-builtin-config-port", "9", *args, "prog"])


def test_failure_flags_need_an_elastic_job():
    for flag in (["-min-np", "2"], ["-max-restarts", "1"], ["-replace"],
                 ["-host-cooldown", "5s"], ["-spares", "1"]):
        with pytest.raises(_hosts.UsageError, match="for elastic jobs"):
            flags.parse_args(["-np", "2", *flag, "prog"])


def test_verbose_and_gpu_flags():
    assert not flags.parse_args(["python", "t.py"]).verbose
    assert flags.parse_args(["-v", "python", "t.py"]).verbose
    assert not flags.parse_args(["-v=false", "python", "t.py"]).verbose
    assert flags.parse_args(["python", "t.py"]).gpu_per_worker
    assert not flags.parse_args(["-gpu-per-worker=false", "python", "t.py"]).gpu_per_worker
    assert not flags.parse_args(["--gpu-per-worker=0", "python", "t.py"]).gpu_per_worker
    with pytest.raises(_hosts.UsageError, match="only one of -q and -v"):
        flags.parse_args(["-q", "-v", "python", "t.py"])
    with pytest.raises(_hosts.UsageError, match="gpu-per-worker"):
        flags.parse_args(["-gpu-per-worker=maybe", "python", "t.py"])


def test_help_documents_verbose_and_gpu_flags():
    text = flags.help_text()
    assert "\n  -v " in text and '"kungfu.run"' in text
    assert "-gpu-per-worker=false" in text and "KUNGFU_GPU_COUNT" in text


@pytest.mark.parametrize("slot,gpus,user,expected", [
    (0, 0, None, None),          # no GPU: nothing changes
    (0, 2, None, "0"),
    (3, 2, None, "1"),           # more workers than GPUs: round robin
    (1, 4, "5", None),           # one device chosen by the user: kept for everyone
    (1, 4, "5,7", "7"),          # the user's list, split by slot
    (2, 0, " 5, 7 ,", "5"),
    (0, 4, "", None),            # "no GPU" set by the user: kept
])
def test_visible_devices(slot, gpus, user, expected):
    assert plan.visible_devices(slot, gpus, user) == expected


def test_gpu_count_override():
    assert plan.gpu_count({_env.GPU_COUNT.name: "3"}) == 3
    assert plan.gpu_count({_env.GPU_COUNT.name: "0"}) == 0
    with pytest.raises(ValueError, match="KUNGFU_GPU_COUNT"):
        plan.gpu_count({_env.GPU_COUNT.name: "-1"})


def test_a_bad_leave_grace_is_a_usage_error_before_anything_starts():
    for bad in ("0", "-3s", "soon"):
        r = launcher("-w", "-np", "1", "-H", "127.0.0.1:1", "-port-range", free_port_range(1),
                     "-builtin-config-port", str(free_ports(1)[0]), sys.executable, "-c",
                     "print('started')",
                     env_extra={_env.LEAVE_GRACE.name: bad})
        assert r.returncode == 2, (bad, r.stderr)
        assert f"KUNGFU_LEAVE_GRACE={bad!r} is invalid" in r.stderr, r.stderr
        assert "started" not in r.stdout


def test_etcd_password_in_the_url_is_warned_about_and_never_shown(tmp_path):
    """The probe (3g): `-config-server etcd://alice:S3cretPW@...` shows the password to every
    local user (ps). It still works, with one warning that does not repeat the password; a
    credentials file is the way that does not show it, and one open to others is refused."""
    port = free_port_range(1).split("-")[0]  # nobody listens: -timeout ends the wait
    common = ("-w", "-np", "1", "-H", "127.0.0.1:1", "-port-range", free_port_range(1),
              "-timeout", "1s")
    r = launcher(*common, "-config-server", f"etcd://alice:S3cretPW@127.0.0.1:{port}",
                 sys.executable, "-c", "pass")
    assert r.returncode == 124, r.stderr
    assert r.stderr.count("-config-server-credentials FILE") == 1, r.stderr
    assert f"etcd://alice:***@127.0.0.1:{port} holds etcd user 'alice'" in r.stderr, r.stderr
    assert "S3cretPW" not in r.stderr + r.stdout
    creds = tmp_path / "etcd.credentials"
    creds.write_text("alice:S3cretPW\n")
    creds.chmod(0o600)
    r = launcher(*common, "-config-server", f"etcd://127.0.0.1:{port}",
                 "-config-server-credentials", str(creds), sys.executable, "-c", "pass")
    assert r.returncode == 124 and "warning" not in r.stderr, r.stderr
    creds.chmod(0o644)
    r = launcher(*common, "-config-server", f"etcd://127.0.0.1:{port}",
                 "-config-server-credentials", str(creds), sys.executable, "-c", "pass")
    assert r.returncode == 2 and "open to other users (mode 0644): chmod 600" in r.stderr, r.stderr
    r = launcher(*common, "-builtin-config-port", port, "-config-server-credentials", str(creds),
                 sys.executable, "-c", "pass")
    assert r.returncode == 2 and "is for an etcd store" in r.stderr, r.stderr
