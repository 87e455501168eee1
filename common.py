"""
What train_sft.py and train_dpo.py share, so that each script holds only its own loop: distributed setup,
precision, one way to build a run (tokenizer, data, model, optimizer, loader, resume), the optimizer and LR
schedule, checkpoints and Hugging Face export, and honest throughput metrics (tokens/s, MFU, padding, memory).
"""

import datetime
import json
import math
import os
import random
import resource
import shutil
import signal
import time
import warnings
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from data.arithmetic import prepare_builtin
from data.prepare import load, prepare
from model import PRESETS, ModelConfig, Transformer, config_from_preset, read_hf_config
from packing import PackedLoader
from tokenizer import Tokenizer, get_tokenizer

# DCP in one process (no process group) warns at every save and load that it assumes one process: we mean it
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

# -----------------------------------------------------------------------------
# distributed


def setup_distributed(device="auto", timeout_s=300):
    """torchrun sets RANK/WORLD_SIZE/LOCAL_RANK; a plain `python script.py` is rank 0 of 1.
    Returns (rank, world_size, device). CUDA uses NCCL, CPU uses gloo (so tests run without a GPU).
    A collective that waits longer than timeout_s (a stalled or dead rank) fails instead of hanging."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    if world_size > 1:
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s))
    return rank, world_size, torch.device(device)


def teardown_distributed():
    if dist.is_initialized():
        dist.barrier()  # no rank tears down while another still talks to it (seen: an abort at exit under gloo)
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
        return DDP(model, device_ids=[model.embed_tokens.weight.device.index] if model.embed_tokens.weight.is_cuda else None)
    if parallel == "fsdp":
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        for block in model.layers:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        return model
    raise ValueError(f"parallel={parallel!r}: choose 'ddp' or 'fsdp'")


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
# one way to build a run: tokenizer, data, model, optimizer, loader, resume


@dataclass
class Run:
    """Everything a training script needs before its loop, built the same way for SFT and DPO by setup()."""
    rank: int
    world_size: int
    device: torch.device
    dtype: str                 # 'bfloat16' | 'float32'
    autocast: object           # context manager for forward passes
    tok: Tokenizer
    data_dir: str
    train_data: dict
    val_data: dict
    start: dict                # what the initial weights are: dict(init_from=..., preset=...)
    model: torch.nn.Module     # wrapped for DDP / FSDP2 when world_size > 1: call this one
    raw_model: Transformer     # the network itself: num_params, flops_per_token, generation
    optimizer: torch.optim.Optimizer
    loader: PackedLoader
    iter_num: int              # optimizer steps already taken (resume)
    max_iters: int
    out_dir: str
    ckpt_path: str
    saved: dict                # the script's own extras from the checkpoint being resumed ({} otherwise)
    max_bad_steps: int
    stop: "StopSignal"
    skipped_steps: int = 0     # updates skipped for a non-finite loss or gradient norm, this process's lifetime
    bad_in_a_row: int = 0

    @property
    def master(self):
        return self.rank == 0

    def optimizer_step(self, step_loss, grad_clip):
        """Clip, and update only if the step's loss and gradient norm are finite on every rank. One small
        all-reduce read by the host per step, which also makes every rank agree on a stop signal.
        -> (gradient norm, whether the update was made, whether to stop after this step)."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # FSDP2: a DTensor
        flags = torch.stack([~torch.isfinite(step_loss.float()) | ~torch.isfinite(grad_norm),
                             torch.tensor(self.stop.name is not None, device=grad_norm.device)]).float()
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        bad, stop = flags.tolist()
        if not bad:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.iter_num += 1
        self.bad_in_a_row = self.bad_in_a_row + 1 if bad else 0
        self.skipped_steps += int(bad)
        if bad:
            print0(f"iter {self.iter_num}: the loss or gradient norm is NaN or infinite: update skipped, weights unchanged "
                   f"({self.bad_in_a_row} in a row, at most max_bad_steps={self.max_bad_steps})")
        if self.bad_in_a_row >= self.max_bad_steps:
            raise SystemExit(f"stopping: {self.bad_in_a_row} steps in a row had a non-finite loss or gradient norm. The "
                             f"last checkpoint ({self.ckpt_path}, if one was written) holds finite weights. Lower "
                             f"learning_rate or check the data, then resume or start again.")
        return float(grad_norm), not bad, bool(stop)

    def stopped(self, out_dir):
        """After a stop signal: the checkpoint is saved, say how to continue, exit cleanly."""
        print0(f"stopped by {self.stop.name or 'a signal on another rank'} after iter {self.iter_num}: checkpoint "
               f"{self.ckpt_path}; continue with --init_from=resume --out_dir={out_dir}")
        teardown_distributed()
        raise SystemExit(0)


