"""RoPE: the eager reference against an independent formula, and the fused Triton kernel against the
reference (outputs and gradients) under the Triton CPU interpreter and, where there is a GPU, compiled; and
the fused kernel inside torch.compile'd blocks (dynamic shapes) against the eager reference model."""
import copy
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # model.py lives in the repo root, also for this file's own subprocess
from nanopack.kernels import rope_fused  # noqa: E402
from model import rope_reference  # noqa: E402


def rope_angles(P, D, base=10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    return torch.arange(P, dtype=torch.float64)[:, None] * inv_freq  # (P, D/2) float64


def packed_positions(lengths):
    return torch.cat([torch.arange(n) for n in lengths])  # restarts at 0 for every packed sequence


def test_reference_matches_complex_rotation():
    # Each pair (x[i], x[i + D/2]) is the complex number x1 + i*x2, and RoPE multiplies it by e^(i*angle).
    torch.manual_seed(0)
    D, pos = 64, packed_positions([5, 17, 1, 33])
    angles = rope_angles(33, D)
    q, k = torch.randn(len(pos), 4, D), torch.randn(len(pos), 2, D)
    q_rot, k_rot = rope_reference(q, k, angles.cos().float(), angles.sin().float(), pos)

    def complex_rotate(x):  # float64 throughout
        z = torch.complex(x[..., :D // 2].double(), x[..., D // 2:].double())
        z = z * torch.polar(torch.ones_like(angles[pos]), angles[pos])[:, None, :]
        return torch.cat((z.real, z.imag), dim=-1)

    # 1e-5: float32 tables and products against float64, |x| ~ 4 at most, error a few ulp of float32.
    torch.testing.assert_close(q_rot.double(), complex_rotate(q), atol=1e-5, rtol=0)
    torch.testing.assert_close(k_rot.double(), complex_rotate(k), atol=1e-5, rtol=0)
    # The first token of every packed sequence is at angle 0, so it must come out unchanged.
    assert torch.equal(q_rot[pos == 0], q[pos == 0]) and torch.equal(k_rot[pos == 0], k[pos == 0])


# (sequence lengths, Hq, Hkv, head_dim, dtype, q/k as slices of one fused qkv tensor).
# T = 53 or 37 is never a multiple of the kernel's token block (a power of two > 1 for these shapes).
CASES = [
    ([5, 17, 1, 30], 4, 4, 64, torch.float32, False),   # MHA, packed positions restarting at 0
    ([5, 17, 1, 30], 6, 2, 128, torch.float32, False),  # GQA, head count not a power of two
    ([37], 8, 1, 16, torch.float32, True),              # MQA, smallest head_dim, non-contiguous views
    ([5, 17, 1, 30], 32, 8, 128, torch.float32, True),  # Llama-3-8B heads: one token per program
    ([5, 17, 1, 30], 4, 2, 64, torch.bfloat16, True),
]


def check_fused_vs_reference(device, cases=CASES):
    torch.manual_seed(0)
    for lengths, n_q, n_kv, D, dtype, from_qkv in cases:
        pos = packed_positions(lengths).to(device)
        T, angles = len(pos), rope_angles(max(lengths), D)
        cos, sin = angles.cos().float().to(device), angles.sin().float().to(device)
        qkv = torch.randn(T, n_q + 2 * n_kv, D, device=device).to(dtype)  # (T, Hq + 2*Hkv, D)
        grad_q = torch.randn(T, n_q, D, device=device).to(dtype)
        grad_k = torch.randn(T, n_kv, D, device=device).to(dtype)
        results = []
        for rope in (rope_reference, rope_fused):
            leaf = qkv.clone().requires_grad_()
            q, k = leaf[:, :n_q], leaf[:, n_q:n_q + n_kv]  # head slices: strided, non-contiguous views
            if not from_qkv:
                q, k = q.contiguous(), k.contiguous()
            q_rot, k_rot = rope(q, k, cos, sin, pos)
            torch.autograd.backward([q_rot, k_rot], [grad_q, grad_k])
            assert q_rot.dtype == k_rot.dtype == dtype
            results.append((q_rot, k_rot, leaf.grad))  # leaf.grad holds dq, dk (and zeros for v)
        # float32: both sides do the same float32 multiply-adds; only contraction into FMAs on a GPU
        # can differ (~1e-7 for randn inputs; 0 seen under the interpreter), so 1e-5 catches any wrong
        # index or sign while ignoring rounding. bf16: results land up to one bf16 ulp apart (<= 2^-7
        # relative), because the interpreter casts float32 -> bf16 by truncation where torch rounds to
        # nearest (seen here: half the elements differ by one ulp), and FMAs can flip a rounding on GPU.
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        for name, ref, fused in zip(("q_rot", "k_rot", "grad"), *results):
            torch.testing.assert_close(fused, ref, atol=tol, rtol=tol,
                                       msg=lambda m: f"{name} {lengths} Hq={n_q} Hkv={n_kv} D={D} {dtype}: {m}")


def check_compiled_blocks_vs_eager():
    """The tiny model with its blocks compiled as nanopack/startup.py does (dynamic=True, no padding) and the fused RoPE
    forced on, against an eager copy with the reference RoPE: loss and every gradient, at two packed lengths."""
    import model as M
    from conftest import next_token_targets
    torch.manual_seed(0)
    net = M.Transformer(M.config_from_preset("tiny", vocab_size=64))  # head_dim 16: the kernel's smallest
    ref = copy.deepcopy(net)
    graphs = []

    def inductor_recording(gm, example_inputs):  # Inductor (the CPU backend users get), keeping each graph
        graphs.append(gm)
        return torch._inductor.compile(gm, example_inputs)

    for block in net.layers:
        block.compile(backend=inductor_recording, dynamic=True)
    n_graphs = []
    for lengths in ([5, 17, 1, 30], [9, 40, 3]):  # T = 53, then 52 with one sequence fewer
        ids = torch.randint(0, 64, (sum(lengths),))
        pos = packed_positions(lengths)
        cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
        targets = next_token_targets(ids, cu)
        results = []
        for rope_backend, model in (("reference", ref), ("fused", net)):
            M.ROPE_BACKEND = rope_backend
            model.zero_grad()
            loss, _ = model(ids, pos, cu, max(lengths), targets=targets)
            loss.backward()
            results.append([loss] + [p.grad for p in model.parameters()])
        # Inductor fuses RMSNorm and SwiGLU into its own loops and may sum in another order: float32
        # rounding only (seen here: the summed loss equal, gradients up to ~5 within 1e-6). A wrong position,
        # sign or backward in the RoPE path is off by the size of the values (a forward rotation in backward:
        # 5e-2 on the embedding gradient), far outside atol 1e-5 + rtol 1e-4.
        for name, eager, compiled in zip(["loss"] + [n for n, _ in net.named_parameters()], *results):
            torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-4, msg=lambda m: f"{lengths} {name}: {m}")
        n_graphs.append(len(graphs))
    M.ROPE_BACKEND = None
    assert n_graphs[1] == n_graphs[0], f"the second length recompiled: graphs {n_graphs}"
    # the op is traced into a compiled graph (the blocks share one compiled code), not run beside it
    rope_calls = sum(str(node.target) == "nanopack.rope.default" for gm in graphs for node in gm.graph.nodes)
    assert rope_calls >= 1, "the fused RoPE was split out of the compiled graphs"


CHECKS = dict(kernel=lambda: check_fused_vs_reference("cpu"), compiled=check_compiled_blocks_vs_eager)


def run_interpreted(check, cache_dir):
    # TRITON_INTERPRET is read when triton is first imported, and another test file may already have
    # imported triton in this pytest process; only a fresh Python with the variable set is certain to
    # run the kernel under the CPU interpreter. The subprocess runs this file's __main__ below.
    # An empty Inductor cache: its key does not cover a custom op's Python backward, so a warm cache
    # could replay the compiled backward of an older rope and hide a change to it.
    env = dict(os.environ, TRITON_INTERPRET="1", TORCHINDUCTOR_CACHE_DIR=str(cache_dir))
    run = subprocess.run([sys.executable, os.path.abspath(__file__), check], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_fused_matches_reference_interpreter(tmp_path):
    run_interpreted("kernel", tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_compiled_blocks_with_fused_rope_interpreter(tmp_path):
    run_interpreted("compiled", tmp_path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_matches_reference_cuda():
    # Compiled kernel: the interpreter shapes, plus a packed micro-batch of realistic length.
    lengths = [int(n) for n in torch.randint(1, 2048, (8,), generator=torch.Generator().manual_seed(0))]
    check_fused_vs_reference("cuda", CASES + [(lengths, 32, 8, 128, torch.bfloat16, True)])


if __name__ == "__main__":  # the interpreter tests' subprocess: python tests/test_rope.py kernel|compiled
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest, or set TRITON_INTERPRET=1"
    check = sys.argv[1] if len(sys.argv) > 1 else "kernel"
    CHECKS[check]()
    print(f"{check}: rope_fused matches rope_reference under the Triton interpreter")


def test_fused_rope_only_where_the_kernel_runs(monkeypatch):
    """A CUDA model whose head dim the Triton kernel does not take (a toy's 8, Phi's 80, 96) runs the reference
    instead of raising from inside the forward (seen on an H100: the tiny test model failed there)."""
    from nanopack import kernels
    import model as M
    monkeypatch.setattr(kernels, "HAS_TRITON", True)
    assert [M.rope_fusable(True, d) for d in (8, 64, 80, 96, 128, 256)] == [False, True, False, False, True, True]
    assert not M.rope_fusable(False, 64)
    monkeypatch.setattr(kernels, "HAS_TRITON", False)
    assert not M.rope_fusable(True, 64)
