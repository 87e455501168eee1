"""
LM head + cross-entropy, forward and backward: full logits (what F.linear + F.cross_entropy does) against
kernels.py's chunked loss, which never holds more than LOSS_CHUNK x vocab logits.

    python bench/bench_lm_head.py                          # T=16384, d=2048, V=128256 (Llama-3 vocab)
    python bench/bench_lm_head.py --T 512 --d 64 --V 1000  # seconds; what the smoke test runs

Each (method, T) runs in a fresh subprocess so its peak memory is its own: CUDA max_memory_allocated, or on
CPU the peak resident set (ru_maxrss) minus the process's resident set before the inputs were made. On CPU the
child gets an address-space limit (--mem_limit_gb), so a method that needs more memory fails with an
allocation error, reported as OOM, instead of waking the kernel's OOM killer.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_one(method, T, d, V, device, dtype, iters):
    import torch
    import torch.nn.functional as F
    from nanopack import kernels

    dt = getattr(torch, dtype)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB (ru_maxrss is KiB on Linux)
    torch.manual_seed(0)
    h = (torch.randn(T, d, device=device) * 0.5).to(dt).requires_grad_(True)
    w = (torch.randn(V, d, device=device) * 0.02).to(dt).requires_grad_(True)
    targets = torch.randint(0, V, (T,), device=device)
    targets[: T // 8] = -100  # a prompt's worth of ignored positions, as in SFT

    def step():
        if method == "full":
            logits = F.linear(h, w).float()  # (T, V): what a plain LM head + cross_entropy materialises
            loss = F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
        else:
            loss, _ = kernels.chunked_cross_entropy(h, w, targets, V)
        loss.backward()
        h.grad = w.grad = None
        return loss.detach()

    return measure(step, device, iters, rss0)


def measure(step, device, iters, rss0):
    """step() -> its loss; the peak memory of the first call and the median time of `iters` more -> dict(loss,
    peak_gib, ms). rss0: the process's peak RSS in GiB before the inputs were made (CPU)."""
    import torch
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    loss = step()  # warm-up (and the peak-memory measurement)
    if device == "cuda":
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if device != "cuda":
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20 - rss0
    return dict(loss=loss.item(), peak_gib=peak, ms=1000 * sorted(times)[len(times) // 2])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--T", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--d", type=int, default=2048)
    p.add_argument("--V", type=int, default=128256)
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--mem_limit_gb", type=float, default=20.0, help="CPU: address-space limit of each child")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()

    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    if args.child:  # inside a subprocess: run one configuration and print its result as JSON
        method, T = args.child.split(":")
        if device == "cpu":
            limit = int(args.mem_limit_gb * 2**30)
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        try:
            res = run_one(method, int(T), args.d, args.V, device, dtype, args.iters)
        except (RuntimeError, MemoryError) as e:  # CPU allocator failure or torch.OutOfMemoryError
            res = dict(error="OOM" if "memory" in str(e).lower() else str(e)[:80])
        print("RESULT " + json.dumps(res))
        return

    dev_name = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    print(f"device: {dev_name}, torch {torch.__version__}, dtype {dtype}, d={args.d}, V={args.V}, "
          f"1/8 of positions ignored, fwd+bwd, median of {args.iters}")
    rows = []
    for T in args.T:
        res = {}
        for method in ("full", "chunked"):
            cmd = [sys.executable, __file__, "--child", f"{method}:{T}", "--d", str(args.d), "--V", str(args.V),
                   "--dtype", dtype, "--iters", str(args.iters), "--mem_limit_gb", str(args.mem_limit_gb)]
            out = subprocess.run(cmd, capture_output=True, text=True)
            line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
            res[method] = json.loads(line[-1][7:]) if line else dict(error=f"crashed (exit {out.returncode})")
        rows.append((T, res))

    def cell(r, key, fmt):
        return r["error"] if "error" in r else format(r[key], fmt)

    mem_name = "peak GiB (CUDA alloc)" if device == "cuda" else "peak GiB (RSS)"
    header = f"| T | full: {mem_name} | chunked: {mem_name} | memory ratio | full ms | chunked ms | loss rel. diff |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for T, r in rows:
        f, c = r["full"], r["chunked"]
        ok = "error" not in f and "error" not in c
        ratio = f"{f['peak_gib'] / c['peak_gib']:.1f}x" if ok else "-"
        diff = f"{abs(f['loss'] - c['loss']) / abs(f['loss']):.1e}" if ok else "-"
        limit = f" (limit {args.mem_limit_gb:g} GiB)" if device == "cpu" and "error" in f else ""
        print(f"| {T} | {cell(f, 'peak_gib', '.2f')}{limit} | {cell(c, 'peak_gib', '.2f')} | {ratio} | "
              f"{cell(f, 'ms', '.0f')} | {cell(c, 'ms', '.0f')} | {diff} |")


if __name__ == "__main__":
    main()
