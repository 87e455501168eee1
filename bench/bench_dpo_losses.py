"""
Each DPO loss type on the built-in task, from one SFT checkpoint with the same seed and steps: the val reward
accuracy (and margin, preferred style, exact-match accuracy) before -> after, and the wall time, one table.

    python train_sft.py                                   # out/sft/hf, the workshop's SFT model
    python bench/bench_dpo_losses.py                      # every loss type, train_dpo.py's defaults otherwise
    python bench/bench_dpo_losses.py --types sigmoid,bco_pair --out /tmp/dpo_losses -- --max_iters=16

Each loss type is one train_dpo.py run, one after another (a subprocess, OMP_NUM_THREADS=1 unless set), its out_dir
under --out; arguments after `--` go to every run. robust runs with label_smoothing=0.1 (the rDPO paper's value;
at 0 it is sigmoid). Rewards are beta x log-ratio sums, per response token for ipo and dpo_norm, and simpo's are
beta x the policy's mean log-prob (no reference): its reward accuracy is a different question.
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from losses import LOSS_TYPES  # noqa: E402

EXTRA = {"robust": ["--label_smoothing=0.1"]}


def evaluations(out_dir):
    """The run's evaluation lines of metrics.jsonl: (first, last)."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        evals = [m for m in map(json.loads, f) if "val_reward_accuracy" in m]
    return evals[0], evals[-1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--init_from", default="out/sft/hf", help="the SFT model every run starts from")
    parser.add_argument("--types", default=",".join(LOSS_TYPES))
    parser.add_argument("--out", default="/tmp/bench_dpo_losses", help="one out_dir per loss type under it")
    parser.add_argument("rest", nargs="*", help="after --: arguments for every train_dpo.py run")
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    rows = []
    for loss_type in args.types.split(","):
        out_dir = os.path.join(args.out, loss_type)
        cmd = [sys.executable, "train_dpo.py", f"--init_from={args.init_from}", f"--out_dir={out_dir}",
               f"--loss_type={loss_type}", "--overwrite=True", *EXTRA.get(loss_type, []), *args.rest]
        t0 = time.perf_counter()
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if out.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
        first, last = evaluations(out_dir)
        pct = lambda m, k: f"{100 * m[k]:.1f}%" if k in m else "-"
        rows.append([loss_type, " ".join(EXTRA.get(loss_type, [])) or "-",
                     f"{pct(first, 'val_reward_accuracy')} -> **{pct(last, 'val_reward_accuracy')}**",
                     f"{last['val_reward_margin']:.3f}", f"{pct(first, 'val_preferred')} -> {pct(last, 'val_preferred')}",
                     f"{pct(first, 'val_accuracy')} -> {pct(last, 'val_accuracy')}", f"{wall:.0f} s"])
        print(f"{loss_type}: done in {wall:.0f} s", flush=True)
    print(f"\ntrain_dpo.py from {args.init_from}, {' '.join(args.rest) or 'defaults'}; iter 0 -> the last evaluation")
    print("| loss_type | extra | val reward accuracy | val margin | preferred (plain style) | exact match | wall |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
