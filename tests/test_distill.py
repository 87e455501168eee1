"""Distillation (nanopack/teacher.py, kernels.chunked_distill, losses.distill_objective): the chunked JSD through both
LM heads equals TRL's generalized_jsd_loss on full logits, loss and gradients; a teacher equal to the student gives a
JSD of 0 and no gradient from it; the on-policy advantage is log p_teacher - log p_student of each sampled token.
The scripts with a teacher (a tiny random model of the byte vocabulary; train_sft.py logit distillation, train_rl.py
on-policy): DDP x2 and FSDP2 x2 take one process's steps, a LoRA student, SIGTERM + resume equal to the straight run;
tolerances as tests/test_train_sft.py's and test_train_rl.py's (float32, only the order of sums differs).
"""
import os
import sys

import pytest
import torch

from nanopack import kernels
from conftest import builtin_data, run_script, step_metrics, stop_after_first_step
from test_train_rl import REWARD, args as rl_args, assert_same_run as assert_same_rl_run
from test_train_sft import assert_same_run as assert_same_sft_run, common_args as sft_args

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
    monkeypatch.setattr(kernels, "DISTILL_CHUNK", 8)
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_chunked_distill_under_bf16_autocast_on_cuda(monkeypatch):
    """The GPU's path: float32 weights under bf16 autocast, as a training step holds them: the loss and gradients
    near float64 on the same values (bf16 matmuls round logits to ~3 significant digits: a few % of the norm)."""
    monkeypatch.setattr(kernels, "DISTILL_CHUNK", 8)
    h, w, h_t, w_t, targets, vocab = student_and_teacher(torch.float32)
    hc, wc = (x.detach().cuda().requires_grad_() for x in (h, w))
    with torch.autocast("cuda", torch.bfloat16):
        loss, (nll, jsd) = kernels.chunked_distill(hc, wc, targets.cuda(), vocab, h_t.cuda(), w_t.cuda(), 0.5, 2.0,
                                                   0.5)
    grads = torch.autograd.grad(loss, (hc, wc))
    h64, w64 = (x.detach().double().requires_grad_() for x in (h, w))
    ref, (ref_nll, ref_jsd) = kernels.chunked_distill(h64, w64, targets, vocab, h_t.double(), w_t.double(), 0.5,
                                                      2.0, 0.5)
    assert loss.dtype == torch.float32 and bool(torch.isfinite(loss))
    for ours, theirs in ((loss, ref), (nll, ref_nll), (jsd, ref_jsd)):
        torch.testing.assert_close(ours.double().cpu(), theirs.detach(), rtol=3e-2, atol=1e-2)
    for ours, theirs in zip(grads, torch.autograd.grad(ref, (h64, w64))):
        assert ((ours.double().cpu() - theirs).norm() / theirs.norm()).item() < 5e-2


def test_the_mix_weighs_nll_and_jsd_per_token(monkeypatch):
    """(1 - weight) NLL + weight JSD, each token scaled: the loss and gradients of the two terms written apart."""
    monkeypatch.setattr(kernels, "DISTILL_CHUNK", 8)
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


def test_the_on_policy_advantage_is_the_teachers_log_ratio_per_token():
    """Two groups of k=2 replies, 7 trained tokens: each token's advantage is (1 - c) x its reply's group advantage +
    c x (log p_teacher - log p_student at sampling), and the loss the PPO clip of it written out; distill_loss sums
    log p_student - log p_teacher; a teacher equal to the sampling policy leaves only the group advantage's share."""
    from types import SimpleNamespace
    from losses import distill_advantages, distill_objective, policy_loss
    settings = dict(k=2, clip_eps=0.2, clip_eps_high=0.28, clip_mode="ppo", importance_sampling_level="token",
                    kl_coef=0.0, distill_coef=0.25, is_correction="none")
    mb = SimpleNamespace(units=torch.tensor([1, 0]), seq_ids=torch.tensor([0, 0, 1, 1, 1, 2, 3]))
    sampling = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.5, -0.2, -2.5])
    teacher = torch.tensor([-0.5, -2.5, -0.1, -1.0, -4.0, -0.2, -1.5])
    # later updates: ratios inside and outside the clip
    logps = (sampling + torch.tensor([0.1, -0.3, 0.4, 0.0, -0.1, 0.05, 0.2])).requires_grad_()
    group_adv = torch.tensor([0.3, -0.3, 1.0, -1.0])  # replies of groups 0 and 1, in group order
    weights = torch.full((4,), 1 / 7)
    lengths = torch.tensor([2.0, 3.0, 1.0, 1.0])
    token_adv = distill_advantages(teacher, sampling, 0.25)
    torch.testing.assert_close(token_adv, 0.25 * (teacher - sampling), rtol=0, atol=0)
    old = dict(sampling=sampling, ref=None, teacher=teacher)
    loss, sums = distill_objective(mb, logps, old, (group_adv, weights, lengths), settings)
    # the batch holds group 1 then group 0: replies 2, 3, 0, 1
    seqs = torch.tensor([2, 3, 0, 1])
    a = 0.75 * group_adv[seqs][mb.seq_ids] + 0.25 * (teacher - sampling)
    ratio = torch.exp(logps - sampling)
    want = (-torch.min(ratio * a, ratio.clamp(0.8, 1.28) * a) / 7).sum()
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(sums["distill_loss"], (sampling - teacher).sum())
    alone, _ = policy_loss(logps, sampling, mb.seq_ids, 0.75 * group_adv[seqs], weights[seqs], lengths[seqs], 0.2,
                           0.28)
    same, sums = distill_objective(mb, logps, dict(old, teacher=sampling), (group_adv, weights, lengths), settings)
    assert sums["distill_loss"] == 0 and same.item() == alone.item()



