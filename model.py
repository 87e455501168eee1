"""
A Llama-style transformer that runs on a *packed* 1-D token stream.

Several sequences are concatenated into one stream of T tokens with no padding:
  input_ids    (T,)    the tokens
  position_ids (T,)    restart at 0 for every sequence (RoPE reads them)
  cu_seqlens   (N+1,)  int32 sequence boundaries: sequence i is [cu_seqlens[i], cu_seqlens[i+1])
  max_seqlen   int     the longest sequence (the attention kernels want it on the host)
Attention never crosses a boundary, so the stream computes exactly what N separate padded rows would.
Optionally kv = (kv_index, cu_seqlens_k, max_seqlen_k): keys and values come from k[kv_index], a stream
of their own, so a query segment may also attend to tokens outside it (DPO prefix sharing: a rejected
response attends to the prompt laid out once before the chosen one; see packing.py). Causal attention
is then aligned at the bottom right: a segment's last query sees all of its keys.

Contents, top to bottom: config + presets, RMSNorm, RoPE (eager reference + fused Triton kernel),
attention (one dispatch over the varlen backends), the KV cache for generation, MLP, Block, Transformer,
the LM-head loss that never materialises full logits, Hugging Face checkpoint load/save, FLOPs per token.
"""

import inspect
import json
import math
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

HAS_TRITON = False
if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    # only where the fused kernel can run (or its CPU interpreter test): importing triton costs seconds
    try:
        import triton
        import triton.language as tl
        HAS_TRITON = True
    except ImportError:  # the eager RoPE is used instead
        pass

try:
    from flash_attn import flash_attn_varlen_func
except ImportError:
    flash_attn_varlen_func = None

try:
    from torch.nn.attention.varlen import varlen_attn
    if not {"window_size", "enable_gqa"} <= set(inspect.signature(varlen_attn).parameters):
        varlen_attn = None  # torch 2.9-2.11 took is_causal instead: the flash_attn or SDPA path is used there
except ImportError:
    varlen_attn = None

# -----------------------------------------------------------------------------
# Config


@dataclass
class ModelConfig:
    vocab_size: int = 512
    n_layer: int = 6
    n_head: int = 6
    n_kv_head: Optional[int] = None  # None -> n_head (no GQA)
    d_model: int = 192
    ffn_hidden: int = 512
    head_dim: Optional[int] = None  # None -> d_model // n_head
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None  # {"rope_type": "llama3", factor, ...} or {"rope_type": "linear", "factor": f}
    max_seq_len: int = 2048  # RoPE table size; Hugging Face's max_position_embeddings
    norm_eps: float = 1e-5
    qkv_bias: bool = False  # Qwen2 has biases on q, k, v (not on o)
    qk_norm: bool = False  # Qwen3: an RMSNorm over head_dim on each q and k head, before RoPE
    nope_layers: tuple = ()  # SmolLM3: indices of the layers that skip RoPE ("NoPE")
    tie_embeddings: bool = False
    sliding_window: Optional[int] = None  # Mistral: a token sees itself and the sliding_window-1 before it
    arch: str = "llama"  # the Hugging Face architecture save_pretrained writes: a key of _HF_ARCH (llama, qwen2, ...)

    def __post_init__(self):
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.head_dim is None:
            self.head_dim = self.d_model // self.n_head
        assert self.n_head % self.n_kv_head == 0, f"n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head}"
        assert self.head_dim % 2 == 0, f"RoPE needs an even head_dim, got {self.head_dim}"
        assert self.arch in _HF_ARCH, f"unknown arch {self.arch!r}"
        # checked here, not at export: a run must not train for hours a model save_pretrained cannot describe
        assert not self.qk_norm or self.arch == "qwen3", "qk_norm needs arch='qwen3'"
        assert not self.nope_layers or self.arch == "smollm3", "nope_layers needs arch='smollm3'"
        self.nope_layers = tuple(self.nope_layers)  # a list (JSON, a config file) too: equal configs compare equal
        # Embedding/head rows padded to a multiple of 64 keep the head matmul on fast tile sizes;
        # the extra rows are zero, never indexed by a token, and cut off before any softmax.
        self.padded_vocab_size = -(-self.vocab_size // 64) * 64


PRESETS = {
    # ~0.1M parameters: tests and smoke runs of the training scripts
    "tiny": dict(vocab_size=512, n_layer=2, n_head=4, n_kv_head=2, d_model=64, ffn_hidden=128, max_seq_len=2048),
    # ~1.1M parameters: learns the built-in arithmetic chat task in a few minutes on a laptop CPU.
    "toy": dict(vocab_size=512, n_layer=4, n_head=4, n_kv_head=2, d_model=128, ffn_hidden=512, max_seq_len=2048),
    "smollm2-135m": dict(vocab_size=49152, n_layer=30, n_head=9, n_kv_head=3, d_model=576, ffn_hidden=1536,
                         rope_theta=100000.0, max_seq_len=8192, tie_embeddings=True),
    "qwen2.5-0.5b": dict(vocab_size=151936, n_layer=24, n_head=14, n_kv_head=2, d_model=896, ffn_hidden=4864,
                         rope_theta=1000000.0, max_seq_len=32768, norm_eps=1e-6, qkv_bias=True,
                         tie_embeddings=True, arch="qwen2"),
    "qwen3-0.6b": dict(vocab_size=151936, n_layer=28, n_head=16, n_kv_head=8, d_model=1024, ffn_hidden=3072,
                       head_dim=128, rope_theta=1000000.0, max_seq_len=40960, norm_eps=1e-6, qk_norm=True,
                       tie_embeddings=True, arch="qwen3"),
    "qwen3-1.7b": dict(vocab_size=151936, n_layer=28, n_head=16, n_kv_head=8, d_model=2048, ffn_hidden=6144,
                       head_dim=128, rope_theta=1000000.0, max_seq_len=40960, norm_eps=1e-6, qk_norm=True,
                       tie_embeddings=True, arch="qwen3"),
    "llama-3.2-1b": dict(vocab_size=128256, n_layer=16, n_head=32, n_kv_head=8, d_model=2048, ffn_hidden=8192,
                         rope_theta=500000.0, max_seq_len=131072, tie_embeddings=True,
                         rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "llama-3.1-8b": dict(vocab_size=128256, n_layer=32, n_head=32, n_kv_head=8, d_model=4096, ffn_hidden=14336,
                         rope_theta=500000.0, max_seq_len=131072,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=8192)),
}


def config_from_preset(name, **overrides):
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return ModelConfig(**{**PRESETS[name], **overrides})


# -----------------------------------------------------------------------------
# RMSNorm


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # statistics in float32 whatever the activation dtype (bf16 squares lose digits), like the reference
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


# -----------------------------------------------------------------------------
# RoPE: inverse frequencies (with Llama-3 / linear scaling), eager reference, fused Triton kernel


def rope_inv_freq(config):
    dim, base = config.head_dim, config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # (D/2,)
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend smoothly in between
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / hi) * ~(wavelen > old_len / lo)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    elif kind != "default":
        raise ValueError(f"rope_scaling.rope_type={kind!r} is not supported (supported: default, linear, llama3)")
    return inv_freq


