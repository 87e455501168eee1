"""
A training script's own step on fake tensors, and the memory it holds: what plan.py reports.
plan_step runs the script unchanged (runpy) as rank 0 of a fake process group of `gpus` ranks under
FakeTensorMode: parameters, gradients, optimizer state and activations have sizes but no storage, so
an 8B model plans on a laptop with no weights. Two optimizer steps run; the second, its optimizer
state allocated, is measured by torch's MemTracker (FSDPMemTracker under FSDP2), which sees every
tensor the step allocates.

Swapped, meaning nothing on fake tensors: reading weights (config.json or a preset at its own
vocabulary suffice), checks of weight and loss values, checkpoints and exports (the plan stops
before them), a cached DPO reference (zeros stand for it), a value read from a fake tensor (.item()
and .tolist() read 1s). Data not on this machine ('builtin' too) is the worst case: every
micro-batch filled with sequences of min(max_len, context_parallel x microbatch_tokens / group)
tokens (no shared DPO prompt); data on disk is the run's own first two steps. A rank's micro-batches
are cut to its first two (the largest), standing for its alike rest. RL's worst case: every prompt
the data's longest (or, not on this machine, as long as a group may be), every reply max_new_tokens
long, every group trained (distinct_reward); generation is its own phase, the rank's KV cache its
own category, its middle decode steps skip the model (Decoding).

Not seen: a GPU run is planned on CPU fake tensors at the GPU's precision (bfloat16 compute, FSDP2's
float32 shards) with the CUDA varlen kernel's attention memory (CudaAttention); device='cpu' plans
the CPU's own attention. Kernel workspaces (cuBLAS, compiled code) and tensors a kernel allocates
inside itself are not seen. DDP's reducer runs no fake tensors: a DDP rank is planned unwrapped with
its share of the batch (its buckets are its gradients: gradient_as_bucket_view). RL's decode
attention is planned as the CPU's SDPA holds it (scores over the cached keys).
"""
import glob
import itertools
import os
import re
import runpy
import shutil
import signal
import sys
import tempfile
from contextlib import ExitStack, nullcontext
from unittest import mock

import numpy as np
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp._fully_shard import _fully_shard as fully_shard_module
from torch.distributed._tools.mem_tracker import MemTracker
from torch.testing._internal.distributed.fake_pg import FakeStore

from nanopack import configurator
from nanopack.fakes import (Decoding, cuda_attention, fake_item, fake_tolist,
                            first_step_leftovers, frozen_hook, module_to, on_host)
from nanopack import context
from nanopack import generate as generation
from nanopack import hub
import packing
from nanopack import reference
from nanopack import run as run_start
from nanopack import startup
from data import dataset
from nanopack.env import Trajectory
from nanopack.hf import read_hf_config
from nanopack.metrics import Throughput
from nanopack.rollout import Rollouts
from model import PRESETS, Transformer, config_from_preset

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporaries", "collectives",
              "reference", "kv_cache", "allowance")
# The tracker's categories -> ours. FSDP2's unsharded parameters and gradients are one block's
# gathered / to-be-reduced copies: memory the collectives hold, not shrinking with more GPUs.
TRACKER = {"Parameter": "parameters", "Buffer": "parameters", "Sharded Param": "parameters",
           "Gradient": "gradients", "Sharded Grad": "gradients", "Optstate": "optimizer",
           "OptState": "optimizer", "Activation": "activations", "Inputs": "activations",
           "Temp": "temporaries", "Other": "temporaries", "Unsharded Param": "collectives",
           "Unsharded Grad": "collectives", "All Gather": "collectives",
           "Reduce Scatter": "collectives"}
# what the patches below fall back to
REAL_MAKE_BATCH = packing.make_batch
REWARDS = itertools.count()


class Done(Exception):
    """Raised at the start of the third step: two steps ran."""


