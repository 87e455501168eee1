"""Benchmarks are not tests, but each must still run: a tiny-size smoke run per script, so none can rot."""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args):
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.mark.slow
def test_bench_lm_head_smoke():
    out = run("bench/bench_lm_head.py", "--T", "512", "--d", "32", "--V", "300", "--iters", "1")
    table = [l for l in out.splitlines() if l.startswith("| 512 |")]
    assert len(table) == 1 and "OOM" not in table[0] and "crashed" not in table[0], out
    rel_diff = float(table[0].split("|")[-2])
    assert rel_diff < 1e-5  # both methods computed the same loss


@pytest.mark.slow
def test_bench_packing_smoke():
    out = run("bench/bench_packing.py", "--small")
    assert "BFD (ours)" in out and "packing time" in out, out


def table_rows(out):
    return {cells[0]: cells[1:] for cells in ([c.strip() for c in l.strip("|").split("|")]
                                             for l in out.splitlines() if l.startswith("| ")) if cells[0] != "config"}


@pytest.mark.slow
def test_bench_train_smoke_and_equal_losses():
    """Packed (eager and torch.compile), padded, Hugging Face and TRL (padding-free SFT, DPO) training take the
    same steps on the same data and weights: the loss after two optimizer steps must agree (float32 on CPU:
    rounding only), or the speed comparison is void. TRL's packed SFT trains on other step contents, so it
    only has to run."""
    for mode, same, other in (("sft", ("packed", "packed+compile", "padded", "hf", "trl-padfree"), ("trl-packed",)),
                              ("dpo", ("packed", "packed+shared", "padded", "hf", "trl"), ())):
        out = run("bench/bench_train.py", "--mode", mode, "--size", "tiny", "--steps", "1", "--warmup", "1",
                  "--configs", ",".join(same + other))
        rows = table_rows(out)
        assert set(rows) == set(same + other), out
        losses = [float(rows[c][4]) for c in same + other]  # a crashed row has no number here
        assert max(losses[:len(same)]) - min(losses[:len(same)]) < 1e-3 * abs(losses[0]), out
        assert rows["packed"][3] == "0.0%" and float(rows["padded"][3].rstrip("%")) > 10, out  # padding fraction
        assert rows.get("packed+compile", ["", "", "", "0.0%"])[3] == "0.0%", out  # dynamic shapes: nothing padded
        assert rows.get("packed+compile", [""] * 12)[11] in ("", "0"), out  # and no recompile as lengths change


@pytest.mark.slow
def test_bench_kernels_smoke():
    out = run("bench/bench_kernels.py", "--small")
    assert "| sdpa | 64 |" in out and "RoPE" in out, out


@pytest.mark.slow
def test_bench_generate_smoke():
    """Every method runs, and the cached generation gives the no-cache tokens (transformers' may differ where a
    tiny random model's logits nearly tie, so only its row's presence is checked)."""
    out = run("bench/bench_generate.py", "--preset", "tiny", "--new_tokens", "8", "--batches", "1,3", "--rounds", "1")
    rows = [[c.strip() for c in l.strip("|").split("|")] for l in out.splitlines() if l.startswith(("| 1 |", "| 3 |"))]
    assert [r[1] for r in rows] == ["nanopack, KV cache", "nanopack, no cache", "transformers generate"] * 2, out
    assert [r[5] for r in rows if r[1] == "nanopack, no cache"] == ["1/1", "3/3"], out


@pytest.mark.slow
def test_bench_rl_smoke():
    out = run("bench/bench_rl.py", "--preset", "tiny", "--groups", "1", "--k", "2", "--rounds", "1")
    rows = [l for l in out.splitlines() if l.startswith("| prompt-heavy (512 | 2 x 64)")]
    assert [r.split("|")[3].strip() for r in rows] == ["shared prompt", "own copy each"], out


@pytest.mark.slow
def test_bench_trees_smoke():
    """Both layouts of a 3-turn trace run; the tree computes fewer tokens for the same loss."""
    out = run("bench/bench_trees.py", "--turns=3", "--preset=tiny", "--prompt=20")
    rows = {r[2].strip(): r for r in (l.split("|") for l in out.splitlines() if l.startswith("| 3 |"))}
    assert set(rows) == {"expanded", "tree"}, out
    tokens = {k: int(r[3].replace(",", "")) for k, r in rows.items()}
    assert tokens["tree"] < tokens["expanded"] and rows["tree"][9] == rows["expanded"][9], out


@pytest.mark.slow
def test_bench_scale_smoke():
    out = run("bench/bench_scale.py", "--preset", "tiny", "--world_sizes", "1,2")
    rows = [l for l in out.splitlines() if l.startswith(("| 1 |", "| 2 |"))]
    assert len(rows) == 4 and not any("failed" in r for r in rows), out


@pytest.mark.slow
def test_bench_context_smoke():
    out = run("bench/bench_context.py", "--tokens", "512", "--n_layer", "1", "--steps", "1")
    rows = [l for l in out.splitlines() if l.startswith(("| 1 | 0 |", "| 2 | 0 |", "| 2 | 1 |"))]
    assert len(rows) == 3 and not any("failed" in r for r in rows), out
    assert "| one sequence of 512 | 1 | 2 | 0 | 1.000 | 1.499 |" in out, out  # head-tail balanced, contiguous not


