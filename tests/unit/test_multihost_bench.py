"""benchmarks/multihost.py without a network: its limit, its arguments, its refusals."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "multihost.py"


@pytest.fixture(scope="module")
def mh():
    spec = importlib.util.spec_from_file_location("bench_multihost", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_link_limit(mh):
    # 2 hosts: each link carries B each way; 100 MB at 10 Gbit/s is 80 ms.
    assert mh.link_limit_s(100_000_000, 2, 10e9) == pytest.approx(0.08)
    # 4 hosts: 2 * 3/4 * B = 1.5 B per link.
    assert mh.link_limit_s(100_000_000, 4, 1e9) == pytest.approx(1.2)
    assert mh.link_limit_s(100_000_000, 2, None) is None
    assert mh.resnet50_bytes() == 4 * 25_583_592


@pytest.mark.parametrize("text, bps", [("10gbit", 10e9), ("100mbit", 1e8), ("1.5Gbit", 1.5e9),
                                       ("800kbit", 8e5), ("64bit", 64.0)])
def test_rate(mh, text, bps):
    assert mh.parse_rate(text) == pytest.approx(bps)
    assert mh.parse_rate(mh.human_rate(bps)) == pytest.approx(bps)


@pytest.mark.parametrize("argv, message", [
    (["--workers-per-host", "1,3,2"], "names 3 hosts, --hosts is 2"),
    (["--workers-per-host", "0"], "at least 1 worker"),
    (["--workers-per-host", "two"], "give a count"),
    (["--rate", "10G"], "bad rate '10G'"),
    (["--rate", "0gbit"], "bad rate"),
    (["--rate", "10gbps"], "bad rate"),
    (["--delay", "0.1"], "bad delay"),
    (["--hosts", "1"], "--hosts must be between 2"),
    (["--strategies", "RING,FASTEST"], "unknown strategy 'FASTEST'"),
    (["--prefix", "Bad-Name"], "--prefix"),
    (["--repeats", "0"], "--repeats"),
    (["--env", "PARALLELISM=4"], "expected KUNGFU_NAME=VALUE"),
    (["--env", "KUNGFU_PARALLELISM"], "expected KUNGFU_NAME=VALUE"),
])
def test_bad_arguments(mh, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        mh.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_good_arguments(mh):
    a = mh.parse_args([])
    assert (a.hosts, a.workers, a.rate, a.delay, a.repeats) == (2, [2, 2], None, None, 3)
    assert a.strategy_list == ["AUTO", "HIERARCHICAL", "RING", "BINARY_TREE_STAR", "TREE"]
    a = mh.parse_args(["--hosts", "3", "--workers-per-host", "1,3,2", "--rate", "10gbit",
                       "--delay", "0.1ms", "--strategies", "ring,binary-tree-star"])
    assert a.workers == [1, 3, 2] and a.rate == 10e9 and a.delay == pytest.approx(1e-4)
    assert a.strategy_list == ["RING", "BINARY_TREE_STAR"]
    assert a.env_vars == {}
    a = mh.parse_args(["--env", "KUNGFU_PARALLELISM=4", "--env", "KUNGFU_CHUNK_BYTES=1=2"])
    assert a.env_vars == {"KUNGFU_PARALLELISM": "4", "KUNGFU_CHUNK_BYTES": "1=2"}


def test_arms_rotate(mh):
    s = ["AUTO", "RING", "TREE"]
    assert [mh.arm_order(s, k) for k in range(4)] == [
        ["AUTO", "RING", "TREE"], ["RING", "TREE", "AUTO"], ["TREE", "AUTO", "RING"],
        ["AUTO", "RING", "TREE"]]


def test_summary_ratios(mh):
    rows = []
    for k, (ring, gloo) in enumerate([(0.30, 0.20), (0.10, 0.25), (0.20, 0.30)]):
        rows.append({"impl": "kungfu", "strategy": "RING", "mode": "fused", "time_s": ring})
        rows.append({"impl": "gloo", "strategy": "gloo", "mode": "fused", "time_s": gloo})
    s = {r["arm"]: r for r in mh.summarize(rows, ["RING", "gloo"], 0.08)}
    assert (s["RING"]["median_s"], s["RING"]["min_s"], s["RING"]["max_s"]) == (0.20, 0.10, 0.30)
    assert s["RING"]["ratio_gloo"] == pytest.approx(0.20 / 0.25)
    assert s["RING"]["ratio_limit"] == pytest.approx(0.20 / 0.08)
    assert s["gloo"]["ratio_gloo"] == pytest.approx(1.0)
    text = mh.table(list(s.values()))
    assert "200.0 [100.0, 300.0]" in text and "2.50" in text
    none = mh.summarize(rows, ["RING"], None)
    assert none[0]["ratio_limit"] is None and " - " in mh.table(none) + " "


def test_not_root(mh, monkeypatch, capsys):
    monkeypatch.setattr(mh.os, "geteuid", lambda: 1000)
    built = []
    monkeypatch.setattr(mh.Network, "build", lambda *a: built.append(a))
    assert mh.main(["--rate", "10gbit"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [mh.NEEDS] and "root" in err[0] and "iproute2" in err[0]
    assert not built


def test_no_ip_command(mh, monkeypatch):
    monkeypatch.setattr(mh.os, "geteuid", lambda: 0)
    monkeypatch.setattr(mh.shutil, "which", lambda name: None if name == "tc" else "/sbin/" + name)
    assert mh.missing_privileges(need_tc=False) is None
    assert mh.missing_privileges(need_tc=True) == mh.NEEDS


def test_refuses_existing_namespaces(mh, monkeypatch, capsys):
    monkeypatch.setattr(mh.os, "geteuid", lambda: 0)
    monkeypatch.setattr(mh.shutil, "which", lambda name: "/sbin/" + name)
    monkeypatch.setattr(mh, "existing_namespaces", lambda: ["other", "kfmh1"])
    built = []
    monkeypatch.setattr(mh.Network, "build", lambda *a: built.append(a))
    assert mh.main([]) == 2
    err = capsys.readouterr().err
    assert "kfmh1 exist already" in err and "--prefix" in err
    assert not built


def test_shaping_commands(mh):
    assert mh.shaping("kfv0", None, None) == []
    tbf = mh.shaping("kfv0", 10e9, None)
    assert len(tbf) == 1 and tbf[0][tbf[0].index("rate") + 1] == "10000000000bit"
    both = mh.shaping("kfp1", 1e9, 1e-4)
    assert both[1][-4:] == ["delay", "100us", "limit", "100000"] and "parent" in both[1]
    assert mh.shaping("kfv0", None, 2e-3)[0][5:8] == ["root", "netem", "delay"]