class PhaseTracker:
    """The tracker, remembering the phase (forward, backward, optimizer, generation) of its peak."""

    def __init__(self, model, optimizer):
        fsdp = hasattr(model, "set_requires_gradient_sync") and dist.is_initialized()
        self.tracker = FSDPMemTracker(model, optimizer) if fsdp else MemTracker()
        # the state of the steps before
        self.tracker.track_external(optimizer, *([] if fsdp else [model]))
        self.phase = "forward"
        # each phase's own peak (bytes), a later micro-batch's apart: plan.py fits a line to each
        self.phase_peaks, self.microbatches = {}, 0
        # RL's generation (Decoding) while it runs; its KV cache at the peak
        self.decoding, self.kv_cache = None, 0

        # the peaks, global and per phase, only: per-module peaks were 80% of an 8B LoRA plan's time
        def update_peak_stats(state):
            tracker = self.tracker
            for device, snap in tracker._curr_mem_snap.items():
                phase = ("optimizer" if tracker._in_opt else "generation" if self.decoding
                         else "backward" if tracker._mod_tracker.is_bw else "forward")
                later = self.microbatches > 1 and phase in ("forward", "backward")
                key = phase + ", later" * later
                self.phase_peaks[key] = max(self.phase_peaks.get(key, 0), snap["Total"])
                if tracker._peak_mem.get(device, 0) < snap["Total"]:
                    tracker._peak_mem[device] = snap["Total"]
                    tracker._peak_mem_snap[device] = dict(snap)
                    self.phase = phase
                    self.kv_cache = self.decoding.cache_bytes() if self.decoding else 0
        self.tracker._update_peak_stats = update_peak_stats

        # a training or generation forward starts the module stats anew; a no-grad one does not
        def new_forward(module, inputs):
            if (module is model and not self.tracker._mod_tracker.is_bw
                    and (torch.is_grad_enabled() or self.decoding)):
                self.tracker.reset_mod_stats()
                self.microbatches += torch.is_grad_enabled()
        # registered before the tracker's
        self.hook = torch.nn.modules.module.register_module_forward_pre_hook(new_forward)
        # a no-grad policy forward (adapters_off's reference): its tensors count, its stats not
        policy = {id(m) for m in model.modules()}
        for name in ("_pre_fw_hook", "_post_fw_hook"):
            hook = getattr(self.tracker, name)
            setattr(self.tracker, name, lambda module, *a, hook=hook: None if id(module) in policy
                    and not torch.is_grad_enabled() else hook(module, *a))
        # the end of backward closes every module that ran without grad, a frozen teacher's too,
        # whose stats the student's forward reset after it ran: nothing to close (was a KeyError)
        post_bw = self.tracker._post_bw_hook
        self.tracker._post_bw_hook = lambda module, *a: (
            post_bw(module, *a) if module in self.tracker.memory_tracking else None)

    def __enter__(self):
        self.tracker.__enter__()

    def __exit__(self, *exc):
        self.tracker.__exit__(*exc)
        self.hook.remove()

    def peak(self):
        """-> {category: bytes} at the peak moment."""
        out = dict.fromkeys(CATEGORIES, 0)
        for snap in self.tracker.get_tracker_snapshot("peak").values():
            for key, nbytes in snap.items():
                if key != "Total":
                    out[TRACKER.get(str(getattr(key, "value", key)), "temporaries")] += nbytes
        # made in the model's forward: the tracker counts it as activations
        out["activations"] -= self.kv_cache
        out["kv_cache"] += self.kv_cache
        return out


