"""
Memory and step time of full fine-tuning vs LoRA vs QLoRA on the same model, side by side in one run. Each row runs
in its own process (peak RSS is per row): random weights of a preset's shape, one packed micro-batch of --tokens
tokens, AdamW, float32 on the CPU (bf16 autocast on CUDA).

  weights    bytes of every parameter as stored (an NF4 weight: its 4-bit codes and scales)
  grads      bytes of the gradients after backward (only what trains has one)
  optimizer  bytes of AdamW's state after a step
  peak       peak RSS of the process (CPU) or max allocated (CUDA), GiB

    python bench/bench_lora.py --shapes smollm2-135m,qwen2.5-0.5b --tokens 512 --steps 3
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODES = {"full": {}, "lora r=16": dict(rank=16), "qlora r=16": dict(rank=16, quantize=True)}


def nbytes(t):
    """Bytes a tensor holds; a tensor subclass (NF4) is summed over its inner tensors."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(nbytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def measure(shape, mode, tokens, steps):
    import resource

    import torch

    from nanopack import lora
    from model import Transformer, config_from_preset
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):  # initialised where it trains: a 1B model's random init takes seconds on the CPU
        model = Transformer(config_from_preset(shape))
    opts = MODES[mode]
    if opts:
        lora.add_adapters(model, opts["rank"], 2 * opts["rank"])
        if opts.get("quantize"):
            lora.quantize_base(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (tokens,), device=device)
    cu = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    autocast = torch.autocast("cuda", torch.bfloat16) if device == "cuda" else torch.autocast("cpu", enabled=False)
    times = []
    for step in range(steps + 1):  # the first step is a warm-up
        t0 = time.perf_counter()
        with autocast:
            loss, n = model(ids, torch.arange(tokens, device=device), cu, tokens, targets=ids.roll(-1))
        (loss / n).backward()
        grads = sum(nbytes(p.grad) for p in params)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    state = sum(nbytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    peak = (torch.cuda.max_memory_allocated() if device == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return dict(trained=sum(p.numel() for p in params), weights=sum(nbytes(p) for p in model.parameters()),
                grads=grads, optimizer=state, peak=peak, step_s=sum(times[1:]) / steps, loss=(loss / n).item())


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="smollm2-135m,qwen2.5-0.5b", help="model.PRESETS names, comma-separated")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: shape/mode of a single row, JSON out
    args = ap.parse_args()
    if args.one:
        shape, mode = args.one.split("/")
        print(json.dumps(measure(shape, mode, args.tokens, args.steps)))
        sys.exit()
    gib = lambda b: f"{b / 2**30:.2f}"
    print(f"{args.tokens} tokens per step, {args.steps} timed steps (+1 warm-up), one process per row")
    print("| shape | mode | trained params | weights GiB | grads GiB | optimizer GiB | peak GiB | step s | loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        for mode in MODES:
            out = subprocess.run([sys.executable, __file__, f"--one={shape}/{mode}", f"--tokens={args.tokens}",
                                  f"--steps={args.steps}"], capture_output=True, text=True)
            if out.returncode:
                print(f"| {shape} | {mode} | failed: {(out.stderr.strip().splitlines() or ['(no message)'])[-1]} |")
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"| {shape} | {mode} | {r['trained'] / 1e6:.1f}M | {gib(r['weights'])} | {gib(r['grads'])} | "
                  f"{gib(r['optimizer'])} | {gib(r['peak'])} | {r['step_s']:.2f} | {r['loss']:.3f} |", flush=True)
