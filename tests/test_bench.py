"""Benchmarks are not tests, but each must still run: a tiny-size smoke run per script, so none can rot."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args):
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_bench_lm_head_smoke():
    out = run("bench/bench_lm_head.py", "--T", "512", "--d", "32", "--V", "300", "--iters", "1")
    table = [l for l in out.splitlines() if l.startswith("| 512 |")]
    assert len(table) == 1 and "OOM" not in table[0] and "crashed" not in table[0], out
    rel_diff = float(table[0].split("|")[-2])
    assert rel_diff < 1e-5  # both methods computed the same loss


def test_bench_packing_smoke():
    out = run("bench/bench_packing.py", "--small")
    assert "BFD (ours)" in out and "packing time" in out, out