def rope_tables(config, device):
    """cos, sin: (max_seq_len, D/2) float32, looked up by position id."""
    inv_freq = rope_inv_freq(config).to(device)
    freqs = torch.outer(torch.arange(config.max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return freqs.cos(), freqs.sin()


def rope_reference(q, k, cos, sin, position_ids):
    """q: (T, Hq, D), k: (T, Hkv, D); cos/sin: (P, D/2) float32; position_ids: (T,) int64.
    Non-interleaved (Hugging Face 'rotate_half') layout, math in float32, result in the input dtype."""
    c, s = cos[position_ids][:, None, :], sin[position_ids][:, None, :]  # (T, 1, D/2)

    def rotate(x):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


if HAS_TRITON:
    @triton.jit
    def _rotate_tile(x_ptr, out_ptr, stride_t, stride_h, n_head, tok, cos, sin,
                     H_PAD: tl.constexpr, HALF: tl.constexpr):
        # tok: (BLOCK_T,) int64 token indices (-1 where past T); cos, sin: (BLOCK_T, 1, HALF) float32
        h = tl.arange(0, H_PAD)[None, :, None]
        d = tl.arange(0, HALF)[None, None, :]
        mask = (tok[:, None, None] >= 0) & (h < n_head)  # (BLOCK_T, H_PAD, 1), broadcast over d
        x1_ptrs = x_ptr + tok[:, None, None] * stride_t + h * stride_h + d  # last dim is contiguous
        x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x1_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
        o1_ptrs = out_ptr + tok[:, None, None] * (n_head * 2 * HALF) + h * (2 * HALF) + d  # out is contiguous
        tl.store(o1_ptrs, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(o1_ptrs + HALF, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, pos_ptr, T,
                     q_stride_t, q_stride_h, k_stride_t, k_stride_h, n_q_head, n_kv_head,
                     BLOCK_T: tl.constexpr, HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr,
                     HALF: tl.constexpr, INVERSE: tl.constexpr):
        # int64 token index: T * stride of a fused qkv buffer can pass 2**31 at long packed lengths
        tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        tok = tl.where(tok < T, tok, -1)
        pos = tl.load(pos_ptr + tok, mask=tok >= 0, other=0)  # (BLOCK_T,) packed positions restart at 0
        d = tl.arange(0, HALF)[None, None, :]
        cos = tl.load(cos_ptr + pos[:, None, None] * HALF + d)  # (BLOCK_T, 1, HALF), read once for q and k
        sin = tl.load(sin_ptr + pos[:, None, None] * HALF + d)
        if INVERSE:  # backward: the rotation is orthogonal, so its transpose is the rotation by -angle
            sin = -sin
        _rotate_tile(q_ptr, q_out_ptr, q_stride_t, q_stride_h, n_q_head, tok, cos, sin, HQ_PAD, HALF)
        _rotate_tile(k_ptr, k_out_ptr, k_stride_t, k_stride_h, n_kv_head, tok, cos, sin, HKV_PAD, HALF)

    # A torch custom op, so torch.compile(dynamic=True) keeps the fused RoPE inside a compiled block's graph
    # with a symbolic T: the compiler sees the op and its fake (shape-only) version below, never the kernel.
    # custom_op, not triton_op: triton_op's tracing of the kernel cannot run under TRITON_INTERPRET=1, so the
    # CPU test could not compile the graph a GPU run compiles; Inductor runs the kernel as written either way.
    @torch.library.custom_op("nanopack::rope", mutates_args=())
    def _rope_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 position_ids: torch.Tensor, inverse: bool) -> tuple[torch.Tensor, torch.Tensor]:
        T, n_q_head, D = q.shape
        n_kv_head = k.shape[1]
        # Token and head strides go to the kernel, so q/k slices of a fused qkv projection are read in
        # place; only a non-unit last-dim stride (not produced by slicing heads) costs a copy.
        q = q if q.stride(-1) == 1 else q.contiguous()
        k = k if k.stride(-1) == 1 else k.contiguous()
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # outputs contiguous: (T, Hq, D)
        k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        # Launch design: one program = BLOCK_T tokens x all heads of q and k, so each (cos, sin) row is
        # loaded once and reused for Hq + Hkv heads. RoPE is memory-bound; the tile is sized to ~2048
        # elements per half (Llama-3-8B: 1 token x 32 heads x 64; small models get more tokens per
        # program) which keeps registers low at num_warps=4 and gives T/BLOCK_T programs, plenty to
        # fill an H100's 132 SMs at packed lengths of thousands of tokens.
        hq_pad = triton.next_power_of_2(n_q_head)
        block_t = max(1, 2048 // (hq_pad * (D // 2)))
        grid = (triton.cdiv(T, block_t),)
        _rope_kernel[grid](q, k, q_out, k_out, cos, sin, position_ids, T,
                           q.stride(0), q.stride(1), k.stride(0), k.stride(1), n_q_head, n_kv_head,
                           BLOCK_T=block_t, HQ_PAD=hq_pad, HKV_PAD=triton.next_power_of_2(n_kv_head),
                           HALF=D // 2, INVERSE=inverse)
        return q_out, k_out

    @_rope_op.register_fake
    def _(q, k, cos, sin, position_ids, inverse):
        return q.new_empty(q.shape), k.new_empty(k.shape)  # contiguous, as the kernel writes them

    def _rope_setup_context(ctx, inputs, output):
        _, _, cos, sin, position_ids, _ = inputs
        ctx.save_for_backward(cos, sin, position_ids)

    def _rope_backward(ctx, grad_q, grad_k):
        cos, sin, position_ids = ctx.saved_tensors
        grad_q, grad_k = _rope_op(grad_q, grad_k, cos, sin, position_ids, True)
        return grad_q, grad_k, None, None, None, None  # cos/sin are fixed buffers, positions are ints

    _rope_op.register_autograd(_rope_backward, setup_context=_rope_setup_context)


def rope_fused(q, k, cos, sin, position_ids):
    """Same contract as rope_reference, as one Triton launch for Q and K together (backward: one more)."""
    if not HAS_TRITON:
        raise RuntimeError("rope_fused needs triton (pip install triton); use rope_reference instead")
    D = q.shape[-1]
    if D < 16 or D & (D - 1) or k.shape[-1] != D or k.shape[0] != q.shape[0]:
        raise ValueError(f"rope_fused needs q (T, Hq, D), k (T, Hkv, D) with D a power of two >= 16, "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}")
    # The tables are small and already contiguous float32 in the model: these are no-op guards.
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    return _rope_op(q, k, cos, sin, position_ids.contiguous(), False)


ROPE_BACKEND = None  # None: fused on CUDA when triton is installed, else the reference; tests may force "fused"


def apply_rope(q, k, cos, sin, position_ids):
    if ROPE_BACKEND == "fused" or (ROPE_BACKEND is None and q.is_cuda and HAS_TRITON):
        return rope_fused(q, k, cos, sin, position_ids)
    return rope_reference(q, k, cos, sin, position_ids)


# -----------------------------------------------------------------------------
# Attention over a packed stream: one dispatch function, backend chosen once per device type


_ATTN_BACKEND = {}  # device type -> backend name; tests may set it to force a backend


def attention_backend(device, dtype):
    if device.type not in _ATTN_BACKEND:
        if device.type == "cuda" and flash_attn_varlen_func is not None:
            name = "flash_attn"
        elif device.type == "cuda" and varlen_attn is not None:
            name = "torch_varlen"
        else:
            name = "sdpa"
        _ATTN_BACKEND[device.type] = name
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"nanopack: attention backend on {device.type}: {name}")
    name = _ATTN_BACKEND[device.type]
    # the flash kernels take half precision only; a float32 run (e.g. a parity test) uses the exact fallback
    return name if dtype in (torch.float16, torch.bfloat16) else "sdpa"


def varlen_attention(q, k, v, cu_seqlens, max_seqlen, sliding_window=None, cu_seqlens_k=None, max_seqlen_k=None):
    """Causal attention within each packed sequence. q: (T, Hq, D), k/v: (T, Hkv, D) -> (T, Hq, D).
    With cu_seqlens_k, k/v are (Tk, Hkv, D) and query segment i attends to key segment i, aligned at the
    bottom right (its last query sees every key): flash-attn >= 2.1's causal semantics, which torch's
    varlen_attn shares (it calls the same FA2 kernel, aten._flash_attention_forward, whose is_causal torch
    itself uses for lower-right causal masks: torch/nn/attention/bias.py)."""
    backend = attention_backend(q.device, q.dtype)
    left = -1 if sliding_window is None else sliding_window - 1  # tokens seen before the query
    cu_k, max_k = (cu_seqlens, max_seqlen) if cu_seqlens_k is None else (cu_seqlens_k, max_seqlen_k)
    if backend == "flash_attn":
        return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_k, max_seqlen, max_k,
                                      causal=True, window_size=(left, 0))
    if backend == "torch_varlen":
        return varlen_attn(q, k, v, cu_seqlens, cu_k, max_seqlen, max_k,
                           window_size=(left, 0), enable_gqa=q.shape[1] != k.shape[1])
    return sdpa_per_sequence(q, k, v, cu_seqlens, sliding_window, cu_seqlens_k)


@torch.compiler.disable  # a Python loop over a data-dependent number of sequences: run eagerly, never traced
def sdpa_per_sequence(q, k, v, cu_seqlens, sliding_window=None, cu_seqlens_k=None):
    """Exact fallback for any device: one SDPA call per sequence, so memory is O(max L^2), not O(T^2).
    The Python loop and .tolist() sync are fine on CPU; CUDA uses the varlen kernels above.
    K/V heads are repeated for GQA here: SDPA's enable_gqa falls to a math path ~30x slower on CPU."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    # split, not slicing in the loop: the backward of split is one cat, a slice's is a zero (T, H, D) each
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    k_lens = lens if cu_seqlens_k is None else (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
    outs = []
    # 4-D (1, H, L, D): with 3-D inputs CPU SDPA takes its math path (2.5x slower, O(L^2) memory), not flash
    for qi, ki, vi in zip(q.split(lens), k.split(k_lens), v.split(k_lens)):
        qi, ki, vi = qi.transpose(0, 1)[None], ki.transpose(0, 1)[None], vi.transpose(0, 1)[None]
        Lq, Lk = qi.shape[2], ki.shape[2]
        mask = None
        if Lq != Lk or (sliding_window is not None and Lk > sliding_window):
            # SDPA's is_causal aligns at the top left; queries are the last Lq of the Lk keys (bottom right)
            i = torch.arange(Lk - Lq, Lk, device=q.device)[:, None]  # each query's place among the keys
            j = torch.arange(Lk, device=q.device)[None, :]
            mask = (j <= i) & (i - j < (sliding_window or Lk))  # (Lq, Lk)
        o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, is_causal=mask is None)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs, dim=0)


class Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        C, H, Hkv, D = config.d_model, config.n_head, config.n_kv_head, config.head_dim
        self.q_proj = nn.Linear(C, H * D, bias=config.qkv_bias)
        self.k_proj = nn.Linear(C, Hkv * D, bias=config.qkv_bias)
        self.v_proj = nn.Linear(C, Hkv * D, bias=config.qkv_bias)
        self.o_proj = nn.Linear(H * D, C, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(D, config.norm_eps)
            self.k_norm = RMSNorm(D, config.norm_eps)
        self.use_rope = layer_idx not in config.nope_layers

    def forward(self, x, rope, position_ids, cu_seqlens, max_seqlen, kv=None, cache=None):
        T, cfg = x.shape[0], self.config
        q = self.q_proj(x).view(T, cfg.n_head, cfg.head_dim)
        k = self.k_proj(x).view(T, cfg.n_kv_head, cfg.head_dim)
        v = self.v_proj(x).view(T, cfg.n_kv_head, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            q, k = apply_rope(q, k, *rope, position_ids)
        if kv is not None:  # a key stream of its own: e.g. the shared prompt's keys again for a rejected response
            k, v = k.index_select(0, kv[0]), v.index_select(0, kv[0])  # gradients add back into the prompt's rows
            y = varlen_attention(q, k, v, cu_seqlens, max_seqlen, cfg.sliding_window, kv[1], kv[2])
        elif cache is None:
            y = varlen_attention(q, k, v, cu_seqlens, max_seqlen, cfg.sliding_window)  # (T, H, D)
        else:
            y = cache.attend(q, k, v, cu_seqlens, max_seqlen, cfg.sliding_window)
        return self.o_proj(y.reshape(T, -1))


# -----------------------------------------------------------------------------
# KV cache for generation


class KVCache:
    """Keys and values of a batch of sequences while generating: per layer a buffer (B, Hkv, capacity, D) whose
    row b holds sequence b's keys at their positions (capacity: the longest sequence when generation ends).
    A forward with a cache runs rows 0..B-1 in order; begin() is called once per forward, then attend() once by
    each layer in turn, which writes the layer's new k, v at (row, position) and attends:
      prefill (the first forward, each sequence from position 0): within the packed stream, as without a cache;
      decode (each later forward, one new token per row): over the row's positions 0..position, all rows in
      one SDPA call (on CUDA too: one query row per sequence needs no varlen kernel).
    keep(rows) drops finished sequences, so later decode steps compute the unfinished ones only."""

    def __init__(self, batch_size, capacity):
        self.batch_size, self.capacity = batch_size, capacity
        self.k, self.v = [], []  # per layer (B, Hkv, capacity, D), made at the first write, in k's dtype

    def begin(self, position_ids, cu_seqlens, max_seqlen, sliding_window):
        """Where this forward's tokens go and, in decode, which keys each one sees.
        max_seqlen: the longest sequence, its cached tokens included."""
        T, B = position_ids.shape[0], cu_seqlens.shape[0] - 1
        assert B == self.batch_size, f"a forward with a cache of {self.batch_size} sequences got {B}"
        self.layer = 0  # the next attend() is this layer's
        self.decoding = T == B  # a prefill of length-1 prompts is also one token per row: the same arithmetic
        self.rows = torch.repeat_interleave(torch.arange(B, device=position_ids.device), cu_seqlens.diff(),
                                            output_size=T)  # (T,) each token's row
        self.pos, self.length = position_ids, max_seqlen
        if self.decoding:
            key_pos = torch.arange(max_seqlen, device=position_ids.device)
            sees = key_pos <= position_ids[:, None]  # (B, L) causal; unwritten slots lie past each position
            if sliding_window is not None:
                sees &= key_pos > position_ids[:, None] - sliding_window
            self.mask = sees[:, None, None, :]  # (B, 1, 1, L): broadcast over heads and query rows

    # eager even inside a compiled block: in-place writes into buffers held by a Python object, and no
    # layer index for the compiler to specialise each layer's code on
    @torch.compiler.disable
    def attend(self, q, k, v, cu_seqlens, max_seqlen, sliding_window):
        """q: (T, Hq, D), k, v: (T, Hkv, D) of the current layer -> (T, Hq, D)."""
        if self.layer == len(self.k):
            shape = (self.batch_size, k.shape[1], self.capacity, k.shape[2])
            self.k.append(k.new_zeros(shape))
            self.v.append(v.new_zeros(shape))
        k_buf, v_buf = self.k[self.layer], self.v[self.layer]
        self.layer += 1
        k_buf[self.rows, :, self.pos] = k  # (T, Hkv, D) scattered to (row, :, position)
        v_buf[self.rows, :, self.pos] = v
        if not self.decoding:
            return varlen_attention(q, k, v, cu_seqlens, max_seqlen, sliding_window)
        B, H, D = q.shape
        k, v = k_buf[:, :, :self.length], v_buf[:, :, :self.length]  # (B, Hkv, L, D)
        # GQA without repeating K/V: the query heads that share a K/V head become its query rows
        q = q.view(B, k.shape[1], H // k.shape[1], D)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask).reshape(B, H, D)

    def keep(self, rows):
        """Keep these rows (a list of row indices), in this order, as rows 0..len(rows)-1."""
        for buffers in (self.k, self.v):
            for layer, buf in enumerate(buffers):
                buffers[layer] = buf[torch.tensor(rows, dtype=torch.long, device=buf.device)]
        self.batch_size = len(rows)


# -----------------------------------------------------------------------------
# MLP and Block


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(config.d_model, config.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(config.ffn_hidden, config.d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


class Block(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.input_layernorm = RMSNorm(config.d_model, config.norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, rope, position_ids, cu_seqlens, max_seqlen, kv=None, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), rope, position_ids, cu_seqlens, max_seqlen, kv, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


# -----------------------------------------------------------------------------
# The model


class Transformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        # Module names follow Hugging Face's Llama so checkpoints map one-to-one (see from_pretrained)
        self.embed_tokens = nn.Embedding(config.padded_vocab_size, config.d_model)
        self.layers = nn.ModuleList([Block(config, i) for i in range(config.n_layer)])
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.d_model, config.padded_vocab_size, bias=False)
        self._rope = {}  # device -> (cos, sin); kept out of the state dict and out of .to(dtype)
        self.activation_checkpointing = False  # recompute each block in backward: less memory, ~1/3 more compute
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        # GPT-2 style: N(0, 0.02), with the residual-branch outputs scaled down by sqrt(2 * n_layer) so
        # the residual stream's variance does not grow with depth at init.
        std = 0.02
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif name.endswith("norm.weight"):  # the layer norms, the final norm, Qwen3's q_norm / k_norm
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.normal_(0.0, std / math.sqrt(2 * self.config.n_layer))
            else:
                p.normal_(0.0, std)
        self.head_weight()[self.config.vocab_size:].zero_()

    def head_weight(self):
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def rope(self, device):
        if device not in self._rope:
            self._rope[device] = rope_tables(self.config, device)
        return self._rope[device]

    def hidden_states(self, input_ids, position_ids=None, cu_seqlens=None, max_seqlen=None, kv=None, cache=None):
        """The trunk: (T,) token ids -> (T, d_model) final-normed hidden states."""
        T = input_ids.shape[0]
        if cu_seqlens is None:  # a plain (T,) call is one sequence
            cu_seqlens = torch.tensor([0, T], dtype=torch.int32, device=input_ids.device)
            max_seqlen = T
        if position_ids is None:
            assert cu_seqlens.numel() == 2, "packed input needs position_ids restarting at 0 per sequence"
            position_ids = torch.arange(T, device=input_ids.device)
        if max_seqlen is None:
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())  # host sync; the packer passes it
        longest = max_seqlen if kv is None else max(max_seqlen, kv[2])  # a shared rest's positions start past 0
        if longest > self.config.max_seq_len:
            raise ValueError(f"a sequence of {longest} tokens exceeds max_seq_len={self.config.max_seq_len} "
                             f"(the RoPE table size); raise max_seq_len in the config or use shorter sequences")
        rope = self.rope(input_ids.device)
        if cache is not None:
            cache.begin(position_ids, cu_seqlens, max_seqlen, self.config.sliding_window)
        x = self.embed_tokens(input_ids)
        for block in self.layers:
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, rope, position_ids, cu_seqlens, max_seqlen, kv,
                                                      use_reentrant=False)
            else:
                x = block(x, rope, position_ids, cu_seqlens, max_seqlen, kv, cache)
        return self.norm(x)

    def forward(self, input_ids, position_ids=None, cu_seqlens=None, max_seqlen=None, targets=None,
                loss_weights=None, logprobs=False, logits_at=None, cache=None, target_rows=None, kv=None):
        """targets (T,): the token each position must predict, IGNORE (-100) where none (the packer builds
        them, already shifted and cut at sequence boundaries); or, with target_rows (K,), the token hidden row
        target_rows[i] must predict (a row may predict several: a shared prompt's last one, see packing.py).
        kv: the optional separate key/value stream (module docstring). Three uses, all through forward so that the
        DDP / FSDP2 wrappers' hooks run (gradient sync, parameter all-gathers):
          targets:                 (summed cross-entropy float32, number of targets), without full logits;
                                   loss_weights (T,) weights each position's loss (e.g. 1/len per sequence)
          targets, logprobs=True:  (T,) float32 log p(targets[t]) per position, 0 where ignored (DPO)
          no targets:              logits (T, vocab_size), or only at the rows logits_at (generation)
        cache (a KVCache; generation, no gradients): the first call is a prefill of whole prompts, each later
        call brings one new token per sequence at its position, max_seqlen counting the cached tokens too."""
        h = self.hidden_states(input_ids, position_ids, cu_seqlens, max_seqlen, kv, cache)
        if target_rows is not None:
            h = h.index_select(0, target_rows)  # (K, d): the gradient of a row used twice is summed
        w, V = self.head_weight(), self.config.vocab_size
        if targets is None:
            h = h if logits_at is None else h[logits_at]
            return F.linear(h, w)[:, :V]
        if logprobs:
            return chunked_logprobs(h, w, targets, V)
        return chunked_cross_entropy(h, w, targets, V, loss_weights)

    @classmethod
    def from_pretrained(cls, path, dtype=None, device="cpu"):
        """Load a local Hugging Face Llama / Qwen2 / Qwen3 / Mistral / SmolLM3 folder. dtype None keeps the
        checkpoint's dtype. Every problem with the folder is one ValueError or FileNotFoundError naming the file and what to do.
        Built on the meta device, then each tensor is read from the memory-mapped files straight into its parameter:
        peak memory is the model plus one tensor."""
        config = read_hf_config(path)
        files = SafetensorsFolder(path)
        with torch.device("meta"):
            model = cls(config)
        model.to(dtype=dtype or files.dtype("model.embed_tokens.weight")).to_empty(device=device)
        model.load_hf_weights(files)
        return model

    @torch.no_grad()
    def load_hf_weights(self, files):
        """Fill this model's parameters from a Hugging Face folder (a path or a SafetensorsFolder) after checking
        every name and shape against config.json. A parameter may be an FSDP2 shard (a DTensor split along dim 0 in
        torch.chunk pieces over the ranks): each rank then reads only its own rows, so no rank ever holds the
        whole model (under FSDP2: build on meta, fully_shard, to_empty, then this)."""
        files = files if isinstance(files, SafetensorsFolder) else SafetensorsFolder(files)
        path, cfg = files.path, self.config
        unused = {k for k in files.keys() if not k.endswith("rotary_emb.inv_freq")}  # old exports' RoPE buffers
        tied_copy = cfg.tie_embeddings and files.has("lm_head.weight")  # some exports also write the tied head
        if tied_copy:
            unused.discard("lm_head.weight")  # checked against the embedding below
        for name, p in self.named_parameters():
            key = _hf_key(name)
            if key not in unused:
                hint = " (config.json says tie_word_embeddings=false)" if name == "lm_head.weight" else ""
                raise ValueError(f"{path}: tensor {key!r} missing from the checkpoint{hint} — the weights and "
                                 f"config.json do not match; re-download or re-export the model")
            unused.discard(key)
            vocab_rows = name in ("embed_tokens.weight", "lm_head.weight")
            want = (cfg.vocab_size, *p.shape[1:]) if vocab_rows else tuple(p.shape)
            if files.shape(key) != want:
                raise ValueError(f"{path}: tensor {key!r} has shape {files.shape(key)}, config.json implies {want} "
                                 f"— the weights and config.json come from different models")
        if unused:  # weights the model would drop: a bias, a layer or a head this config has no place for
            raise ValueError(f"{path}: {len(unused)} tensor(s) in the checkpoint are not used by this "
                             f"{cfg.arch} config.json, e.g. {sorted(unused)[:3]} — the weights belong to "
                             f"another architecture or config.json is wrong; re-export the model")
        for name, p in self.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            start = 0
            if hasattr(p, "to_local"):  # Shard(0): rank r holds rows [r * ceil(n / W), ...), as torch.chunk splits
                start = min(p.shape[0], p.device_mesh.get_local_rank() * -(-p.shape[0] // p.device_mesh.size()))
            stop = start + local.shape[0]
            if name in ("embed_tokens.weight", "lm_head.weight"):  # rows past vocab_size are our padding
                stop = max(start, min(stop, cfg.vocab_size))
            rows = files.read(_hf_key(name), start, stop)
            if name == "embed_tokens.weight" and tied_copy and not torch.equal(rows, files.read("lm_head.weight", start, stop)):
                raise ValueError(f"{path}: config.json says tie_word_embeddings=true, but the checkpoint's "
                                 f"'lm_head.weight' differs from 'model.embed_tokens.weight' — set "
                                 f"tie_word_embeddings to false if the model has its own head, or re-export it")
            local[:len(rows)].copy_(rows)
            local[len(rows):].zero_()  # the vocab padding rows past vocab_size

    def save_pretrained(self, path, max_shard_bytes=5 * 2**30, write=True):
        """Write config.json + safetensors (sharded with an index past max_shard_bytes) that transformers loads.
        Tensors stream into the files one at a time (the headers are written first, from the shapes), so the writer
        holds one tensor, never a shard file's worth. An FSDP2-sharded model is streamed to the writer (global rank 0,
        write=True) one tensor at a time, each rank sending its own rows: every rank calls this, no GPU ever holds a
        whole tensor, and the writer's CPU holds one."""
        V = self.config.vocab_size
        state = self.state_dict()  # FSDP2: DTensors, each rank holding its own rows
        shapes = {name: (V if name in ("embed_tokens.weight", "lm_head.weight") else t.shape[0], *t.shape[1:])
                  for name, t in state.items()}  # without our vocab padding
        sizes = {name: math.prod(shapes[name]) * t.element_size() for name, t in state.items()}
        shards, size = [[]], 0
        for name, nbytes in sizes.items():
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(name)
            size += nbytes
        names = ["model.safetensors"] if len(shards) == 1 else [
            f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        if write:
            os.makedirs(path, exist_ok=True)
        for fname, shard in zip(names, shards):
            f = open(os.path.join(path, fname), "wb") if write else None
            if write:
                _write_safetensors_header(f, [(_hf_key(n), shapes[n], state[n].dtype, sizes[n]) for n in shard])
            for name in shard:
                t = _gather_rows(state[name].detach(), write)
                if write:
                    f.write(t[:shapes[name][0]].contiguous().cpu().view(-1).view(torch.uint8).numpy())  # no copy
            if write:
                f.close()
        if not write:
            return
        written = ["config.json"] + names
        if len(shards) > 1:
            weight_map = {_hf_key(name): fname for fname, shard in zip(names, shards) for name in shard}
            with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}, f, indent=2)
            written.append("model.safetensors.index.json")
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config_to_hf(self.config, self.embed_tokens.weight.dtype), f, indent=2)
        for fname in os.listdir(path):  # a previous export's index or shards would be loaded instead of these
            stale = fname in ("model.safetensors", "model.safetensors.index.json") or (
                fname.startswith("model-") and "-of-" in fname and fname.endswith(".safetensors"))
            if stale and fname not in written:
                os.remove(os.path.join(path, fname))
        # save_file creates 0600 files and open() keeps an older file's mode: give every file the mode a
        # new file gets (0666 less the umask), so others sharing the export can read it
        umask = os.umask(0)
        os.umask(umask)
        for fname in written:
            os.chmod(os.path.join(path, fname), 0o666 & ~umask)

    def flops_per_token(self, seq_lens, head_tokens=None, key_lens=None):
        """Training FLOPs (forward + backward) per real token of a packed batch with these sequence lengths.
        6 per matmul parameter per token (2 forward, 4 backward), plus causal attention from the *actual*
        lengths: QK^T and AV cost 4*L^2*H*D forward per layer for full attention, half of that causal,
        times 3 for fwd+bwd -> 6 * n_layer * H * D * sum(L^2) / sum(L). Embedding lookups are not matmuls.
        The LM head only runs on target tokens; pass head_tokens to count it there alone. key_lens: a query
        segment of Lq tokens over Lk keys (bottom-right causal, prefix sharing) scores Lq * (2 Lk - Lq) / 2 pairs."""
        cfg = self.config
        lens = torch.as_tensor(seq_lens, dtype=torch.float64)
        n_tokens = float(lens.sum())
        keys = lens if key_lens is None else torch.as_tensor(key_lens, dtype=torch.float64)
        scored = lens * (2 * keys - lens)  # L^2 where Lk = Lq
        head = cfg.d_model * cfg.vocab_size
        trunk = self.num_params() - self.embed_tokens.weight.numel() - (0 if self.lm_head is None else self.lm_head.weight.numel())
        head_share = 1.0 if head_tokens is None else head_tokens / n_tokens
        attn = 6 * cfg.n_layer * cfg.n_head * cfg.head_dim * float(scored.sum()) / n_tokens
        return 6 * trunk + 6 * head * head_share + attn


