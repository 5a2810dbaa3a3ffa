"""The benchmarks' --plot and --from-json: records built by the benchmarks' own code, drawn to
PNG files; without matplotlib, a one-line error that names `pip install matplotlib`."""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def load(name: str):
    """benchmarks/<name>.py as a module (its helpers _common and _plot beside it)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def ar():
    return load("allreduce")


@pytest.fixture(scope="module")
def rl():
    return load("resize_latency")


@pytest.fixture(scope="module")
def kt():
    return load("keras_throughput")


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert len(data) > 1000
    assert data[:8] == PNG_MAGIC


def write_json_lines(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# -- allreduce.py ---------------------------------------------------------------------------------


def allreduce_rows(ar, n: int):
    """A sweep of two strategies over three sizes and the model case in both modes, at np=n,
    built by allreduce.record as the benchmark builds them; time grows with size."""
    rows = []
    for strategy, scale in (("RING", 1.0), ("STAR", 2.0)):
        for nbytes in (4096, 65536, 1 << 20):
            times = np.array([1e-4, 2e-4, 3e-4]) * scale * nbytes / 4096
            rows.append(ar.record("kungfu", strategy, "sweep", nbytes, times, n, 3, 2,
                                  count=nbytes // 4))
        for mode in ("fused", "per-tensor"):
            times = np.array([0.04, 0.05, 0.09]) * scale
            rows.append(ar.record("kungfu", strategy, "resnet50", 102334368, times, n, 3, 2,
                                  mode=mode, tensors=214))
    return rows


def test_allreduce_record(ar):
    r = ar.record("kungfu", "RING", "sweep", 1_000_000, np.array([0.003, 0.001, 0.002]), 4, 3, 2)
    assert r["time_s"] == 0.002 and r["min_s"] == 0.001 and r["max_s"] == 0.003
    assert r["algbw_GBps"] == pytest.approx(0.5)
    assert r["busbw_GBps"] == pytest.approx(0.5 * 2 * 3 / 4)


def test_allreduce_sweep_lines(ar):
    plt = pytest.importorskip("matplotlib.pyplot")
    rows = [r for r in allreduce_rows(ar, 2) if r["case"] == "sweep"]
    fig, (top, bottom) = plt.subplots(2)
    ar.plot_sweep(top, bottom, rows, 2, {"kungfu RING": "C0", "kungfu STAR": "C1"})
    lines = {line.get_label(): line for line in top.get_lines()}
    assert sorted(lines) == ["kungfu RING", "kungfu STAR"]
    assert list(lines["kungfu RING"].get_xdata()) == [4096, 65536, 1 << 20]
    assert list(lines["kungfu STAR"].get_ydata()) == pytest.approx([4e-4, 64e-4, 1024e-4])
    bw = {line.get_label(): line for line in bottom.get_lines()}
    assert list(bw["kungfu RING"].get_ydata()) == pytest.approx(
        [r["busbw_GBps"] for r in rows if r["strategy"] == "RING"])
    assert top.get_xscale() == top.get_yscale() == "log"
    assert [t.get_text() for t in top.get_xticklabels()] == ["4KiB", "64KiB", "1MiB"]
    plt.close(fig)


def test_allreduce_plot_and_from_json(ar, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    a = write_json_lines(tmp_path / "np2.jsonl", allreduce_rows(ar, 2))
    b = write_json_lines(tmp_path / "np3.jsonl", allreduce_rows(ar, 3))
    png = tmp_path / "sub" / "allreduce.png"
    assert ar.main(["--from-json", str(a), str(b), "--plot", str(png)]) == 0
    assert_png(png)
    out = capsys.readouterr().out
    # the tables of both runs, each at its own np
    assert "allreduce float32 sum, np=2: time (median)" in out
    assert "allreduce float32 sum, np=3: busbw GB/s" in out
    assert f"plot: {png}" in out


# -- resize_latency.py ----------------------------------------------------------------------------


def elastic_procs(rl):
    """Records of a 2 -> 4 -> 2 elastic job: rank 0 steps 1 s at np=2 and 1.5 s at np=4; the
    grow (asked at step 3, switched after step 4) has a 3 s boundary, so a 1.5 s pause; the
    shrink (asked at step 7, switched after step 8) a 1.2 s boundary, so a 0.2 s pause."""
    ends = {1: 10.0, 2: 11.0, 3: 12.0, 4: 13.0, 5: 16.0, 6: 17.5, 7: 19.0, 8: 20.5, 9: 21.7,
            10: 22.7, 11: 23.7, 12: 24.7}
    size = {i: 4 if 5 <= i <= 8 else 2 for i in ends}

    def step(i, rank):
        return {"ev": "step", "step": i, "epoch": 0, "rank": rank, "size": size[i],
                "size_after": size.get(i + 1, 2), "t_begin": ends[i] - 0.5, "t_end": ends[i],
                "t_hook": ends[i] + 0.01, "detached": False}

    def info(t_proc, joining):
        return {"ev": "proc", "t_proc": t_proc, "t_main": t_proc + 0.1,
                "t_imported": t_proc + 2, "t_model": t_proc + 3, "t_built": t_proc + 3,
                "t_fit": t_proc + 4, "joining": joining}

    rank0 = [info(0.0, False), *(step(i, 0) for i in ends),
             {"ev": "ask", "t": 12.0, "step": 3, "from": 2, "to": 4},
             {"ev": "ask", "t": 19.0, "step": 7, "from": 4, "to": 2},
             {"ev": "save", "t0": 25.0, "t1": 26.0, "path": "ckpt", "bytes": 1 << 20}]
    rank1 = [info(0.5, False), *(step(i, 1) for i in ends)]
    joiner = {"ev": "proc", "t_proc": 12.05, "t_main": 12.1, "t_imported": 12.3,
              "t_model": 12.5, "t_built": 12.5, "t_fit": 12.7, "joining": True}
    joiners = [[joiner, {"ev": "rehearsed", "t0": 12.75, "t1": 12.9}, {"ev": "joined", "t": 13.3},
                *(step(i, r) for i in (5, 6, 7, 8))] for r in (2, 3)]
    return [rl.Proc(rows) for rows in [rank0, rank1, *joiners]]


def resize_rows(rl):
    """The records resize_latency.main writes, built by its own analysis from elastic_procs;
    a restart row as analyse_restart builds it; the run row's keys."""
    args = argparse.Namespace(small=2, big=4)
    procs = elastic_procs(rl)
    rows, r0 = rl.analyse_elastic(args, procs)
    rows.append(rl.timeline_row(r0, 5.0))
    restart_procs = [rl.Proc([{**p.info, "t_proc": 30.0 + k}, *({**s, "t_end": 40.0 + s["step"]}
                                                               for s in p.steps[:3])])
                     for k, p in enumerate(procs[:2])]
    rows.append(rl.analyse_restart("2->4", r0.saves[-1], {"t_exit": 28.0}, {}, restart_procs))
    rows.append({"measure": "run", "wall_s": 60.0, "loadavg_before": [1.0, 1.0, 1.0],
                 "loadavg_after": [2.0, 2.0, 2.0], "cpus": 2, "params": 1000,
                 "optimizer": "momentum", "batch_size": 8, "small": 2, "big": 4, "cycles": 1,
                 "threads": 1, "restart_broadcast": False, "elastic_steps": 12,
                 "epoch_boundaries": 0})
    return rows


