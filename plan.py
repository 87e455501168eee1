r"""
Will this run fit? Runs a training script's own step on fake tensors (fake_step.py) and reports the
peak memory of one GPU by category, the phase of the peak, whether it fits, and the largest
microbatch_tokens that does.

    python plan.py train_sft.py config/sft_llama3.1_8b_fsdp.py --gpus=8 --gpu_memory=80 \
        [--json=plan.json]
    python plan.py train_dpo.py --init_from=scratch --preset=llama-3.1-8b --lora_rank=16 \
        --quantize_base=nf4
    python plan.py train_rl.py --init_from=/models/Qwen3-1.7B --gpus=8 --k=8 --prompts_per_step=64
    # a CPU run: no allowance, float32 as the script runs
    python plan.py train_sft.py --preset=tiny --device=cpu

plan.py's own keys: --gpus (the world size planned, default 1), --gpu_memory (GiB per GPU, default
80), --json (write the figures there), --device ('cuda', default: a GPU run, bfloat16; 'cpu': the
script's CPU run). Every other --key=value and config file is the script's own
(`python plan.py train_sft.py --help` lists them); the planned run's own printed lines are shown
only where the plan fails. The CUDA context, NCCL's buffers and the caching allocator's
fragmentation hold no tensors: on a GPU they are one stated allowance (ALLOWANCE_GIB,
FRAGMENTATION).
"""
import io
import json
import math
import os
import runpy
import sys
import time
from contextlib import redirect_stdout
from unittest import mock

from nanopack import plan_search
from nanopack.fake_reuse import Reuse
from nanopack.fake_step import config_keys, plan_step

GIB = 2 ** 30
# Memory no tensor holds, on a GPU: the CUDA context with its kernels and NCCL's communicators and
# buffers (1 GiB together), and the caching allocator's fragmentation and cached blocks (8% of the
# tensors' peak; one H100 run measured 6.1%: bench/RESULTS.md). Orders of magnitude: measure on the
# GPU that will run the job to replace them.
ALLOWANCE_GIB, FRAGMENTATION = 1.0, 0.08
PLAN_KEYS = dict(gpus=1, gpu_memory=80.0, json="", device="cuda")