# -----------------------------------------------------------------------------
# LM head + loss over chunks of tokens: peak memory O(chunk * vocab), never O(T * vocab)

# Tokens per head chunk. A chunk holds two (chunk, vocab) float32 buffers (log-probs and their gradient):
# 2048 x 128k x 4 bytes = 1 GiB each, while (2048, d) @ (d, 128k) is still a large, efficient matmul.
LOSS_CHUNK = 2048


def _compute_dtype(h):
    return torch.get_autocast_dtype(h.device.type) if torch.is_autocast_enabled(h.device.type) else h.dtype


def _chunk_logprobs(h, w, targets, vocab_size):
    """h: (C, d), w: (Vp, d) -> float32 log-softmax over the real vocab (C, V) and the targets' log-probs (C,)."""
    logits = (h @ w.t()).float()[:, :vocab_size]
    logp = logits.sub_(torch.logsumexp(logits, dim=-1, keepdim=True))  # in place: one (C, V) buffer, not two
    return logp, logp.gather(1, targets[:, None]).squeeze(1)


def _select(h, targets):
    # positions without a target skip the head entirely (e.g. prompt tokens in SFT); nonzero syncs once
    idx = (targets != -100).nonzero().squeeze(1)
    return idx, h.index_select(0, idx), targets.index_select(0, idx)