def worst_case_data(c, group_size, max_seq_len, gpus):
    """Token data of one step's units (SFT examples, DPO pairs: chosen and rejected differ from
    their first token), every sequence as long as allowed, all trained; c["batch_size"] cut to two
    micro-batches a rank, since later ones hold what the second does (a plan's time grows with
    them) -> (data, the cut's factor)."""
    group_tokens = c["microbatch_tokens"] * c["context_parallel"]
    n = max(1, min(c["max_len"], group_tokens // group_size, max_seq_len))
    per_microbatch = max(1, group_tokens // (n * group_size))
    units = min(c["batch_size"], 2 * per_microbatch * (gpus // c["context_parallel"]))
    scale, c["batch_size"] = c["batch_size"] / units, units
    # chosen 1, rejected 2
    ids = np.ones((units, group_size, n), dtype=np.int64) + np.arange(group_size)[None, :, None]
    offsets = np.arange(units * group_size + 1, dtype=np.int64) * n
    mask = np.ones(units * group_size * n, dtype=np.uint8)
    return dict(ids=ids.reshape(-1), offsets=offsets, loss_mask=mask), scale


def config_keys(script):
    """The config keys of a training script: the names its top level assigns (`name = default`)
    and the machinery's (nanopack/keys.py). A script that runs no step through start_run and set_lr
    (sample.py, plot.py) cannot be planned: one line says so."""
    from nanopack import keys
    with open(script) as f:
        text = f.read()
    if not all(f"{name}(" in text for name in ("start_run", "set_lr")):
        raise SystemExit(f"plan.py: {script} is not a training script (it calls no start_run and "
                         f"set_lr, whose step a plan runs); plan train_sft.py, train_dpo.py, "
                         f"train_rl.py or a copy of one")
    return set(re.findall(r"^(\w+) = ", text, re.M)) | set(configurator.declared(keys))


def plan_step(script, args, gpus=1, device="cuda", fake=True, reuse=None):
    """Run `script` with `args` for two steps as rank 0 of `gpus` -> dict of the second step's peak
    memory by category (bytes), its phase, tokens and FLOPs on this rank, and the microbatch_tokens
    from which its step is one micro-batch on every rank. fake=False: real tensors (gpus > 1: each
    rank of a torchrun gloo group), what the tests compare the plan against. reuse: a
    fake_reuse.Reuse shared by plans that differ only in microbatch_tokens (their models)."""
    keys = config_keys(script)
    out_dir = tempfile.mkdtemp(prefix="plan-")
    swapped = [f"--out_dir={out_dir}", "--max_iters=1000000000", "--log_interval=1000000000",
               "--eval_interval=0", "--eval_examples=0", "--overwrite=True", "--wandb_log=False",
               "--compile=False", "--device=cpu", "--reward=nanopack.fake_step:distinct_reward",
               "--reward_weights=None"]
    swapped += ["--dtype=bfloat16"] * (device == "cuda")
    script_args = [script, *args] + [a for a in swapped if a[2:].partition("=")[0] in keys]
    state = dict(steps=0, tokens=0, flops=0.0, tracker=None, config=None, whole_step_tokens=0)
    patches = patch_table(state, gpus, fake, reuse)
    run_script(script, script_args, patches, state, gpus, device, fake, out_dir, reuse)
    return report(script, state)


def fake_process_group(gpus, fake):
    """The patches that make this process rank 0 of `gpus`: a fake group, or torchrun's gloo."""
    def setup_distributed(device_name="auto", timeout_s=300):
        # a reused group: the one the reused models are sharded over
        if gpus > 1 and not dist.is_initialized():
            kind, options = (("fake", dict(store=FakeStore(), rank=0, world_size=gpus)) if fake
                             else ("gloo", {}))
            dist.init_process_group(kind, **options)
        return dist.get_rank() if gpus > 1 else 0, gpus, torch.device("cpu")

    # FSDP2's device mesh, built outside fake mode: its rank map is read on the host
    def default_mesh():
        with unset_fake_temporarily():
            return init_device_mesh("cpu", (gpus,))

    return [(run_start, "setup_distributed", setup_distributed),
            (fully_shard_module, "_init_default_mesh", default_mesh)]


def startup_patches(state, real, gpus, fake, reuse):
    """The start-up's patches: worst-case data where none is on disk, no weights, no DDP."""
    def prepare_data(c, out_dir, tok, kind, max_seq_len, builtin_sizes=None):
        state["kind"], state["max_seq_len"] = kind, max_seq_len
        if not on_disk(c["data"]):
            return None
        return real["prepare_data"](c, out_dir, tok, kind, max_seq_len, builtin_sizes)

    def load_data(data_dir, tok):
        if data_dir is not None:
            return real["load_data"](data_dir, tok)
        # before worst_case_data cuts it
        state["worst_case_units"] = state["config"]["batch_size"]
        data, state["scale"] = worst_case_data(state["config"], 2 if state["kind"] == "dpo" else 1,
                                               state["max_seq_len"], gpus)
        return data, data

    # a preset at its own vocabulary: the byte tokenizer would shrink the head
    def initial_config(start, tok):
        if start["init_from"] == "scratch":
            vocab = max(PRESETS[start["preset"]]["vocab_size"], tok.vocab_size)
            model_config = config_from_preset(start["preset"], vocab_size=vocab)
        else:
            model_config = read_hf_config(start["init_from"])
        state["max_seq_len"] = model_config.max_seq_len
        return model_config

    def build_model(*a, **k):
        with mock.patch.object(torch.nn.Module, "to", module_to):
            return real["build_model"](*a, **k)

    # DDP's reducer runs no fake tensors; its buckets are the gradients
    def wrap_model(model, parallel, *a):
        return model if parallel == "ddp" else real["wrap_model"](model, parallel, *a)

    def start_run(config, *a, **k):
        # what load_data and read_prompts read
        state["config"] = config
        return real["start_run"](config, *a, **k)

    def load_model(*a, **k):
        build = lambda: real["load_model"](*a, **k)
        model, raw_model = reuse.model("policy", 0, build) if reuse else build()
        # what the tracker follows
        state["model"] = model
        return model, raw_model

    patches = [(run_start, name, new) for name, new in [
        ("start_run", start_run),
        ("check_kind", lambda data, *a: on_disk(data) and real["check_kind"](data, *a))]]
    patches += [(startup, name, new) for name, new in [
        ("prepare_data", prepare_data), ("load_data", load_data),
        ("initial_config", initial_config),
        ("build_model", build_model), ("load_model", load_model), ("wrap_model", wrap_model),
        ("refuse_non_finite", lambda *a: None), ("base_weights", lambda init_from: None),
        ("load_hf_weights", lambda *a, **k: None),
        ("from_pretrained", lambda folder, dtype=None: Transformer(read_hf_config(folder)))]]
    return patches


def rl_patches(state, real, fake):
    """RL's patches: the longest prompts, every reply max_new_tokens long."""
    # every prompt as long as the data's longest, or (not on this machine) as a group may hold
    def read_prompts(source, n, tok, limit, *args, **kwargs):
        if on_disk(source) or source == "builtin":
            found = real["read_prompts"](source, n, tok, limit, *args, **kwargs)
            return [max(found, key=lambda p: len(p[0]))] * len(found)
        c, positions = state["config"], state["max_seq_len"]
        group, new = c["microbatch_tokens"] * c["context_parallel"], c["max_new_tokens"]
        room = group - c["k"] * new if c["prefix_sharing"] else group // c["k"] - new
        ids = [1] * max(1, min(positions - new, room))
        limit(ids, f"{source} (not on this machine: prompts of {len(ids)} tokens planned)")
        return [(ids, [dict(role="user", content="")], {}, source)] * (n or c["prompts_per_step"])

    # one draw for all rows; replies differ from their first token, each stopped by its last
    def generate(model, prompts, max_new_tokens, stop_ids=(), *args, **kwargs):
        # the real run decodes every step: to compare
        decoding = Decoding(model, max_new_tokens if fake else 0)
        with ExitStack() as stack:
            stack.enter_context(mock.patch.object(generation, "sample", decoding.sample))
            if state["tracker"] is not None:
                stack.enter_context(mock.patch.object(state["tracker"], "decoding", decoding))
            out = real["generate"](decoding, prompts, max_new_tokens, (), *args, **kwargs)
        stop = list(stop_ids)[:1] or [1]
        replies = [[1 + i % kwargs.get("num_samples", 1)] + [1] * (len(r) - 2) + stop[:len(r) - 1]
                   for i, r in enumerate(out[0] if kwargs.get("logprobs") else out)]
        return (replies, [[0.0] * len(r) for r in replies]) if kwargs.get("logprobs") else replies

    # multi-turn's worst case: every trajectory max_new_tokens long, every token trained
    def play(self, prompts, keys, k, temperature):
        replies, logps = self.generate(prompts, temperature=temperature, seed=0, keys=keys,
                                       num_samples=k)
        return [Trajectory(prompts[i // k][0], [], None, ids=r, mask=[1] * len(r), logprobs=lp,
                           turns=1) for i, (r, lp) in enumerate(zip(replies, logps))]

    return [(dataset, "read_prompts", read_prompts), (generation, "generate", generate),
            (Rollouts, "play", play)]


def step_patches(state, real, fake, reuse):
    """The step's patches: two micro-batches a rank, the second step measured, then Done."""
    # a rank's first two bins stand for the rest
    def rank_bins(units, lengths, token_budget, rank=0, world_size=1):
        bins = real["rank_bins"](units, lengths, token_budget, rank, world_size)
        # the step measured: from which microbatch_tokens on is it one micro-batch a rank?
        if state["steps"] == 2:
            step = lengths[units]
            # alike units, cut to two micro-batches a rank: the whole step has them all
            if "worst_case_units" in state:
                step = np.full(state["worst_case_units"], step.max())
            busiest = max(step[share].sum() for share in packing.balance(step, world_size))
            state["whole_step_tokens"] = -(-int(busiest) // state["config"]["context_parallel"])
            # absent data: what max_len allows
            c, group = state["config"], 2 if state.get("kind") == "dpo" else 1
            state["longest_unit"] = (min(c["max_len"], state["max_seq_len"]) * group
                                     if "worst_case_units" in state else int(lengths.max()))
            # worst-case units at full length: micro-batches hold whole ones, the search's stairs
            full = "worst_case_units" in state and step.max() == state["longest_unit"]
            state["unit"] = int(step.max()) if full else 0
            # its largest micro-batch (the first: BFD fills it most) and its second
            state["filled"] = max((int(lengths[b].sum()) for b in bins), default=0) if full else 0
            state["later"] = int(lengths[bins[1]].sum()) if full and len(bins) > 1 else 0
        if len(bins) > 2:
            state["scale"], bins = sum(map(len, bins)) / sum(map(len, bins[:2])), bins[:2]
        # the first step only allocates the optimizer state, whose size no micro-batch changes:
        # what its forward and backward leave is made without them (the real run, which the tests
        # compare against, keeps its two micro-batches)
        if state["steps"] == 1 and fake:
            first_step_leftovers(state["model"], state.get("frozen", []),
                                 gradients=not (reuse and reuse.optimizer_state))
            return []
        return bins

    def set_lr(optimizer, lr):
        state["steps"] += 1
        # a reused model's optimizer state, as the first plan's first step allocated it
        if state["steps"] == 1 and reuse and reuse.optimizer_state:
            optimizer.state.update(reuse.optimizer_state)
        # the steady state, the optimizer state allocated: measured from here on
        if state["steps"] == 2:
            if reuse:
                reuse.optimizer_state = optimizer.state
            state["tracker"] = PhaseTracker(state["model"], optimizer)
            state["tracker"].__enter__()
        if state["steps"] == 3:
            raise Done
        return real["set_lr"](optimizer, lr)

    def count(meter, microbatches, data_time):
        tokens, flops = meter.tokens, meter.flops
        # host bookkeeping: lengths in, FLOPs out
        with unset_fake_temporarily():
            real["count"](meter, microbatches, data_time)
        if state["steps"] == 2:
            state["tokens"], state["flops"] = meter.tokens - tokens, meter.flops - flops

    # a frozen copy beside the policy (a live reference, a distillation teacher): its parameters
    # are the 'reference' category
    def frozen_model(*a, **k):
        frozen, build = state.setdefault("frozen", []), lambda: real["frozen_model"](*a, **k)
        frozen.append(reuse.model("frozen", len(frozen), build) if reuse else build())
        return frozen[-1]

    # cached log-probs are computed before training, never seen by the step
    def reference_build(cls, mode, *a, **k):
        return real["build"](cls, "none" if mode == "cached" and fake else mode, *a, **k)

    return [(packing, "rank_bins", rank_bins), (run_start, "set_lr", set_lr),
            (Throughput, "count", count),
            (reference, "frozen_model", frozen_model),
            (reference.Reference, "build", classmethod(reference_build))]


def refuse_resume(config, values, given):
    """configure's init_from='resume': it would read the plan's out_dir."""
    raise configurator.ConfigError(
        "init_from='resume': a plan runs in a folder of its own and loads no "
        "checkpoint; plan the run as it started (its config file and --key=value, its "
        "first init_from): a resumed step holds the same memory")


def patch_table(state, gpus, fake, reuse=None):
    """Every patch a plan runs under: (target, name, new)."""
    real = dict(check_kind=run_start.check_kind, prepare_data=startup.prepare_data,
                load_data=startup.load_data, build_model=startup.build_model,
                wrap_model=startup.wrap_model, start_run=run_start.start_run,
                load_model=startup.load_model, set_lr=run_start.set_lr, count=Throughput.count,
                read_prompts=dataset.read_prompts, generate=generation.generate,
                rank_bins=packing.rank_bins, frozen_model=reference.frozen_model,
                build=reference.Reference.build.__func__)
    patches = fake_process_group(gpus, fake) + startup_patches(state, real, gpus, fake, reuse)
    patches += rl_patches(state, real, fake) + step_patches(state, real, fake, reuse)
    # a hub name: its config.json and tokenizer only, no weights
    patches += [(hub, "PLAN", True),
                # one process stands for every rank: no other rank's commits to compare
                (hub, "check_same_on_all_ranks", lambda pins: None),
                (configurator, "restore_saved", refuse_resume),
                (generation, "packed", on_host(generation.packed)),
                (run_start.StepGuard, "check", lambda self, *a: (True, False)),
                # no step to finish: Ctrl-C and SIGTERM stop a plan at once
                (run_start.stop_signal, "install", lambda: None),
                (context.ContextParallel, "split", on_host(context.ContextParallel.split)),
                # a printed loss, an evaluation
                (torch.Tensor, "item", fake_item),
                # FakeTensor has its own tolist
                (torch.Tensor, "tolist", fake_tolist), (FakeTensor, "tolist", fake_tolist)]
    patches += [(torch.Tensor, name, frozen_hook(getattr(torch.Tensor, name)))
                for name in ("register_hook", "register_post_accumulate_grad_hook")]
    patches += [(module, "make_batch", on_host(REAL_MAKE_BATCH))
                for module in list(sys.modules.values())
                if getattr(module, "make_batch", None) is REAL_MAKE_BATCH]
    return patches


def run_script(script, script_args, patches, state, gpus, device, fake, out_dir, reuse=None):
    """Run the script under the patches until Done; restore signals, the group (unless reused),
    the folder."""
    env = dict(WORLD_SIZE=str(gpus), RANK="0", LOCAL_RANK="0") if fake else {}
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    fake_mode = (reuse.fake_mode if reuse else FakeTensorMode(allow_non_fake_inputs=True)
                 ) if fake else None
    with ExitStack() as stack:
        for target, name, new in patches:
            stack.enter_context(mock.patch.object(target, name, new))
        stack.enter_context(mock.patch.dict(os.environ, env))
        stack.enter_context(mock.patch.object(sys, "argv", script_args))
        # the CUDA kernel's memory, not the CPU fallback's
        if device == "cuda" and fake:
            stack.enter_context(mock.patch("model.varlen_attention", cuda_attention))
        try:
            with fake_mode or nullcontext():
                runpy.run_path(script, run_name="__main__")
        except Done:
            pass
        finally:
            if state["steps"] >= 2:
                state["tracker"].__exit__(None, None, None)
            if dist.is_initialized() and not reuse:
                dist.destroy_process_group()
            for s, h in handlers.items():
                signal.signal(s, h)
            # the run's folder: logs, a lock, prepared data
            shutil.rmtree(out_dir, ignore_errors=True)


def report(script, state):
    """The second step's figures, scaled from its two micro-batches a rank to the whole step."""
    if state["steps"] < 3:
        raise SystemExit(f"plan: {script} ended before its second step finished")
    by_category = state["tracker"].peak()
    if state.get("frozen"):
        local = lambda p: p.to_local() if hasattr(p, "to_local") else p
        moved = sum(local(p).untyped_storage().nbytes() for frozen in state["frozen"]
                    for p in frozen.parameters())
        by_category["parameters"] -= moved
        by_category["reference"] += moved
    # a step cut to two micro-batches a rank counts as the whole step
    scale = state.get("scale", 1.0)
    return dict(by_category=by_category, phase=state["tracker"].phase,
                phase_peaks=state["tracker"].phase_peaks,
                tokens=state["tokens"] * scale, flops=state["flops"] * scale,
                config=state["config"], whole_step_tokens=state["whole_step_tokens"],
                longest_unit=state.get("longest_unit", 0), unit=state.get("unit", 0),
                filled=state.get("filled", 0), later=state.get("later", 0))


def distinct_reward(messages, reply, **fields):
    """RL's reward in a plan: a new value for every reply, so every group trains (worst case)."""
    return float(next(REWARDS))


def on_disk(data):
    """Data on this machine: a path, or a glob or comma-separated list (a hub split's files) of
    files that are there."""
    return data != "builtin" and (os.path.exists(data)
                                  or all(glob.glob(p.strip()) for p in data.split(",")))
