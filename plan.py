"""
Will this run fit? Runs a training script's own step on fake tensors (fake_step.py) and reports the peak memory of one
GPU by category, the phase of the peak, whether it fits, and the largest microbatch_tokens that does.

    python plan.py train_sft.py config/sft_llama3.1_8b_fsdp.py --gpus=8 --gpu_memory=80 [--json=plan.json]
    python plan.py train_dpo.py --preset=llama-3.1-8b --gpus=1 --lora_rank=16 --quantize_base=nf4
    python plan.py train_rl.py --init_from=/models/Qwen3-1.7B --gpus=8 --k=8 --prompts_per_step=64
    python plan.py train_sft.py --preset=tiny --device=cpu     # a CPU run: no allowance, float32 as the script runs

plan.py's own keys: --gpus (the world size planned, default 1), --gpu_memory (GiB per GPU, default 80), --json (write
the figures there), --device ('cuda', default: a GPU run, bfloat16; 'cpu': the script's CPU run). Every other
--key=value and config file is the script's own. The CUDA context, NCCL's buffers and the caching allocator's
fragmentation hold no tensors: on a GPU they are one stated allowance (ALLOWANCE_GIB, FRAGMENTATION).
"""
import json
import os
import sys
import time
from contextlib import redirect_stdout

from fake_step import plan_step

GIB = 2 ** 30
# Memory no tensor holds, on a GPU: the CUDA context with its kernels and NCCL's communicators and buffers (1 GiB
# together), and the caching allocator's fragmentation and cached blocks (8% of the tensors' peak; one H100 run
# measured 6.1%: bench/RESULTS.md). Orders of magnitude: measure on the GPU that will run the job to replace them.
ALLOWANCE_GIB, FRAGMENTATION = 1.0, 0.08
PLAN_KEYS = dict(gpus=1, gpu_memory=80.0, json="", device="cuda")


def figures(script, args, gpus, gpu_memory, device):
    """One plan -> the figures of --json (allowance added for a GPU)."""
    r = plan_step(script, args, gpus, device)
    by = {k: v / GIB for k, v in r["by_category"].items()}
    if device == "cuda":
        by["allowance"] = ALLOWANCE_GIB + FRAGMENTATION * sum(by.values())
    peak = sum(by.values())
    return dict(world_size=gpus, gpu_memory_gib=gpu_memory, peak_gib=peak, peak_phase=r["phase"],
                fits=peak <= gpu_memory, by_category_gib=by, tokens_per_step=int(r["tokens"]) * gpus,
                flops_per_step=r["flops"] * gpus, microbatch_tokens=r["config"]["microbatch_tokens"])


