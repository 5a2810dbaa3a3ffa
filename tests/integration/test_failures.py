"""Failures: dead peers, peers that disagree, bad arguments, deadlines and strangers.

Nothing may hang or abort: every spawn has a deadline, and workers that survive a failure must
exit with status 0.
"""
import re

import pytest

import _w_failures as W

pytestmark = pytest.mark.timeout(120)

CRASH_MARKERS = ("Fatal Python error", "terminate called", "Segmentation fault", "Aborted",
                 "core dumped", "AddressSanitizer")


def assert_clean_exit(outcome):
    assert outcome.returncode == 0, outcome.describe()
    for marker in CRASH_MARKERS:
        assert marker not in outcome.stderr, outcome.describe()


# -- (a) a peer dies ---------------------------------------------------------------------------

@pytest.mark.parametrize("n,victim,mode,strategy,count", [
    (2, 1, "waiting", "AUTO", 1000),
    (3, 0, "in-op", "STAR", 1 << 20),
    (4, 2, "in-op", "RING", 1 << 21),
    (3, 2, "waiting", "BINARY_TREE_STAR", 7),
    (3, 1, "exit", "TREE", 1000),
], ids=["np2-waiting", "np3-root-killed-in-op-star", "np4-killed-in-op-ring",
        "np3-waiting-bts", "np3-peer-exits-normally"])
def test_peer_death_fails_survivors_fast(spawn, n, victim, mode, strategy, count):
    run = spawn.run(n, W.peer_dies, victim, mode, strategy, count, timeout=60)
    assert not run.timed_out, run.check()
    dead = run.peers[victim]
    v = run.outcomes[victim]
    if mode == "exit":
        assert_clean_exit(v)
    else:
        assert v.returncode == -9, v.describe()
    for o in run.outcomes:
        if o.rank == victim:
            continue
        assert_clean_exit(o)
        assert o.status == "ok", o.describe()
        first = o.value["first"]
        where = f"rank {o.rank}: {first}"
        assert first["error"] == "PeerFailedError", where
        assert "ConnectionError" in first["mro"], where
        assert dead in first["message"], f"message does not name {dead}: {where}"
        assert "doomed" in first["message"], f"message does not name the op: {where}"
        assert first["after_death"] < 10.0, where
        for key in ("later", "later_bc"):
            later = o.value[key]
            assert later["error"] == "PeerFailedError", f"rank {o.rank} {key}: {later}"
            assert later["seconds"] < 5.0, f"rank {o.rank} {key}: {later}"
            assert dead in later["message"], f"rank {o.rank} {key}: {later}"


# -- (b) peers disagree ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mismatch_results(session_spawn):
    cache = {}

    def get(n):
        if n not in cache:
            # A hang would end at the 6 s op deadline and show up below as OpTimeoutError.
            cache[n] = session_spawn.run(n, W.mismatch, env={"KUNGFU_OP_TIMEOUT": "6s"},
                                         timeout=100)
        return cache[n].check()

    return get


def check_mismatch(results, n, kinds):
    problems = []
    seen = 0
    for rank, cases in enumerate(results):
        for c in cases:
            if c["case"].split("-")[0] not in kinds:
                continue
            seen += 1
            where = f"{c['case']} (rank {rank} of {n}{', the odd one' if rank == n - 1 else ''})"
            if c["error"] != "InvalidArgumentError":
                problems.append(f"{where}: expected InvalidArgumentError, got {c}")
                continue
            if "ValueError" not in c["mro"]:
                problems.append(f"{where}: not a ValueError: {c['mro']}")
            if f"'{c['op']}'" not in c["message"] or "disagree" not in c["message"]:
                problems.append(f"{where}: the message does not say which op disagrees: "
                                f"{c['message']!r}")
            # A dtype mismatch names the dtypes (an avg of float16, summed in float32 on the
            # wire, says so rather than blaming the shape).
            dtypes = re.search(r"dtype-(\w+)-vs-(\w+)", c["case"])
            want = ["avg of float16"] if "avg-dtype" in c["case"] else dtypes.groups() if dtypes \
                else []
            if any(w not in c["message"] for w in want) or "disagree on the shape" in c["message"] and want:
                problems.append(f"{where}: the message does not name {want}: {c['message']!r}")
            if c["seconds"] > 5.0:
                problems.append(f"{where}: took {c['seconds']:.1f} s")
            if not (c["after"].get("error") is None and c["after"].get("ok")):
                problems.append(f"{where}: the next op failed: {c['after']}")
    assert seen > 0
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("n", [2, 3], ids=lambda n: f"np{n}")
def test_mismatch_fails_every_rank_allreduce_allgather(mismatch_results, n):
    """The last rank disagrees on size (10/11, 1000/999, 0/1, 100000/100001) or dtype
    (int32/float32, float16/bfloat16, int64/uint64) under several strategies: every rank raises
    InvalidArgumentError within seconds, and the next op works."""
    check_mismatch(mismatch_results(n), n, {"allreduce", "allgather"})


@pytest.mark.parametrize("n", [2, 3], ids=lambda n: f"np{n}")
def test_mismatch_fails_every_rank_broadcast_reduce_gather(mismatch_results, n):
    """Same contract for the rooted collectives: every rank raises, the ranks that only send
    included."""
    check_mismatch(mismatch_results(n), n, {"broadcast", "reduce", "gather"})