class ChunkedCrossEntropy(torch.autograd.Function):
    """sum_t weight_t * CE(h_t @ W^T, target_t). The loss is a weighted sum with weights known up front,
    so the gradients are computed chunk by chunk in the forward pass (3 matmuls per chunk, not 4) and
    the backward only scales them: the (T, V) logits never exist, neither forward nor backward."""

    @staticmethod
    def forward(ctx, h, w, targets, vocab_size, weights, need_grad):
        dtype = _compute_dtype(h)
        with torch.autocast(h.device.type, enabled=False):
            idx, hs, ts = _select(h, targets)
            hs, wc = hs.to(dtype), w.to(dtype)
            ws = None if weights is None else weights.index_select(0, idx).float()
            loss = torch.zeros((), device=h.device, dtype=torch.float32)
            if need_grad:
                grad_hs = torch.empty_like(hs)
                grad_w = torch.zeros(w.shape, device=w.device, dtype=torch.float32)
            for s in range(0, hs.shape[0], LOSS_CHUNK):
                hc, tc = hs[s:s + LOSS_CHUNK], ts[s:s + LOSS_CHUNK]
                logp, tgt = _chunk_logprobs(hc, wc, tc, vocab_size)
                wt = None if ws is None else ws[s:s + LOSS_CHUNK]
                loss -= tgt.sum() if wt is None else (tgt * wt).sum()
                if not need_grad:
                    continue
                # d(-log p_t)/d logits = softmax - onehot(target)
                g = logp.exp_()
                g[torch.arange(len(tc), device=g.device), tc] -= 1.0
                if wt is not None:
                    g *= wt[:, None]
                g = g.to(dtype)
                grad_hs[s:s + LOSS_CHUNK] = g @ wc[:vocab_size]
                grad_w[:vocab_size] += (g.t() @ hc).float()
        if need_grad:
            grad_h = torch.zeros_like(h).index_copy_(0, idx, grad_hs.to(h.dtype))
            ctx.save_for_backward(grad_h, grad_w.to(w.dtype))
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_loss, grad_w * grad_loss, None, None, None, None


