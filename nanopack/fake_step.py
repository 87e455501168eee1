"""
A training script's own step on fake tensors, and the memory it holds: what plan.py reports. plan_step runs the script
unchanged (runpy) as rank 0 of a fake process group of `gpus` ranks under FakeTensorMode: parameters, gradients,
optimizer state and activations have sizes but no storage, so an 8B model plans on a laptop with no weights. Two
optimizer steps run; the second, its optimizer state allocated, is measured by torch's MemTracker (FSDPMemTracker
under FSDP2), which sees every tensor the step allocates.

Swapped, meaning nothing on fake tensors: reading weights (config.json or a preset at its own vocabulary suffice),
checks of weight and loss values, checkpoints and exports (the plan stops before them), a cached DPO reference (zeros
stand for it), a value read from a fake tensor (.item() and .tolist() read 1s). Data not on this machine ('builtin'
too) is the worst case: every micro-batch filled with sequences of min(max_len, context_parallel x microbatch_tokens /
group) tokens (no shared DPO prompt); data on disk is the run's own first two steps. A rank's micro-batches are cut to
its first two (the largest), standing for its alike rest. RL's worst case: every prompt the data's longest (or, not on
this machine, as long as a group may be), every reply max_new_tokens long, every group trained (distinct_reward);
generation is its own phase, the rank's KV cache its own category, its middle decode steps skip the model (Decoding).

Not seen: a GPU run is planned on CPU fake tensors at the GPU's precision (bfloat16 compute, FSDP2's float32 shards)
with the CUDA varlen kernel's attention memory (CudaAttention); device='cpu' plans the CPU's own attention. Kernel
workspaces (cuBLAS, compiled code) and tensors a kernel allocates inside itself are not seen. DDP's reducer runs no fake
tensors: a DDP rank is planned unwrapped with its share of the batch (its buckets are its gradients:
gradient_as_bucket_view). RL's decode attention is planned as the CPU's SDPA holds it (scores over the cached keys).
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
from nanopack import context
from nanopack import generate as generation
from nanopack import hub
import packing
from nanopack import reference
from nanopack import run as run_start
from nanopack import startup
from data import dataset
from nanopack.hf import read_hf_config
from nanopack.metrics import Throughput
from model import PRESETS, Transformer, config_from_preset

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporaries", "collectives", "reference",
              "kv_cache", "allowance")
# The tracker's categories -> ours. FSDP2's unsharded parameters and gradients are the all-gathered / to-be-reduced
# copies of one block: they are memory the collectives hold, and do not shrink with more GPUs.
TRACKER = {"Parameter": "parameters", "Buffer": "parameters", "Sharded Param": "parameters", "Gradient": "gradients",
           "Sharded Grad": "gradients", "Optstate": "optimizer", "OptState": "optimizer", "Activation": "activations",
           "Inputs": "activations", "Temp": "temporaries", "Other": "temporaries", "Unsharded Param": "collectives",
           "Unsharded Grad": "collectives", "All Gather": "collectives", "Reduce Scatter": "collectives"}
# what the patches below fall back to
REAL_ITEM, REAL_TOLIST, REAL_TO = torch.Tensor.item, torch.Tensor.tolist, torch.nn.Module.to
REAL_SAMPLE, REAL_MAKE_BATCH = generation.sample, packing.make_batch
NO_HOOKS = torch.utils.hooks.OrderedDict()
REWARDS = itertools.count()


class Done(Exception):
    """Raised at the start of the third step: two steps ran."""


class PhaseTracker:
    """The tracker, remembering the phase (forward / backward / optimizer / generation) of its peak."""

    def __init__(self, model, optimizer):
        fsdp = hasattr(model, "set_requires_gradient_sync") and dist.is_initialized()
        self.tracker = FSDPMemTracker(model, optimizer) if fsdp else MemTracker()
        self.tracker.track_external(optimizer, *([] if fsdp else [model]))  # the state of the steps before
        self.phase = "forward"
        self.decoding, self.kv_cache = None, 0  # RL's generation (Decoding) while it runs; its KV cache at the peak

        def update_peak_stats(state):  # the global peak and its phase only: the per-module peaks, unread, were 80% of
            # an 8B LoRA plan's time (a loop over every module at every op)
            for device, snap in self.tracker._curr_mem_snap.items():
                if self.tracker._peak_mem.get(device, 0) < snap["Total"]:
                    self.tracker._peak_mem[device], self.tracker._peak_mem_snap[device] = snap["Total"], dict(snap)
                    self.phase = ("optimizer" if self.tracker._in_opt else "generation" if self.decoding else
                                  "backward" if self.tracker._mod_tracker.is_bw else "forward")
                    self.kv_cache = self.decoding.cache_bytes() if self.decoding else 0
        self.tracker._update_peak_stats = update_peak_stats

        def new_forward(module, inputs):  # a training or generation forward starts the module stats anew (the second
            # step's too); a no-grad forward (adapters_off's reference) does not
            if module is model and not self.tracker._mod_tracker.is_bw and (torch.is_grad_enabled() or self.decoding):
                self.tracker.reset_mod_stats()
        self.hook = torch.nn.modules.module.register_module_forward_pre_hook(new_forward)  # before the tracker's
        policy = {id(m) for m in model.modules()}  # a no-grad forward of the policy's modules (adapters_off's
        for name in ("_pre_fw_hook", "_post_fw_hook"):  # reference) is no second iteration: its tensors count,
            hook = getattr(self.tracker, name)  # its module stats not
            setattr(self.tracker, name, lambda module, *a, hook=hook: None if id(module) in policy and
                    not torch.is_grad_enabled() else hook(module, *a))

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
        out["activations"] -= self.kv_cache  # made in the model's forward: the tracker counts it as activations
        out["kv_cache"] += self.kv_cache
        return out


def worst_case_data(c, group_size, max_seq_len, gpus):
    """Token data of one step's units (SFT examples, DPO pairs: chosen and rejected differ from their first token),
    every sequence as long as allowed, all trained; c["batch_size"] cut to two micro-batches a rank, since later ones
    hold what the second does (a plan's time grows with them) -> (data, the cut's factor)."""
    n = max(1, min(c["max_len"], c["microbatch_tokens"] * c["context_parallel"] // group_size, max_seq_len))
    per_microbatch = max(1, c["microbatch_tokens"] * c["context_parallel"] // (n * group_size))
    units = min(c["batch_size"], 2 * per_microbatch * (gpus // c["context_parallel"]))
    scale, c["batch_size"] = c["batch_size"] / units, units
    ids = np.ones((units, group_size, n), dtype=np.int64) + np.arange(group_size)[None, :, None]  # chosen 1, rejected 2
    offsets = np.arange(units * group_size + 1, dtype=np.int64) * n
    return dict(ids=ids.reshape(-1), offsets=offsets, loss_mask=np.ones(units * group_size * n, dtype=np.uint8)), scale


def config_keys(script):
    """The config keys of a training script: the names its top level assigns (`name = default`). A script that runs no
    step through start_run and set_lr (sample.py, plot.py) cannot be planned: one line says so."""
    with open(script) as f:
        text = f.read()
    if not all(f"{name}(" in text for name in ("start_run", "set_lr")):
        raise SystemExit(f"plan.py: {script} is not a training script (it calls no start_run and "
                         f"set_lr, whose step a plan runs); plan train_sft.py, train_dpo.py, "
                         f"train_rl.py or a copy of one")
    return set(re.findall(r"^(\w+) = ", text, re.M))


def plan_step(script, args, gpus=1, device="cuda", fake=True):
    """Run `script` with `args` for two steps as rank 0 of `gpus` -> dict of the second step's peak memory by category
    (bytes), its phase, tokens and FLOPs on this rank, and the microbatch_tokens from which its step is one micro-batch
    on every rank. fake=False: real tensors (gpus > 1: each rank of a torchrun gloo group), what the tests compare the
    plan against."""
    keys = config_keys(script)
    out_dir = tempfile.mkdtemp(prefix="plan-")
    swapped = [f"--out_dir={out_dir}", "--max_iters=1000000000", "--log_interval=1000000000", "--eval_interval=0",
               "--eval_examples=0", "--overwrite=True", "--wandb_log=False", "--compile=False", "--device=cpu",
               "--reward=nanopack.fake_step:distinct_reward", "--reward_weights=None"]
    swapped += ["--dtype=bfloat16"] * (device == "cuda")
    script_args = [script, *args] + [a for a in swapped if a[2:].partition("=")[0] in keys]
    state = dict(steps=0, tokens=0, flops=0.0, tracker=None, config=None, whole_step_tokens=0)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None

    def setup_distributed(device_name="auto", timeout_s=300):  # real tensors on more ranks: torchrun's gloo group
        if gpus > 1:
            kind, options = ("fake", dict(store=FakeStore(), rank=0, world_size=gpus)) if fake else ("gloo", {})
            dist.init_process_group(kind, **options)
        return dist.get_rank() if gpus > 1 else 0, gpus, torch.device("cpu")

    def prepare_data(c, out_dir, tok, kind, max_seq_len, builtin_sizes=None):
        state["kind"], state["max_seq_len"] = kind, max_seq_len
        return real["prepare_data"](c, out_dir, tok, kind, max_seq_len, builtin_sizes) if on_disk(c["data"]) else None

    def load_data(data_dir, tok):
        if data_dir is not None:
            return real["load_data"](data_dir, tok)
        state["worst_case_units"] = state["config"]["batch_size"]  # before worst_case_data cuts it
        data, state["scale"] = worst_case_data(state["config"], 2 if state["kind"] == "dpo" else 1,
                                               state["max_seq_len"], gpus)
        return data, data

    def initial_config(start, tok):  # a preset at its own vocabulary: the byte tokenizer would shrink the head
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

    def wrap_model(model, parallel, *a):  # DDP's reducer runs no fake tensors; its buckets are the gradients
        return model if parallel == "ddp" else real["wrap_model"](model, parallel, *a)

    def default_mesh():  # FSDP2's device mesh, built outside fake mode: its rank map is read on the host
        with unset_fake_temporarily():
            return init_device_mesh("cpu", (gpus,))

    def start_run(config, *a, **k):
        state["config"] = config  # what load_data and read_prompts read
        return real["start_run"](config, *a, **k)

    def load_model(*a, **k):
        model, raw_model = real["load_model"](*a, **k)
        state["model"] = model  # what the tracker follows
        return model, raw_model

    def read_prompts(source, n, tok, limit, *args):  # RL: every prompt as long as the data's longest, or (the data
        # not on this machine) as long as a group may be (train_rl.check_prompt_length)
        if on_disk(source) or source == "builtin":
            found = real["read_prompts"](source, n, tok, limit, *args)
            return [max(found, key=lambda p: len(p[0]))] * len(found)
        c, positions = state["config"], state["max_seq_len"]
        group, new = c["microbatch_tokens"] * c["context_parallel"], c["max_new_tokens"]
        ids = [1] * max(1, min(positions - new, group - c["k"] * new if c["prefix_sharing"] else group // c["k"] - new))
        limit(ids, f"{source} (not on this machine: prompts of {len(ids)} tokens planned)")
        return [(ids, [dict(role="user", content="")], {}, source)] * (n or c["prompts_per_step"])

    def generate(model, prompts, max_new_tokens, stop_ids=(), *args, **kwargs):  # RL: every reply max_new_tokens
        # long, one draw for all rows; a prompt's replies differ from their first token (only the prompt is shared),
        # each stopped by its last token (a truncated reply may leave the loss: mask_truncated)
        decoding = Decoding(model, max_new_tokens if fake else 0)  # the real run decodes every step: to compare
        with ExitStack() as stack:
            stack.enter_context(mock.patch.object(generation, "sample", decoding.sample))
            if state["tracker"] is not None:
                stack.enter_context(mock.patch.object(state["tracker"], "decoding", decoding))
            replies = real["generate"](decoding, prompts, max_new_tokens, (), *args, **{**kwargs, "generator": None})
        stop = list(stop_ids)[:1] or [1]
        return [[1 + i % kwargs.get("num_samples", 1)] + [1] * (len(r) - 2) + stop[:len(r) - 1]
                for i, r in enumerate(replies)]

    def rank_bins(units, lengths, token_budget, rank=0, world_size=1):  # a rank's first two bins stand for the rest
        bins = real["rank_bins"](units, lengths, token_budget, rank, world_size)
        if state["steps"] == 2:  # the step measured: from which microbatch_tokens on is it one micro-batch a rank?
            step = lengths[units]
            if "worst_case_units" in state:  # alike units, cut to two micro-batches a rank: the whole step has them all
                step = np.full(state["worst_case_units"], step.max())
            busiest = max(step[share].sum() for share in packing.balance(step, world_size))
            state["whole_step_tokens"] = -(-int(busiest) // state["config"]["context_parallel"])
            c, group = state["config"], 2 if state.get("kind") == "dpo" else 1  # absent data: what max_len allows
            state["longest_unit"] = min(c["max_len"], state["max_seq_len"]) * group if "worst_case_units" in state \
                else int(lengths.max())
        if len(bins) > 2:
            state["scale"], bins = sum(map(len, bins)) / sum(map(len, bins[:2])), bins[:2]
        return bins

    def set_lr(optimizer, lr):
        state["steps"] += 1
        if state["steps"] == 2:  # the steady state, the optimizer state allocated: measured from here on
            state["tracker"] = PhaseTracker(state["model"], optimizer)
            state["tracker"].__enter__()
        if state["steps"] == 3:
            raise Done
        return real["set_lr"](optimizer, lr)

    def count(meter, microbatches, data_time):
        tokens, flops = meter.tokens, meter.flops
        with unset_fake_temporarily():  # host bookkeeping: lengths in, FLOPs out
            real["count"](meter, microbatches, data_time)
        if state["steps"] == 2:
            state["tokens"], state["flops"] = meter.tokens - tokens, meter.flops - flops

    def refuse_resume(config, values, given):  # configure's init_from='resume': it would read the plan's out_dir
        raise configurator.ConfigError("init_from='resume': a plan runs in a folder of its own and loads no "
                                       "checkpoint; plan the run as it started (its config file and --key=value, its "
                                       "first init_from): a resumed step holds the same memory")

    # a live reference's frozen copy: its parameters are its own category
    def reference_model(cls, mode, *a):
        ref = real["of_model"](cls, mode, *a)
        state["reference"] = ref.model if mode == "live" else None
        return ref

    def reference_build(cls, mode, *a, **k):  # cached log-probs are computed before training, never seen by the step
        return real["build"](cls, "none" if mode == "cached" and fake else mode, *a, **k)

    real = dict(check_kind=run_start.check_kind, prepare_data=startup.prepare_data,
                load_data=startup.load_data, build_model=startup.build_model,
                wrap_model=startup.wrap_model, start_run=run_start.start_run,
                load_model=startup.load_model, set_lr=run_start.set_lr, count=Throughput.count,
                read_prompts=dataset.read_prompts, generate=generation.generate,
                rank_bins=packing.rank_bins, of_model=reference.Reference.of_model.__func__,
                build=reference.Reference.build.__func__)
    patches = [(run_start, name, new) for name, new in [
        ("setup_distributed", setup_distributed), ("start_run", start_run), ("set_lr", set_lr),
        ("check_kind", lambda data, *a: on_disk(data) and real["check_kind"](data, *a))]]
    patches += [(startup, name, new) for name, new in [
        ("prepare_data", prepare_data), ("load_data", load_data),
        ("initial_config", initial_config),
        ("build_model", build_model), ("load_model", load_model), ("wrap_model", wrap_model),
        ("refuse_non_finite", lambda *a: None), ("base_weights", lambda init_from: None),
        ("load_hf_weights", lambda *a, **k: None),
        ("from_pretrained", lambda folder, dtype=None: Transformer(read_hf_config(folder)))]]
    patches += [(hub, "PLAN", True),  # a hub name: its config.json and tokenizer only, no weights
                # one process stands for every rank: no other rank's commits to compare (a collective on fake ranks)
                (hub, "check_same_on_all_ranks", lambda pins: None),
                (configurator, "restore_saved", refuse_resume), (dataset, "read_prompts", read_prompts),
                (generation, "generate", generate),
                (generation, "packed", on_host(generation.packed)), (packing, "rank_bins", rank_bins),
                (fully_shard_module, "_init_default_mesh", default_mesh),
                (run_start.StepGuard, "check", lambda self, *a: (True, False)),
                # a plan has no step to finish: Ctrl-C and SIGTERM stop it at once, not after a step and a checkpoint
                (run_start.stop_signal, "install", lambda: None), (Throughput, "count", count),
                (context.ContextParallel, "split", on_host(context.ContextParallel.split)),
                (torch.Tensor, "item", fake_item),  # a printed loss, an evaluation
                (torch.Tensor, "tolist", fake_tolist), (FakeTensor, "tolist", fake_tolist),  # FakeTensor has its own
                (reference.Reference, "of_model", classmethod(reference_model)),
                (reference.Reference, "build", classmethod(reference_build))]
    patches += [(torch.Tensor, name, frozen_hook(getattr(torch.Tensor, name)))
                for name in ("register_hook", "register_post_accumulate_grad_hook")]
    patches += [(module, "make_batch", on_host(REAL_MAKE_BATCH))
                for module in list(sys.modules.values()) if getattr(module, "make_batch", None) is REAL_MAKE_BATCH]
    env = dict(WORLD_SIZE=str(gpus), RANK="0", LOCAL_RANK="0") if fake else {}
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with ExitStack() as stack:
        for target, name, new in patches:
            stack.enter_context(mock.patch.object(target, name, new))
        stack.enter_context(mock.patch.dict(os.environ, env))
        stack.enter_context(mock.patch.object(sys, "argv", script_args))
        if device == "cuda" and fake:  # the CUDA kernel's memory, not the CPU fallback's
            stack.enter_context(mock.patch("model.varlen_attention", cuda_attention))
        try:
            with fake_mode or nullcontext():
                runpy.run_path(script, run_name="__main__")
        except Done:
            pass
        finally:
            if state["steps"] >= 2:
                state["tracker"].__exit__(None, None, None)
            if dist.is_initialized():
                dist.destroy_process_group()
            for s, h in handlers.items():
                signal.signal(s, h)
            shutil.rmtree(out_dir, ignore_errors=True)  # the run's folder: logs, a lock, prepared data
    if state["steps"] < 3:
        raise SystemExit(f"plan: {script} ended before its second step finished")
    by_category = state["tracker"].peak()
    if state.get("reference") is not None:
        local = lambda p: p.to_local() if hasattr(p, "to_local") else p
        moved = sum(local(p).untyped_storage().nbytes() for p in state["reference"].parameters())
        by_category["parameters"] -= moved
        by_category["reference"] += moved
    scale = state.get("scale", 1.0)  # a step cut to two micro-batches a rank counts as the whole step
    return dict(by_category=by_category, phase=state["tracker"].phase, tokens=state["tokens"] * scale,
                flops=state["flops"] * scale, config=state["config"], whole_step_tokens=state["whole_step_tokens"],
                longest_unit=state.get("longest_unit", 0))


class Decoding:
    """The policy while a plan generates: every reply runs to max_new_tokens, so decode steps differ only in how many
    keys they read. The prefill, the first decode step and the last (the longest keys: the largest temporaries) run the
    model; between them only logits are made (an 8B decode step is ~0.5 s of planning; the KV cache is made once)."""

    def __init__(self, model, steps):
        self.model, self.config, self.steps, self.calls, self.cache = model, model.config, steps, 0, None
        self.skipping = False

    def parameters(self):
        return self.model.parameters()

    def __call__(self, ids, positions, cu_seqlens, *args, cache=None, **kwargs):
        self.calls, self.cache = self.calls + 1, cache
        self.skipping = 2 < self.calls < self.steps
        if self.skipping:
            return torch.empty(len(cu_seqlens) - 1, self.vocab, dtype=self.dtype)
        logits = self.model(ids, positions, cu_seqlens, *args, cache=cache, **kwargs)
        self.vocab, self.dtype = logits.shape[-1], logits.dtype
        return logits

    def sample(self, logits, *args, **kwargs):
        return torch.ones(len(logits), dtype=torch.long) if self.skipping else REAL_SAMPLE(logits, *args, **kwargs)

    def cache_bytes(self):
        return sum(t.untyped_storage().nbytes() for t in self.cache.k + self.cache.v) if self.cache else 0


def distinct_reward(messages, reply, **fields):
    """RL's reward in a plan: a new value for every reply, so that every group is trained (the worst case)."""
    return float(next(REWARDS))


