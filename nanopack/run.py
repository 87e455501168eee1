"""
A run's start and stop: start_run checks the config, takes the out_dir lock, joins the ranks and
sets the device, precision and seed, and reads the checkpoint being resumed. StepGuard skips
non-finite updates and has the ranks agree on a stop (parallel.StopSignal), which the scripts turn
into a checkpoint; Run.exit_stopped then ends the process.
"""
import glob
import math
import os
import re
import shutil
import signal
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from data.dataset import check_kind
from model import attention_backend
from nanopack import context, hub, lora
from nanopack.checkpoint import EXPORT_NEW, EXPORT_OLD, EXPORT_TMP, finish_export, load_checkpoint
from nanopack.parallel import (fail, lock_out_dir, precision, print0, setup_distributed,
                               stop_signal, teardown_distributed)


@dataclass
class Run:
    """What the loop and checkpointing need of a run: its ranks, device, precision and files."""
    config: dict
    script: str                # the checkpoint records it: only this script resumes the run
    rank: int
    world_size: int
    device: torch.device
    dtype: str                 # 'bfloat16' | 'float32'
    ptdtype: torch.dtype
    autocast: object           # context manager for forward passes
    cp: context.ContextParallel  # this rank's CP group (size 1: none) and data-parallel rank / size
    out_dir: str
    ckpt_path: str
    resumed: dict = None       # ckpt.pt of the run being resumed (None: a fresh run)
    guard: "StepGuard" = None
    saved_iter: int = None     # the iteration ckpt.pt holds (None: none yet): save_checkpoint's

    @property
    def master(self):
        return self.rank == 0

    def begin(self, raw_model, iter_num, max_iters, data_note=""):
        """The run's summary line; from here on a signal stops the run after its step, with a
        checkpoint."""
        c = self.config
        if 0 < max_iters <= c["warmup_iters"]:
            print0(f"note: warmup_iters={c['warmup_iters']} is at least the run's {max_iters} "
                   f"steps: every step warms up, learning_rate is never reached; lower "
                   f"--warmup_iters")
        if iter_num >= max_iters:
            print0(f"note: the run is already at iter {iter_num}, max_iters={max_iters}: nothing "
                   f"to train (raise max_iters)")
        trained = sum(p.numel() for p in raw_model.parameters() if p.requires_grad)
        lora_note = f" (LoRA r={c['lora_rank']}: {trained / 1e6:.2f}M train)" * bool(c["lora_rank"])
        cp = self.cp
        cp_note = f", context parallel {cp.size} x data parallel {cp.data_size}" * (cp.size > 1)
        print0(f"model: {raw_model.num_params() / 1e6:.2f}M parameters{lora_note}{data_note} | "
               f"world size {self.world_size} ({c['parallel']}{cp_note}) | device {self.device}, "
               f"{self.dtype}, attention {attention_backend(self.device, self.ptdtype)} | "
               f"{max_iters} iterations")
        stop_signal.starting = False

    def exit_stopped(self, iter_num):
        """Exit 128 + the signal (143 SIGTERM, 130 Ctrl-C) as a killed process would, which a
        scheduler reads as "stopped", once this iteration is saved; a stop that was not saved, or
        for a failure (a full disk): exit 1."""
        stop, resume = self.guard.stop, f"--init_from=resume --out_dir={self.out_dir}"
        why = stop.name or f"a {'failure' if self.guard.failed else 'signal'} on another rank"
        if self.saved_iter != iter_num:
            held = f"holds iter {self.saved_iter}"
            if self.saved_iter is None:
                held = "was never written"
            print0(f"stopped after iter {iter_num} ({why}) without saving it: {self.ckpt_path} "
                   f"{held}; the iterations since are lost")
            teardown_distributed(1)
        if self.guard.failed:
            print0(f"stopped after iter {iter_num} by a failure: {why}; checkpoint "
                   f"{self.ckpt_path}; once that is fixed, continue with {resume}")
            teardown_distributed(1)
        # the grace a stop needs
        took = f", {time.monotonic() - stop.at:.0f} s after the signal" if stop.at else ""
        print0(f"stopped by {why} after iter {iter_num}{took}: checkpoint {self.ckpt_path}; "
               f"continue with {resume}")
        teardown_distributed(128 + (stop.signal or signal.SIGTERM))