class ChunkedLogprobs(torch.autograd.Function):
    """Per-token log p(target_t) for a loss not known in advance (DPO): the backward recomputes each
    chunk's logits instead of keeping them (4 matmuls per chunk, memory O(chunk * vocab))."""

    @staticmethod
    def forward(ctx, h, w, targets, vocab_size):
        dtype = _compute_dtype(h)
        with torch.no_grad(), torch.autocast(h.device.type, enabled=False):
            idx, hs, ts = _select(h, targets)
            hs, wc = hs.to(dtype), w.to(dtype)
            out = torch.zeros(h.shape[0], device=h.device, dtype=torch.float32)
            for s in range(0, hs.shape[0], LOSS_CHUNK):
                out[idx[s:s + LOSS_CHUNK]] = _chunk_logprobs(hs[s:s + LOSS_CHUNK], wc, ts[s:s + LOSS_CHUNK], vocab_size)[1]
        ctx.save_for_backward(h, w, targets)
        ctx.vocab_size, ctx.dtype = vocab_size, dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        h, w, targets = ctx.saved_tensors
        dtype, V = ctx.dtype, ctx.vocab_size
        with torch.no_grad(), torch.autocast(h.device.type, enabled=False):
            idx, hs, ts = _select(h, targets)
            hs, wc, gs = hs.to(dtype), w.to(dtype), grad_out.index_select(0, idx).float()
            grad_hs = torch.empty_like(hs)
            grad_w = torch.zeros(w.shape, device=w.device, dtype=torch.float32)
            for s in range(0, hs.shape[0], LOSS_CHUNK):
                hc, tc, gc = hs[s:s + LOSS_CHUNK], ts[s:s + LOSS_CHUNK], gs[s:s + LOSS_CHUNK]
                logp, _ = _chunk_logprobs(hc, wc, tc, V)
                # d log p_t / d logits = onehot(target) - softmax, scaled by the upstream gradient
                g = logp.exp_().neg_()
                g[torch.arange(len(tc), device=g.device), tc] += 1.0
                g = (g * gc[:, None]).to(dtype)
                grad_hs[s:s + LOSS_CHUNK] = g @ wc[:V]
                grad_w[:V] += (g.t() @ hc).float()
            grad_h = torch.zeros_like(h).index_copy_(0, idx, grad_hs.to(h.dtype))
        return grad_h, grad_w.to(w.dtype), None, None