class StopSignal:
    """SIGINT (Ctrl-C) or SIGTERM (a cluster's preemption) asks the run to stop after the current step with a
    checkpoint. A second SIGINT stops at once; a SIGTERM after a SIGINT (torchrun passes Ctrl-C on) does not.
    Under torchrun the workers exit 0 with their checkpoint; the launcher itself exits 1 on a signal."""

    def __init__(self):
        self.name = None
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, self.handle)

    def handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.name == "SIGINT" and name == "SIGINT":
            raise SystemExit("second SIGINT: stopped at once, without a checkpoint")
        self.name = self.name or name
        # os.write, not print: a print inside a signal handler can interrupt a print and raise "reentrant call"
        os.write(2, f"rank {os.environ.get('RANK', 0)}: {name}: stopping after this step with a checkpoint\n".encode())


def check_config(c, kind, choices):
    """Every value a user can get wrong, checked before any data is tokenized or model loaded: one
    `config error:` line each, naming the key, the value and what is accepted."""
    def bad(key, accepted):
        raise SystemExit(f"config error: {key}={c[key]!r}; {accepted}")

    choices = dict(device=("auto", "cpu", "cuda"), dtype=("auto", "bfloat16", "float32"), compile=("auto", True, False),
                   parallel=("ddp", "fsdp"),
                   overlong=("error", "truncate", "skip"), loss_weighting=("token", "sequence"), **choices)
    for key, allowed in choices.items():
        if key in c and c[key] not in allowed:
            why = "; float16 needs loss scaling that nanopack does not do: bfloat16 has float32's range" * (
                c[key] in ("float16", "fp16", "half"))
            bad(key, f"choose one of {', '.join(allowed)}{why}")
    at_least = dict(batch_size=1, microbatch_tokens=1, log_interval=1, max_len=1, max_bad_steps=1, dist_timeout=1,
                    max_iters=0, eval_interval=0, eval_examples=0, warmup_iters=0, weight_decay=0.0, grad_clip=0.0,
                    min_lr=0.0, label_smoothing=0.0, sft_weight=0.0)
    for key, low in at_least.items():
        if key in c and c[key] < low:
            bad(key, f"it must be at least {low}")
    for key in ("learning_rate", "epochs", "beta"):
        if key in c and not 0 < c[key] < math.inf:
            bad(key, "it must be a finite number greater than 0")
    if c["min_lr"] > c["learning_rate"]:
        bad("min_lr", f"it must not exceed learning_rate={c['learning_rate']} (the schedule decays to it)")
    if not 0 <= c["seed"] < 2**32:
        bad("seed", "it must be in [0, 2**32)")
    if not 0.0 <= c["val_fraction"] < 1.0:
        bad("val_fraction", "it must be in [0, 1)")
    if kind == "dpo" and (c["label_smoothing"] >= 0.5 or (c["label_smoothing"] and c["loss_type"] in ("ipo", "hinge"))):
        bad("label_smoothing", "it must be below 0.5, and 0 for ipo and hinge")
    if c["device"] == "cuda" and not torch.cuda.is_available():
        bad("device", "this machine has no CUDA GPU (torch.cuda.is_available() is False); use 'auto' or 'cpu'")
    if c["init_from"] == "scratch" and c["preset"] not in PRESETS:
        bad("preset", f"choose one of {', '.join(PRESETS)}")
    if c["init_from"] not in ("scratch", "resume") and not os.path.isfile(os.path.join(c["init_from"], "config.json")):
        hint = "; DPO starts from a fine-tuned model: make the default one with `python train_sft.py`" * (kind == "dpo")
        bad("init_from", f"it is neither 'scratch', 'resume' nor a Hugging Face model folder (with a config.json)"
                         f"{hint}")
    if c["tokenizer"] not in ("", "byte") and not Tokenizer.has_files(c["tokenizer"]):
        bad("tokenizer", "use 'byte' or a folder with tokenizer.json or tokenizer.model")
    data = c["data"]
    if data != "builtin" and not (data.endswith(".jsonl") and os.path.isfile(data)) and not os.path.isfile(
            os.path.join(data, "meta.json")):
        what = "no such file" if data.endswith(".jsonl") else "not a .jsonl file nor a folder written by data/prepare.py"
        bad("data", f"{what}; use 'builtin', a chat .jsonl file, or a folder written by data/prepare.py")
    try:  # can we write where the run will live? Better now than after an hour of training
        os.makedirs(c["out_dir"], exist_ok=True)
        with open(os.path.join(c["out_dir"], f".write_test_{os.getpid()}"), "w") as f:
            f.write("ok")
        os.remove(f.name)
    except OSError as e:
        bad("out_dir", f"cannot write there ({e.strerror}); choose a writable folder")
    if c["init_from"] != "resume" and not c["overwrite"] and os.path.exists(os.path.join(c["out_dir"], "ckpt.pt")):
        raise SystemExit(f"config error: {c['out_dir']} already holds a run (ckpt.pt); continue it with "
                         f"--init_from=resume, or start over there with --overwrite=True, or choose another out_dir")