# ---- the scripts -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A tiny random model of the byte vocabulary, as a Hugging Face folder."""
    import model as M
    from nanopack.hf import save_pretrained
    from nanopack.tokenizer import get_tokenizer
    folder = str(tmp_path_factory.mktemp("teacher") / "hf")
    torch.manual_seed(3)
    save_pretrained(M.Transformer(M.config_from_preset("tiny", vocab_size=get_tokenizer("byte").vocab_size)), folder)
    return folder


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    return builtin_data(tmp_path_factory.mktemp("data") / "builtin", "sft", n_train=200, n_val=20)


def sft(out_dir, data, teacher, nproc=1, **kw):
    cfg = dict(teacher=teacher, distill_beta=0.5, distill_temperature=2.0, distill_weight=0.5, max_iters=3)
    out = run_script("train_sft.py", sft_args(out_dir, data, **dict(cfg, **kw)), nproc)
    return out


@pytest.fixture(scope="module")
def sft_baseline(tmp_path_factory, sft_data, teacher):
    out_dir = str(tmp_path_factory.mktemp("sft_distill"))
    out = sft(out_dir, sft_data, teacher)
    assert all(m["distill_loss"] > 0 for m in step_metrics(out_dir)) and "| distill " in out.stdout
    return out_dir


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_logit_distillation_on_two_processes_equals_one(tmp_path, sft_data, teacher, sft_baseline, parallel):
    out_dir = str(tmp_path / parallel)
    sft(out_dir, sft_data, teacher, nproc=2, parallel=parallel, microbatch_tokens=512)
    assert_same_sft_run(sft_baseline, out_dir)
    for a, b in zip(step_metrics(sft_baseline), step_metrics(out_dir)):
        assert a["distill_loss"] == pytest.approx(b["distill_loss"], rel=1e-5)


@pytest.mark.slow
def test_logit_distillation_under_context_parallelism_equals_one_process(tmp_path, sft_data, teacher, sft_baseline):
    """cp=2: each rank holds half of every sequence, the teacher's forward and the JSD on the same half."""
    out_dir = str(tmp_path / "cp")
    sft(out_dir, sft_data, teacher, nproc=2, context_parallel=2, microbatch_tokens=512)
    assert_same_sft_run(sft_baseline, out_dir)
    for a, b in zip(step_metrics(sft_baseline), step_metrics(out_dir)):
        assert a["distill_loss"] == pytest.approx(b["distill_loss"], rel=1e-5)


@pytest.mark.slow
def test_logit_distillation_resumes_as_the_straight_run(tmp_path, sft_data, teacher, sft_baseline):
    cut = str(tmp_path / "cut")
    cfg = dict(teacher=teacher, distill_beta=0.5, distill_temperature=2.0, distill_weight=0.5, max_iters=3)
    stop_after_first_step([sys.executable, "train_sft.py", *sft_args(cut, sft_data, **cfg)], cut)
    assert len(step_metrics(cut)) < 3
    run_script("train_sft.py", [f"--out_dir={cut}", "--init_from=resume"])
    assert_same_sft_run(sft_baseline, cut)
    for a, b in zip(step_metrics(sft_baseline), step_metrics(cut)):
        assert a["distill_loss"] == pytest.approx(b["distill_loss"], rel=1e-5)


@pytest.mark.slow
def test_a_lora_student_of_the_teacher_starts_at_jsd_0(tmp_path, sft_data, teacher):
    """The teacher is the student's base: the adapters start at 0, so the first step's JSD is 0 (float32 rounding of
    two equal log-softmaxes), and the adapters then move the student away from it."""
    out_dir = str(tmp_path / "lora")
    sft(out_dir, sft_data, teacher, init_from=teacher, lora_rank=4, learning_rate=3e-2)
    s = step_metrics(out_dir)
    assert abs(s[0]["distill_loss"]) < 1e-6 and s[-1]["distill_loss"] > 1e-4
    assert os.path.exists(os.path.join(out_dir, "adapter"))


