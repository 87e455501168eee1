"""
Plot runs from their metrics.jsonl: one PNG, one panel per quantity, one line per run, against
optimizer steps.

    python plot.py out/sft out/dpo                 # writes runs.png
    python plot.py out/dpo/metrics.jsonl --out=dpo.png  # a run's out_dir, or its metrics.jsonl
    python plot.py out/grpo out/dapo --overlay  # runs from the same start, each drawn from step 0

Panels, those some run logged: training and held-out loss; held-out exact-match accuracy; the
preferred-behaviour rate (built-in task: greedy replies in the plain style); for DPO runs the reward
margin and the log-probs of chosen and rejected responses (if logps_chosen falls with
logps_rejected, the policy is displacing likelihood, not preferring); for RL runs the mean reward of
each step's sampled replies. Each run's steps follow the last's (--overlay: all start at 0). A run
is named by its folder, with the folders above it that tell runs of the same name apart (a/sft,
b/sft).
"""

import json
import os
import sys

PANELS = [  # (title, [(metrics key, label suffix)])
    ("loss (training, held-out)", [("loss", ""), ("val_loss", " held-out")]),
    ("held-out exact-match accuracy", [("val_accuracy", "")]),
    ("preferred behaviour (plain style)", [("val_preferred", "")]),
    ("DPO reward margin (chosen - rejected)", [("reward_margin", "")]),
    ("DPO log-probs of the responses",
     [("logps_chosen", " chosen"), ("logps_rejected", " rejected")]),
    ("RL: mean reward of the sampled replies", [("reward_mean", "")]),
]


def read(run):
    """A run's rows, from its out_dir's metrics.jsonl or that file named; a last line cut short (a
    run stopped while writing it) is skipped, and said."""
    path = run if os.path.isfile(run) else os.path.join(run, "metrics.jsonl")
    if not os.path.exists(path):
        sys.exit(f"plot.py: {path} does not exist; pass the out_dir of a run (it writes "
                 "metrics.jsonl)")
    with open(path, errors="replace") as f:
        lines = f.readlines()
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            if i < len(lines):
                sys.exit(f"plot.py: {path}:{i} is not a JSON line ({e}); fix or delete that line")
            print(f"note: {path}:{i}, the last line, is cut short (a run stopped while writing "
                  "it): skipped")
            continue
        if not (isinstance(row, dict) and isinstance(row.get("iter"), int)):
            sys.exit(f"plot.py: {path}:{i} is not a metrics row (a JSON object with 'iter'): "
                     f"{line.strip()[:80]}; pass a run's out_dir or its metrics.jsonl")
        rows.append(row)
    return path, rows


def names(paths):
    """Each run's folder name, with as many folders above it as tell the runs apart."""
    folders = [os.path.dirname(os.path.abspath(p)).split(os.sep) for p in paths]
    for depth in range(1, max(map(len, folders)) + 1):
        named = ["/".join(f[-depth:]) for f in folders]
        if len(set(named)) == len(named):
            return named
    return named


def main(argv):
    if {"-h", "--help"} & set(argv):
        print(__doc__.strip())
        return
    for a in argv:
        if a.startswith("-") and not a.startswith("--out=") and a != "--overlay":
            sys.exit(f"plot.py: unknown option {a!r}; the options are --out=FILE.png and --overlay "
                     "(--help)")
    out = next((a[len("--out="):] for a in argv if a.startswith("--out=")), "runs.png")
    runs = [a for a in argv if not a.startswith("-")]
    if not runs:
        sys.exit(__doc__)
    # savefig would add it to the file, not to our "wrote" line
    out += "" if os.path.splitext(out)[1] else ".png"
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        sys.exit(f"plot.py: --out={out}: the folder {folder} does not exist; create it, or write "
                 "the plot elsewhere")
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot.py needs matplotlib, an optional dependency: pip install matplotlib")
    formats = matplotlib.figure.Figure().canvas.get_supported_filetypes()
    if os.path.splitext(out)[1][1:].lower() not in formats:
        sys.exit(f"plot.py: --out={out}: matplotlib writes {', '.join(sorted(formats))}, not this "
                 "extension")
    runs = dict(read(run) for run in runs)
    empty = [path for path, rows in runs.items() if not rows]
    runs = {path: rows for path, rows in runs.items() if rows}
    if not runs:
        sys.exit(f"plot.py: nothing to plot: {', '.join(empty)} empty (a run logs a line every "
                 "log_interval steps)")
    for path in empty:
        print(f"note: {path} is empty (the run has logged nothing yet): left out")
    # only what some run logged
    panels = [p for p in PANELS if any(m.get(key) is not None for rows in runs.values()
                                       for m in rows for key, _ in p[1])]
    if not panels:
        sys.exit("plot.py: nothing to plot: no run logged any of "
                 f"{', '.join(k for _, s in PANELS for k, _ in s)}")
    # one row
    fig, (axes,) = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    offset = 0  # each run continues where the previous one ended, unless --overlay
    for name, (path, rows) in zip(names(runs), runs.items()):
        for ax, (title, series) in zip(axes, panels):
            for key, suffix in series:
                points = [(offset + m["iter"], m[key]) for m in rows if m.get(key) is not None]
                if points:
                    scale = 100 if key in ("val_accuracy", "val_preferred") else 1
                    ax.plot([x for x, _ in points], [scale * y for _, y in points], marker="o"
                            if len(points) < 20
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