def setup(config, kind, builtin_sizes=None, choices=None):
    """Distributed setup, precision, tokenizer, data, model (scratch preset, Hugging Face folder or resumed),
    activation checkpointing, compile, DDP/FSDP2 wrap, optimizer, packed loader, and the checkpoint's state
    restored when config['init_from'] == 'resume'. kind: 'sft' or 'dpo'; choices: the script's own {key: allowed}."""
    c = config
    check_config(c, kind, choices or {})
    rank, world_size, device = setup_distributed(c["device"], c["dist_timeout"])
    torch.manual_seed(c["seed"])
    dtype, ptdtype, autocast = precision(device, c["dtype"], c["parallel"], world_size)
    resume = c["init_from"] == "resume"
    ckpt_path = os.path.join(c["out_dir"], "ckpt.pt")
    ckpt = load_checkpoint(ckpt_path) if resume else None
    if c["overwrite"] and not resume and rank == 0:  # start over: nothing of the previous run may pass for ours
        for old in [ckpt_path, os.path.join(c["out_dir"], "hf")] + [
                os.path.join(c["out_dir"], f) for f in os.listdir(c["out_dir"]) if f.startswith("ckpt-")]:
            shutil.rmtree(old) if os.path.isdir(old) else os.path.exists(old) and os.remove(old)

    if resume:  # a resumed run continues with the data, tokenizer and initial weights of the run it continues
        tok, start = choose_tokenizer(ckpt["tokenizer"], "resume"), ckpt["start"]
        data_dir = os.path.join(c["out_dir"], ckpt["data_dir"])  # relative: the run folder's own data
        model_config = ModelConfig(**ckpt["model_config"])
    else:
        start = dict(init_from=c["init_from"], preset=c["preset"])
        tok = choose_tokenizer(c["tokenizer"], c["init_from"])
        model_config = initial_config(start, tok)
        data_dir = prepare_data(c["data"], c["out_dir"], tok, kind, c["max_len"], model_config.max_seq_len,
                                c["overlong"], c["seed"], c["val_fraction"], **(builtin_sizes or {}))
    train_data, val_data = load_data(data_dir, tok, kind)
    check_fits(model_config, tok, data_dir, train_data, val_data, c["microbatch_tokens"], kind)
    # Weights from files (a checkpoint, or a model folder under FSDP2): the model is built on the meta device and
    # placed first (under FSDP2: sharded), then each rank reads only what its own parameters hold, so no rank ever
    # holds the whole model. A preset (seeded init) or a folder without FSDP2: every rank builds it whole.
    sharded = c["parallel"] == "fsdp" and world_size > 1
    from_files = resume or (start["init_from"] != "scratch" and sharded)
    try:
        if from_files:
            with torch.device("meta"):
                raw_model = Transformer(model_config)
        else:
            raw_model = initial_model(start, tok, c["seed"])
    except (ValueError, OSError, KeyError) as e:  # a model folder we cannot read: what and where, in one line
        raise SystemExit(f"model error: {e}") from None
    if not (from_files and sharded):  # DDP broadcasts rank 0's weights when it wraps: they must exist by then
        raw_model.to_empty(device=device) if from_files else raw_model.to(device)
    raw_model.activation_checkpointing = c["activation_checkpointing"]
    compiled = c["compile"] is True or (c["compile"] == "auto" and device.type == "cuda")
    if c["compile"] == "auto" and not compiled:
        print0("compile='auto': off on CPU, where compiling costs seconds at every start for a gain within noise "
               "(bench/RESULTS.md); --compile=True to use it anyway")
    if compiled:
        # Per block: the chunked loss's loop stays eager, each block is one graph, with the token count, the
        # number of sequences and max_seqlen dynamic: micro-batches run at their real length, no padding
        for block in raw_model.layers:
            block.compile(dynamic=True)
    model = wrap_model(raw_model, c["parallel"], world_size, ptdtype)
    if from_files and sharded:
        raw_model.to_empty(device=device)
    if from_files and not resume:
        try:
            raw_model.load_hf_weights(start["init_from"])
        except (ValueError, OSError, KeyError) as e:
            raise SystemExit(f"model error: {e}") from None
    if not resume and not all_finite(raw_model):
        raise SystemExit(f"model error: {start['init_from']} holds NaN or infinite weights; nothing to train from")
    optimizer = make_optimizer(model, c["learning_rate"], c["weight_decay"], device_type=device.type)

    loader = PackedLoader(train_data, c["batch_size"], c["microbatch_tokens"], rank=rank, world_size=world_size,
                          seed=c["seed"], dpo=kind == "dpo", prefix_sharing=c.get("prefix_sharing", False))
    max_iters = c["max_iters"] or max(1, round(c["epochs"] * len(loader)))
    iter_num, saved = 0, {}
    if resume:
        restore_checkpoint(ckpt, c["out_dir"], model, optimizer)
        loader.load_state_dict(ckpt["loader"])
        iter_num, saved = ckpt["iter_num"], ckpt["extra"]
    n_units = len(loader.lengths)
    if c["batch_size"] > n_units:
        print0(f"note: batch_size={c['batch_size']} is more than the {n_units} train "
               f"{'pairs' if kind == 'dpo' else 'examples'}: each step takes all of them")
    if iter_num >= max_iters:
        print0(f"note: the run is already at iter {iter_num}, max_iters={max_iters}: nothing to train (raise max_iters)")
    print0(f"model: {raw_model.num_params() / 1e6:.2f}M parameters | data: {data_dir}, {n_units} train "
           f"{'pairs' if kind == 'dpo' else 'examples'}, {len(loader)} steps/epoch | world size {world_size} "
           f"({c['parallel']}) | device {device}, {dtype} | {max_iters} iterations")
    return Run(rank=rank, world_size=world_size, device=device, dtype=dtype, autocast=autocast, tok=tok,
               data_dir=data_dir, train_data=train_data, val_data=val_data, start=start, model=model,
               raw_model=raw_model, optimizer=optimizer, loader=loader, iter_num=iter_num, max_iters=max_iters,
               out_dir=c["out_dir"], ckpt_path=ckpt_path, saved=saved, max_bad_steps=c["max_bad_steps"], stop=StopSignal())