def test_resize_records(rl):
    rows = resize_rows(rl)
    pauses = [r for r in rows if r["measure"] == "pause"]
    assert [(p["change"], p["switch_step"], p["pause_s"]) for p in pauses] == [
        ("2->4", 4, 1.5), ("4->2", 8, 0.2)]
    timeline = next(r for r in rows if r["measure"] == "timeline")
    assert timeline["step"] == list(range(1, 13))
    assert timeline["size"] == [2, 2, 2, 2, 4, 4, 4, 4, 2, 2, 2, 2]
    assert timeline["t_end_s"][:5] == [5.0, 6.0, 7.0, 8.0, 11.0]
    assert timeline["step_s"][:6] == [None, 1.0, 1.0, 1.0, 3.0, 1.5]
    assert timeline["asks"] == [{"t_s": 7.0, "step": 3, "to": 4}, {"t_s": 14.0, "step": 7, "to": 2}]
    # what --from-json's table takes the normal step times from
    assert rl.normal_steps(rows) == {2: 1.0, 4: 1.5}
    restart = next(r for r in rows if r["measure"] == "restart")
    assert (restart["save_s"], restart["stop_s"], restart["relaunch_s"]) == (1.0, 2.0, 2.0)


def test_resize_timeline_lines(rl):
    plt = pytest.importorskip("matplotlib.pyplot")
    rows = resize_rows(rl)
    timeline = next(r for r in rows if r["measure"] == "timeline")
    fig, ax = plt.subplots()
    rl.plot_timeline(ax, timeline, [r for r in rows if r["measure"] == "pause"])
    size_line = ax.get_lines()[0]
    assert list(size_line.get_ydata()) == timeline["size"]
    assert size_line.get_drawstyle() == "steps-pre"
    notes = sorted(t.get_text() for t in ax.texts)
    assert notes == ["2->4\npause 1.50 s", "4->2\npause 0.20 s"]
    dots = fig.axes[1].get_lines()[0]
    assert list(dots.get_xdata()) == timeline["t_end_s"][1:]
    assert list(dots.get_ydata()) == timeline["step_s"][1:]
    plt.close(fig)


