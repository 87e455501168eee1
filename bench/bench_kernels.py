"""
The kernels one by one (made for CUDA; runs on CPU at small sizes so it cannot rot):

  1. RoPE: the fused Q+K Triton kernel vs the eager reference, microseconds per call (fwd) and max abs diff,
     for sequence lengths 512..16k, one sequence and packed (many short sequences, positions restarting).
  2. Attention backends available here (flash-attn if installed, torch varlen_attn, the per-sequence SDPA
     fallback), forward + backward TFLOP/s on a packed batch, head dim 64 and 128.
  3. LM head + loss: full logits vs the chunked loss (time and peak memory): see bench_lm_head.py.

    python bench/bench_kernels.py                 # CUDA sizes
    python bench/bench_kernels.py --small         # seconds; what the smoke test runs (CPU ok)
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def timed(fn, iters, cuda):
    fn()  # warm-up: compilation, autotuning, allocator
    if cuda:
        import torch
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def packed_lengths(T, packed):
    """One sequence of T tokens, or T tokens of sequences 128..2048 long (a packed chat batch)."""
    if not packed:
        return [T]
    lens, i = [], 0
    while sum(lens) < T:
        lens.append(min(128 * (1 + (i * 7) % 16), T - sum(lens)))
        i += 1
    return lens


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--small", action="store_true")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()

    import torch
    from nanopack import kernels
    import model as M

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    iters = 2 if args.small else args.iters
    Ts = [256, 1024] if args.small else [512, 2048, 8192, 16384]
    dev = torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} cores)"
    print(f"device {dev} | torch {torch.__version__} | {dtype} | attention backend here: "
          f"{M.attention_backend(torch.device(device), dtype)}")

    # 1. RoPE
    cfg = M.config_from_preset("llama-3.2-1b", max_seq_len=max(Ts))
    cos, sin = M.rope_tables(cfg, torch.device(device))
    fused_ok = kernels.HAS_TRITON and (cuda or os.environ.get("TRITON_INTERPRET") == "1")
    print("\n| RoPE: T | layout | eager µs | fused µs | speed-up | max abs diff |")
    print("|---|---|---|---|---|---|")
    for T in Ts:
        for packed in (False, True):
            lens = packed_lengths(T, packed)
            pos = torch.cat([torch.arange(n, device=device) for n in lens])
            q = torch.randn(T, cfg.n_head, cfg.head_dim, device=device, dtype=dtype)
            k = torch.randn(T, cfg.n_kv_head, cfg.head_dim, device=device, dtype=dtype)
            eager = timed(lambda: M.rope_reference(q, k, cos, sin, pos), iters, cuda)
            if fused_ok:
                fused = timed(lambda: kernels.rope_fused(q, k, cos, sin, pos), iters, cuda)
                diff = max((a.float() - b.float()).abs().max().item() for a, b in
                           zip(kernels.rope_fused(q, k, cos, sin, pos), M.rope_reference(q, k, cos, sin, pos)))
                cells = f"{1e6 * fused:.0f} | {eager / fused:.1f}x | {diff:.1e}"
            else:
                cells = "- | - | - (Triton runs on CUDA, or on CPU under TRITON_INTERPRET=1)"
            layout = f"packed ({len(lens)} seqs)" if packed else "1 sequence"
            print(f"| {T} | {layout} | {1e6 * eager:.0f} | {cells} |")

    # 2. attention backends
    backends = ["sdpa"] + (["torch_varlen", "flash_attn"] if cuda else [])
    print("\n| attention: backend | head dim | T (packed) | fwd+bwd ms | TFLOP/s |")
    print("|---|---|---|---|---|")
    for D in (64, 128):
        H, Hkv = 2048 // D, 8
        for T in Ts:
            lens = packed_lengths(T, True)
            cu = torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)
            q = torch.randn(T, H, D, device=device, dtype=dtype, requires_grad=True)
            k = torch.randn(T, Hkv, D, device=device, dtype=dtype, requires_grad=True)
            v = torch.randn(T, Hkv, D, device=device, dtype=dtype, requires_grad=True)
            flops = 3 * 2 * H * D * sum(n * n for n in lens)  # causal: half of 4*L^2*H*D fwd, x3 fwd+bwd
            for name in backends:
                saved = dict(M._ATTN_BACKEND)
                M._ATTN_BACKEND[device] = name
                try:
                    step = lambda: M.varlen_attention(q, k, v, cu, max(lens)).sum().backward()
                    t = timed(step, iters, cuda)
                    print(f"| {name} | {D} | {T} ({len(lens)} seqs) | {1e3 * t:.2f} | {flops / t / 1e12:.2f} |")
                except Exception as e:  # a backend not installed here (flash-attn) or not built for this GPU
                    print(f"| {name} | {D} | {T} | unavailable: {str(e)[:60]} | |")
                finally:
                    M._ATTN_BACKEND.clear()
                    M._ATTN_BACKEND.update(saved)
    print("\nLM head chunked vs full: python bench/bench_lm_head.py (separate processes for honest peak memory)")


if __name__ == "__main__":
    main()
