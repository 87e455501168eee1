"""
A training script's own step on fake tensors, and the memory it holds: what plan.py reports. plan_step runs the script
unchanged (runpy) as rank 0 of a fake process group of `gpus` ranks, its model and optimizer built under
FakeTensorMode: parameters, gradients, optimizer state and activations have shapes and sizes but no storage, so an 8B
model plans on a laptop with no weights. Two optimizer steps run; the second, with the optimizer state allocated, is
measured by torch's MemTracker (FSDPMemTracker under FSDP2), which sees every tensor the step allocates.

Swapped, because they mean nothing on fake tensors: reading weights (a model folder's config.json, or a preset at its
own vocabulary, is enough), the checks of weight and loss values, checkpoints and exports (the plan stops before
them), a cached DPO reference (zeros stand for log-probs computed before training), and a value read from a fake
tensor (.item() and .tolist() read 1s: a loss to print, AdamW's step count). Data that is not a file or folder on this
machine ('builtin' too) is the worst case: every micro-batch filled to microbatch_tokens with sequences of
min(max_len, context_parallel x microbatch_tokens / group) tokens (no shared prompt for DPO pairs); data on disk is the
run's own first two steps. A rank's micro-batches are cut to its first two (the largest), standing for its alike rest.
RL's worst case: every prompt as long as the data's longest (or, not on this machine, as long as a group may be), every
reply max_new_tokens long (stop tokens ignored), every group trained (distinct_reward: no two replies rewarded alike);
generation is its own phase, the KV cache of every reply of the rank its own category, and its decode steps between
the first and the last skip the model (Decoding).

What it cannot see: this torch is a CPU build, so a GPU run is planned on CPU fake tensors with the GPU's precision
(bfloat16 compute; FSDP2's float32 shards) and the CUDA varlen kernel's attention memory (CudaAttention: output and
log-sum-exp, no L x L scores or masks); device='cpu' plans the CPU's own attention. Kernel workspaces (cuBLAS, compiled
code) are not seen; nor is a tensor a kernel allocates inside itself. DDP's reducer runs no fake tensors: a DDP rank
is planned unwrapped, its share of the batch, which is what it holds (its all-reduce buckets are its gradients:
gradient_as_bucket_view). Not planned: a fake CUDA device (the CUDA branches of the code); RL's decode attention is
planned as the CPU's SDPA holds it (scores over the cached keys).
"""
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

import common
import context
import generate as generation
import packing
import reference
from data import dataset
from hf import read_hf_config
from model import PRESETS, Transformer, config_from_preset

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporaries", "collectives", "reference",
              "kv_cache", "allowance")
# The tracker's categories -> ours. FSDP2's unsharded parameters and gradients are the all-gathered / to-be-reduced
# copies of one block: they are memory the collectives hold, and do not shrink with more GPUs.
TRACKER = {"Parameter": "parameters", "Buffer": "parameters", "Sharded Param": "parameters", "Gradient": "gradients",
           "Sharded Grad": "gradients", "Optstate": "optimizer", "OptState": "optimizer", "Activation": "activations",
           "Inputs": "activations", "Temp": "temporaries", "Other": "temporaries", "Unsharded Param": "collectives",
           "Unsharded Grad": "collectives", "All Gather": "collectives", "Reduce Scatter": "collectives"}
