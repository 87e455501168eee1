"""
What train_sft.py and train_dpo.py would otherwise both copy: distributed setup, wrapping the model for
DDP / FSDP2, precision, tokenizer and data preparation, optimizer and LR schedule, checkpoint save/resume,
the built-in task's accuracy, throughput metrics (tokens/s, MFU, padding, memory), Hugging Face export.
"""

import json
import math
import os
import random
import shutil
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

# -----------------------------------------------------------------------------
# distributed


def setup_distributed(device="auto"):
    """torchrun sets RANK/WORLD_SIZE/LOCAL_RANK; a plain `python script.py` is rank 0 of 1.
    Returns (rank, world_size, device). CUDA uses NCCL, CPU uses gloo (so tests run without a GPU)."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    if world_size > 1:
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return rank, world_size, torch.device(device)


def teardown_distributed():
    if dist.is_initialized():
        dist.destroy_process_group()


def print0(*args, **kwargs):
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kwargs, flush=True)


def all_reduce_sum(values, device):
    """Sum a list of floats over all ranks (one collective). Metrics are sums and counts reduced this way,
    divided afterwards, so an average over ranks with different token counts is still exact."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def wrap_model(model, parallel, world_size, param_dtype):
    """DDP, or FSDP2 `fully_shard` per block then on the root (torchtitan's layout). FSDP2 keeps float32
    sharded master weights and computes in param_dtype; gradients are reduced in float32."""
    if world_size == 1:
        return model
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model, device_ids=[model.embed_tokens.weight.device.index] if model.embed_tokens.weight.is_cuda else None)
    if parallel == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        for block in model.layers:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        return model
    raise ValueError(f"parallel={parallel!r}: choose 'ddp' or 'fsdp'")


def unwrap(model):
    return model.module if hasattr(model, "module") else model


def no_grad_sync(model, parallel, last_microbatch):
    """Gradients are reduced across ranks only on a rank's last micro-batch of the step."""
    if parallel == "fsdp" and hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(last_microbatch)
        return nullcontext()
    if hasattr(model, "no_sync") and not last_microbatch:
        return model.no_sync()
    return nullcontext()


def precision(device, dtype, parallel, world_size):
    """-> (dtype name, torch dtype, autocast context). 'auto' is bfloat16 on CUDA, float32 elsewhere.
    DDP / one process: float32 master weights and bf16 autocast; FSDP2 casts through its mixed-precision
    policy instead (see wrap_model), so no autocast there."""
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    ptdtype = getattr(torch, dtype)
    fsdp = parallel == "fsdp" and world_size > 1
    return dtype, ptdtype, (torch.autocast(device.type, dtype=ptdtype) if ptdtype != torch.float32 and not fsdp
                            else nullcontext())


# -----------------------------------------------------------------------------
# tokenizer and data


def choose_tokenizer(tokenizer, init_from):
    """The tokenizer asked for; else the one in init_from's Hugging Face folder; else the byte-level one
    (a folder without tokenizer files is a model we trained with it, like out/sft/hf)."""
    from tokenizer import Tokenizer, get_tokenizer
    hf_folder = init_from not in ("scratch", "resume")
    return get_tokenizer(tokenizer or (init_from if hf_folder and Tokenizer.has_files(init_from) else "byte"))


def prepare_data(data, out_dir, tok, kind, max_len, overlong, seed, **builtin):
    """-> the folder of token files for `data`. 'builtin' and a .jsonl file are tokenized into out_dir/data
    by rank 0 while the others wait; a folder written by data/prepare.py is used as it is."""
    if data != "builtin" and not data.endswith(".jsonl"):
        return data
    data_dir = os.path.join(out_dir, "data")
    if int(os.environ.get("RANK", 0)) == 0:
        try:
            if data == "builtin":
                from data.arithmetic import prepare_builtin
                prepare_builtin(data_dir, tokenizer=tok, kind=kind, **builtin)
            else:
                from data.prepare import prepare
                prepare(data, data_dir, tokenizer=tok.name, max_len=max_len, overlong=overlong, seed=seed)
        except (ValueError, OSError) as e:  # a bad line (file:line, value, what to do), a missing file
            raise SystemExit(f"data error: {e}") from None
    if dist.is_initialized():
        dist.barrier()
    return data_dir