def initial_config(start, tok):
    """The ModelConfig of the weights a run starts from, without loading them."""
    if start["init_from"] == "scratch":
        return config_from_preset(start["preset"], vocab_size=tok.vocab_size)
    try:
        return read_hf_config(start["init_from"])
    except (ValueError, OSError) as e:
        raise SystemExit(f"model error: {e}") from None


def check_fits(model_config, tok, data_dir, train_data, val_data, microbatch_tokens, kind):
    """Data the model cannot take, found at load time rather than iterations later: a tokenizer larger than the
    embedding table, an example longer than the model's positions or than one micro-batch."""
    if tok.vocab_size > model_config.vocab_size:
        raise SystemExit(f"the tokenizer has {tok.vocab_size} tokens but the model only {model_config.vocab_size} "
                         f"embeddings; use the model's own tokenizer (--tokenizer=<its folder>)")
    for split, data in (("train", train_data), ("val", val_data)):
        lengths = np.diff(np.asarray(data["offsets"]))
        if not len(lengths) and split == "train":
            raise SystemExit(f"{data_dir} has no train examples; check the data (or lower val_fraction)")
        if not len(lengths):
            print0(f"note: {data_dir} has no val examples: evaluation reports no val loss (a small file? raise "
                   f"val_fraction)")
            continue
        i = int(lengths.argmax())
        if lengths[i] > model_config.max_seq_len:
            raise SystemExit(f"{data_dir}: {split} example {i} has {lengths[i]} tokens, more than the model's "
                             f"max_seq_len={model_config.max_seq_len} positions; prepare the data with "
                             f"--max_len={model_config.max_seq_len} (and --overlong=truncate or skip)")
        units = lengths.reshape(-1, 2).sum(1) if kind == "dpo" else lengths
        if units.max() > microbatch_tokens:
            what = "pair (chosen + rejected)" if kind == "dpo" else "example"
            raise SystemExit(f"{data_dir}: the longest {split} {what} ({int(units.argmax())}) has {units.max()} tokens, "
                             f"more than microbatch_tokens={microbatch_tokens}; raise microbatch_tokens to at least "
                             f"{units.max()}, or prepare the data with a smaller --max_len")


