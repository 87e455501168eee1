"""plot.py draws runs from metrics.jsonl into one PNG, and says what to install when matplotlib is missing."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT


def fake_run(folder, rows):
    os.makedirs(folder)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(folder)


def test_plot_writes_one_png_of_both_runs(tmp_path):
    sft = fake_run(tmp_path / "sft", [dict(iter=i, loss=3.0 / i) for i in range(1, 11)]
                   + [dict(iter=10, val_loss=0.4, val_accuracy=0.8, val_preferred=0.5)])
    dpo = fake_run(tmp_path / "dpo", [dict(iter=0, val_accuracy=0.8, val_preferred=0.5)]
                   + [dict(iter=i, loss=0.69 - 0.05 * i, reward_margin=0.1 * i, logps_chosen=-3.0,
                           logps_rejected=-3.0 - i) for i in range(1, 6)])
    out = str(tmp_path / "runs.png")
    r = subprocess.run([sys.executable, "plot.py", sft, dpo, f"--out={out}"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_so(tmp_path):
    blocker = tmp_path / "matplotlib"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    run = fake_run(tmp_path / "sft", [dict(iter=1, loss=1.0)])
    r = subprocess.run([sys.executable, "plot.py", run], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert r.returncode != 0 and "pip install matplotlib" in r.stderr and "Traceback" not in r.stderr


def plot(*args):
    return subprocess.run([sys.executable, "plot.py", *map(str, args)], cwd=ROOT, capture_output=True, text=True)


def test_plot_help_prints_it_and_exits_0():
    r = plot("--help")
    assert r.returncode == 0 and "--out=" in r.stdout, r.stderr


def test_a_last_line_cut_mid_write_is_skipped_and_said(tmp_path):
    run = fake_run(tmp_path / "sft", [dict(iter=i, loss=1.0 / i) for i in range(1, 4)])
    with open(os.path.join(run, "metrics.jsonl"), "a") as f:
        f.write('{"iter": 4, "lo')  # a run killed while writing its fourth line
    r = plot(run, f"--out={tmp_path / 'cut.png'}")
    assert r.returncode == 0, r.stderr
    assert "metrics.jsonl:4, the last line, is cut short" in r.stdout and (tmp_path / "cut.png").exists()


def test_the_metrics_file_itself_is_a_run(tmp_path):
    """Named instead of its folder; an --out without an extension gets .png, and the "wrote" line says so."""
    run = fake_run(tmp_path / "sft", [dict(iter=i, loss=1.0 / i) for i in range(1, 4)])
    r = plot(os.path.join(run, "metrics.jsonl"), f"--out={tmp_path / 'loss'}")
    assert r.returncode == 0, r.stderr
    assert f"wrote {tmp_path / 'loss.png'}" in r.stdout
    with open(tmp_path / "loss.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("case,says", [("empty", "empty"), ("out into a missing folder", "does not exist"),
                                       ("a bad line inside", "metrics.jsonl:2 is not a JSON line"),
                                       ("an unknown option", "unknown option '--output")])
def test_what_cannot_be_plotted_is_one_line(tmp_path, case, says):
    rows = [] if case == "empty" else [dict(iter=1, loss=1.0), dict(iter=2, loss=0.5)]
    run = fake_run(tmp_path / "sft", rows)
    if case == "a bad line inside":
        with open(os.path.join(run, "metrics.jsonl"), "w") as f:
            f.write('{"iter": 1, "loss": 1.0}\n{"iter": 2, "lo\n{"iter": 3, "loss": 0.5}\n')
    extra = {"out into a missing folder": f"--out={tmp_path / 'no' / 'runs.png'}",
             "an unknown option": f"--output={tmp_path / 'runs.png'}"}.get(case, f"--out={tmp_path / 'runs.png'}")
    r = plot(run, extra)
    assert r.returncode != 0 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not os.path.exists(tmp_path / "runs.png")


def test_runs_of_the_same_folder_name_are_told_apart_and_val_loss_is_drawn(tmp_path, monkeypatch):
    """The reported case: a/sft and b/sft were both labelled 'sft'; val_loss (all a run on one's own
    data logs besides its loss) was never drawn."""
    figure = pytest.importorskip("matplotlib.figure")
    import plot
    rows = [dict(iter=i, loss=3.0 / i) for i in range(1, 4)] + [dict(iter=3, val_loss=1.5)]
    runs = [fake_run(tmp_path / "a" / "sft", rows), fake_run(tmp_path / "b" / "sft", rows)]
    figures = []
    monkeypatch.setattr(figure.Figure, "savefig", lambda fig, *a, **k: figures.append(fig))
    plot.main([*runs, f"--out={tmp_path / 'runs.png'}"])
    (ax,) = figures[0].axes
    labels = ["a/sft", "a/sft held-out", "b/sft", "b/sft held-out"]
    assert [line.get_label() for line in ax.lines] == labels
    assert ax.lines[1].get_ydata().tolist() == [1.5]
