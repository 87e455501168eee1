"""Distillation (nanopack/teacher.py, kernels.chunked_distill, losses.distill_objective): the chunked JSD through both
LM heads equals TRL's generalized_jsd_loss on full logits, loss and gradients; a teacher equal to the student gives a
JSD of 0 and no gradient from it; the on-policy advantage is log p_teacher - log p_student of each sampled token."""
import pytest
import torch

from nanopack import kernels

trl = pytest.importorskip("trl")

# float32: the chunked sums and the log-softmax taken in another order than TRL's, ~1e-7 relative per operation over
# ~50 terms; float64: the same at ~1e-16
TOLERANCES = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-10, atol=1e-12)}


def student_and_teacher(dtype, n=37, d=16, d_teacher=12, vocab=50, seed=0):
    """Hidden states and LM heads of a student (a padded head, as the model's) and a teacher of another width; every
    fifth target ignored."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, dtype=dtype, generator=g, requires_grad=True)
    w = torch.randn(64, d, dtype=dtype, generator=g, requires_grad=True)
    h_t = torch.randn(n, d_teacher, dtype=dtype, generator=g)
    w_t = torch.randn(vocab, d_teacher, dtype=dtype, generator=g)
    targets = torch.randint(0, vocab, (n,), generator=g)
    targets[::5] = -100
    return h, w, h_t, w_t, targets, vocab


# importing trl.experimental takes ~8 s
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_chunked_jsd_equals_trl_on_full_logits(monkeypatch, beta, temperature, dtype):
    from trl.experimental.gkd.gkd_trainer import GKDTrainer
    # chunks of 8 rows: 30 trained tokens in four chunks, the last one short
    monkeypatch.setattr(kernels, "LOSS_CHUNK", 8)
    h, w, h_t, w_t, targets, vocab = student_and_teacher(dtype)
    loss, (nll, jsd) = kernels.chunked_distill(h, w, targets, vocab, h_t, w_t, beta, temperature, weight=1.0)
    grads = torch.autograd.grad(loss, (h, w))
    logits = (h @ w.t())[:, :vocab]
    ref = GKDTrainer.generalized_jsd_loss(logits[None], (h_t @ w_t.t())[None], targets[None], beta=beta,
                                          temperature=temperature, reduction="sum")
    ref_grads = torch.autograd.grad(ref, (h, w))
    torch.testing.assert_close(loss, ref.detach(), **TOLERANCES[dtype])
    torch.testing.assert_close(jsd, ref.detach(), **TOLERANCES[dtype])
    for ours, theirs in zip(grads, ref_grads):
        torch.testing.assert_close(ours, theirs, **TOLERANCES[dtype])
    # the NLL beside it, at temperature 1
    nll_ref = torch.nn.functional.cross_entropy(logits.detach(), targets, reduction="sum")
    torch.testing.assert_close(nll, nll_ref, **TOLERANCES[dtype])


def test_the_mix_weighs_nll_and_jsd_per_token(monkeypatch):
    """(1 - weight) NLL + weight JSD, each token scaled: the loss and gradients of the two terms written apart."""
    monkeypatch.setattr(kernels, "LOSS_CHUNK", 8)
    h, w, h_t, w_t, targets, vocab = student_and_teacher(torch.float64)
    scales = torch.rand(len(targets), dtype=torch.float64)
    loss, _ = kernels.chunked_distill(h, w, targets, vocab, h_t, w_t, 0.5, 2.0, 0.3, scales)
    (jsd_part,), (nll_part,) = [kernels.chunked_distill(h, w, targets, vocab, h_t, w_t, 0.5, 2.0, x, scales)[:1]
                                for x in (1.0, 0.0)]
    want = 0.3 * jsd_part + 0.7 * nll_part
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=0)
    for ours, theirs in zip(torch.autograd.grad(loss, (h, w)), torch.autograd.grad(want, (h, w))):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_a_teacher_equal_to_the_student_gives_zero_and_no_gradient(beta):
    h, w, _, _, targets, vocab = student_and_teacher(torch.float64)
    loss, (_, jsd) = kernels.chunked_distill(h, w, targets, vocab, h.detach(), w.detach(), beta, 2.0, weight=1.0)
    # the JSD of a distribution with itself: 0 up to float64 rounding of the log-softmax
    assert abs(jsd.item()) < 1e-12
    for g in torch.autograd.grad(loss, (h, w)):
        assert g.abs().max() < 1e-12
