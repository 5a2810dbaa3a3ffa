"""Process sets (kf.ProcessSet, process_set=): real workers at np 3 and 4, two disjoint sets and
one overlapping set running concurrently with the cluster's own operations; values against
numpy; failures inside a set reach its members only."""
import numpy as np
import pytest

import _w_process_sets as W

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("n", [3, 4])
def test_every_collective_in_concurrent_sets(spawn, n):
    results = spawn(n, W.every_collective, env={"KUNGFU_OP_TIMEOUT": "30s"}, timeout=120)
    sets = W.sets_for(n)
    for res in results:
        r = res["rank"]
        assert res["whole"] == sum(range(n))
        assert res["not_in"] == sorted(k for k, v in sets.items() if r not in v)
        for key, ranks in sets.items():
            if r not in ranks:
                continue
            got, m = res[key], len(ranks)
            me, root = ranks.index(r), m - 1
            xs = [W.x_of(k) for k in ranks]
            assert got["set_rank"] == me
            np.testing.assert_array_equal(got["sum"], sum(xs))
            np.testing.assert_allclose(got["avg"], sum(xs) / m)
            assert got["max_int"] == 7 * ranks[-1]
            assert got["reduce"] == (sum(xs).tolist() if me == root else None)
            assert got["bcast"] == xs[root].tolist()
            assert got["allgather"] == np.concatenate(
                [W.x_of(k)[: k % 3 + 1] for k in ranks]).tolist()
            assert got["gather"] == (np.concatenate(xs).tolist() if me == root else None)
            assert got["alltoall"] == [[100 * k + me, i] for k in ranks for i in range(2)]
            parts = [5 // m + (1 if j < 5 % m else 0) for j in range(m)]
            start = sum(parts[:me])
            assert got["rscatter"] == sum(xs)[start:start + parts[me]].tolist()
            assert got["consensus"] is True
            assert got["disagree"] is (m == 1)


def test_failures_stay_in_the_set(spawn):
    results = spawn(4, W.failures_stay_in_the_set, env={"KUNGFU_OP_TIMEOUT": "30s"}, timeout=90)
    for res in results:
        r = res["rank"]
        if r in (0, 1):
            assert res["refused"] is None
            mismatch, rejected = res["errors"]
            assert "kungfu::set[0,1]/g" in mismatch, mismatch
            assert "unknown reduce op 'bogus'" in rejected, rejected
            if r == 1:
                assert "rejected on rank 0" in rejected, rejected
            assert res["after"] == 1 + 2
        else:
            assert "not a member of ProcessSet([0, 1]" in res["refused"], res["refused"]
            assert res["b"] == [3 + 4] * 3
        assert res["whole"] == 1 + 2 + 3 + 4


@pytest.mark.timeout(150)
def test_a_set_is_refused_after_a_resize(tmp_path):
    """Under kungfu-run -w: a set made before a resize is refused after it, with an error that
    says to make it again; sets made in the new version work, the joiner's too."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from conftest import free_port_range, free_ports

    here = Path(__file__).resolve().parent
    repo = here.parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUNGFU_")}
    env["PYTHONPATH"] = os.pathsep.join([str(repo)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["KUNGFU_RESIZE_TIMEOUT"] = "60"
    cmd = [sys.executable, "-m", "kungfu.cmd", "-w", "-np", "2", "-H", "127.0.0.1:3",
           "-builtin-config-port", str(free_ports(1)[0]), "-port-range", free_port_range(3),
           "-timeout", "100s", sys.executable, str(here / "_w_pset_resize.py"), str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(repo), timeout=120,
                       check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    outs = sorted((json.loads(f.read_text()) for f in tmp_path.glob("*.json")),
                  key=lambda o: o["rank"])
    assert [o["rank"] for o in outs] == [0, 1, 2] and {o["size"] for o in outs} == {3}
    for o in outs[:2]:
        assert o["first_size"] == 2 and o["before"] == 3.0 and o["changed"] is True
        assert "made for cluster version" in o["stale"] and "make the process set again" in \
            o["stale"], o["stale"]
        assert o["again"] == 3.0
    assert outs[2]["first_size"] == 3 and "stale" not in outs[2]
    assert "after" not in outs[0]
    assert outs[1]["after"] == outs[2]["after"] == 2.0 + 3.0


def test_tensorflow_ops_in_concurrent_sets(spawn):
    env = {"TF_CPP_MIN_LOG_LEVEL": "2", "KUNGFU_OP_TIMEOUT": "30s"}
    n = 3
    results = spawn(n, W.tf_collectives, env=env, timeout=150)
    sets = W.sets_for(n)
    for res in results:
        r = res["rank"]
        for key, ranks in sets.items():
            if r not in ranks:
                assert key not in res
                continue
            got, m = res[key], len(ranks)
            me, root = ranks.index(r), m - 1
            xs = [W.x_of(k) for k in ranks]
            total = sum(xs)
            np.testing.assert_array_equal(got["sum"], total)
            np.testing.assert_allclose(got["avg"], total / m)
            np.testing.assert_array_equal(got["group"][0], total)
            np.testing.assert_array_equal(got["group"][1], total[0])
            assert got["bcast"] == xs[root].tolist()
            assert got["allgather"] == np.concatenate(
                [W.x_of(k)[: k % 3 + 1] for k in ranks]).tolist()
            assert got["alltoall"] == [[100 * k + me, i] for k in ranks for i in range(2)]
            parts = [5 // m + (1 if j < 5 % m else 0) for j in range(m)]
            start = sum(parts[:me])
            assert got["rscatter"] == total[start:start + parts[me]].tolist()
            assert got["consensus"] is True
            assert got["traced"] == [total.tolist(), (2 * total).tolist()]
            # d/dv sum(allreduce(v * (r + 1))) = (r + 1) x the allreduce of ones over the set
            np.testing.assert_allclose(got["grad"], np.full((5, 2), (r + 1) * m))


def test_members_that_made_different_sets_fail(spawn):
    results = spawn(3, W.members_made_different_sets,
                    env={"KUNGFU_OP_TIMEOUT": "30s"}, timeout=90)
    for res in results:
        err = res["error"]
        assert err is not None and "InvalidArgumentError" in err, res
        assert "different names" in err, err
        assert "kungfu::set[0,1,2]/kungfu::process-set" in err, err