@pytest.mark.slow
def test_bench_plan_vs_real_smoke():
    """The plan of an SFT and a DPO step equals the same tracker on the real step (tiny model: seconds)."""
    out = run("bench/plan_vs_real.py", "--preset=tiny")
    rows = [l.split("|") for l in out.splitlines() if l.startswith("| train_")]
    assert len(rows) == 2 and all(abs(float(r[4]) - 1) < 0.01 for r in rows), out


@pytest.mark.slow
def test_bench_dpo_losses_smoke(tmp_path):
    """Two loss types from a tiny random model folder on a few built-in pairs, two steps each: a row per type."""
    import torch
    from conftest import builtin_data
    from nanopack.hf import save_pretrained
    from model import Transformer, config_from_preset
    from nanopack.tokenizer import get_tokenizer
    torch.manual_seed(0)
    save_pretrained(Transformer(config_from_preset("tiny", vocab_size=get_tokenizer("byte").vocab_size)),
                    str(tmp_path / "sft"))
    pairs = builtin_data(tmp_path / "pairs", "dpo", n_train=32, n_val=8)
    out = run("bench/bench_dpo_losses.py", f"--init_from={tmp_path / 'sft'}", "--types=robust,bco_pair",
              f"--out={tmp_path / 'runs'}", "--", f"--data={pairs}", "--max_iters=2", "--batch_size=8")
    rows = table_rows(out)
    assert rows["robust"][0] == "--label_smoothing=0.1" and rows["bco_pair"][0] == "-", out


def test_compile_stats_counts_recompiles():
    """bench_train.py's recompiles column: a function compiled under grad, then called under no_grad, recompiles
    once (guard grad_mode), and the reason is kept."""
    code = ("import sys, torch; sys.path.insert(0, 'bench'); import compile_stats; compile_stats.watch()\n"
            "f = torch.compile(lambda x: x * 2, backend='eager', dynamic=True)\n"
            "x = torch.ones(3, requires_grad=True); f(x); f(torch.ones(5, requires_grad=True))\n"
            "with torch.no_grad(): f(x)\n"
            "import json; print(json.dumps(compile_stats.read()))")
    stats = json.loads(run("-c", code).strip().splitlines()[-1])
    assert stats["graphs"] == 2 and stats["recompiles"] == 1, stats
    assert list(stats["recompile_reasons"]) == ["GLOBAL_STATE changed: grad_mode"], stats


def session(tmp_path, *args, **env):
    """bench/gpu_session.sh as the device tool runs it, its logs in tmp_path/out -> (exit code, session.log)."""
    env = dict(os.environ, OUT=str(tmp_path / "out"), RUNS=str(tmp_path / "runs"), PYTHON=sys.executable, **env)
    out = subprocess.run(["bash", "bench/gpu_session.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    return out.returncode, (tmp_path / "out" / "session.log").read_text() + out.stderr


def test_gpu_session_says_what_it_did_not_run(tmp_path):
    """Out of time, no command starts, each is named as not run, and the exit status says so."""
    rc, log = session(tmp_path, "1", STEPS="1 2")
    assert rc == 1 and log.count("NOT RUN (out of time)") == 3 and " rc=" not in log, log


@pytest.mark.slow
def test_gpu_session_rehearsal(tmp_path):
    """Without CUDA the GPU session's script runs every step at toy sizes: every command exits 0 (the CUDA-only checks
    say they were skipped), each step leaves its figures in session.log, and $OUT holds at most 8 files (what the
    device tool brings back)."""
    rc, log = session(tmp_path)
    commands = re.findall(r"^=== (\w+) rc=(\d+)", log, re.M)
    assert rc == 0 and [rc for _, rc in commands] == ["0"] * 12, log
    assert [s for s, _ in commands] == ["1_env"] * 2 + ["2_sft", "3_compile"] + ["4_dpo"] * 3 + ["5_rl"] * 3 + [
        "6_lora"] * 2, log
    assert "skipped: no CUDA" in log and "needs a CUDA GPU" in log, log  # honest skips, not passes
    for figure in ("val accuracy", "| packed+compile |", "| packed+shared |", "| hf |", "| trl |", "generation",
                   "| engine, eager |",
                   "| toy | qlora r=16 |", "LoRA r=16"):
        assert figure in log, figure
    assert not re.search(r"crashed|not installed|failed:|Traceback", log), log
    assert len(os.listdir(tmp_path / "out")) <= 8


@pytest.mark.slow
def test_bench_distill_smoke():
    out = run("bench/bench_distill.py", "--T", "256", "--V", "1000", "--iters", "1")
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| with teacher")]
    assert len(rows) == 2 and "crashed" not in out, out
    # the chunked and the full-logits loss: the same number, float32 sums in another order
    assert float(rows[0][-2]) == pytest.approx(float(rows[1][-2]), rel=1e-5)


@pytest.mark.slow
def test_bench_env_smoke():
    """Both rollouts print a row; the tree computes the fewest tokens, each turn laid out whole the most."""
    out = run("bench/bench_env.py", "--init_from=scratch", "--prompts", "3", "--k", "2", "--rounds", "1",
              "--max_new_tokens", "24")
    assert "| multi-turn (env=builtin) |" in out and "| single-turn |" in out, out
    tokens = [int(line.split("|")[2].replace(",", "")) for line in out.splitlines() if line.startswith(("| tree", "| each"))]
    assert len(tokens) == 3 and tokens[0] <= tokens[1] <= tokens[2], out