def load_data(data_dir, tok, kind):
    """-> (train, val) token data of a folder, checked against the run: SFT or DPO data, same tokenizer."""
    from data.prepare import load
    train, meta = load(data_dir, "train")
    val, _ = load(data_dir, "val")
    if meta.get("kind") != kind:
        what = dict(sft="chats ({\"messages\": [...]} lines)", dpo="preference pairs ({\"prompt\", \"chosen\", "
                    "\"rejected\"} lines)")[kind]
        raise SystemExit(f"{data_dir} holds {meta.get('kind')} data; this script needs {what}, see data/prepare.py")
    if meta.get("tokenizer") != tok.name:
        raise SystemExit(f"{data_dir} was prepared with tokenizer {meta.get('tokenizer')!r}, this run uses "
                         f"{tok.name!r}; prepare it again with the run's tokenizer")
    return train, val


@torch.no_grad()
def builtin_accuracy(model, tok, n, device, autocast, sync_ranks):
    """Held-out exact match on the built-in task: the first n val prompts, answered greedily, split
    over ranks. model: the unwrapped model (FSDP2 modules gather their shards when called)."""
    from data.arithmetic import score, val_problems
    from sample import generate
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    problems = val_problems(n)[rank::world_size]
    with autocast:
        replies = generate(model, [tok.render_prompt(p) for p, _ in problems], max_new_tokens=16,
                           stop_ids=tok.stop_ids, sync_ranks=sync_ranks)
    texts = [tok.decode([t for t in r if t not in tok.stop_ids]) for r in replies]
    right, asked = all_reduce_sum([sum(score(ans, t) for (_, ans), t in zip(problems, texts)), len(problems)], device)
    return right / asked


# -----------------------------------------------------------------------------
# optimizer and schedule


def make_optimizer(model, learning_rate, weight_decay, betas=(0.9, 0.95), device_type="cpu"):
    # decay matrices only: norms' gains and biases are not weights to shrink
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [dict(params=decay, weight_decay=weight_decay), dict(params=no_decay, weight_decay=0.0)]
    return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type == "cuda")


def lr_at(it, max_iters, learning_rate, min_lr, warmup_iters):
    """Linear warmup to learning_rate, then cosine decay to min_lr at max_iters."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / warmup_iters
    progress = min(1.0, (it - warmup_iters) / max(1, max_iters - warmup_iters))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (learning_rate - min_lr)


# -----------------------------------------------------------------------------
# checkpoints: one file, written atomically, loadable with weights_only=True


_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def rng_state():
    np_state = np.random.get_state()
    return dict(python=random.getstate(), numpy=(np_state[0], np_state[1].tolist(), *np_state[2:]),
                torch=torch.get_rng_state(), cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [])


def set_rng_state(state):
    random.setstate(state["python"])
    np_state = state["numpy"]
    np.random.set_state((np_state[0], np.array(np_state[1], dtype=np.uint32), *np_state[2:]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path, model, optimizer, extra):
    """Full (unsharded) model and optimizer state on rank 0, keyed by parameter names so a checkpoint
    moves freely between 1 process, DDP and FSDP2 and any world size. Temp file + rename: a kill
    mid-write leaves the previous checkpoint whole."""
    model_sd = get_model_state_dict(model, options=_FULL)  # collective under FSDP: every rank calls it
    optim_sd = get_optimizer_state_dict(model, optimizer, options=_FULL)
    if int(os.environ.get("RANK", 0)) == 0:
        tmp = path + ".tmp"
        torch.save(dict(model=model_sd, optimizer=optim_sd, rng=rng_state(), **extra), tmp)
        os.replace(tmp, path)
    if dist.is_initialized():
        dist.barrier()


def load_checkpoint(path):
    if not os.path.exists(path):
        raise SystemExit(f"init_from='resume' but {path} does not exist; run without init_from='resume' "
                         f"first, or point out_dir at the run to continue")
    return torch.load(path, map_location="cpu", weights_only=True)


def restore_checkpoint(ckpt, model, optimizer):
    set_model_state_dict(model, ckpt["model"], options=_FULL)
    set_optimizer_state_dict(model, optimizer, ckpt["optimizer"], options=_FULL)
    set_rng_state(ckpt["rng"])


def full_model_state(model):
    """The whole model's weights on CPU, on every rank (a collective under FSDP)."""
    return get_model_state_dict(model, options=_FULL)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