def chunked_cross_entropy(h, w, targets, vocab_size, weights=None):
    """h: (T, d), w: (Vp, d), targets: (T,) with -100 ignored -> (summed CE float32 scalar, n_targets tensor)."""
    n = (targets != -100).sum()
    # forward() runs with grad mode off, so whether gradients are wanted (not in evaluation) is decided here
    need_grad = torch.is_grad_enabled() and (h.requires_grad or w.requires_grad)
    return ChunkedCrossEntropy.apply(h, w, targets, vocab_size, weights, need_grad), n


def chunked_logprobs(h, w, targets, vocab_size):
    """h: (T, d), w: (Vp, d), targets: (T,) -> (T,) float32 log p(target), 0 where the target is -100."""
    return ChunkedLogprobs.apply(h, w, targets, vocab_size)


# -----------------------------------------------------------------------------
# Hugging Face checkpoints: config.json + model.safetensors (or shards + index)

_HF_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "mistral": "MistralForCausalLM", "smollm3": "SmolLM3ForCausalLM"}


def config_from_hf(hf, source="config.json"):
    """Translate a Hugging Face config dict. A missing or mistyped key, or anything we would silently
    compute differently, is a ValueError naming the file and the key."""
    def unsupported(key, why):
        raise ValueError(f"{source}: {key}={hf.get(key)!r} is not supported: {why}")

    def get(key, kind=int, default=None, required=False, within=None):
        """hf[key] (or hf[within][key]), checked: a string "2" or a bool would otherwise flow into
        shapes and arithmetic. Numbers must be positive; an int is accepted where a float is expected."""
        v = (hf if within is None else hf[within]).get(key)
        name = key if within is None else f"{within}.{key}"
        if v is None:
            if required:
                raise ValueError(f"{source}: required key {name!r} is missing — the file is incomplete; "
                                 f"re-download the model or add the key")
            return default
        if kind is bool:
            ok = isinstance(v, bool)
        else:
            ok = isinstance(v, (int, float) if kind is float else int) and not isinstance(v, bool) and v > 0
        if not ok:
            what = "true or false" if kind is bool else f"a positive {kind.__name__}"
            raise ValueError(f"{source}: {name}={v!r} must be {what} — fix the value in the file")
        return v

    arch = hf.get("model_type")
    if not isinstance(arch, str) or arch not in _HF_ARCH:
        unsupported("model_type", f"nanopack loads {sorted(_HF_ARCH)}")
    if hf.get("hidden_act", "silu") != "silu":
        unsupported("hidden_act", "the MLP is SwiGLU (silu)")
    if hf.get("mlp_bias"):
        unsupported("mlp_bias", "the MLP has no biases")
    if arch != "qwen2" and hf.get("attention_bias"):  # Llama, Qwen3, SmolLM3: on o_proj as well
        unsupported("attention_bias", "only Qwen2-style q/k/v biases are implemented (no o_proj bias)")
    # rope: newer transformers write rope_parameters (with rope_theta inside), older rope_theta + rope_scaling
    rope_key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    rope = hf.get(rope_key) or {}
    if not isinstance(rope, dict):
        unsupported(rope_key, 'expected an object such as {"rope_type": "linear", "factor": 2.0}')
    theta = get("rope_theta", float, within=rope_key) if rope else None
    theta = theta or get("rope_theta", float, 10000.0)
    kind = rope.get("rope_type", rope.get("type", "default"))
    needs = {"default": (), "linear": ("factor",),  # the keys rope_inv_freq reads
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    if kind not in needs:
        unsupported(rope_key, f"rope_type {kind!r} (supported: default, linear, llama3)")
    for key in needs[kind]:
        get(key, float, required=True, within=rope_key)
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        unsupported("partial_rotary_factor", "RoPE rotates the whole head")
    scaling = None if kind == "default" else {**{k: v for k, v in rope.items() if k not in ("type", "rope_theta")},
                                              "rope_type": kind}
    max_len = get("max_position_embeddings", default=2048)
    window = None
    if arch == "mistral":
        window = get("sliding_window")
    elif hf.get("use_sliding_window") and hf.get("sliding_window") is not None:
        unsupported("use_sliding_window", "per-layer sliding windows (Qwen2/Qwen3 max_window_layers, SmolLM3 "
                                          "NoPE layers) are not implemented")
    if window is not None and window >= max_len:
        window = None  # a window no sequence can exceed changes nothing
    n_head, n_layer = get("num_attention_heads", required=True), get("num_hidden_layers", required=True)
    nope = ()
    if arch == "smollm3":  # no_rope_layers[i] is 1 where layer i uses RoPE, 0 where it skips it
        interval = get("no_rope_layer_interval", default=4)  # what transformers derives the list from when absent
        flags = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n_layer)]
        if not isinstance(flags, list) or len(flags) < n_layer or any(f not in (0, 1) for f in flags):
            unsupported("no_rope_layers", f"expected a list of {n_layer} (num_hidden_layers) 0s and 1s")
        nope = tuple(i for i in range(n_layer) if flags[i] == 0)
    try:
        return ModelConfig(
            vocab_size=get("vocab_size", required=True), n_layer=n_layer,
            n_head=n_head, n_kv_head=get("num_key_value_heads", default=n_head),
            d_model=get("hidden_size", required=True), ffn_hidden=get("intermediate_size", required=True),
            head_dim=get("head_dim"), rope_theta=float(theta), rope_scaling=scaling, max_seq_len=max_len,
            norm_eps=get("rms_norm_eps", float, 1e-5), qkv_bias=(arch == "qwen2"), qk_norm=(arch == "qwen3"),
            nope_layers=nope, tie_embeddings=get("tie_word_embeddings", bool, False), sliding_window=window,
            arch=arch)
    except AssertionError as e:  # ModelConfig's own checks (head counts, even head_dim)
        raise ValueError(f"{source}: {e} — the values do not describe a valid model") from None


