"""The machine a GPU session runs on, and what it cannot run: versions, the GPU, the attention backend model.py picks,
each optional package present or not (and the steps of bench/gpu_session.sh a missing one leaves out), NF4 on the GPU.

    python bench/gpu_env.py
"""
import importlib
import inspect
import os
import platform
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NEEDED_BY = {  # package -> what of bench/gpu_session.sh cannot run without it
    "torch": "no step can run", "numpy": "no step can run", "pytest": "step 1's CUDA tests cannot run",
    "triton": "no fused RoPE kernel: step 1's RoPE test fails, every run uses eager RoPE",
    "transformers": "step 4's hf and TRL rows cannot run", "tokenizers": "the TRL rows cannot run",
    "trl": "step 4's TRL DPOTrainer row cannot run", "datasets": "step 4's TRL row cannot run (trl needs it)",
    "accelerate": "step 4's TRL row cannot run (trl needs it)", "peft": "nothing in the session needs it",
    "torchao": "step 6's QLoRA rows cannot run (NF4)", "flash_attn": "optional: model.py uses torch's varlen_attn",
}


def main():
    import torch
    print(f"python {platform.python_version()} | torch {torch.__version__} | CUDA {torch.version.cuda} | "
          f"{platform.machine()}, {os.cpu_count()} CPU cores")
    for name, needed_by in NEEDED_BY.items():
        try:
            module = importlib.import_module(name)
            print(f"  {name} {getattr(module, '__version__', '?')} (from {os.path.dirname(module.__file__)})")
        except Exception as e:  # a wheel built for another torch fails with other errors than ImportError
            print(f"  MISSING {name} ({type(e).__name__}: {str(e)[:100]}): {needed_by}")
    import model
    if not torch.cuda.is_available():
        print("skipped: no CUDA (the GPU, its attention backend, NF4 on the GPU)")
        return
    props = torch.cuda.get_device_properties(0)
    print(f"GPU {props.name}, {props.total_memory / 2**30:.1f} GiB, {props.multi_processor_count} SMs, capability "
          f"{props.major}.{props.minor}")
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm", "--format=csv,noheader"],
                             capture_output=True, text=True)
        print(f"nvidia-smi: driver, max SM clock: {smi.stdout.strip() or smi.stderr.strip()[:100]}")
    if model.varlen_attn is not None:
        print(f"torch varlen_attn{inspect.signature(model.varlen_attn)}")
    print(f"attention backend for bf16 on cuda: {model.attention_backend(torch.device('cuda'), torch.bfloat16)}")
    try:  # QLoRA's path: NF4 codes on the GPU, dequantised in a matmul
        from torchao.quantization import to_nf4
        w = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
        err = (torch.nn.functional.linear(torch.eye(256, device="cuda", dtype=torch.bfloat16), to_nf4(w)) - w.T).abs()
        print(f"torchao NF4 on cuda: ok, max abs error {err.max().item():.3f} on N(0, 1) weights")
    except Exception as e:
        print(f"torchao NF4 on cuda FAILED: {type(e).__name__}: {str(e)[:200]}")


if __name__ == "__main__":
    main()
