"""
The LM-head end of a distilled micro-batch, forward and backward: what the student's head costs alone (SFT's chunked
cross-entropy), with a teacher through kernels.chunked_distill (both heads chunk by chunk), and with both models'
full (T, V) logits and an eager generalized JSD (what a loss written on logits materialises).

    python bench/bench_distill.py                          # T=2048, d=64, V=128256 (Llama-3 vocab)
    python bench/bench_distill.py --T 256 --V 1000         # seconds

Each row runs in a fresh subprocess so its peak is its own: CUDA max_memory_allocated, or on CPU the peak resident set
(ru_maxrss) less the process's before the inputs were made; a small hidden size d keeps the trunk out of the figure.
"""
import argparse
import json
import os
import resource
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_lm_head import measure  # noqa: E402  (beside this file)
METHODS = ("student alone (chunked CE)", "with teacher (chunked JSD)", "with teacher (full logits)")


def full_logits_loss(h, w, h_t, w_t, targets, V, beta, temperature):
    """Both models' (T, V) logits, then 0.5 NLL + 0.5 generalized JSD by autograd."""
    import torch
    keep = targets != -100
    z, zt = (h[keep] @ w.t())[:, :V].float(), (h_t[keep] @ w_t.t()).float()
    nll = torch.nn.functional.cross_entropy(z, targets[keep], reduction="sum")
    s, t = torch.log_softmax(z / temperature, -1), torch.log_softmax(zt / temperature, -1)
    m = torch.logaddexp(s + torch.log1p(torch.tensor(-beta)), t + torch.log(torch.tensor(beta)))
    jsd = beta * (t.exp() * (t - m)).sum() + (1 - beta) * (s.exp() * (s - m)).sum()
    return 0.5 * nll + 0.5 * jsd


def run_one(method, T, d, V, device, iters):
    import torch
    from nanopack import kernels
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    torch.manual_seed(0)
    h = (torch.randn(T, d, device=device) * 0.5).requires_grad_(True)
    w = (torch.randn(V, d, device=device) * 0.02).requires_grad_(True)
    h_t, w_t = torch.randn(T, d, device=device) * 0.5, torch.randn(V, d, device=device) * 0.02
    targets = torch.randint(0, V, (T,), device=device)
    targets[:T // 8] = -100

    def step():
        if method == METHODS[0]:
            loss = kernels.chunked_cross_entropy(h, w, targets, V)[0]
        elif method == METHODS[1]:
            loss = kernels.chunked_distill(h, w, targets, V, h_t, w_t, 0.5, 1.0, 0.5)[0]
        else:
            loss = full_logits_loss(h, w, h_t, w_t, targets, V, 0.5, 1.0)
        loss.backward()
        h.grad = w.grad = None
        return loss.detach()

    return measure(step, device, iters, rss0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--T", type=int, default=2048)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--V", type=int, default=128256)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.child:
        res = run_one(METHODS[int(args.child)], args.T, args.d, args.V, device, args.iters)
        print("RESULT " + json.dumps(res))
        return
    name = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    print(f"device: {name}, float32, T={args.T} (1/8 ignored), d={args.d}, V={args.V}, fwd+bwd, median of "
          f"{args.iters}")
    print("| LM head | peak GiB | ms | loss |")
    print("|---|---|---|---|")
    for i, method in enumerate(METHODS):
        cmd = [sys.executable, __file__, "--child", str(i), "--T", str(args.T), "--d", str(args.d), "--V",
               str(args.V), "--iters", str(args.iters)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if not line:
            print(f"| {method} | crashed (exit {out.returncode}) | - | - |")
            continue
        r = json.loads(line[-1][7:])
        print(f"| {method} | {r['peak_gib']:.2f} | {r['ms']:.0f} | {r['loss']:.4f} |")


if __name__ == "__main__":
    main()
