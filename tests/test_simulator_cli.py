"""`lengthwise simulate`: direct mode, plan files, pictures, one-line errors; no PyTorch."""

from __future__ import annotations

import json
import subprocess
import sys

from test_simulator import make_plan, split, whole

from lengthwise.cli import main
from lengthwise.cost import CostModel
from lengthwise.sim import simulate_plan
from lengthwise.sim.gantt import draw_gantt, shown_pipelines


def run_cli(argv, capsys) -> tuple[int, str, str]:
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_direct_mode_answers_chunkflow_figure2(capsys):
    code, out, _ = run_cli(["simulate", "--stages", "4", "--fwd", "4,2,1,1", "--json"], capsys)
    d = json.loads(out)
    assert code == 0 and d["makespan"] == 56.0 and round(d["bubble_ratio"] * 100, 2) == 57.14


def test_direct_mode_groups_and_k(capsys):
    code, out, _ = run_cli(["simulate", "--stages", "4", "--fwd", "2,2,2,2", "--groups", "2-3",
                            "--schedule", "state-aware-1f1b", "--k", "2"], capsys)
    assert code == 0 and "step time 46 units" in out and "47.83%" in out


def test_plan_file_with_pictures(tmp_path, capsys):
    plan = make_plan([[whole(0, 64)] + split(1, [0, 40, 90, 130]), [whole(2, 100), whole(3, 30)]],
                     pp=2, schedule="state-aware-1f1b", k=1)
    path = tmp_path / "plan.json"
    plan.save(path)
    gantt, memory = tmp_path / "g.png", tmp_path / "m.png"
    code, out, _ = run_cli(["simulate", str(path), "--gantt", str(gantt), "--memory-plot", str(memory)], capsys)
    assert code == 0 and "bubble ratio" in out and "fits in memory: yes" in out
    assert gantt.read_bytes()[:4] == memory.read_bytes()[:4] == b"\x89PNG"
    assert "chunk times: built-in curve fitted to" in out and "measured on NVIDIA H200" in out
    code, out, _ = run_cli(["simulate", str(path), "--json"], capsys)
    assert json.loads(out)["step_time_s"] > 0 and "NVIDIA H200" in json.loads(out)["time_source"]


def test_mistakes_exit_2_with_one_line(tmp_path, capsys):
    for argv in (["simulate", "--fwd", "1,2"], ["simulate", "--stages", "2", "--fwd", "1,x"],
                 ["simulate", "--stages", "2", "--fwd", "1,2", "--groups", "1"],
                 ["simulate", str(tmp_path / "missing.json")], ["simulate"]):
        code, _, err = run_cli(argv, capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1, argv


def test_gantt_caps_rows_at_whole_pipelines(tmp_path):
    plan = make_plan([[whole(i, 32 + i)] for i in range(20)], pp=4)
    result = simulate_plan(plan, CostModel(model=plan.model, cluster=plan.cluster))
    shown = shown_pipelines(result, max_rows=64)
    assert len(shown) == 16 and 19 in shown  # the slowest pipeline (longest chunk) is always drawn
    draw_gantt(result, tmp_path / "many.png")
    assert (tmp_path / "many.png").read_bytes()[:4] == b"\x89PNG"


def test_simulator_imports_no_torch():
    code = ("import sys, lengthwise.sim, lengthwise.sim.gantt, lengthwise.commands.simulate; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_pictures_name_what_they_show_and_what_they_leave_out(tmp_path, monkeypatch):
    """The Gantt title names the planner and the plan (or the direct mode's chunk times) and says
    simulated; the memory plot says how many pipelines it left out; direct-mode JSON counts no
    tokens (raw chunk times have none)."""
    from matplotlib.axes import Axes

    import lengthwise.sim.gantt as gantt

    titles = []
    monkeypatch.setattr(gantt.Figure, "suptitle", lambda self, text, **kw: titles.append(text))

    original = Axes.set_title
    monkeypatch.setattr(Axes, "set_title", lambda self, text, **kw: (titles.append(text), original(self, text, **kw))[1])
    assert main(["simulate", "--stages", "2", "--fwd", "2,1", "--gantt", str(tmp_path / "g.png")]) == 0
    assert any("1f1b, 2 stages, chunk times 2,1: simulated step" in t for t in titles)
    out = tmp_path / "many.json"
    assert main(["plan", "--planner", "packing", "--lengths", str(_lengths(tmp_path)), "--batch-size", "12",
                 "--model", "tiny", "--cluster", "cpu", "--dp", "6", "--out", str(out)]) == 0
    assert main(["simulate", str(out), "--memory-plot", str(tmp_path / "m.png")]) == 0
    assert any("4 of 6 pipelines shown (2 left out)" in t for t in titles)
    assert _direct_json()["tokens"] == 0


def _lengths(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(str(20 + 3 * i) for i in range(12)))
    return path


def _direct_json():
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["simulate", "--stages", "2", "--fwd", "2,1", "--json"]) == 0
    return json.loads(buf.getvalue())