def export_hf(model, model_config, hf_dir, tokenizer_from=None):
    """The trained weights as a Hugging Face folder (rank 0 writes; a collective under FSDP), with the
    tokenizer files of the folder the run started from, so the result loads like the original."""
    from model import Transformer
    full_state = full_model_state(model)
    if int(os.environ.get("RANK", 0)) != 0:
        return
    with torch.device("meta"):
        export = Transformer(model_config)
    export.load_state_dict(full_state, assign=True)
    export.save_pretrained(hf_dir)
    for name in TOKENIZER_FILES if tokenizer_from else ():
        if os.path.exists(os.path.join(tokenizer_from, name)):
            shutil.copy(os.path.join(tokenizer_from, name), hf_dir)


# -----------------------------------------------------------------------------
# metrics


# dense bf16 tensor-core peak, FLOP/s, from the vendors' datasheets; an unknown device gets no MFU at all
PEAK_BF16_FLOPS = [("H200", 989e12), ("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989e12),
                   ("B200", 2250e12), ("A100", 312e12), ("L40S", 362e12), ("A10G", 70e12)]


def peak_flops(device):
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None)


class MetricsLogger:
    """One JSON object per line in out_dir/metrics.jsonl, and the same to wandb when asked (rank 0 only)."""

    def __init__(self, out_dir, wandb_log=False, wandb_project="nanopack", run_name=None, config=None, resume=False):
        self.active = int(os.environ.get("RANK", 0)) == 0
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self.wandb = None
        if self.active:
            os.makedirs(out_dir, exist_ok=True)
            if not resume and os.path.exists(self.path):
                os.remove(self.path)  # a fresh run starts a fresh log; a resumed one appends
            if wandb_log:
                import wandb  # offline with WANDB_MODE=offline, no network needed
                self.wandb = wandb.init(project=wandb_project, name=run_name, config=config)

    def log(self, metrics):
        if not self.active:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.wandb is not None:
            self.wandb.log(metrics, step=metrics.get("iter"))

    def finish(self):
        if self.wandb is not None:
            self.wandb.finish()


class Throughput:
    """What a log window did, for honest speed figures: real tokens (padding excluded), padding, positions,
    FLOPs from the actual sequence lengths, time spent waiting for data. Counted on the host; summed over
    ranks in one collective by read(), which also carries the script's own sums along."""

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
                seq_lens = np.diff(mb.cu_seqlens.numpy())[: mb.num_sequences]  # not the padding tail
                self.flops += self.flops_factor * self.model.flops_per_token(seq_lens, mb.num_target_tokens) * mb.num_tokens
            self.tokens += mb.num_tokens
            self.padding += mb.num_padding
            self.positions += mb.input_ids.numel()
        self.data_time += data_time

    def read(self, elapsed, n_steps, extra=()):
        """-> (metrics, the extra values summed over ranks); starts a new window."""
        *extra, tokens, padding, positions, flops, data_time = all_reduce_sum(
            list(extra) + [self.tokens, self.padding, self.positions, self.flops, self.data_time], self.device)
        self.reset()
        metrics = dict(
            tokens=tokens / n_steps, tokens_per_sec=tokens / elapsed, tokens_per_sec_per_gpu=tokens / elapsed / self.world_size,
            mfu=flops / elapsed / (self.peak * self.world_size) if self.peak else None,
            padding_fraction=padding / max(positions, 1),
            peak_mem_gb=(torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda"
                         else peak_rss_bytes()) / 2**30,
            data_time_frac=data_time / self.world_size / elapsed, time_ms=1000 * elapsed / n_steps)
        return metrics, extra

    @staticmethod
    def line(m):
        mfu = f"{100 * m['mfu']:.1f}%" if m["mfu"] is not None else "-"
        return (f"{m['tokens_per_sec_per_gpu']:,.0f} tok/s/gpu | mfu {mfu} | pad {100 * m['padding_fraction']:.1f}% | "
                f"{m['time_ms']:.0f} ms/it")


def grad_norm_value(grad_norm):
    return float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)  # FSDP2: a DTensor


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


def peak_rss_bytes():
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def format_eta(seconds):
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"