def initial_model(start, tok, seed):
    """The weights a run starts from (and, for DPO, its reference): a seeded preset or a Hugging Face folder."""
    if start["init_from"] == "scratch":
        torch.manual_seed(seed)  # the same weights on every rank, and again when a live reference is rebuilt
        return Transformer(config_from_preset(start["preset"], vocab_size=tok.vocab_size))
    return Transformer.from_pretrained(start["init_from"], dtype=torch.float32)


def choose_tokenizer(tokenizer, init_from):
    """The tokenizer asked for; else the one in init_from's Hugging Face folder; else the byte-level one
    (a folder without tokenizer files is a model we trained with it, like out/sft/hf)."""
    hf_folder = init_from not in ("scratch", "resume")
    try:
        return get_tokenizer(tokenizer or (init_from if hf_folder and Tokenizer.has_files(init_from) else "byte"))
    except (ValueError, OSError) as e:  # an unsupported tokenizer or template: the file and the key, one line
        raise SystemExit(f"tokenizer error: {e}") from None


def prepare_data(data, out_dir, tok, kind, max_len, max_seq_len, overlong, seed, val_fraction, **builtin):
    """-> the folder of token files for `data`. 'builtin' and a .jsonl file are tokenized into out_dir/data
    by rank 0 while the others wait; a folder written by data/prepare.py is used as it is. A sequence longer
    than the model's positions is handled as one longer than max_len (`overlong`), so its line is named."""
    if data != "builtin" and not data.endswith(".jsonl"):
        return data
    data_dir = os.path.join(out_dir, "data")
    if int(os.environ.get("RANK", 0)) == 0:
        try:
            if data == "builtin":
                prepare_builtin(data_dir, tokenizer=tok, kind=kind, **builtin)
            else:
                prepare(data, data_dir, tokenizer=tok, max_len=min(max_len, max_seq_len), overlong=overlong,
                        val_fraction=val_fraction, seed=seed)
        except (ValueError, OSError) as e:  # a bad line (file:line, value, what to do), a missing file
            capped = f" (max_len is capped at the model's max_seq_len={max_seq_len}: it has no positions beyond)"
            raise SystemExit(f"data error: {e}{capped * (max_len > max_seq_len and 'max_len' in str(e))}") from None
    if dist.is_initialized():
        dist.barrier()
    return data_dir


def load_data(data_dir, tok, kind):
    """-> (train, val) token data of a folder, checked against the run: SFT or DPO data, same tokenizer."""
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


# -----------------------------------------------------------------------------
# optimizer and schedule


def make_optimizer(model, learning_rate, weight_decay, betas=(0.9, 0.95), device_type="cpu"):
    # decay matrices only: norms' gains and biases are not weights to shrink
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [dict(params=decay, weight_decay=weight_decay), dict(params=no_decay, weight_decay=0.0)]
    return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type == "cuda")