def figures(script, args, gpus, gpu_memory, device, reuse=None):
    """One plan -> the figures of --json (allowance added for a GPU). reuse: the models of the
    plans before it, which differed only in microbatch_tokens."""
    # the planned run's own lines (1000000000 iterations, a loss of 1) are no part of the plan;
    # where the plan fails they are shown, ahead of its error
    with redirect_stdout(io.StringIO()) as run_output:
        try:
            r = plan_step(script, args, gpus, device, reuse=reuse)
        except (Exception, SystemExit):
            sys.stderr.write(run_output.getvalue())
            raise
    by = {k: v / GIB for k, v in r["by_category"].items()}
    if device == "cuda":
        by["allowance"] = ALLOWANCE_GIB + FRAGMENTATION * sum(by.values())
    peak, cp = sum(by.values()), r["config"].get("context_parallel", 1)
    # each phase's peak with the same allowance
    scale, extra = (1 + FRAGMENTATION, ALLOWANCE_GIB) if device == "cuda" else (1.0, 0.0)
    phases = {k: v / GIB * scale + extra for k, v in r["phase_peaks"].items()}
    return dict(world_size=gpus, gpu_memory_gib=gpu_memory, peak_gib=peak, peak_phase=r["phase"],
                phase_peaks_gib=phases,
                fits=peak <= gpu_memory, by_category_gib=by,
                tokens_per_step=int(r["tokens"]) * gpus,
                flops_per_step=r["flops"] * gpus,
                microbatch_tokens=r["config"]["microbatch_tokens"],
                whole_step_tokens=r["whole_step_tokens"],
                # the search's stairs, on the budget's scale (a CP group's tokens over its ranks)
                filled_tokens=r["filled"] / cp, unit_tokens=r["unit"] / cp,
                later_tokens=r["later"] / cp,
                least_microbatch_tokens=-(-r["longest_unit"] // cp))


def max_microbatch_tokens(script, args, gpus, gpu_memory, device, first, step=256,
                          search=plan_search.fit_and_confirm, reuse=None):
    """-> (the largest multiple of `step` tokens whose plan fits (0: none), False), or (the budget
    from which a rank's whole step is one micro-batch, True) where that fits: any larger plans
    alike; and the seconds of each plan it made. Never a budget under the longest example's (its
    run stops at load; absent data: a max_len example's). search: fit_and_confirm (a line through
    two plans, its prediction confirmed by two more) or bisection (nanopack/plan_search.py). reuse:
    the model its plans share (nanopack/fake_reuse.py)."""
    seconds = []

    def plan_at(n):
        progress(f"plan: microbatch_tokens={n * step:,}?")
        t0 = time.perf_counter()
        f = figures(script, [*args, f"--microbatch_tokens={n * step}"], gpus, gpu_memory, device,
                    reuse)
        seconds.append(time.perf_counter() - t0)
        return f
    floor = max(1, -(-first["least_microbatch_tokens"] // step))
    n0 = max(floor, first["microbatch_tokens"] // step)
    # the first plan stands for n0 where its budget is n0's (or under it, holding the same step)
    on_grid = n0 * step == first["microbatch_tokens"] or (n0 * step < first["microbatch_tokens"]
                                                          and first["fits"])
    bracket = plan_search.Bracket(plan_at, floor, step, n0, first if on_grid else plan_at(n0))
    return (*search(bracket, gpu_memory), seconds)


def progress(line):
    print(line, file=sys.stderr, flush=True)


def table(f, seconds):
    state = sum(f["by_category_gib"][k] for k in ("parameters", "gradients", "optimizer"))
    most, least = f["max_microbatch_tokens"], f["least_microbatch_tokens"]
    # absent data: its sequences only as long as the budget
    planned = f"planned at {f['microbatch_tokens']:,}" + (
        f", under the {least:,} a max_len example needs" if f["microbatch_tokens"] < least else "")
    largest = f"largest microbatch_tokens that fits: {most:,} ({planned})"
    if f["any_larger_fits"]:
        largest = (f"largest microbatch_tokens that fits: {most:,} or any larger ({planned}): from "
                   f"{most:,} on a rank's whole step is one micro-batch")
    elif not most and state + f["by_category_gib"].get("allowance", 0) >= f["gpu_memory_gib"]:
        largest += (f": none, the parameters, gradients and optimizer state alone take {state:.2f} "
                    "GiB a GPU (FSDP2 shards them over more GPUs; LoRA trains adapters only)")
    elif not most:
        largest += (": none at a budget that holds the longest example "
                    f"({f['least_microbatch_tokens']:,} tokens a micro-batch); a shorter "
                    "--max_len, --context_parallel over GPUs, activation_checkpointing or LoRA "
                    "hold less")
    rows = [f"{'category':<12} {'GiB':>8}"] + [f"{k:<12} {v:8.2f}"
                                               for k, v in f["by_category_gib"].items()]
    rows += [f"{'peak':<12} {f['peak_gib']:8.2f}  in {f['peak_phase']}, of {f['gpu_memory_gib']:g} "
             f"GiB: {'fits' if f['fits'] else 'does NOT fit'}", largest,
             *(["generation's KV cache grows with prompts_per_step / GPUs x k x (prompt + "
                "max_new_tokens), not with microbatch_tokens"] if f["peak_phase"] == "generation"
               else []),
             f"per step: {f['tokens_per_step']:,} tokens, {f['flops_per_step']:.3e} model FLOPs | "
             f"world size {f['world_size']} | planned in {seconds:.1f}s",
             f"{len(f['plan_seconds'])} fake steps (the plan and its search) of "
             f"{', '.join(f'{s:.1f}' for s in f['plan_seconds'])} s"]
    return "\n".join(rows)


def options(argv):
    """-> (script, plan.py's options, the script's arguments), each option checked before a plan
    starts."""
    if {"-h", "--help"} & set(argv):
        print(__doc__.strip())
        # and the script's keys
        if argv[0].endswith(".py") and os.path.isfile(argv[0]) and config_keys(argv[0]):
            print()
            with mock.patch.object(sys, "argv", [argv[0], "--help"]):
                # its configure prints them and exits 0
                runpy.run_path(argv[0], run_name="__main__")
        raise SystemExit(0)
    if not argv or not argv[0].endswith(".py") or not os.path.isfile(argv[0]):
        raise SystemExit("usage: python plan.py train_sft.py [config.py] [--gpus=8] "
                         "[--gpu_memory=80] [--json=plan.json] [--device=cuda|cpu] [--key=value "
                         "...]; --help tells more")
    script, opts, args = argv[0], dict(PLAN_KEYS), []
    keys = config_keys(script)
    for a in argv[1:]:
        key, eq, value = a[2:].partition("=")
        if not a.startswith("--") or key not in PLAN_KEYS:
            if a.startswith("--") and key not in keys:
                raise SystemExit(f"config error: argument {a!r}: unknown key {key!r}; plan.py's "
                                 f"own are --{', --'.join(PLAN_KEYS)}, and `python {script} "
                                 "--help` lists the script's")
            args.append(a)
            continue
        need = option_error(key, value) if eq else f"write it --{key}=value"
        if need:
            raise SystemExit(f"config error: argument {a!r}: {need}")
        opts[key] = type(PLAN_KEYS[key])(value)
    return script, opts, args


def option_error(key, value):
    """What is wrong with plan.py's own --key=value ('': nothing)."""
    if key == "gpus":
        if value.isdigit() and int(value) >= 1:
            return ""
        return "the number of GPUs planned, a whole number, at least 1"
    if key == "gpu_memory":
        try:
            if 0 < float(value) < math.inf:
                return ""
            return "GiB per GPU, a number above 0 (80 for an H100)"
        except ValueError:
            return "GiB per GPU, a number above 0 (80 for an H100)"
    if key == "device":
        if value in ("cuda", "cpu"):
            return ""
        return "'cuda' (a GPU run, bfloat16) or 'cpu' (the script's CPU run)"
    # --json: written after the plan, so checked before it
    folder = os.path.dirname(os.path.abspath(value))
    if not value or os.path.isdir(value):
        return "a file to write the figures to, such as plan.json"
    if not os.path.isdir(folder):
        return f"the folder {folder} does not exist; create it, or write the figures elsewhere"
    return "" if os.access(folder, os.W_OK) else f"the folder {folder} cannot be written"


def main(argv):
    t0 = time.perf_counter()
    script, opts, args = options(argv)
    plan_args = (script, args, opts["gpus"], opts["gpu_memory"], opts["device"])
    progress(f"plan: {script} on {opts['gpus']} x {opts['gpu_memory']:g} GiB ({opts['device']}), "
             "two steps on fake tensors")
    # the plan and its search differ only in microbatch_tokens: one model, built and sharded once
    with Reuse() as reuse:
        f = figures(*plan_args, reuse)
        first_s = time.perf_counter() - t0
        f["max_microbatch_tokens"], f["any_larger_fits"], searched = max_microbatch_tokens(
            *plan_args, f, reuse=reuse)
    f["plan_seconds"] = [round(s, 1) for s in [first_s, *searched]]
    f["seconds"] = time.perf_counter() - t0
    print(table(f, f["seconds"]))
    if opts["json"]:
        with open(opts["json"], "w") as out:
            keys = ("world_size", "gpu_memory_gib", "peak_gib", "peak_phase", "fits",
                    "max_microbatch_tokens", "any_larger_fits", "by_category_gib",
                    "tokens_per_step", "flops_per_step", "seconds", "plan_seconds")
            json.dump({k: f[k] for k in keys}, out, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