def start_run(config, script, data_kind, init_maker=None):
    """Checks, the out_dir lock, ranks, device, precision, seed; on resume its ckpt.pt -> Run.
    data_kind: the records the script trains on ('sft', 'dpo', 'rl'); init_maker: the command that
    makes the default init_from."""
    c = config
    # until the run begins a signal stops at once, with one line, removing half-written files
    stop_signal.install()
    check_run(c, data_kind, init_maker)
    # a second run into a live run's out_dir stops before it changes anything
    lock_out_dir(c["out_dir"])
    rank, world_size, device = setup_distributed(c["device"], c["dist_timeout"])
    # the names' commits, resolved by each process before the group existed
    hub.check_same_on_all_ranks(c.get("hub"))
    cp = context.setup(c.get("context_parallel", 1), rank, world_size, c["dist_timeout"])
    torch.manual_seed(c["seed"])
    dtype, ptdtype, autocast = precision(device, c["dtype"], c["parallel"], world_size)
    resume = c["init_from"] == "resume"
    ckpt_path = os.path.join(c["out_dir"], "ckpt.pt")
    resumed = load_checkpoint(ckpt_path) if resume else None
    if c["overwrite"] and not resume and rank == 0:
        clear_out_dir(c["out_dir"])
    elif rank == 0 and (moved := finish_export(c["out_dir"])):
        print0(f"note: {', '.join(moved)}: moved into place, finishing an export that a kill cut "
               f"short")
    counts = resumed and resumed.get("guard")
    return Run(config=c, script=os.path.basename(script), rank=rank, world_size=world_size,
               device=device, dtype=dtype, ptdtype=ptdtype, autocast=autocast, cp=cp,
               out_dir=c["out_dir"], ckpt_path=ckpt_path, resumed=resumed,
               guard=StepGuard(c["max_bad_steps"], ckpt_path, counts),
               saved_iter=resumed and resumed["iter_num"])


def clear_out_dir(out_dir):
    """Start over: nothing of the previous run may pass for ours."""
    old = [f for f in os.listdir(out_dir) if f.startswith("ckpt-") or f in (
        "ckpt.pt", "hf", "adapter", EXPORT_TMP, EXPORT_NEW, EXPORT_OLD)]
    for path in (os.path.join(out_dir, f) for f in old):
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def check_run(c, data_kind, init_maker=None):
    """What RULES cannot say, before any data is tokenized or model loaded: one `config error:` line
    each."""
    if c["device"] == "cuda" and not torch.cuda.is_available():
        fail("config error: device='cuda'; this machine has no CUDA GPU (torch.cuda.is_available() "
             "is False); use 'auto' or 'cpu'")
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world % c.get("context_parallel", 1):
        fail(context_parallel_error(c, world))
    try:
        lora.check_settings(c, world)
    except ValueError as e:
        fail(f"config error: {e}")
    hf_folder = os.path.isfile(os.path.join(c["init_from"], "config.json"))
    if c["init_from"] not in ("scratch", "resume") and not hf_folder:
        fail(init_from_error(c["init_from"], data_kind, init_maker))
    if c["init_from"] != "resume":
        try:
            check_kind(c["data"], c["data_split"], c["val_data"], c["val_split"], data_kind,
                       c.get("fields"))
        except SystemExit as e:
            fail(e.code)
    check_writable(c["out_dir"])
    taken = os.path.exists(os.path.join(c["out_dir"], "ckpt.pt"))
    if c["init_from"] != "resume" and not c["overwrite"] and taken:
        fail(f"config error: {c['out_dir']} already holds a run (ckpt.pt); continue it with "
             f"--init_from=resume, or start over there with --overwrite=True, or choose another "
             f"out_dir")


def context_parallel_error(c, world):
    cp, budget = c["context_parallel"], c["microbatch_tokens"]
    ckpt_path = os.path.join(c["out_dir"], "ckpt.pt")
    saved = c["init_from"] == "resume" and load_checkpoint(ckpt_path)["config"]
    same = saved and saved.get("context_parallel") == cp
    to_resume = (f"; to resume it in {world} process{'es' * (world > 1)}, pass "
                 f"--context_parallel=1 and a --microbatch_tokens that holds its longest sequence "
                 f"(--microbatch_tokens={cp * budget} does: {cp} x {budget})") if saved else ""
    return (f"config error: context_parallel={cp}"
            + " (the value of the run being resumed)" * bool(same)
            + f"; it must divide the number of processes ({world}): each group of that many ranks "
            f"splits one micro-batch's tokens (1: no context parallelism){to_resume}")


