"""
Plot runs from their metrics.jsonl: one PNG, one panel per quantity, one line per run, against optimizer steps.

    python plot.py out/sft out/dpo                 # writes runs.png
    python plot.py out/dpo --out=dpo.png
    python plot.py out/grpo out/dapo --overlay     # runs from the same start, each drawn from step 0

Panels, those some run logged: training loss; held-out exact-match accuracy; the preferred-behaviour rate (built-in
task: greedy replies in the plain style); for DPO runs the reward margin and the log-probs of chosen and rejected
responses (if logps_chosen falls with logps_rejected, the policy is displacing likelihood, not preferring); for RL runs
the mean reward of each step's sampled replies. Each run's steps follow the last's (--overlay: all start at 0).
"""

import json
import os
import sys

PANELS = [  # (title, [(metrics key, label suffix)])
    ("training loss", [("loss", "")]),
    ("held-out exact-match accuracy", [("val_accuracy", "")]),
    ("preferred behaviour (plain style)", [("val_preferred", "")]),
    ("DPO reward margin (chosen - rejected)", [("reward_margin", "")]),
    ("DPO log-probs of the responses", [("logps_chosen", " chosen"), ("logps_rejected", " rejected")]),
    ("RL: mean reward of the sampled replies", [("reward_mean", "")]),
]


def read(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        sys.exit(f"plot.py: {path} does not exist; pass the out_dir of a run (it writes metrics.jsonl)")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv):
    out = next((a.split("=", 1)[1] for a in argv if a.startswith("--out=")), "runs.png")
    runs = [a for a in argv if not a.startswith("--")]
    if not runs:
        sys.exit(__doc__)
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot.py needs matplotlib, an optional dependency: pip install matplotlib")
    runs = {run_dir: read(run_dir) for run_dir in runs}
    panels = [p for p in PANELS if any(m.get(key) is not None for rows in runs.values() for m in rows
                                       for key, _ in p[1])]  # only what some run logged
    fig, (axes,) = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)  # one row
    offset = 0  # each run continues where the previous one ended, unless --overlay
    for run_dir, rows in runs.items():
        name = os.path.basename(os.path.normpath(run_dir))
        for ax, (title, series) in zip(axes, panels):
            for key, suffix in series:
                points = [(offset + m["iter"], m[key]) for m in rows if m.get(key) is not None]
                if points:
                    scale = 100 if key in ("val_accuracy", "val_preferred") else 1
                    ax.plot([x for x, _ in points], [scale * y for _, y in points], marker="o" if len(points) < 20
                            else None, markersize=3, label=name + suffix)
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("optimizer step")
        offset += 0 if "--overlay" in argv else max((m["iter"] for m in rows), default=0)
    for ax, (title, _) in zip(axes, panels):
        if "accuracy" in title or "preferred" in title:
            ax.set_ylim(0, 100)
            ax.set_ylabel("%")
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