def config_to_hf(cfg, dtype):
    hf = dict(architectures=[_HF_ARCH[cfg.arch]], model_type=cfg.arch, vocab_size=cfg.vocab_size,
              hidden_size=cfg.d_model, intermediate_size=cfg.ffn_hidden, num_hidden_layers=cfg.n_layer,
              num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head, head_dim=cfg.head_dim,
              hidden_act="silu", max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
              rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling, tie_word_embeddings=cfg.tie_embeddings,
              torch_dtype=str(dtype).removeprefix("torch."))
    if cfg.arch in ("llama", "qwen3", "smollm3"):
        hf.update(attention_bias=False, mlp_bias=False)
    if cfg.arch == "mistral":
        hf.update(sliding_window=cfg.sliding_window)
    if cfg.arch in ("qwen2", "qwen3", "smollm3"):
        hf.update(use_sliding_window=False, sliding_window=None)
    if cfg.arch == "smollm3":
        hf.update(no_rope_layers=[int(i not in cfg.nope_layers) for i in range(cfg.n_layer)])
    return hf


def _gather_rows(t, write):
    """A full tensor on the writer's CPU from an FSDP2 DTensor (dim 0 in torch.chunk pieces over the mesh), rank by
    rank: the writer (mesh rank 0) receives each other rank's rows into one shard-sized buffer on its device and copies
    them to CPU; the others send theirs and get None. A plain tensor comes back as it is."""
    if not hasattr(t, "to_local"):
        return t
    import torch.distributed as dist
    local, mesh = t.to_local(), t.device_mesh
    group, n, world_size = mesh.get_group(), t.shape[0], mesh.size()
    chunk = -(-n // world_size)
    if not write:
        if local.shape[0]:
            dist.send(local.contiguous(), dist.get_global_rank(group, 0), group=group)
        return None
    out = torch.empty(t.shape, dtype=t.dtype)
    out[:local.shape[0]] = local
    buf = torch.empty((min(chunk, n), *t.shape[1:]), dtype=t.dtype, device=local.device)
    for r in range(1, world_size):
        start = min(n, r * chunk)
        rows = min(n, start + chunk) - start
        if rows:
            dist.recv(buf[:rows], dist.get_global_rank(group, r), group=group)
            out[start:start + rows] = buf[:rows]
    return out


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def _write_safetensors_header(f, entries):
    """The safetensors layout: an 8-byte little-endian header length, a JSON header of name -> dtype, shape and
    byte range (padded with spaces to a multiple of 8), then the tensors' bytes in that order, back to back.
    entries: (name, shape, torch dtype, nbytes) in the order their bytes will follow."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, dtype, nbytes in entries:
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    f.write(len(text).to_bytes(8, "little") + text)


def _hf_key(name):
    return name if name.startswith("lm_head.") else "model." + name


def read_hf_config(path):
    """The ModelConfig of a Hugging Face model folder, from its config.json alone (no weights read)."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"{cfg_path} not found: point to a Hugging Face model folder "
                                f"(config.json + model.safetensors)")
    return config_from_hf(_read_json_object(cfg_path), cfg_path)


