"""
One way to build a training run, so that train_sft.py and train_dpo.py each hold only their own loop:
setup() (ranks and device, tokenizer, data, model, optimizer, packed loader, resume) returns a Run, whose
optimizer_step() skips non-finite updates; StopSignal turns Ctrl-C / SIGTERM into a checkpoint; the LR schedule.
The config it gets has been checked by configurator.configure().
"""
import math
import os
import shutil
import signal
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from checkpoint import all_finite, base_fingerprint, load_checkpoint, restore_checkpoint
from data.arithmetic import prepare_builtin
from data.prepare import load, prepare
import lora
from hf import from_pretrained, load_hf_weights, read_hf_config
from model import ModelConfig, Transformer, attention_backend, config_from_preset
from packing import PackedLoader
from parallel import is_master, lock_out_dir, precision, print0, setup_distributed, teardown_distributed, wrap_model
from tokenizer import Tokenizer, get_tokenizer


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
    start_iter: int            # optimizer steps already taken (the checkpoint's, on resume)
    max_iters: int
    out_dir: str
    ckpt_path: str
    saved: dict                # the script's own extras from the checkpoint being resumed ({} otherwise)
    max_bad_steps: int
    stop: "StopSignal"
    adapters: dict = None      # LoRA settings (rank, alpha, dropout, targets, quantize); None: full fine-tuning
    skipped_steps: int = 0     # updates skipped for a non-finite loss or gradient norm, this process's lifetime
    bad_in_a_row: int = 0

    @property
    def master(self):
        return self.rank == 0

    def optimizer_step(self, step_loss, grad_clip, iter_num):
        """Clip, and update only if the step's loss and gradient norm are finite on every rank. One small
        all-reduce read by the host per step, which also makes every rank agree on a stop signal.
        -> (gradient norm, whether the update was made, whether to stop after this step)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # FSDP2: a DTensor
        flags = torch.stack([~torch.isfinite(step_loss.float()) | ~torch.isfinite(grad_norm),
                             torch.tensor(self.stop.name is not None, device=grad_norm.device)]).float()
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        bad, stop = flags.tolist()
        if not bad:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.bad_in_a_row = self.bad_in_a_row + 1 if bad else 0
        self.skipped_steps += int(bad)
        if bad:
            print0(f"iter {iter_num}: the loss or gradient norm is NaN or infinite: update skipped, weights "
                   f"unchanged ({self.bad_in_a_row} in a row, at most max_bad_steps={self.max_bad_steps})")
        if self.bad_in_a_row >= self.max_bad_steps:
            raise SystemExit(f"stopping: {self.bad_in_a_row} steps in a row had a non-finite loss or gradient norm. "
                             f"The last checkpoint ({self.ckpt_path}, if one was written) holds finite weights. "
                             f"Lower learning_rate or check the data, then resume or start again.")
        return float(grad_norm), not bad, bool(stop)

    def exit_stopped(self, iter_num):
        """After a stop signal, with the checkpoint saved: say how to continue, and exit 128 + the signal (143 for
        SIGTERM, 130 for Ctrl-C) as a process it killed would: a scheduler reads the run as stopped, not done."""
        print0(f"stopped by {self.stop.name or 'a signal on another rank'} after iter {iter_num}: checkpoint "
               f"{self.ckpt_path}; continue with --init_from=resume --out_dir={self.out_dir}")
        teardown_distributed(128 + signal.Signals[self.stop.name or "SIGTERM"])


class StopSignal:
    """SIGINT (Ctrl-C) or SIGTERM (a cluster's preemption) asks the run to stop after the current step with a
    checkpoint. A second SIGINT stops at once; a SIGTERM after a SIGINT (torchrun passes Ctrl-C on) does not.
    Under torchrun, launch.py makes the launcher end the same way (torchrun's own exits 1 with a traceback)."""

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


def setup(config, kind, builtin_sizes=None):
    """Ranks and device, precision, tokenizer, data, model (scratch preset, Hugging Face folder or resumed),
    optimizer, packed loader, and the checkpoint's state restored when init_from='resume'. kind: 'sft', 'dpo' or 'rl'
    (no token files and no loader: train_rl.py reads its prompts and makes its batches itself)."""
    c = config
    lock_out_dir(c["out_dir"])  # first: a second run into a live run's out_dir stops before it changes anything
    rank, world_size, device = setup_distributed(c["device"], c["dist_timeout"])
    torch.manual_seed(c["seed"])
    dtype, ptdtype, autocast = precision(device, c["dtype"], c["parallel"], world_size)
    resume = c["init_from"] == "resume"
    ckpt_path = os.path.join(c["out_dir"], "ckpt.pt")
    ckpt = load_checkpoint(ckpt_path) if resume else None
    if c["overwrite"] and not resume and rank == 0:  # start over: nothing of the previous run may pass for ours
        for old in [ckpt_path, os.path.join(c["out_dir"], "hf"), os.path.join(c["out_dir"], "adapter")] + [
                os.path.join(c["out_dir"], f) for f in os.listdir(c["out_dir"]) if f.startswith("ckpt-")]:
            shutil.rmtree(old) if os.path.isdir(old) else os.path.exists(old) and os.remove(old)

    if resume:  # a resumed run continues with the data, tokenizer and initial weights of the run it continues
        tok, start = choose_tokenizer(ckpt["tokenizer"], "resume"), ckpt["start"]
        data_dir = ckpt["data_dir"] and os.path.join(c["out_dir"], ckpt["data_dir"])  # relative: the run's data
        model_config = ModelConfig(**ckpt["model_config"])
        if c["lora_rank"] and ckpt.get("base") != base_fingerprint(start["init_from"]):
            raise SystemExit(f"{start['init_from']} is not the base model this LoRA run started from (its files "
                             f"changed); its checkpoint holds only the adapters: restore that folder to resume")
    else:
        start = dict(init_from=c["init_from"], preset=c["preset"])
        tok = choose_tokenizer(c["tokenizer"], c["init_from"])
        model_config = initial_config(start, tok)
        data_dir = None if kind == "rl" else prepare_data(
            c["data"], c["out_dir"], tok, kind, c["max_len"], model_config.max_seq_len, c["overlong"], c["seed"],
            c["val_fraction"], c["data_split"], c["val_data"], **(builtin_sizes or {}))
    train_data = val_data = loader = None
    if kind != "rl":
        train_data, val_data = load_data(data_dir, tok, kind)
        check_fits(model_config, tok, data_dir, train_data, val_data, c["microbatch_tokens"], kind)
    compiled = c["compile"] is True or (c["compile"] == "auto" and device.type == "cuda")
    if c["compile"] == "auto" and not compiled:
        print0("compile='auto': off on CPU, where compiling costs seconds at every start for a gain within noise "
               "(bench/RESULTS.md); --compile=True to use it anyway")
    adapters = dict(rank=c["lora_rank"], alpha=c["lora_alpha"] or 2 * c["lora_rank"], dropout=c["lora_dropout"],
                    targets=c["lora_targets"].split(","), quantize=c["quantize_base"]) if c["lora_rank"] else None
    model, raw_model = build_model(model_config, start, c["seed"], device, c["parallel"], world_size, ptdtype,
                                   compiled, c["activation_checkpointing"], from_checkpoint=resume, adapters=adapters)
    optimizer = make_optimizer(model, c["learning_rate"], c["weight_decay"], device_type=device.type)

    if kind != "rl":
        loader = PackedLoader(train_data, c["batch_size"], c["microbatch_tokens"], rank=rank, world_size=world_size,
                              seed=c["seed"], dpo=kind == "dpo", prefix_sharing=c.get("prefix_sharing", False))
        units = f"{len(loader.lengths)} train {'pairs' if kind == 'dpo' else 'examples'}"
        if c["batch_size"] > len(loader.lengths):
            print0(f"note: batch_size={c['batch_size']} is more than the {units}: each step takes all of them")
    max_iters = c["max_iters"] or max(1, round(c["epochs"] * len(loader)))
    start_iter, saved = 0, {}
    if resume:
        restore_checkpoint(ckpt, c["out_dir"], model, optimizer)
        if loader:
            loader.load_state_dict(ckpt["loader"])
        start_iter, saved = ckpt["iter_num"], ckpt["extra"]
    if start_iter >= max_iters:
        print0(f"note: the run is already at iter {start_iter}, max_iters={max_iters}: nothing to train "
               f"(raise max_iters)")
    trained = sum(p.numel() for p in raw_model.parameters() if p.requires_grad) if adapters else 0
    lora_note = f" (LoRA r={adapters['rank']}: {trained / 1e6:.2f}M train)" if adapters else ""
    data_note = f" | data: {data_dir}, {units}, {len(loader)} steps/epoch" if loader else ""
    print0(f"model: {raw_model.num_params() / 1e6:.2f}M parameters{lora_note}{data_note} | world size {world_size} "
           f"({c['parallel']}) | device {device}, {dtype}, "
           f"attention {attention_backend(device, ptdtype)} | {max_iters} iterations")
    return Run(rank=rank, world_size=world_size, device=device, dtype=dtype, autocast=autocast, tok=tok,
               data_dir=data_dir, train_data=train_data, val_data=val_data, start=start, model=model,
               raw_model=raw_model, optimizer=optimizer, loader=loader, start_iter=start_iter, max_iters=max_iters,
               out_dir=c["out_dir"], ckpt_path=ckpt_path, saved=saved, max_bad_steps=c["max_bad_steps"],
               stop=StopSignal(), adapters=adapters)


def build_model(model_config, start, seed, device, parallel, world_size, param_dtype, compile=False,
                activation_checkpointing=False, from_checkpoint=False, adapters=None):
    """-> (the model to call: wrapped for DDP / FSDP2, the network itself), placed on device with the initial
    weights of `start` (a seeded preset or a Hugging Face folder); from_checkpoint: left for restore_checkpoint.
    Weights from files under FSDP2 (and checkpoints always) are read after building on the meta device and
    sharding, so each rank reads only its own rows and none ever holds the whole model.
    adapters: LoRA settings (rank, alpha, dropout, targets, quantize): the base is frozen and a checkpoint holds
    only the adapters, so on resume the base is read from `start` again."""
    sharded = parallel == "fsdp" and world_size > 1
    from_checkpoint = from_checkpoint and not adapters
    from_files = from_checkpoint or (start["init_from"] != "scratch" and sharded)
    try:
        if from_files:
            with torch.device("meta"):
                raw_model = Transformer(model_config)
        elif start["init_from"] == "scratch":
            torch.manual_seed(seed)  # the same weights on every rank, and again when a live reference is rebuilt
            raw_model = Transformer(model_config)
        else:
            raw_model = from_pretrained(start["init_from"], dtype=torch.float32)
        if not from_files:
            refuse_non_finite(raw_model, start)
        if adapters:
            lora.add_adapters(raw_model, adapters["rank"], adapters["alpha"], adapters["dropout"], adapters["targets"])
            if adapters["quantize"]:
                lora.quantize_base(raw_model)
            if param_dtype != torch.float32 and not sharded:  # FSDP2 casts through its mixed-precision policy
                lora.cast_base(raw_model, param_dtype)
        if not (from_files and sharded):  # DDP broadcasts rank 0's weights when it wraps: they must exist by then
            raw_model.to_empty(device=device) if from_files else raw_model.to(device)
        raw_model.activation_checkpointing = activation_checkpointing
        if compile:  # per block, with the token count dynamic: micro-batches run at their real length
            for block in raw_model.layers:
                block.compile(dynamic=True)
        model = wrap_model(raw_model, parallel, world_size, param_dtype)
        if from_files and sharded:
            raw_model.to_empty(device=device)
        if adapters and from_files:
            lora.init_adapters(raw_model)
        if from_files and not from_checkpoint:
            load_hf_weights(raw_model, start["init_from"], lora.base_parameters(raw_model) if adapters else None)
            refuse_non_finite(raw_model, start)
    except (ValueError, OSError, KeyError) as e:  # a model folder we cannot read: what and where, in one line
        raise SystemExit(f"model error: {e}") from None
    return model, raw_model


def refuse_non_finite(model, start):
    if not all_finite(model, frozen_too=True):
        raise SystemExit(f"model error: {start['init_from']} holds NaN or infinite weights; nothing to train from")


def initial_config(start, tok):
    """The ModelConfig of the weights a run starts from, without loading them."""
    if start["init_from"] == "scratch":
        return config_from_preset(start["preset"], vocab_size=tok.vocab_size)
    try:
        return read_hf_config(start["init_from"])
    except (ValueError, OSError) as e:
        raise SystemExit(f"model error: {e}") from None


def choose_tokenizer(tokenizer, init_from):
    """The tokenizer asked for; else the one in init_from's Hugging Face folder; else the byte-level one
    (a folder without tokenizer files is a model we trained with it, like out/sft/hf)."""
    hf_folder = init_from not in ("scratch", "resume")
    try:
        return get_tokenizer(tokenizer or (init_from if hf_folder and Tokenizer.has_files(init_from) else "byte"))
    except (ValueError, OSError) as e:  # an unsupported tokenizer or template: the file and the key, one line
        raise SystemExit(f"tokenizer error: {e}") from None


def prepare_data(data, out_dir, tok, kind, max_len, max_seq_len, overlong, seed, val_fraction, data_split, val_data,
                 **builtin):
    """-> the folder of token files for `data`. 'builtin' and records (data/prepare.py) are tokenized into out_dir/data
    by rank 0 while the others wait; a folder written by data/prepare.py is used as it is. A sequence longer
    than the model's positions is handled as one longer than max_len (`overlong`), so its line is named."""
    if data != "builtin" and os.path.isfile(os.path.join(data, "meta.json")):
        return data
    data_dir = os.path.join(out_dir, "data")
    if is_master():
        try:
            if data == "builtin":
                prepare_builtin(data_dir, tokenizer=tok, kind=kind, **builtin)
            else:
                prepare(data, data_dir, tokenizer=tok, max_len=min(max_len, max_seq_len), overlong=overlong,
                        val_fraction=val_fraction, seed=seed, data_split=data_split, val_input=val_data)
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
            raise SystemExit(f"{data_dir}: the longest {split} {what} ({int(units.argmax())}) has {units.max()} "
                             f"tokens, more than microbatch_tokens={microbatch_tokens}; raise microbatch_tokens to "
                             f"at least {units.max()}, or prepare the data with a smaller --max_len")


def make_optimizer(model, learning_rate, weight_decay, betas=(0.9, 0.95), device_type="cpu"):
    """AdamW over the parameters that train; matrices decay, norms' gains and biases do not."""
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