def set_lr(optimizer, lr):
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def lr_at(it, max_iters, learning_rate, min_lr, warmup_iters):
    """Linear warmup to learning_rate, then cosine decay to min_lr at max_iters."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / warmup_iters
    progress = min(1.0, (it - warmup_iters) / max(1, max_iters - warmup_iters))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (learning_rate - min_lr)


# -----------------------------------------------------------------------------
# checkpoints: a DCP folder of sharded tensors + a small ckpt.pt naming it, replaced atomically


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


def save_checkpoint(run, loader_state, config, extra, evaluation=None):
    """Model and optimizer as a torch.distributed.checkpoint folder, out_dir/ckpt-<iter>-<n>/, each rank writing
    its own FSDP2 shards (replicated weights, 1 process or DDP, are written once); then rank 0 replaces ckpt.pt,
    small (which folder, config, loader position, RNG, iteration), by temp file + rename, and only then removes
    older folders: a kill at any moment leaves ckpt.pt naming a complete checkpoint. Any world size and layout
    (1 process, DDP, FSDP2) resumes it: DCP reshards on load. extra: the script's own state, run.saved on resume.
    Weights that are not all finite, or whose evaluation is not, are never written: the previous checkpoint stays."""
    bad = [k for k, v in (evaluation or {}).items() if not math.isfinite(v)]
    if bad or not all_finite(run.model):
        print0(f"iter {run.iter_num}: {'the weights are' if not bad else ', '.join(bad) + ' is'} not finite: checkpoint "
               f"NOT written ({run.ckpt_path} stays as it was)")
        return False
    name = [None]
    if run.master:  # a fresh folder name, never the one ckpt.pt names now (a resumed run may save the same iter)
        n = 0
        while os.path.exists(os.path.join(run.out_dir, f"ckpt-{run.iter_num:06d}-{n}")):
            n += 1
        name = [f"ckpt-{run.iter_num:06d}-{n}"]
    if dist.is_initialized():
        dist.broadcast_object_list(name, src=0)
    model_sd, optim_sd = get_state_dict(run.model, run.optimizer)  # sharded under FSDP2: each rank its own
    dcp.save(dict(model=model_sd, optimizer=optim_sd), checkpoint_id=os.path.join(run.out_dir, name[0]),
             no_dist=not dist.is_initialized())
    if run.master:
        tmp = run.ckpt_path + ".tmp"
        torch.save(dict(weights=name[0], rng=rng_state(), model_config=asdict(run.raw_model.config), iter_num=run.iter_num,
                        loader=loader_state, config=config, tokenizer=run.tok.name,
                        data_dir=portable(run.data_dir, run.out_dir), start=run.start, extra=extra), tmp)
        os.replace(tmp, run.ckpt_path)
        for old in os.listdir(run.out_dir):  # earlier checkpoints, and any a kill left half written
            if old.startswith("ckpt-") and old != name[0]:
                shutil.rmtree(os.path.join(run.out_dir, old), ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    return True


def all_finite(model):
    """Whether every parameter is finite, on every rank (each checks its own shards under FSDP2)."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    ok = torch.stack([torch.isfinite(p).all() for p in local]).all().float()
    if dist.is_initialized():
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def portable(path, out_dir):
    """A path as a checkpoint stores it: relative to the run's folder when inside it (out_dir/data), so a run
    folder that is copied or moved resumes with its own data; absolute otherwise."""
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(out_dir))
    return rel if not rel.startswith("..") else os.path.abspath(path)


def load_checkpoint(path):
    """ckpt.pt: the small part of a checkpoint (its "weights" entry names the DCP folder beside it)."""
    if not os.path.exists(path):
        raise SystemExit(f"init_from='resume' but {path} does not exist; run without init_from='resume' "
                         f"first, or point out_dir at the run to continue")
    return torch.load(path, map_location="cpu", weights_only=True)


def restore_checkpoint(ckpt, folder, model, optimizer=None):
    """Load the checkpoint's weights (and optimizer state) from its DCP folder into a placed model, whatever its
    world size and layout: each rank reads the pieces its own parameters need."""
    if optimizer is None:
        state = dict(model=get_model_state_dict(model))
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = dict(model=model_sd, optimizer=optim_sd)
    path = os.path.join(folder, ckpt["weights"])
    if not os.path.isdir(path):
        raise SystemExit(f"{path} is missing: ckpt.pt names it as holding the weights; the run folder is incomplete")
    dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
        set_rng_state(ckpt["rng"])


def checkpoint_model(ckpt_path, device="cpu"):
    """(Transformer with the checkpoint's weights, the checkpoint's small part): for sample.py and tests."""
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    with torch.device("meta"):
        model = Transformer(ModelConfig(**ckpt["model_config"]))
    model.to_empty(device=device)
    restore_checkpoint(ckpt, os.path.dirname(ckpt_path), model)
    return model, ckpt


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")  # config.json keys generation tools read