def test_resize_plot_and_from_json(rl, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    saved = write_json_lines(tmp_path / "resize.jsonl", resize_rows(rl))
    png = tmp_path / "resize.png"
    assert rl.main(["--from-json", str(saved), "--plot", str(png)]) == 0
    assert_png(png)
    out = capsys.readouterr().out
    assert "normal step (rank 0, median): np=2: 1.00 s, np=4: 1.50 s" in out
    assert f"plot: {png}" in out


# -- keras_throughput.py --------------------------------------------------------------------------


def test_keras_throughput_plot(kt, tmp_path):
    pytest.importorskip("matplotlib")
    args = argparse.Namespace(model="cnn", batch_size=32, steps=10, threads=0)
    rows = [kt.measurement(impl, n, [1.0, 1.1, 0.9], args, 1000, [1.0], [[1.0, 1.1, 0.9]])
            for impl in ("kungfu", "mwms") for n in (1, 2)]
    assert rows[1]["samples_per_s"] == pytest.approx(2 * 32 * 10 / 1.0)
    png = tmp_path / "keras.png"
    kt.plot(rows, str(png))
    assert_png(png)


# -- without matplotlib ---------------------------------------------------------------------------


@pytest.fixture
def no_matplotlib(monkeypatch):
    """`import matplotlib` fails, as where it is not installed."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def test_without_matplotlib_plot_says_how_to_install(ar, rl, kt, tmp_path, no_matplotlib):
    png = tmp_path / "never.png"
    for draw, rows in ((ar.plot, allreduce_rows(ar, 2)), (rl.plot, resize_rows(rl)),
                       (kt.plot, [])):
        with pytest.raises(SystemExit) as e:
            draw(rows, str(png))
        assert str(e.value) == "--plot needs matplotlib, which is not installed: pip install matplotlib"
    assert not png.exists()


def test_without_matplotlib_drivers_stop_before_running(ar, rl, tmp_path, no_matplotlib):
    """--plot without matplotlib stops a driver before it reads or runs anything (here: a
    --from-json file that does not exist is never opened)."""
    missing = str(tmp_path / "absent.jsonl")
    for main in (ar.main, rl.main):
        with pytest.raises(SystemExit, match="pip install matplotlib"):
            main(["--from-json", missing, "--plot", str(tmp_path / "p.png")])