def rl_cli(out_dir, teacher, **kw):
    """test_train_rl.py's run (a KL term, two updates per batch, the batch's reward std) distilling from teacher, the
    reward mixed in; importance_sampling_level left out: distill does not read it (its advantages are per token)."""
    cfg = dict(dict(loss="distill", teacher=teacher, reward=REWARD, distill_coef=0.5), **kw)
    return [a for a in rl_args(out_dir, **cfg) if not a.startswith("--importance_sampling_level=")]


def rl(out_dir, teacher, nproc=1, **kw):
    return run_script("train_rl.py", rl_cli(out_dir, teacher, **kw), nproc)


@pytest.fixture(scope="module")
def rl_baseline(tmp_path_factory, teacher):
    out_dir = str(tmp_path_factory.mktemp("rl_distill"))
    rl(out_dir, teacher)
    s = step_metrics(out_dir)
    assert all(m["distill_loss"] != 0 and m["groups_trained"] == 6 for m in s)
    return out_dir


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_on_policy_distillation_on_two_processes_equals_one(tmp_path, teacher, rl_baseline, parallel):
    out_dir = str(tmp_path / parallel)
    rl(out_dir, teacher, nproc=2, parallel=parallel, microbatch_tokens=240)
    assert_same_rl_run(rl_baseline, out_dir)
    for a, b in zip(step_metrics(rl_baseline), step_metrics(out_dir)):
        assert a["distill_loss"] == pytest.approx(b["distill_loss"], rel=1e-5, abs=1e-7)


@pytest.mark.slow
def test_on_policy_distillation_under_context_parallelism_equals_one_process(tmp_path, teacher, rl_baseline):
    out_dir = str(tmp_path / "cp")
    rl(out_dir, teacher, nproc=2, context_parallel=2, microbatch_tokens=120)
    assert_same_rl_run(rl_baseline, out_dir)
    for a, b in zip(step_metrics(rl_baseline), step_metrics(out_dir)):
        assert a["distill_loss"] == pytest.approx(b["distill_loss"], rel=1e-5, abs=1e-7)


@pytest.mark.slow
def test_on_policy_distillation_resumes_as_the_straight_run(tmp_path, teacher, rl_baseline):
    cut = str(tmp_path / "cut")
    stop_after_first_step([sys.executable, "train_rl.py", *rl_cli(cut, teacher)], cut)
    assert len(step_metrics(cut)) < 3
    run_script("train_rl.py", [f"--out_dir={cut}", "--init_from=resume"])
    # the same samples, the same teacher, the same ops in the same order
    assert_same_rl_run(rl_baseline, cut, exact=True)


@pytest.mark.slow
def test_a_teacher_equal_to_the_student_teaches_nothing(tmp_path, teacher):
    """reward='none' and the student's own weights as the teacher: every advantage is 0, so the loss, its gradient
    and distill_loss are 0."""
    out_dir = str(tmp_path / "same")
    rl(out_dir, teacher, init_from=teacher, reward="none", updates_per_batch=1, max_iters=1, kl_coef=0.0)
    (step,) = step_metrics(out_dir)
    assert step["distill_loss"] == 0 and step["loss"] == 0 and step["grad_norm"] == 0


@pytest.mark.slow
def test_a_teacher_of_another_vocabulary_is_one_line(tmp_path, sft_data):
    import model as M
    from nanopack.hf import save_pretrained
    folder = str(tmp_path / "other")
    save_pretrained(M.Transformer(M.config_from_preset("tiny", vocab_size=400)), folder)
    out = run_script("train_sft.py", sft_args(str(tmp_path / "run"), sft_data, teacher=folder), check=False)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert f"teacher={folder!r} has a vocabulary of 400 tokens and the student 261" in out.stderr


def test_a_distillation_key_without_a_teacher_is_a_config_error():
    from nanopack.configurator import ConfigError, check_read
    read_by = {"distill_beta": ("teacher", None, "only logit distillation reads it")}
    check_read(dict(teacher="t", distill_beta=0.2), {"distill_beta"}, read_by)
    check_read(dict(teacher=None, distill_beta=0.5), set(), read_by)  # the default, not set: nothing to say
    with pytest.raises(ConfigError, match="distill_beta=0.2 does nothing without teacher: only logit distillation "
                                          "reads it; set teacher, or drop distill_beta"):
        check_read(dict(teacher=None, distill_beta=0.2), {"distill_beta"}, read_by)