def fake_item(t):
    """Tensor.item: 1 for a fake tensor, which has no value (a loss to print, AdamW's step count): 1 divides."""
    return (1.0 if t.is_floating_point() else 1) if isinstance(t, FakeTensor) else REAL_ITEM(t)


def fake_tolist(t):
    return np.ones(t.shape, dtype=np.float64 if t.is_floating_point() else np.int64).tolist() \
        if isinstance(t, FakeTensor) else REAL_TOLIST(t)


def frozen_hook(register):
    """Tensor.register_hook (or its post-accumulate kin), a no-op on a frozen tensor: the tracker hooks every
    parameter of a module, a LoRA base's and a live reference's too, and no gradient will come."""
    return lambda t, hook: register(t, hook) if t.requires_grad else torch.utils.hooks.RemovableHandle(NO_HOOKS)


class CudaAttention(torch.autograd.Function):
    """What a CUDA varlen kernel (flash-attn, torch's varlen_attn) holds in a plan of a GPU run: its output, and for
    backward q, k, v, the output and a float32 log-sum-exp per query and head; no L x L scores or masks (the CPU path
    builds a boolean mask per query piece: a DPO shared prompt, a CP slice). Under FakeTensorMode only sizes exist."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:2], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def cuda_attention(q, k, v, *args, **kwargs):
    return CudaAttention.apply(q, k, v)


def on_host(fn):
    """fn with real tensors under FakeTensorMode: make_batch and context.split, whose boundaries the model reads."""
    def unfaked(*args, **kwargs):
        with unset_fake_temporarily():
            return fn(*args, **kwargs)
    return unfaked


def module_to(module, *args, **kwargs):
    """Module.to, and nothing done where nothing is to do: torch cannot swap a fake parameter for itself."""
    device, dtype = torch._C._nn._parse_to(*args, **kwargs)[:2]
    if dtype is None and all(device is None or t.device == device for t in module.parameters()):
        return module
    return REAL_TO(module, *args, **kwargs)


def on_disk(data):
    """Data on this machine: a path, or a glob or comma-separated list (a hub split's files) of files that are there."""
    return data != "builtin" and (os.path.exists(data) or all(glob.glob(p.strip()) for p in data.split(",")))
