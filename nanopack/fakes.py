"""The stand-ins a plan's fake step runs on: decoding that skips the middle of a reply, the
memory a CUDA varlen kernel holds, values for fake tensors (.item, .tolist), hooks on frozen
tensors, host-side functions run on real tensors, and what a first step leaves, made without it."""
import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.distributed.fsdp import FSDPModule

from model import Transformer
from nanopack import generate as generation

REAL_ITEM, REAL_TOLIST, REAL_TO = torch.Tensor.item, torch.Tensor.tolist, torch.nn.Module.to
REAL_SAMPLE = generation.sample
NO_HOOKS = torch.utils.hooks.OrderedDict()


class Decoding:
    """The policy while a plan generates: every reply runs to max_new_tokens, so decode steps
    differ only in how many keys they read. The prefill, the first decode step and the last (the
    longest keys: the largest temporaries) run the model; between them only logits are made (an 8B
    decode step is ~0.5 s of planning; the KV cache is made once)."""

    def __init__(self, model, steps):
        self.model, self.config, self.steps = model, model.config, steps
        self.calls, self.cache = 0, None
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
        if self.skipping:
            return torch.ones(len(logits), dtype=torch.long), torch.zeros(len(logits))
        return REAL_SAMPLE(logits, *args, **kwargs)

    def cache_bytes(self):
        if not self.cache:
            return 0
        return sum(t.untyped_storage().nbytes() for t in self.cache.k + self.cache.v)


def fake_item(t):
    """Tensor.item: 1 for a fake tensor, which has no value (a loss to print, AdamW's step count):
    1 divides."""
    return (1.0 if t.is_floating_point() else 1) if isinstance(t, FakeTensor) else REAL_ITEM(t)


def fake_tolist(t):
    return np.ones(t.shape, dtype=np.float64 if t.is_floating_point() else np.int64).tolist() \
        if isinstance(t, FakeTensor) else REAL_TOLIST(t)


def frozen_hook(register):
    """Tensor.register_hook (or its post-accumulate kin), a no-op on a frozen tensor: the tracker
    hooks every parameter of a module, a LoRA base's and a live reference's too, and no gradient
    will come."""
    return lambda t, hook: (register(t, hook) if t.requires_grad
                            else torch.utils.hooks.RemovableHandle(NO_HOOKS))


class CudaAttention(torch.autograd.Function):
    """What a CUDA varlen kernel (flash-attn, torch's varlen_attn) holds in a plan of a GPU run: its
    output, and for backward q, k, v, the output and a float32 log-sum-exp per query and head; no
    L x L scores or masks (the CPU path builds a boolean mask per query piece: a DPO shared prompt,
    a CP slice). Under FakeTensorMode only sizes exist."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:2], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def cuda_attention(q, k, v, *args, kv_index=None, **kwargs):
    if kv_index is not None:  # the kernels read K/V gathered
        k, v = k.index_select(0, kv_index), v.index_select(0, kv_index)
    return CudaAttention.apply(q, k, v)


def on_host(fn):
    """fn with real tensors under FakeTensorMode: make_batch and context.split, whose boundaries
    the model reads."""
    def unfaked(*args, **kwargs):
        with unset_fake_temporarily():
            return fn(*args, **kwargs)
    return unfaked


def module_to(module, *args, **kwargs):
    """Module.to, and nothing done where nothing is to do: torch cannot swap a fake parameter for
    itself."""
    device, dtype = torch._C._nn._parse_to(*args, **kwargs)[:2]
    if dtype is None and all(device is None or t.device == device for t in module.parameters()):
        return module
    return REAL_TO(module, *args, **kwargs)


def first_step_leftovers(policy, frozen, gradients=True):
    """What a first forward and backward leave for the optimizer step and the steps after, made
    without them: each model's RoPE tables and FSDP2's lazy set-up (its sharded parameters re-made),
    made at a first forward; the policy's FSDP2 parameters sharded again (a no-grad evaluation
    before the step leaves the root's gathered, its backward frees them); gradients: zeros on every
    trained parameter, from which AdamW's first step allocates its state."""
    for model in [policy, *frozen]:
        if isinstance(model, FSDPModule):
            model._get_fsdp_state()._lazy_init()
        for m in model.modules():
            if isinstance(m, Transformer):
                m.rope(next(m.parameters()).device)
    for m in policy.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    for p in policy.parameters():
        if p.requires_grad and gradients:
            p.grad = torch.zeros_like(p)
