"""
The fast paths, each tested against a reference (tests/test_rope.py, tests/test_model.py):
  rope_fused             Q and K rotated by one Triton launch; the eager reference is
                         model.rope_reference
  chunked_cross_entropy  the LM head + loss over chunks of tokens: the (T, vocab) logits never exist
  chunked_logprobs       the same for per-token log-probs (DPO), the backward recomputing each
                         chunk
  chunked_distill        the NLL mixed with a generalized JSD to a teacher, through both models'
                         LM heads chunk by chunk: neither (T, vocab) logits ever exists
"""
import math
import os

import numpy as np
import torch

HAS_TRITON = False
if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    # only where the kernel can run (or its CPU interpreter test): importing triton costs seconds
    try:
        import triton
        import triton.language as tl
        HAS_TRITON = True
    except ImportError:  # the eager RoPE is used instead
        pass

IGNORE_INDEX = -100

if HAS_TRITON:
    @triton.jit
    def _rotate_tile(x_ptr, out_ptr, stride_t, stride_h, n_head, tok, cos, sin,
                     H_PAD: tl.constexpr, HALF: tl.constexpr):
        # tok: (BLOCK_T,) int64 token indices (-1 where past T); cos, sin: (BLOCK_T, 1, HALF)
        # float32
        h = tl.arange(0, H_PAD)[None, :, None]
        d = tl.arange(0, HALF)[None, None, :]
        mask = (tok[:, None, None] >= 0) & (h < n_head)  # (BLOCK_T, H_PAD, 1), broadcast over d
        x1_ptrs = x_ptr + tok[:, None, None] * stride_t + h * stride_h + d  # last dim is contiguous
        x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x1_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
        # out is contiguous
        o1_ptrs = out_ptr + tok[:, None, None] * (n_head * 2 * HALF) + h * (2 * HALF) + d
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
        # (BLOCK_T,) packed positions restart at 0
        pos = tl.load(pos_ptr + tok, mask=tok >= 0, other=0)
        d = tl.arange(0, HALF)[None, None, :]
        # (BLOCK_T, 1, HALF), read once for q and k
        cos = tl.load(cos_ptr + pos[:, None, None] * HALF + d)
        sin = tl.load(sin_ptr + pos[:, None, None] * HALF + d)
        # backward: the rotation is orthogonal, so its transpose is the rotation by -angle
        if INVERSE:
            sin = -sin
        _rotate_tile(q_ptr, q_out_ptr, q_stride_t, q_stride_h, n_q_head, tok, cos, sin, HQ_PAD,
                     HALF)
        _rotate_tile(k_ptr, k_out_ptr, k_stride_t, k_stride_h, n_kv_head, tok, cos, sin, HKV_PAD,
                     HALF)

    # a custom op stays in a torch.compile(dynamic=True) graph with a symbolic T; triton_op fails
    # under TRITON_INTERPRET
    @torch.library.custom_op("nanopack::rope", mutates_args=())
    def _rope_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 position_ids: torch.Tensor, inverse: bool) -> tuple[torch.Tensor, torch.Tensor]:
        T, n_q_head, D = q.shape
        n_kv_head = k.shape[1]
        # strides go to the kernel: q/k slices of a fused qkv projection are read in place
        q = q if q.stride(-1) == 1 else q.contiguous()
        k = k if k.stride(-1) == 1 else k.contiguous()
        # outputs contiguous: (T, Hq, D)
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        # One program = BLOCK_T tokens x all heads of q and k, so each (cos, sin) row is loaded
        # once; ~2048 elements per half-tile keeps registers low at num_warps=4 and gives T/BLOCK_T
        # programs to fill the SMs.
        hq_pad = triton.next_power_of_2(n_q_head)
        block_t = max(1, 2048 // (hq_pad * (D // 2)))
        grid = (triton.cdiv(T, block_t),)
        _rope_kernel[grid](q, k, q_out, k_out, cos, sin, position_ids, T,
                           q.stride(0), q.stride(1), k.stride(0), k.stride(1), n_q_head, n_kv_head,
                           BLOCK_T=block_t, HQ_PAD=hq_pad,
                           HKV_PAD=triton.next_power_of_2(n_kv_head),
                           HALF=D // 2, INVERSE=inverse)
        return q_out, k_out

    @_rope_op.register_fake
    def _(q, k, cos, sin, position_ids, inverse):
        return q.new_empty(q.shape), k.new_empty(k.shape)  # contiguous, as the kernel writes them

    def _rope_setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[2:5])  # cos, sin, position_ids

    def _rope_backward(ctx, grad_q, grad_k):
        grad_q, grad_k = _rope_op(grad_q, grad_k, *ctx.saved_tensors, True)
        # cos/sin are fixed buffers, positions are ints
        return grad_q, grad_k, None, None, None, None

    _rope_op.register_autograd(_rope_backward, setup_context=_rope_setup_context)


# tl.arange spans half the head dim: a power of two; >= 16 is what the tests cover
def rope_fits(head_dim):
    return head_dim >= 16 and not head_dim & (head_dim - 1)


def rope_fused(q, k, cos, sin, position_ids):
    """model.rope_reference's contract, as one Triton launch for Q and K together (backward: one
    more)."""
    if not HAS_TRITON:
        raise RuntimeError("rope_fused needs triton (pip install triton); use rope_reference "
                           "instead")
    D = q.shape[-1]
    if not rope_fits(D) or k.shape[-1] != D or k.shape[0] != q.shape[0]:
        raise ValueError("rope_fused needs q (T, Hq, D), k (T, Hkv, D) with D a power of two >= "
                         f"16, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    cos, sin = cos.float().contiguous(), sin.float().contiguous()  # no-ops for the model's tables
    return _rope_op(q, k, cos, sin, position_ids.contiguous(), False)


# a chunk's two (chunk, vocab) float32 buffers: 2048 x 128k x 4 bytes = 1 GiB each, and still a
# large matmul
LOSS_CHUNK = 2048


def _compute_dtype(h):
    if torch.is_autocast_enabled(h.device.type):
        return torch.get_autocast_dtype(h.device.type)
    return h.dtype


def _chunk_logprobs(h, w, targets, vocab_size, temperature=1.0):
    """h: (C, d), w: (Vp, d) -> float32 log-softmax of logits / temperature over the real vocab
    (C, V) and the targets' log-probs (C,)."""
    logits = (h @ w.t()).float()[:, :vocab_size]
    if temperature != 1.0:
        logits.div_(temperature)
    # in place: one (C, V) buffer, not two
    logp = logits.sub_(torch.logsumexp(logits, dim=-1, keepdim=True))
    return logp, logp.gather(1, targets[:, None]).squeeze(1)


def _chunk_grads(logp, h, w, targets, scale, dtype, need_w):
    """Gradients of -sum_t scale_t * log p_t over one chunk, consuming logp: d/dlogits = softmax -
    onehot. -> (grad_h (C, d) in dtype, grad_w (V, d) float32, None for a frozen head: LoRA's)."""
    g = logp.exp_()
    g[torch.arange(len(targets), device=g.device), targets] -= 1.0
    if scale is not None:
        g *= scale[:, None]
    g = g.to(dtype)
    return g @ w[:g.shape[1]], (g.t() @ h).float() if need_w else None


def _select(h, w, targets, dtype):
    # positions without a target skip the head entirely (e.g. prompt tokens in SFT), found on the
    # host (a sync, as nonzero's size is): from the targets as they are, so that fake parameters
    # (plan.py) still give a real index
    idx = torch.tensor(np.flatnonzero(np.array(targets.tolist()) != IGNORE_INDEX),
                       device=targets.device)
    return idx, h.index_select(0, idx).to(dtype), w.to(dtype), targets.index_select(0, idx)


def _loss_and_grads(h, w, targets, vocab_size, scales, dtype, need_grad, need_w=True,
                    temperature=1.0):
    """-sum_t scale_t * log p(target_t) (scales (T,) or None: all 1) chunk by chunk, with its
    gradients if need_grad -> (loss float32, grad_h like h, grad_w float32), the gradients None
    without need_grad (grad_w: need_w)."""
    # p at a temperature: the caller divides scales by it (the chain rule's factor)
    idx, hs, wc, ts = _select(h, w, targets, dtype)
    scales = None if scales is None else scales.index_select(0, idx).float()
    loss, grad_h, grad_w = torch.zeros((), device=h.device, dtype=torch.float32), None, None
    if need_grad:
        grad_hs = torch.empty_like(hs)
        grad_w = torch.zeros(w.shape, device=w.device, dtype=torch.float32) if need_w else None
    for s in range(0, hs.shape[0], LOSS_CHUNK):
        hc, tc = hs[s:s + LOSS_CHUNK], ts[s:s + LOSS_CHUNK]
        sc = None if scales is None else scales[s:s + LOSS_CHUNK]
        logp, tgt = _chunk_logprobs(hc, wc, tc, vocab_size, temperature)
        loss -= tgt.sum() if sc is None else (tgt * sc).sum()
        if need_grad:
            grad_hs[s:s + LOSS_CHUNK], gw = _chunk_grads(logp, hc, wc, tc, sc, dtype, need_w)
            if need_w:
                grad_w[:vocab_size] += gw
    if need_grad:
        grad_h = torch.zeros_like(h).index_copy_(0, idx, grad_hs.to(h.dtype))
    return loss, grad_h, grad_w


class ChunkedCrossEntropy(torch.autograd.Function):
    """sum_t weight_t * CE(h_t @ W^T, target_t), its gradients computed in the forward (3 matmuls a
    chunk, not 4)."""

    @staticmethod
    def forward(ctx, h, w, targets, vocab_size, weights, need_grad):
        dtype = _compute_dtype(h)  # read before autocast is switched off
        with torch.autocast(h.device.type, enabled=False):
            loss, grad_h, grad_w = _loss_and_grads(h, w, targets, vocab_size, weights, dtype,
                                                   need_grad,
                                                   w.requires_grad)
        if need_grad:
            ctx.save_for_backward(grad_h, None if grad_w is None else grad_w.to(w.dtype))
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        grad_w = None if grad_w is None else grad_w * grad_loss
        return grad_h * grad_loss, grad_w, None, None, None, None


class ChunkedLogprobs(torch.autograd.Function):
    """Per-token log p(target_t) for a loss not known in advance (DPO), p = softmax(logits /
    temperature) (RL's sampling one): the backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, h, w, targets, vocab_size, temperature):
        dtype = _compute_dtype(h)
        with torch.no_grad(), torch.autocast(h.device.type, enabled=False):
            idx, hs, wc, ts = _select(h, w, targets, dtype)
            out = torch.zeros(h.shape[0], device=h.device, dtype=torch.float32)
            for s in range(0, hs.shape[0], LOSS_CHUNK):
                out[idx[s:s + LOSS_CHUNK]] = _chunk_logprobs(hs[s:s + LOSS_CHUNK], wc,
                                                             ts[s:s + LOSS_CHUNK],
                                                             vocab_size, temperature)[1]
        ctx.save_for_backward(h, w, targets)
        ctx.vocab_size, ctx.dtype, ctx.temperature = vocab_size, dtype, temperature
        return out

    @staticmethod
    def backward(ctx, grad_out):
        h, w, targets = ctx.saved_tensors
        # d log p = -d(-log p): scales -grad_out; d(logits / T) = d logits / T
        scales = -grad_out / ctx.temperature
        with torch.no_grad(), torch.autocast(h.device.type, enabled=False):
            _, grad_h, grad_w = _loss_and_grads(h, w, targets, ctx.vocab_size, scales, ctx.dtype,
                                                True, ctx.needs_input_grad[1], ctx.temperature)
        return grad_h, None if grad_w is None else grad_w.to(w.dtype), None, None, None


def chunked_cross_entropy(h, w, targets, vocab_size, weights=None):
    """h: (T, d), w: (Vp, d), targets: (T,) with -100 ignored -> (summed CE float32 scalar,
    n_targets tensor)."""
    n = (targets != IGNORE_INDEX).sum()
    # forward() runs with grad mode off, so whether gradients are wanted (not in evaluation) is
    # decided here
    need_grad = torch.is_grad_enabled() and (h.requires_grad or w.requires_grad)
    return ChunkedCrossEntropy.apply(h, w, targets, vocab_size, weights, need_grad), n


def chunked_logprobs(h, w, targets, vocab_size, temperature=1.0):
    """h: (T, d), w: (Vp, d), targets: (T,) -> (T,) float32 log p(target), 0 where the target is
    -100; p = softmax(h @ w^T / temperature)."""
    return ChunkedLogprobs.apply(h, w, targets, vocab_size, temperature)


def _jsd_rows(s, t, beta):
    """Student and teacher log-probs (C, V) -> the generalized JSD of each row (C,) and its gradient
    with respect to the student's logits / temperature (C, V). beta: 0 KL(teacher || student), 1
    KL(student || teacher), between beta KL(t || m) + (1 - beta) KL(s || m), m = (1 - beta) p_s +
    beta p_t (TRL's generalized_jsd_loss)."""
    ps = s.exp()
    if beta == 0:
        pt = t.exp()
        return (pt * (t - s)).sum(1), ps - pt
    if beta == 1:
        diff = s - t
        kl = (ps * diff).sum(1)
        return kl, ps * (diff - kl[:, None])
    m = torch.logaddexp(s + math.log1p(-beta), t + math.log(beta))
    jsd = beta * (t.exp() * (t - m)).sum(1) + (1 - beta) * (ps * (s - m)).sum(1)
    # d jsd / d s = (1 - beta) p_s (s - m); through the log-softmax: g - p_s sum(g)
    g = (1 - beta) * ps * (s - m)
    return jsd, g - ps * g.sum(1, keepdim=True)


# the JSD's chunk: ~8 (chunk, vocab) float32 buffers at once, 512 x 128k x 4 bytes x 8 = 2 GiB
DISTILL_CHUNK = 512


def _distill_chunk(z, zt, targets, beta, temperature, weight):
    """A chunk's student and teacher logits (C, V) -> (per-row NLL, JSD (C,), the gradient of (1 -
    weight) NLL + weight JSD with respect to the student's logits (C, V))."""
    logp = torch.log_softmax(z, dim=-1)
    rows = torch.arange(len(targets), device=z.device)
    nll = -logp[rows, targets]
    s = logp if temperature == 1 else torch.log_softmax(z / temperature, dim=-1)
    jsd, g_jsd = _jsd_rows(s, torch.log_softmax(zt / temperature, dim=-1), beta)
    del s
    g = logp.exp_()
    g[rows, targets] -= 1.0
    # d(z / T) = dz / T
    return nll, jsd, g.mul_(1 - weight).add_(g_jsd, alpha=weight / temperature)


class ChunkedDistill(torch.autograd.Function):
    """sum_t scale_t ((1 - weight) NLL_t + weight JSD_t) through the student's head (h, w) and the
    teacher's (h_t, w_t), its gradients computed in the forward: the teacher's gathered head is
    needed only here. Also returns the unscaled-by-weight sums (NLL, JSD), for the log."""

    @staticmethod
    def forward(ctx, h, w, h_t, w_t, targets, vocab_size, beta, temperature, weight, scales):
        dtype = _compute_dtype(h)
        # float32 at least: float64 inputs (the tests) stay float64
        acc = torch.promote_types(dtype, torch.float32)
        need_w = w.requires_grad
        with torch.no_grad(), torch.autocast(h.device.type, enabled=False):
            idx, hs, wc, ts = _select(h, w, targets, dtype)
            hts, wt = h_t.index_select(0, idx).to(dtype), w_t[:vocab_size].to(dtype)
            sc = None if scales is None else scales.index_select(0, idx).to(acc)
            sums = torch.zeros(3, device=h.device, dtype=acc)
            grad_hs = torch.empty_like(hs)
            grad_w = torch.zeros(w.shape, device=w.device, dtype=acc) if need_w else None
            for s in range(0, hs.shape[0], DISTILL_CHUNK):
                hc, tc = hs[s:s + DISTILL_CHUNK], ts[s:s + DISTILL_CHUNK]
                z = (hc @ wc.t()).to(acc)[:, :vocab_size]
                zt = (hts[s:s + DISTILL_CHUNK] @ wt.t()).to(acc)
                nll, jsd, g = _distill_chunk(z, zt, tc, beta, temperature, weight)
                del z, zt
                scale = None if sc is None else sc[s:s + DISTILL_CHUNK]
                if scale is not None:
                    nll, jsd, g = nll * scale, jsd * scale, g.mul_(scale[:, None])
                sums += torch.stack([(1 - weight) * nll.sum() + weight * jsd.sum(), nll.sum(),
                                     jsd.sum()])
                g = g.to(dtype)
                grad_hs[s:s + DISTILL_CHUNK] = g @ wc[:vocab_size]
                if need_w:
                    grad_w[:vocab_size] += (g.t() @ hc).to(acc)
            grad_h = torch.zeros_like(h).index_copy_(0, idx, grad_hs.to(h.dtype))
        ctx.save_for_backward(grad_h, None if grad_w is None else grad_w.to(w.dtype))
        loss, stats = sums[0].clone(), sums[1:].clone()
        ctx.mark_non_differentiable(stats)
        return loss, stats

    @staticmethod
    def backward(ctx, grad_loss, _):
        grad_h, grad_w = ctx.saved_tensors
        grad_w = None if grad_w is None else grad_w * grad_loss
        return grad_h * grad_loss, grad_w, *[None] * 8


def chunked_distill(h, w, targets, vocab_size, h_t, w_t, beta, temperature, weight, scales=None):
    """Student h: (T, d), w: (Vp, d); teacher h_t: (T, d_t), w_t: (>= V, d_t); targets (T,) with
    -100 ignored -> (sum_t scale_t ((1 - weight) NLL_t + weight JSD_t), (NLL sum, JSD sum)), the
    JSD at `temperature` (beta: _jsd_rows), the NLL at 1."""
    return ChunkedDistill.apply(h, w, h_t, w_t, targets, vocab_size, beta, temperature, weight,
                                scales)
