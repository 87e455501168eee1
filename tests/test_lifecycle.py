"""A run's processes from start to exit, as users drive them: one live run per out_dir (a second one stops with one
line and writes nothing; a killed run's lock is taken over with a note); the workers of a SIGKILLed torchrun launcher
save and stop instead of training on; launch.py ends a SIGTERM as a preemption (exit 143, our line last); and no
process finalizes with another thread alive (a gloo thread freeing a tensor then aborted a finished run: exit -6)."""
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, as_args, builtin_data, run_script, step_metrics

LONG = dict(preset="tiny", batch_size=16, microbatch_tokens=2048, max_iters=100_000, warmup_iters=0, log_interval=1,
            eval_interval=2, eval_examples=0, seed=7)  # runs until stopped, a checkpoint every 2 steps


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    return builtin_data(tmp_path_factory.mktemp("data") / "builtin", "sft", n_train=400, n_val=40)


def start(args, log, nproc=1, launcher=("-m", "torch.distributed.run"), env=None):
    """train_sft.py in the background, as a user starts it; its output (and its workers') into the file log."""
    cmd = [sys.executable] + ([] if nproc == 1 else [*launcher, "--standalone", f"--nproc_per_node={nproc}"])
    return subprocess.Popen(cmd + ["train_sft.py", *args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))


def wait_for(condition, timeout=120):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)
    return time.time()


def rows(out_dir):
    path = os.path.join(out_dir, "metrics.jsonl")
    return len(step_metrics(out_dir)) if os.path.exists(path) else 0


