"""Honest numbers for the log: metrics.jsonl (and wandb), tokens/s, MFU and padding from each
micro-batch's real tokens and sequence lengths, peak memory, time."""
import json
import os
import resource
import time

import numpy as np
import torch
from torch._dynamo.utils import counters

from nanopack.parallel import all_reduce_sum, fail, is_master, stop_signal

# dense bf16 tensor-core peak, FLOP/s, from the vendors' datasheets; an unknown device gets no MFU
# at all
PEAK_BF16_FLOPS = [("H200", 989e12), ("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989e12),
                   ("B200", 2250e12), ("A100", 312e12), ("L40S", 362e12), ("A10G", 70e12)]


def peak_flops(device):
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None)


class MetricsLogger:
    """One JSON object per line in out_dir/metrics.jsonl, and the same to wandb when asked (rank 0
    only). A line the disk refuses stops the run after its step with a checkpoint, as a SIGTERM
    does, and the file is written no more."""

    def __init__(self, out_dir, wandb_log=False, wandb_project="nanopack", run_name=None,
                 config=None,
                 resume_iter=None):
        """resume_iter: the checkpoint's step; rows past it (a killed run's) are dropped, so no step
        appears twice."""
        self.active = is_master()
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self.wandb = None
        if self.active:
            os.makedirs(out_dir, exist_ok=True)
            kept = []
            if resume_iter is not None and os.path.exists(self.path):
                with open(self.path, errors="replace") as f:
                    lines = f.readlines()
                for i, line in enumerate(lines, 1):
                    try:
                        row = json.loads(line) if line.strip() else {}
                    except ValueError as e:
                        if i < len(lines):
                            raise SystemExit(f"{self.path}:{i} is not a JSON line ({e}): fix or "
                                             "delete that line of the log, then resume "
                                             "again") from None
                        print(f"note: {self.path}:{i}, the last line, was cut short (a write that "
                              "did not finish, e.g. on a full disk): dropped", flush=True)
                        continue
                    if row and row.get("iter", 0) <= resume_iter:
                        # a last line cut just before its newline
                        kept.append(line.rstrip("\n") + "\n")
            # a run from hub names: their commits head its log
            if not kept and (config or {}).get("hub"):
                kept = [json.dumps(dict(iter=0, hub=config["hub"])) + "\n"]
            try:
                with open(self.path + ".tmp", "w") as f:
                    f.writelines(kept)
                os.replace(self.path + ".tmp", self.path)
            except OSError as e:  # a full disk: the log as it was, and no empty .tmp beside it
                if os.path.lexists(self.path + ".tmp"):
                    os.remove(self.path + ".tmp")
                fail(f"{e.strerror}: {self.path} cannot be written; free space there, then run the "
                     "same command again")
            if wandb_log:
                try:
                    # optional, so imported only when asked for; WANDB_MODE=offline needs no network
                    import wandb
                    self.wandb = wandb.init(project=wandb_project, name=run_name, config=config)
                except Exception as e:
                    # not installed, not logged in, no network: one line, before any training
                    raise SystemExit(f"wandb_log=True, but wandb cannot start ({type(e).__name__}: "
                                     f"{e}); `pip install wandb` and `wandb login`, or "
                                     "WANDB_MODE=offline") from None

    def log(self, metrics):
        if not self.active:
            return
        if self.path:
            try:
                with open(self.path, "a") as f:
                    f.write(json.dumps(metrics) + "\n")
            except OSError as e:
                stop_signal.request(f"{e.strerror}: {self.path} could not be written from iter "
                                    f"{metrics.get('iter')} on (those rows are missing)")
                print(f"{e.strerror}: {self.path} could not be written at iter "
                      f"{metrics.get('iter')}: stopping after the next step with a checkpoint",
                      flush=True)
                self.path = None
        if self.wandb is not None:
            self.wandb.log(metrics, step=metrics.get("iter"))

    def finish(self):
        if self.wandb is not None:
            self.wandb.finish()


class Throughput:
    """A log window's real tokens, padding, positions, FLOPs from the actual sequence lengths, and
    time waiting for data, counted on the host; read() sums them over ranks in one collective, with
    the script's own sums."""

    def __init__(self, model, device, world_size, flops_factor=1.0):
        self.model, self.device, self.world_size = model, device, world_size
        self.flops_factor = flops_factor  # e.g. 4/3 when a live reference model adds a forward pass
        self.peak = peak_flops(device)
        self.reset()

    def reset(self):
        self.tokens = self.padding = self.positions = self.flops = self.data_time = 0.0

    def count(self, microbatches, data_time):
        for mb in microbatches:
            if mb.num_tokens:
                # per query segment of real tokens (a CP slice: pieces of sequences)
                keys = mb.key_lengths()
                flops = self.model.flops_per_token(np.diff(mb.cu_seqlens.numpy())[:len(keys)],
                                                   mb.num_target_tokens,
                                                   keys)
                self.flops += self.flops_factor * flops * mb.num_tokens
            self.tokens += mb.num_tokens
            self.padding += mb.num_padding
            self.positions += mb.input_ids.numel()
        self.data_time += data_time

    def read(self, elapsed, n_steps, extra=()):
        """-> (metrics, the extra values summed over ranks); starts a new window."""
        *extra, tokens, padding, positions, flops, data_time = all_reduce_sum(
            list(extra) + [self.tokens, self.padding, self.positions, self.flops, self.data_time],
            self.device)
        self.reset()
        metrics = dict(
            tokens=tokens / n_steps, tokens_per_sec=tokens / elapsed,
            tokens_per_sec_per_gpu=tokens / elapsed / self.world_size,
            mfu=flops / elapsed / (self.peak * self.world_size) if self.peak else None,
            padding_fraction=padding / max(positions, 1),
            peak_mem_gb=(torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda"
                         # Linux: KiB
                         else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**30,
            data_time_frac=data_time / self.world_size / elapsed, time_ms=1000 * elapsed / n_steps,
            # recompiles show here: bounded, not one per step
            compiled_graphs=counters["stats"]["unique_graphs"])
        return metrics, extra

    @staticmethod
    def line(m):
        mfu = f"{100 * m['mfu']:.1f}%" if m["mfu"] is not None else "-"
        graphs = f" | {m['compiled_graphs']} graphs" if m["compiled_graphs"] else ""
        return (f"{m['tokens_per_sec_per_gpu']:,.0f} tok/s/gpu | mfu {mfu} | pad "
                f"{100 * m['padding_fraction']:.1f}% | {m['time_ms']:.0f} ms/it{graphs}")


class Timer:
    def __init__(self, device):
        self.device = device
        self.t0 = time.perf_counter()

    def lap(self):
        """Seconds since the last lap, with the GPU's queued work finished first."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t, self.t0 = time.perf_counter() - self.t0, time.perf_counter()
        return t


def format_eta(seconds):
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds // 60 % 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"