def max_microbatch_tokens(script, args, gpus, gpu_memory, device, first, step=256):
    """The largest multiple of `step` tokens whose plan fits (0: none). The peak grows about linearly with the budget,
    so the line through the last two plans guesses where it crosses gpu_memory; each guess narrows [fits, does not fit]
    to one step: 3-5 plans on a line, bisection's count on a staircase (whole sequences a micro-batch). Twice the
    budget at the same peak is a rank's whole step: larger budgets change nothing; the search stops (the smaller)."""
    def plan_at(n):
        progress(f"plan: microbatch_tokens={n * step:,}?")
        f = figures(script, [*args, f"--microbatch_tokens={n * step}"], gpus, gpu_memory, device)
        return f["peak_gib"], f["fits"]
    n0 = max(1, first["microbatch_tokens"] // step)
    lo, hi = (n0, None) if first["fits"] else (0, n0)
    peaks, sides, plateau = {n0: first["peak_gib"]}, [], False  # budget (in steps) -> its peak; each guess fit?
    while hi is None or hi - lo > 1:
        (na, pa), (nb, pb) = sorted(peaks.items())[-2:] if len(peaks) > 1 else ((None, None), (None, None))
        if hi is None and na and pb == pa and nb >= 2 * na:  # twice the budget, one peak: the same micro-batches,
            first["search_capped"] = True  # the step's whole share: the smaller of the two
            return na * step
        if hi is None:  # grow: where the line through the two largest crosses, at least doubling the last gain
            line = int(nb + (gpu_memory - pb) * (nb - na) / (pb - pa)) if na and pb > pa else 0
            guess = max(line, 2 * lo - (na if sides[-1:] == [True] and na else 0), lo + 1)
        elif lo in peaks and peaks[hi] > peaks[lo] and not plateau and sides[-2:] not in ([True, True], [False, False]):
            guess = lo + int((gpu_memory - peaks[lo]) * (hi - lo) / (peaks[hi] - peaks[lo]))  # the bracket's line
        else:  # bisection: no line yet, or it missed (a staircase: whole sequences per micro-batch)
            guess = (lo + hi) // 2
        guess = max(lo + 1, guess if hi is None else min(guess, hi - 1))
        peaks[guess], fits = plan_at(guess)
        plateau = fits and peaks[guess] == peaks.get(lo)  # the line fell short on lo's stair: it cannot see its end
        sides.append(fits)
        lo, hi = (guess, hi) if fits else (lo, guess)
    return lo * step


def progress(line):
    print(line, file=sys.stderr, flush=True)


def table(f, seconds):
    state = sum(f["by_category_gib"][k] for k in ("parameters", "gradients", "optimizer"))
    rows = [f"{'category':<12} {'GiB':>8}"] + [f"{k:<12} {v:8.2f}" for k, v in f["by_category_gib"].items()]
    rows += [f"{'peak':<12} {f['peak_gib']:8.2f}  in {f['peak_phase']}, of {f['gpu_memory_gib']:g} GiB: "
             f"{'fits' if f['fits'] else 'does NOT fit'}",
             f"largest microbatch_tokens that fits: {f['max_microbatch_tokens']:,} (planned at "
             f"{f['microbatch_tokens']:,})" + (" or any larger: from there on a rank's whole step is one micro-batch"
                                                if f.get("search_capped") else "") + (
                 f": none, the parameters, gradients and optimizer state alone take {state:.2f} GiB a GPU (FSDP2 "
                 f"shards them over more GPUs; LoRA trains adapters only)" if not f["max_microbatch_tokens"] else ""),
             *(["generation's KV cache grows with prompts_per_step / GPUs x k x (prompt + max_new_tokens), not with "
                "microbatch_tokens"] if f["peak_phase"] == "generation" else []),
             f"per step: {f['tokens_per_step']:,} tokens, {f['flops_per_step']:.3e} model FLOPs | "
             f"world size {f['world_size']} | planned in {seconds:.1f}s"]
    return "\n".join(rows)


def main(argv):
    if not argv or not argv[0].endswith(".py") or not os.path.isfile(argv[0]):
        raise SystemExit("usage: python plan.py train_sft.py [config.py] [--gpus=8] [--gpu_memory=80] "
                         "[--json=plan.json] [--device=cuda|cpu] [--key=value ...]")
    t0, opts, args = time.perf_counter(), dict(PLAN_KEYS), []
    for a in argv[1:]:
        key, _, value = a[2:].partition("=")
        if a.startswith("--") and key in PLAN_KEYS:
            opts[key] = type(PLAN_KEYS[key])(value)
        else:
            args.append(a)
    if opts["device"] not in ("cuda", "cpu") or opts["gpus"] < 1:
        raise SystemExit(f"plan: --device={opts['device']!r} --gpus={opts['gpus']}; device is 'cuda' or 'cpu', "
                         f"gpus at least 1")
    script, plan_args = argv[0], (argv[0], args, opts["gpus"], opts["gpu_memory"], opts["device"])
    progress(f"plan: {script} on {opts['gpus']} x {opts['gpu_memory']:g} GiB ({opts['device']}), two steps on fake "
             f"tensors")
    with redirect_stdout(sys.stderr):  # the script's own lines are progress; stdout is the table
        f = figures(*plan_args)
        f["max_microbatch_tokens"] = max_microbatch_tokens(*plan_args, f)
    f["seconds"] = time.perf_counter() - t0
    print(table(f, f["seconds"]))
    if opts["json"]:
        with open(opts["json"], "w") as out:
            json.dump({k: f[k] for k in ("world_size", "gpu_memory_gib", "peak_gib", "peak_phase", "fits",
                                         "max_microbatch_tokens", "by_category_gib", "tokens_per_step",
                                         "flops_per_step", "seconds")}, out, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