def alive(pid):
    """A process that still runs (a zombie waiting to be reaped has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def children(pid):
    found = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(p))
        except (FileNotFoundError, ProcessLookupError):
            pass
    return found


def snapshot(folder):
    """Every file under folder with its size and modification time: what a second run must leave as it was."""
    return {os.path.relpath(os.path.join(d, f), folder): (os.path.getsize(os.path.join(d, f)),
                                                          os.path.getmtime(os.path.join(d, f)))
            for d, _, files in os.walk(folder) for f in files}


@pytest.mark.slow
def test_a_second_run_into_a_live_runs_out_dir_stops_with_one_line_and_writes_nothing(tmp_path, sft_data):
    out_dir = str(tmp_path / "run")
    first = start(as_args(**LONG, out_dir=out_dir, data=sft_data), open(tmp_path / "first.log", "w"))
    try:
        wait_for(lambda: os.path.exists(os.path.join(out_dir, "ckpt.pt")))
        first.send_signal(signal.SIGSTOP)  # it holds the lock, and writes nothing while the others try
        before = snapshot(out_dir)
        for script, extra in [("train_sft.py", ["--data=builtin", "--overwrite=True"]),  # would prepare data, remove
                              ("train_dpo.py", ["--init_from=scratch", "--preset=tiny", "--overwrite=True"]),
                              ("train_sft.py", ["--init_from=resume"])]:
            out = run_script(script, [f"--out_dir={out_dir}", *extra], check=False)
            lines = [line for line in out.stderr.splitlines() if line.strip()]
            assert out.returncode == 1 and len(lines) == 1 and not out.stdout, out.stdout + out.stderr
            assert f"{out_dir} is in use by a live run (pid {first.pid} on {socket.gethostname()} since " in lines[0]
            assert "train_sft.py): wait for it to end, or stop it (SIGTERM saves a checkpoint" in lines[0]
            assert snapshot(out_dir) == before, script
    finally:
        first.send_signal(signal.SIGCONT)
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=120)
    assert first.returncode == 128 + signal.SIGTERM  # stopped with a checkpoint, as a preemption
    iters = [m["iter"] for m in step_metrics(out_dir)]
    assert iters == list(range(1, len(iters) + 1))  # one run's rows, none interleaved
    assert open(os.path.join(out_dir, "run.lock")).read() == ""  # its clean exit names no holder


@pytest.mark.slow
def test_the_lock_of_a_killed_run_is_taken_over_with_a_note(tmp_path, sft_data):
    out_dir = str(tmp_path / "run")
    first = start(as_args(**LONG, out_dir=out_dir, data=sft_data), open(tmp_path / "first.log", "w"))
    wait_for(lambda: os.path.exists(os.path.join(out_dir, "ckpt.pt")))
    first.kill()
    first.wait()
    lock = os.path.join(out_dir, "run.lock")
    assert open(lock).read().startswith(f"pid {first.pid} on ")  # what a kill -9 leaves: a holder that is gone
    at = torch.load(os.path.join(out_dir, "ckpt.pt"))["iter_num"]
    out = run_script("train_sft.py", [f"--out_dir={out_dir}", "--init_from=resume", f"--max_iters={at + 1}"])
    assert f"note: taking over {lock} from pid {first.pid} on {socket.gethostname()} since " in out.stdout
    assert "which is gone (killed?)" in out.stdout
    assert open(lock).read() == ""
    out = run_script("train_sft.py", [f"--out_dir={out_dir}", "--init_from=resume", f"--max_iters={at + 2}"])
    assert "taking over" not in out.stdout  # a run that ended cleanly left no holder to take over from
    assert [m["iter"] for m in step_metrics(out_dir)][-2:] == [at + 1, at + 2]


@pytest.mark.slow
def test_the_workers_of_a_killed_launcher_save_and_stop_and_the_run_resumes(tmp_path, sft_data):
    """kill -9 of torchrun: its workers (in sessions of their own) get SIGTERM from the kernel (PR_SET_PDEATHSIG),
    finish the step, save and exit; none trains on into out_dir beside the resumed run."""
    out_dir, log = str(tmp_path / "run"), tmp_path / "run.log"
    launcher = start(as_args(**dict(LONG, out_dir=out_dir, data=sft_data, microbatch_tokens=1024)), open(log, "w"),
                     nproc=2)
    wait_for(lambda: rows(out_dir) >= 3)
    workers = children(launcher.pid)
    assert len(workers) == 2 and all(alive(p) for p in workers)
    launcher.kill()
    killed = time.time()
    gone = wait_for(lambda: not any(alive(p) for p in workers), timeout=30)
    assert gone - killed < 10, f"workers still ran {gone - killed:.1f} s after their launcher was killed"
    n = rows(out_dir)
    time.sleep(1)
    assert rows(out_dir) == n  # nothing writes into the run any more
    text = log.read_text()
    assert "stopped by SIGTERM after iter" in text and "Traceback" not in text, text[-3000:]
    at = torch.load(os.path.join(out_dir, "ckpt.pt"))["iter_num"]
    assert at == n  # the checkpoint holds every step the log shows
    run_script("train_sft.py", [f"--out_dir={out_dir}", "--init_from=resume", f"--max_iters={at + 2}"], nproc=2)
    assert [m["iter"] for m in step_metrics(out_dir)] == list(range(1, at + 3))


@pytest.mark.slow
def test_launch_py_ends_a_sigterm_as_a_preemption_and_the_run_resumes_as_if_never_stopped(tmp_path, sft_data):
    cfg = dict(LONG, data=sft_data, max_iters=30, eval_interval=0, microbatch_tokens=1024)
    straight, cut, log = str(tmp_path / "straight"), str(tmp_path / "cut"), tmp_path / "cut.log"
    launcher = start(as_args(**cfg, out_dir=cut), open(log, "w"), nproc=2, launcher=("launch.py",))
    wait_for(lambda: rows(cut) >= 2)
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=120) == 128 + signal.SIGTERM
    text = log.read_text()
    assert "Traceback" not in text and "SignalException" not in text, text[-3000:]
    last = text.strip().splitlines()[-1]
    assert last.startswith("stopped by SIGTERM after iter ") and "continue with --init_from=resume" in last
    assert rows(cut) < 30
    run_script("launch.py", ["--standalone", "--nproc_per_node=2", "train_sft.py", f"--out_dir={cut}",
                             "--init_from=resume"])
    run_script("train_sft.py", as_args(**cfg, out_dir=straight), nproc=2)
    timing = {"time_ms", "tokens_per_sec", "tokens_per_sec_per_gpu", "mfu", "data_time_frac", "peak_mem_gb"}
    a, b = ([{k: v for k, v in m.items() if k not in timing} for m in step_metrics(d)] for d in (straight, cut))
    assert a == b and len(a) == 30  # the same steps, bit for bit


SLOW_SAVE = """import os, time
if b"launch.py" not in open("/proc/self/cmdline", "rb").read().split(b"\\0"):  # the workers, not the launcher
    replace = os.replace
    def slow_replace(src, dst, *args, **kwargs):  # ckpt.pt is replaced 6 s late, as a big model's checkpoint would be
        if str(dst).endswith("ckpt.pt"):
            time.sleep(6)
        return replace(src, dst, *args, **kwargs)
    os.replace = slow_replace
