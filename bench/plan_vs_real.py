"""
Plan vs real on this CPU: plan.py's --device=cpu plan of a training step beside the same step run for real (same
script, same worst-case data, real tensors): the tracker's peak on both, and the real process's RSS growth (its peak
resident memory over what it held after imports). Prints one table.

    python bench/plan_vs_real.py                      # smollm2-135m shape, SFT and DPO, 2,048-token micro-batches
    python bench/plan_vs_real.py --preset=tiny        # seconds: a check that it runs
"""
import multiprocessing as mp
import os
import resource
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import plan  # noqa: E402

GIB = 2 ** 30
RUNS = {  # script -> its arguments: one 2,048-token micro-batch a step, two a step
    "train_sft.py": ["--max_len=2048", "--microbatch_tokens=2048", "--batch_size=2"],
    "train_dpo.py": ["--max_len=1024", "--microbatch_tokens=2048", "--batch_size=2", "--reference=live"],
}


def real_step(script, args, out):
    """In a fresh process: the step on real tensors -> (tracker's peak bytes, RSS growth bytes)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB, on Linux
    r = plan.plan_step(script, args, device="cpu", fake=False)
    out.put((sum(r["by_category"].values()), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024))


def main(preset="smollm2-135m"):
    rows = []
    for script, extra in RUNS.items():
        args = ["--init_from=scratch", f"--preset={preset}", *extra]
        t0 = time.perf_counter()
        fake = plan.plan_step(script, args, device="cpu")
        planned, plan_s = sum(fake["by_category"].values()), time.perf_counter() - t0
        out = mp.get_context("fork").Queue()
        child = mp.get_context("fork").Process(target=real_step, args=(script, args, out))
        t0 = time.perf_counter()
        child.start()
        tracked, rss = out.get()
        child.join()
        rows.append((script, planned, tracked, rss, fake["phase"], plan_s, time.perf_counter() - t0))
    print(f"| {preset} | plan GiB (phase) | real, tracker GiB | plan / tracker | real, RSS growth GiB | plan / RSS | "
          f"plan s | real s |")
    print("|---|---|---|---|---|---|---|---|")
    for script, planned, tracked, rss, phase, plan_s, real_s in rows:
        print(f"| {script} | {planned / GIB:.3f} ({phase}) | {tracked / GIB:.3f} | {planned / tracked:.3f} | "
              f"{rss / GIB:.3f} | {planned / rss:.3f} | {plan_s:.1f} | {real_s:.1f} |")


if __name__ == "__main__":
    main(*[a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--preset=")])
