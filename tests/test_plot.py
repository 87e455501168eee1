"""plot.py draws runs from metrics.jsonl into one PNG, and says what to install when matplotlib is missing."""

import json
import os
import subprocess
import sys

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