# -- (c) invalid arguments ---------------------------------------------------------------------

def test_invalid_arguments_raise_value_error(spawn):
    results = spawn(2, W.invalid_arguments, env={"KUNGFU_OP_TIMEOUT": "6s"}, timeout=60)
    problems = []
    for rank, cases in enumerate(results):
        for c in cases:
            where = f"{c['case']} (rank {rank})"
            if c["error"] is None or "ValueError" not in c["mro"]:
                problems.append(f"{where}: expected a ValueError, got {c}")
                continue
            if c["error"] != "InvalidArgumentError":
                problems.append(f"{where}: expected kungfu's InvalidArgumentError, got {c}")
            missing = [w for w in c["words"] if w.lower() not in c["message"].lower()]
            if missing:
                problems.append(f"{where}: message {c['message']!r} does not mention {missing}")
            if c["seconds"] > 2.0:
                problems.append(f"{where}: took {c['seconds']:.1f} s")
            if not c["after_ok"]:
                problems.append(f"{where}: the next op failed: {c['after']}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("var,value,words", [
    ("KUNGFU_ALLREDUCE_STRATEGY", "FOO", ["FOO"]),
    ("KUNGFU_PEER_TIMEOUT", "soon", ["KUNGFU_PEER_TIMEOUT", "soon"]),
    ("KUNGFU_CHUNK_BYTES", "-5", ["KUNGFU_CHUNK_BYTES"]),
    ("KUNGFU_PROGRESS_INTERVAL", "-1s", ["KUNGFU_PROGRESS_INTERVAL", "bad duration"]),
])
def test_bad_environment_fails_at_init(spawn, var, value, words):
    run = spawn.run(2, W.init_only, env={var: value}, timeout=30)
    assert not run.timed_out, run.check()
    for o in run.outcomes:
        assert o.status == "error", o.describe()
        assert isinstance(o.exception, ValueError), o.describe()
        for w in words:
            assert w in o.error_message, o.describe()
        assert o.returncode == 1, o.describe()  # the worker's own exit code after an exception
        for marker in CRASH_MARKERS:
            assert marker not in o.stderr, o.describe()


# -- (d) deadlines -----------------------------------------------------------------------------

@pytest.mark.parametrize("per_op,env", [(1, {}), (None, {"KUNGFU_OP_TIMEOUT": "1s"})],
                         ids=["timeout-argument", "KUNGFU_OP_TIMEOUT"])
def test_op_timeout(spawn, per_op, env):
    results = spawn(2, W.lonely_op, per_op, env=env, timeout=40)
    for key, op in (("lonely", "never"), ("lonely_bc", "never-bc"),
                    ("lonely_barrier", "never-barrier")):
        o = results[0][key]
        assert o["error"] == "OpTimeoutError", (key, o)
        assert "TimeoutError" in o["mro"], (key, o)
        assert 0.9 <= o["seconds"] <= 2.0, (key, o)
        assert op in o["message"], (key, o)
    assert results[0]["after"] == [3, 3] and results[1]["after"] == [3, 3], results


@pytest.mark.parametrize("interval", ["1s", "0"])
def test_waiting_for_a_late_peer_is_reported(spawn, interval):
    # Every KUNGFU_PROGRESS_INTERVAL the others name the peer they wait for; once it comes up the
    # job goes on. 0 turns the lines off.
    delay = 3.5
    run = spawn.run(3, W.late_peer, delay, env={"KUNGFU_PROGRESS_INTERVAL": interval}, timeout=60)
    results = run.check()
    assert results == [[3.0, 3.0, 3.0]] * 3
    late = run.outcomes[2].peer
    for o in run.outcomes[:2]:
        lines = [l for l in o.stderr.splitlines() if l.startswith("kungfu: ")]
        if interval == "0":
            assert lines == [], o.describe()
            continue
        # Lines at 1, 2 and 3 s (give or take the start-up of the processes).
        assert 2 <= len(lines) <= 4, o.describe()
        for i, line in enumerate(lines):
            assert f"{o.peer} (rank {run.outcomes.index(o)}): waiting for" in line, line
            assert late in line, line  # the late peer is named, however far dialing got
            assert f"({i + 1} s so far; gives up after 30 s)" in line, line
    assert not [l for l in run.outcomes[2].stderr.splitlines() if l.startswith("kungfu: ")]


# -- (e) strangers -----------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 3], ids=lambda n: f"np{n}")
def test_strangers_are_rejected(spawn, n):
    results = spawn(n, W.strangers, timeout=90)
    problems = []
    for rank, res in enumerate(results):
        assert res["first"] == n * (n - 1) // 2, res
        for p in res["probes"]:
            where = f"rank {rank} -> {res['target']}: {p['case']}"
            if p["state"] != "closed":
                problems.append(f"{where}: the worker did not close the stream: {p}")
            elif p["seconds"] > 5.0:
                problems.append(f"{where}: closed only after {p['seconds']:.1f} s")
            if p["case"].startswith("hello") and p.get("code") in (None, 0):
                problems.append(f"{where}: no refusal in the handshake reply: {p}")
            if not p["after_ok"]:
                problems.append(f"{where}: the job broke: {p}")
    assert not problems, "\n".join(problems)