def init_from_error(init_from, data_kind, init_maker):
    """init_from names no model folder: what it should be, and how to make the one the script
    expects."""
    hint = ""
    if init_maker:
        pair = config_leaving(init_from)
        made = f"this one with `{pair}`" if pair else f"the default one with `{init_maker}`"
        hint = f"; {data_kind.upper()} starts from a fine-tuned model: make {made}"
    # the path wins over the name
    if os.path.isdir(init_from) and hub.spelt_as_name(init_from):
        return (f"config error: init_from={init_from!r} is a local folder, read before any hub "
                f"name, and it holds no config.json: pass a Hugging Face model folder, or move "
                f"that folder away to read the hub repo of that name")
    return (f"config error: init_from={init_from!r}; it is neither 'scratch', 'resume', a Hugging "
            f"Face model folder (with a config.json) nor a hub name (org/name[@revision]){hint}")


def check_writable(out_dir):
    """Can we write where the run will live? Better now than after an hour of training."""
    test = os.path.join(out_dir, f".write_test_{os.getpid()}")
    try:
        os.makedirs(out_dir, exist_ok=True)
        with open(test, "w") as f:
            f.write("ok")
    except OSError as e:
        fail(f"config error: out_dir={out_dir!r}; cannot write there ({e.strerror}); choose a "
             f"writable folder, or free space there")
    finally:
        # created, then refused its bytes (a full disk): gone all the same
        if os.path.lexists(test):
            os.remove(test)


def config_leaving(folder):
    """The command that leaves folder (out/<run>/hf) when a config/ file writes out/<run>."""
    run = os.path.dirname(os.path.normpath(folder))
    configs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "config")
    for path in sorted(glob.glob(os.path.join(configs, "*.py"))):
        name = os.path.basename(path)
        if re.search(rf'^out_dir = "{re.escape(run)}"', open(path).read(), re.M):
            return f"python train_{name.split('_')[0]}.py config/{name}"
    return None


class StepGuard:
    """One all-reduce per step: a non-finite loss or gradient norm on any rank skips the update
    (max_bad_steps in a row stop the run), and the ranks agree on a stop. A step that trained
    nothing neither counts nor breaks a run. The counts are the run's: saved with each checkpoint
    (counts()), a resumed run goes on from them."""

    def __init__(self, max_bad_steps, ckpt_path, counts=None, stop=stop_signal):
        self.max_bad_steps, self.ckpt_path, self.stop = max_bad_steps, ckpt_path, stop
        # a checkpoint of an older nanopack has none
        counts = counts or {}
        self.skipped_steps = counts.get("skipped_steps", 0)
        self.bad_in_a_row = counts.get("bad_in_a_row", 0)
        # the stop the ranks agreed on is a failure on one of them (stop.request), not a signal
        self.failed = False

    def counts(self):
        return dict(skipped_steps=self.skipped_steps, bad_in_a_row=self.bad_in_a_row)

    def check(self, model, loss, grad_norm, iter_num):
        """-> (whether to update, whether to stop after this step)."""
        trained = any(p.grad is not None for p in model.parameters() if p.requires_grad)
        # no gradients: the norm is on the CPU
        bad = ~torch.isfinite(loss.float()) | ~torch.isfinite(grad_norm.to(loss.device))
        # 2: a failure, which wins over a signal
        stop = 0 if self.stop.name is None else 1 if self.stop.signal else 2
        flags = torch.cat([bad.view(1), torch.tensor([stop, trained], device=loss.device)]).float()
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        bad, stop, trained = flags.tolist()
        self.failed = stop == 2
        if trained:
            self.bad_in_a_row = self.bad_in_a_row + 1 if bad else 0
        self.skipped_steps += int(bad)
        if bad:
            print0(f"iter {iter_num}: the loss or gradient norm is NaN or infinite: update "
                   f"skipped, weights unchanged ({self.bad_in_a_row} in a row, at most "
                   f"max_bad_steps={self.max_bad_steps})")
        if self.bad_in_a_row >= self.max_bad_steps:
            raise SystemExit(f"stopping: {self.bad_in_a_row} steps in a row had a non-finite loss "
                             f"or gradient norm. The last checkpoint ({self.ckpt_path}, if one was "
                             f"written) holds finite weights. Lower learning_rate or check the "
                             f"data, then resume or start again.")
        return not bad, bool(stop)


def clip_grad_norm(model, max_norm):
    """Clip the trained parameters' gradients to max_norm (0: no clipping) -> their norm before
    clipping."""
    params = [p for p in model.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    # FSDP2: a DTensor
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


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