# Memory no tensor holds, on a GPU: the CUDA context with PyTorch's kernels loaded and NCCL's communicators and
# buffers (taken as 1 GiB together), and the caching allocator's fragmentation and cached blocks (reserved over
# allocated, taken as 8% of the tensors' peak). Assumed orders of magnitude, not measured: no GPU was at hand when
# this was written; a measurement on the GPU that will run the job should replace them.


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

        def update_peak_stats(state):  # the tracker's global peak, and its phase; not its per-module peaks, which
            # plan.py does not read (their loop over every module at every op was 80% of an 8B LoRA plan's time)
            for device, snap in self.tracker._curr_mem_snap.items():
                if self.tracker._peak_mem.get(device, 0) < snap["Total"]:
                    self.tracker._peak_mem[device], self.tracker._peak_mem_snap[device] = snap["Total"], dict(snap)
                    self.phase = ("optimizer" if self.tracker._in_opt else "generation" if self.decoding else
                                  "backward" if self.tracker._mod_tracker.is_bw else "forward")
                    self.kv_cache = self.decoding.cache_bytes() if self.decoding else 0
        self.tracker._update_peak_stats = update_peak_stats

        def new_forward(module, inputs):  # each micro-batch's forward starts the tracker's module stats anew (it
            # takes a second one for a second step), as does generation's; a no-grad forward (adapters_off's
            # reference) is not one
            if module is model and not self.tracker._mod_tracker.is_bw and (torch.is_grad_enabled() or
                                                                          self.decoding):
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
    """Token data of one step's units (SFT examples, DPO pairs), each sequence min(max_len, context_parallel x
    microbatch_tokens / group, max_seq_len) tokens, all trained; a pair's chosen and rejected differ from their first
    token (nothing shared). Its micro-batches are all alike, so a rank's third and later hold what its second does:
    c["batch_size"] is cut to two micro-batches a rank (a plan's time grows with them) -> (data, the cut's factor)."""
    n = max(1, min(c["max_len"], c["microbatch_tokens"] * c["context_parallel"] // group_size, max_seq_len))
    per_microbatch = max(1, c["microbatch_tokens"] * c["context_parallel"] // (n * group_size))
    units = min(c["batch_size"], 2 * per_microbatch * (gpus // c["context_parallel"]))
    scale, c["batch_size"] = c["batch_size"] / units, units
    ids = np.ones((units, group_size, n), dtype=np.int64) + np.arange(group_size)[None, :, None]  # chosen 1, rejected 2
    offsets = np.arange(units * group_size + 1, dtype=np.int64) * n
    return dict(ids=ids.reshape(-1), offsets=offsets, loss_mask=np.ones(units * group_size * n, dtype=np.uint8)), scale


def plan_step(script, args, gpus=1, device="cuda", fake=True):
    """Run `script` with `args` for two steps as rank 0 of `gpus` -> dict of the second step's peak memory by
    category (bytes), its phase, tokens and FLOPs on this rank. fake=False: the same, with real tensors (gpus > 1:
    each rank of a torchrun gloo group) -- what the tests compare the plan against."""
    out_dir, keys = tempfile.mkdtemp(prefix="plan-"), script_keys(script)
    script_args = [script, *args] + [a for a in (
        f"--out_dir={out_dir}", "--max_iters=1000000000", "--log_interval=1000000000", "--eval_interval=0",
        "--eval_examples=0", "--overwrite=True", "--wandb_log=False", "--compile=False", "--device=cpu",
        "--reward=fake_step:distinct_reward") if a[2:].partition("=")[0] in keys]
    if device == "cuda":
        script_args.append("--dtype=bfloat16")
    state = dict(steps=0, tokens=0, flops=0.0, tracker=None, config=None)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None

    def setup_distributed(device_name="auto", timeout_s=300):  # real tensors on more ranks: torchrun's gloo group
        if gpus > 1:
            kind, options = ("fake", dict(store=FakeStore(), rank=0, world_size=gpus)) if fake else ("gloo", {})
            dist.init_process_group(kind, **options)
        return dist.get_rank() if gpus > 1 else 0, gpus, torch.device("cpu")

    def prepare_data(c, out_dir, tok, kind, max_seq_len, builtin_sizes=None):
        state["config"], state["kind"], state["max_seq_len"] = c, kind, max_seq_len
        return real["prepare_data"](c, out_dir, tok, kind, max_seq_len, builtin_sizes) if on_disk(c["data"]) else None

    def load_data(data_dir, tok):
        if data_dir is not None:
            return real["load_data"](data_dir, tok)
        data, state["scale"] = worst_case_data(state["config"], 2 if state["kind"] == "dpo" else 1,
                                               state["max_seq_len"], gpus)
        return data, data

    def initial_config(start, tok):  # a preset at its own vocabulary: the byte tokenizer would shrink the head
        if start["init_from"] == "scratch":
            vocab = max(PRESETS[start["preset"]]["vocab_size"], tok.vocab_size)
            return config_from_preset(start["preset"], vocab_size=vocab)
        return read_hf_config(start["init_from"])

    def build_model(*a, **k):
        with mock.patch.object(torch.nn.Module, "to", module_to):
            return real["build_model"](*a, **k)

    def wrap_model(model, parallel, *a):  # DDP's reducer runs no fake tensors; its buckets are the gradients
        return model if parallel == "ddp" else real["wrap_model"](model, parallel, *a)

    def default_mesh():  # FSDP2's device mesh, built outside fake mode: its rank map is read on the host
        with unset_fake_temporarily():
            return init_device_mesh("cpu", (gpus,))

    def setup(config, kind, builtin_sizes=None):
        state["config"], state["run"] = config, real["setup"](config, kind, builtin_sizes)
        return state["run"]

    def read_prompts(source, n, tok, limit, *args):  # RL: every prompt as long as the data's longest, or (the data
        # not on this machine) as long as a group may be (train_rl.fits)
        if on_disk(source) or source == "builtin":
            found = real["read_prompts"](source, n, tok, limit, *args)
            return [max(found, key=lambda p: len(p[0]))] * len(found)
        c, positions = state["config"], state["run"].raw_model.config.max_seq_len
        group, new = c["microbatch_tokens"] * c["context_parallel"], c["max_new_tokens"]
        ids = [1] * max(1, min(positions - new, group - c["k"] * new if c["prefix_sharing"] else group // c["k"] - new))
        limit(ids, f"{source} (not on this machine: prompts of {len(ids)} tokens planned)")
        return [(ids, [dict(role="user", content="")], {}, source)] * (n or c["prompts_per_step"])

    def generate(model, prompts, max_new_tokens, stop_ids=(), *args, **kwargs):  # RL: every reply max_new_tokens
        # long, one draw for all rows; a prompt's replies differ from their first token (only the prompt is shared)
        decoding = Decoding(model, max_new_tokens if fake else 0)  # the real run decodes every step: to compare
        with ExitStack() as stack:
            stack.enter_context(mock.patch.object(generation, "sample", decoding.sample))
            if state["tracker"] is not None:
                stack.enter_context(mock.patch.object(state["tracker"], "decoding", decoding))
            replies = real["generate"](decoding, prompts, max_new_tokens, (), *args, **{**kwargs, "generator": None})
        return [[1 + i % kwargs.get("num_samples", 1)] + [1] * (len(r) - 1) for i, r in enumerate(replies)]

    def rank_bins(*args):  # a rank's micro-batches: the first two (the largest) stand for its alike rest
        bins = real["rank_bins"](*args)
        if len(bins) > 2:
            state["scale"], bins = sum(map(len, bins)) / sum(map(len, bins[:2])), bins[:2]
        return bins

    def set_lr(optimizer, lr):
        state["steps"] += 1
        if state["steps"] == 2:  # the steady state, the optimizer state allocated: measured from here on
            state["tracker"] = PhaseTracker(state["run"].model, state["run"].optimizer)
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

    real = dict(check_kind=common.check_kind, prepare_data=common.prepare_data, load_data=common.load_data,
                build_model=common.build_model, wrap_model=common.wrap_model,
                setup=common.setup, set_lr=common.set_lr, count=__import__("metrics").Throughput.count,
                read_prompts=dataset.read_prompts, generate=generation.generate, rank_bins=packing.rank_bins)
    env = dict(WORLD_SIZE=str(gpus), RANK="0", LOCAL_RANK="0") if fake else {}
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with ExitStack() as stack:
        for name, new in [("setup_distributed", setup_distributed), ("prepare_data", prepare_data),
                          ("load_data", load_data), ("initial_config", initial_config), ("build_model", build_model),
                          ("wrap_model", wrap_model), ("setup", setup), ("set_lr", set_lr),
                          ("refuse_non_finite", lambda *a: None),
                          ("check_kind", lambda data, *a: on_disk(data) and real["check_kind"](data, *a)),
                          ("base_weights", lambda init_from: None), ("load_hf_weights", lambda *a, **k: None),
                          ("from_pretrained", lambda folder, dtype=None: Transformer(read_hf_config(folder)))]:
            stack.enter_context(mock.patch.object(common, name, new))
        for module, name, new in [(dataset, "read_prompts", read_prompts), (generation, "generate", generate),
                                  (generation, "packed", on_host(generation.packed)), (packing, "rank_bins", rank_bins),
                                  (fully_shard_module, "_init_default_mesh", default_mesh)]:
            stack.enter_context(mock.patch.object(module, name, new))
        stack.enter_context(mock.patch.object(common.StepGuard, "check", lambda self, *a: (True, False)))
        # a plan has no step to finish: Ctrl-C and SIGTERM stop it at once, not "after this step with a checkpoint"
        stack.enter_context(mock.patch.object(common.StopSignal, "__init__", lambda self: setattr(self, "name", None)))
        stack.enter_context(mock.patch.object(__import__("metrics").Throughput, "count", count))
        stack.enter_context(mock.patch.dict(os.environ, env))
        stack.enter_context(mock.patch.object(sys, "argv", script_args))
        for module in [m for m in list(sys.modules.values()) if getattr(m, "make_batch", None) is REAL_MAKE_BATCH]:
            stack.enter_context(mock.patch.object(module, "make_batch", on_host(REAL_MAKE_BATCH)))
        stack.enter_context(mock.patch.object(context.ContextParallel, "split", on_host(context.ContextParallel.split)))
        if device == "cuda" and fake:  # the CUDA kernel's memory, not the CPU fallback's
            stack.enter_context(mock.patch("model.varlen_attention", cuda_attention))
        stack.enter_context(mock.patch.object(torch.Tensor, "item", fake_item))  # a printed loss, an evaluation
        stack.enter_context(mock.patch.object(torch.Tensor, "tolist", fake_tolist))
        stack.enter_context(mock.patch.object(FakeTensor, "tolist", fake_tolist))  # its own: an item() a value
        for name in ("register_hook", "register_post_accumulate_grad_hook"):
            stack.enter_context(mock.patch.object(torch.Tensor, name, frozen_hook(getattr(torch.Tensor, name))))
        stack.enter_context(mock.patch.object(reference, "build_model", build_model))  # a live reference's copy
        of_model = reference.Reference.of_model.__func__

        def reference_model(cls, mode, run):  # a live reference's frozen copy: its parameters are its own category
            ref = of_model(cls, mode, run)
            state["reference"] = ref.model if mode == "live" else None
            return ref
        stack.enter_context(mock.patch.object(reference.Reference, "of_model", classmethod(reference_model)))
        if fake:  # cached log-probs are computed before training and never seen by the step: zeros stand for them
            build = reference.Reference.build.__func__
            stack.enter_context(mock.patch.object(reference.Reference, "build", classmethod(
                lambda cls, mode, *a, **k: build(cls, "none" if mode == "cached" else mode, *a, **k))))
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
                flops=state["flops"] * scale, config=state["config"])


class Decoding:
    """The policy while a plan generates: every reply runs to max_new_tokens (no stop), so decode steps differ only in
    how many keys they read: the prefill, the first decode step and the last (the longest keys: the largest
    temporaries) run the model and draw; between them a step's logits are made, its forward and draw skipped (an 8B
    decode step is ~0.5 s of planning; the KV cache, made at the prefill, is the same size throughout)."""

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


REAL_SAMPLE = generation.sample


def script_keys(script):
    """The config keys a script defines: the names its top level assigns (`name = default`)."""
    with open(script) as f:
        return set(re.findall(r"^(\w+) = ", f.read(), re.M))


def distinct_reward(messages, reply, **fields):
    """RL's reward in a plan: a new value for every reply, so that every group is trained (the worst case)."""
    return float(next(REWARDS))


REWARDS = itertools.count()


def fake_item(t):
    """Tensor.item: 1 for a fake tensor, which has no value (a loss to print, AdamW's step count): 1 divides."""
    return (1.0 if t.is_floating_point() else 1) if isinstance(t, FakeTensor) else REAL_ITEM(t)


def fake_tolist(t):
    return np.ones(t.shape, dtype=np.float64 if t.is_floating_point() else np.int64).tolist() \
        if isinstance(t, FakeTensor) else REAL_TOLIST(t)


REAL_ITEM, REAL_TOLIST = torch.Tensor.item, torch.Tensor.tolist


def frozen_hook(register):
    """Tensor.register_hook (or its post-accumulate kin), a no-op on a frozen tensor (no gradient will come): the
    tracker hooks every parameter of a module, a LoRA base's and a live reference's too."""
    return lambda t, hook: register(t, hook) if t.requires_grad else torch.utils.hooks.RemovableHandle(NO_HOOKS)


NO_HOOKS = torch.utils.hooks.OrderedDict()


class CudaAttention(torch.autograd.Function):
    """What a CUDA varlen kernel (flash-attn, torch's varlen_attn) holds, in place of the CPU's attention in a plan of a
    GPU run: its output, and for backward q, k, v (GQA in the kernel), the output and a float32 log-sum-exp per
    query and head; no L x L scores or masks (the CPU path builds a boolean mask per query piece over longer keys:
    a DPO shared prompt, a CP slice). Nothing is computed: under FakeTensorMode only sizes exist."""

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
    """fn, its tensors real even under FakeTensorMode: packing.make_batch and a CP rank's slice of it (context.split),
    whose boundaries and targets the model reads on the host."""
    def unfaked(*args, **kwargs):
        with unset_fake_temporarily():
            return fn(*args, **kwargs)
    return unfaked


REAL_MAKE_BATCH = packing.make_batch


def module_to(module, *args, **kwargs):
    """Module.to, and nothing done where nothing is to do: torch cannot swap a fake parameter for itself."""
    device, dtype = torch._C._nn._parse_to(*args, **kwargs)[:2]
    if dtype is None and all(device is None or t.device == device for t in module.parameters()):
        return module
    return REAL_TO(module, *args, **kwargs)


REAL_TO = torch.nn.Module.to


def on_disk(data):
    return data != "builtin" and os.path.exists(data)