"""


@pytest.mark.slow
def test_launch_py_says_a_stop_its_workers_could_not_save_in_time_is_lost(tmp_path, sft_data):
    """torchrun SIGKILLs a worker still running --shutdown_timeout seconds after its SIGTERM: no checkpoint, and
    launch.py's exit is not 143 (a stop that was saved) but 1, with a line saying what was lost and what to set."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SLOW_SAVE)
    out_dir, log = str(tmp_path / "run"), tmp_path / "run.log"
    cfg = dict(LONG, data=sft_data, out_dir=out_dir, eval_interval=0, microbatch_tokens=1024)  # saves only to stop
    launcher = start(as_args(**cfg), open(log, "w"), nproc=2, launcher=("launch.py", "--shutdown_timeout=2"),
                     env=dict(PYTHONPATH=str(tmp_path / "site")))
    wait_for(lambda: rows(out_dir) >= 2)
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=120) == 1
    text = log.read_text()
    last = text.strip().splitlines()[-1]
    assert last.startswith("launch.py: SIGTERM: the run was NOT saved (local rank 0 killed by SIGKILL"), text[-3000:]
    assert "torchrun kills a worker still running 2 s after its signal" in last and "--shutdown_timeout=" in last
    assert not os.path.exists(os.path.join(out_dir, "ckpt.pt"))  # (rank 1 may print its barrier's peer gone first)


def test_launch_py_gives_the_workers_600_s_to_save_unless_told(monkeypatch):
    """torchrun's own 30 s is less than a big model's step and checkpoint; a user's --shutdown_timeout wins."""
    from torch.distributed.run import config_from_args, parse_args
    import launch
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    argv = ["--standalone", "--nproc_per_node=2", "train_sft.py", "--max_iters=5"]
    assert launch.shutdown_timeout(argv, os.environ) == 600
    assert config_from_args(parse_args(argv))[0].shutdown_timeout == 600  # what torchrun's agent waits
    argv = ["--standalone", "--shutdown_timeout=45", "train_sft.py"]
    assert launch.shutdown_timeout(argv, os.environ) == 45
    assert config_from_args(parse_args(argv))[0].shutdown_timeout == 45


SIGTERM_IN_DATA = """import os, runpy, signal, sys
import data.arithmetic as arithmetic
examples = arithmetic.sft_examples
def examples_then_sigterm(split, n, seed):  # SIGTERM with the 50th example: data preparation under way
    for i, record in enumerate(examples(split, n, seed)):
        if i == 50:
            os.kill(os.getpid(), signal.SIGTERM)
        yield record
arithmetic.sft_examples = examples_then_sigterm
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_a_sigterm_during_data_preparation_is_one_line_and_leaves_no_temporary_files(tmp_path):
    out_dir = str(tmp_path / "run")
    out = subprocess.run([sys.executable, "-c", SIGTERM_IN_DATA, "train_sft.py", f"--out_dir={out_dir}",
                          "--preset=tiny"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 128 + signal.SIGTERM, out.stderr[-3000:]
    assert out.stderr.strip().splitlines() == ["stopped by SIGTERM during start-up (before the first step): nothing "
                                               "to save; the same command starts it again"], out.stderr[-3000:]
    left = [os.path.join(d, f) for d, _, files in os.walk(out_dir) for f in files]
    assert left == [os.path.join(out_dir, "run.lock")] and open(left[0]).read() == ""  # no data/*.tmp, no holder


SITE = """import os
class Sentinel:  # freed when the interpreter finalizes: says which threads are alive then
    def __del__(self, listdir=os.listdir, read=os.read, open=os.open, write=os.write, sorted=sorted):
        names = sorted(read(open(f"/proc/self/task/{t}/comm", 0), 100).decode().strip()
                       for t in listdir("/proc/self/task"))
        write(2, f"finalizing: threads {names}\\n".encode())
if b"torch.distributed.run" not in open("/proc/self/cmdline", "rb").read():  # the scripts, not the launcher
    sentinel = Sentinel()
"""


@pytest.mark.slow
@pytest.mark.parametrize("nproc, parallel", [(1, "ddp"), (2, "ddp"), (2, "fsdp")])
def test_no_thread_is_alive_when_the_interpreter_finalizes(tmp_path, sft_data, nproc, parallel):
    """A gloo worker thread that frees a tensor while the interpreter finalizes aborts the process (exit -6 after
    `done:`, about 1 run in 50 of 2-process FSDP2): a process that finalizes must have no other thread left."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SITE)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(tmp_path / "site"))
    launcher = [sys.executable] + ([] if nproc == 1 else ["-m", "torch.distributed.run", "--standalone",
                                                          f"--nproc_per_node={nproc}"])
    args = as_args(**dict(LONG, out_dir=str(tmp_path / "run"), data=sft_data, max_iters=2, parallel=parallel,
                          lora_rank=4 if parallel == "fsdp" else 0))
    out = subprocess.run(launcher + ["train_sft.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "done: checkpoint" in out.stdout, out.stderr[-3000:]
    found = [line for line in out.stderr.splitlines() if line.startswith("finalizing: ")]
    assert all(line.endswith("threads ['python']") for line in found), found
    assert len(found) == (1 if nproc == 1 else 0)  # a process group's ranks end without finalizing (os._exit)