def _read_json_object(path):
    """json.load that names the file: json's own errors give a line and column but no file."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except ValueError as e:  # JSONDecodeError ("... line 3 column 5"), or bytes that are not UTF-8
        raise ValueError(f"{path}: not valid JSON ({e}) — fix the file or re-download the model") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: holds a JSON {type(obj).__name__}, not an object — fix the file or "
                         f"re-download the model")
    return obj


class SafetensorsFolder:
    """The tensors of a model folder (model.safetensors, or shards listed by model.safetensors.index.json), memory-mapped:
    names and shapes come from the headers, and read() copies only the rows asked for."""

    def __init__(self, path):
        from safetensors import SafetensorError, safe_open
        self.path = path
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            weight_map = _read_json_object(index).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise ValueError(f"{index}: no \"weight_map\" object of tensor name -> shard file — re-download "
                                 f"or re-export the model")
            names = sorted(set(weight_map.values()))
        elif os.path.exists(os.path.join(path, "model.safetensors")):
            names = ["model.safetensors"]
        else:
            raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json; point to a "
                                    f"Hugging Face model folder (pytorch_model.bin is not read: unsafe pickle)")
        self.files = {}  # tensor name -> the open file that holds it
        for name in names:
            file = os.path.join(path, name)
            if not os.path.exists(file):
                raise FileNotFoundError(f"{file} not found, but {index} lists it — the download is incomplete; "
                                        f"re-download the model")
            try:
                handle = safe_open(file, framework="pt")
            except SafetensorError as e:  # e.g. "incomplete metadata, file not fully covered": names no file
                raise ValueError(f"{file}: incomplete or corrupt safetensors file ({e}) — re-download or "
                                 f"re-export the model") from None
            self.files.update({key: handle for key in handle.keys()})

    def keys(self):
        return self.files.keys()

    def has(self, key):
        return key in self.files

    def shape(self, key):
        return tuple(self.files[key].get_slice(key).get_shape())

    def dtype(self, key):
        return self.read(key, 0, 1).dtype

    def read(self, key, start=0, stop=None):
        """Rows start:stop of a tensor (all of a 1-D one's elements in that range), as a new CPU tensor."""
        return self.files[key].get_slice(key)[start:stop]


# -----------------------------------------------------------------------------
# Smoke run: python model.py trains the toy preset for a few steps on a packed stream and shows the loss fall

if __name__ == "__main__":
    torch.manual_seed(0)
    cfg = config_from_preset("toy")
    model = Transformer(cfg)
    print(f"toy model: {model.num_params() / 1e6:.2f}M parameters")
    # sequences of varied length counting up from a random start: learnable, and positions matter
    lens = [37, 120, 64, 9, 200, 81]
    seqs = [(torch.arange(n) + torch.randint(0, 300, ())) % cfg.vocab_size for n in lens]
    input_ids = torch.cat(seqs)
    position_ids = torch.cat([torch.arange(n) for n in lens])
    cu_seqlens = F.pad(torch.tensor(lens).cumsum(0), (1, 0)).to(torch.int32)
    targets = F.pad(input_ids[1:], (0, 1), value=-100)  # position t predicts token t+1 of its own sequence
    targets[cu_seqlens[1:].long() - 1] = -100
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(31):
        loss_sum, n = model(input_ids, position_ids, cu_seqlens, max(lens), targets=targets)
        loss = loss_sum / n
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0:
            print(f"step {step}: loss {loss.item():.4f} over {int(n)} target tokens in {len(lens)} packed sequences")