def finish(run, out_dir):
    """The trained weights as a Hugging Face folder next to the checkpoint (rank 0 writes; a collective under
    FSDP), with the tokenizer files of the folder the run started from, so the result loads like the original."""
    hf_dir = os.path.join(out_dir, "hf")
    if not all_finite(run.model):
        raise SystemExit(f"the weights are not all finite: no Hugging Face folder written; {run.ckpt_path} holds the "
                         f"last finite checkpoint")
    run.raw_model.save_pretrained(hf_dir, write=run.master)  # FSDP2: gathered one tensor at a time, to rank 0's CPU
    if run.master:
        byte = run.tok.name == "byte"
        folders = [f for f in {run.start["init_from"], run.tok.name} if os.path.isdir(f)]  # the source's files
        for name in TOKENIZER_FILES:
            for folder in folders:
                if os.path.exists(os.path.join(folder, name)):
                    shutil.copy(os.path.join(folder, name), hf_dir)
        # the special token ids the source's config.json carries (or the tokenizer's), so generation stops
        ids = dict(bos_token_id=run.tok.bos_id, eos_token_id=run.tok.eos_id, pad_token_id=None)
        source = os.path.join(run.start["init_from"], "config.json")
        if os.path.exists(source):
            with open(source) as f:
                ids.update({k: v for k, v in json.load(f).items() if k in TOKEN_ID_KEYS})
        with open(os.path.join(hf_dir, "config.json")) as f:
            hf_config = json.load(f)
        with open(os.path.join(hf_dir, "config.json"), "w") as f:
            json.dump({**hf_config, **ids}, f, indent=2)
        print0(f"done: checkpoint {run.ckpt_path}, Hugging Face folder {hf_dir}"
               + (" (byte-level tokenizer: sample.py uses it by default)" if byte else ""))
    teardown_distributed()


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

    def __init__(self, out_dir, wandb_log=False, wandb_project="nanopack", run_name=None, config=None, resume_iter=None):
        """resume_iter: the checkpoint's step when resuming: the log is kept up to it (rows a killed run wrote past
        its last checkpoint are dropped, so no step appears twice) and appended to; None: a fresh log."""
        self.active = int(os.environ.get("RANK", 0)) == 0
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self.wandb = None
        if self.active:
            os.makedirs(out_dir, exist_ok=True)
            kept = []
            if resume_iter is not None and os.path.exists(self.path):
                with open(self.path) as f:
                    kept = [line for line in f if line.strip() and json.loads(line).get("iter", 0) <= resume_iter]
            with open(self.path + ".tmp", "w") as f:
                f.writelines(kept)
            os.replace(self.path + ".tmp", self.path)
            if wandb_log:
                try:
                    import wandb  # optional, so imported only when asked for; WANDB_MODE=offline needs no network
                    self.wandb = wandb.init(project=wandb_project, name=run_name, config=config)
                except Exception as e:  # not installed, not logged in, no network: one line, before any training
                    raise SystemExit(f"wandb_log=True, but wandb cannot start ({type(e).__name__}: {e}); "
                                     f"`pip install wandb` and `wandb login`, or WANDB_MODE=offline") from None

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
                flops = self.model.flops_per_token(seq_lens, mb.num_target_tokens, mb.key_lengths())
                self.flops += self.flops_factor * flops * mb.num_tokens
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
            data_time_frac=data_time / self.world_size / elapsed, time_ms=1000 * elapsed / n_steps,
            compiled_graphs=counters["stats"]["unique_graphs"])  # recompiles show here: bounded, not one per step
        return metrics, extra

    @staticmethod
    def line(m):
        mfu = f"{100 * m['mfu']:.1f}%" if m["mfu"] is not None else "-"
        graphs = f" | {m['compiled_graphs']} graphs" if m["compiled_graphs"] else ""
        return (f"{m['tokens_per_sec_per_gpu']:,.0f} tok/s/gpu | mfu {mfu} | pad {100 * m['padding_fraction']:.1f}% | "
                f"{m['time_ms']:.0f} ms/it{graphs}")


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
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def format_eta(seconds):
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"
