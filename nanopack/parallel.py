"""
Processes and devices: torchrun's ranks (or one plain process), one live run per out_dir, workers
that stop with their launcher, printing (and failing) once, sums over ranks, the DDP / FSDP2 wrap,
gradient sync, and precision.
"""
import atexit
import ctypes
import datetime
import fcntl
import os
import signal
import socket
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

# under torchrun the launcher, read when the script imports this: stop_with_launcher()
PARENT_AT_START = os.getppid()


def setup_distributed(device="auto", timeout_s=300):
    """-> (rank, world_size, device) from torchrun's environment (a plain process: 0 of 1); NCCL on
    CUDA, gloo on CPU, a collective waiting past timeout_s (a dead rank) failing instead of
    hanging."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    if world_size > 1:
        stop_with_launcher()
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s))
    return rank, world_size, torch.device(device)


def stop_with_launcher():
    """SIGTERM when the launcher dies, even by SIGKILL (torchrun puts each worker in a session of
    its own: nothing else would reach it), so a worker saves a checkpoint and exits instead of
    training on into out_dir."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != PARENT_AT_START:  # it died before the line above: no signal will come
            raise SystemExit(f"rank {os.environ.get('RANK')}: the launcher of this worker is gone; "
                             "stopping")


def lock_out_dir(out_dir):
    """One live run per out_dir: rank 0 holds an flock on out_dir/run.lock, which the kernel drops
    however the process dies; the holder is written inside, for the line a second run stops with."""
    if not is_master():
        return
    path = os.path.join(out_dir, "run.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 500).decode(errors="replace").strip() or "starting or ending"
        raise SystemExit(f"{out_dir} is in use by a live run ({holder}): wait for it to end, or "
                         "stop it (SIGTERM saves a checkpoint, then --init_from=resume), or choose "
                         "another out_dir") from None
    except OSError as e:
        # a file system without flock (e.g. Lustre mounted noflock): run, and say nothing guards it
        print0(f"note: cannot lock {path} ({e.strerror}): nothing stops a second run from writing "
               f"into {out_dir}")
        return
    stale = os.read(fd, 500).decode(errors="replace").strip()
    if stale:  # a clean exit empties the file: a holder named in an unlocked file was killed
        print0(f"note: taking over {path} from {stale}, which is gone (killed?)")
    os.ftruncate(fd, 0)
    holder = (f"pid {os.getpid()} on {socket.gethostname()} since "
              f"{datetime.datetime.now():%Y-%m-%d %H:%M:%S}, {os.path.basename(sys.argv[0])}\n")
    os.pwrite(fd, holder.encode(), 0)
    atexit.register(os.ftruncate, fd, 0)  # a clean exit; the lock itself goes with the process


def teardown_distributed(code=0):
    """Exit with `code`; with a process group, destroy it and skip Python's finalization: the
    wrapped model keeps gloo's threads alive, and freeing a tensor while the interpreter finalizes
    dies in std::terminate (exit -6)."""
    if dist.is_initialized():
        dist.barrier()  # no rank tears down while another still talks to it
        dist.destroy_process_group()
        # what a normal exit runs first (the out_dir lock's release, logging, wandb)
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)


class StopSignal:
    """Why this process stops before its last step, if it does. From install() (setup's first step)
    a SIGINT or SIGTERM during start-up stops at once, unwinding (data preparation removes its
    temporary files), with one line; once `starting` is False (setup's end), after the current step
    with a checkpoint, as does request() (a log the disk refused). A second SIGINT stops at once; a
    SIGTERM after a SIGINT (torchrun passes Ctrl-C on) does not."""

    def __init__(self):
        self.name = None     # 'SIGINT' or 'SIGTERM', or the reason given to request()
        # the signal's number; None for a request: a stop that is a failure, not a preemption
        self.signal = None
        # time.monotonic() of the signal: how long a stop takes, for a scheduler's grace period
        self.at = None
        self.starting = True

    def install(self):
        self.starting = True
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, self.handle)

    def handle(self, signum, frame):
        name = signal.Signals(signum).name
        # os.write, not print: a print inside a signal handler can interrupt a print and raise
        # "reentrant call"
        if self.starting:
            if is_master():
                os.write(2, f"stopped by {name} during start-up (before the first step): nothing "
                            "to save; the same command starts it again\n".encode())
            raise SystemExit(128 + signum)
        if self.name == "SIGINT" and name == "SIGINT":
            raise SystemExit("second SIGINT: stopped at once, without a checkpoint")
        if self.name is None:
            self.name, self.signal, self.at = name, signum, time.monotonic()
        os.write(2, f"rank {os.environ.get('RANK', 0)}: {name}: stopping after this step with a "
                    "checkpoint\n".encode())

    def request(self, reason):
        """Stop after the current step with a checkpoint, exiting 1: reason says what failed."""
        if self.name is None:
            self.name = reason


stop_signal = StopSignal()  # one per process, as signal handlers are


def is_master():
    """Rank 0, or a plain process; readable before the process group exists (from torchrun's
    environment)."""
    return int(os.environ.get("RANK", 0)) == 0


def print0(*args, **kwargs):
    if is_master():
        print(*args, **kwargs, flush=True)


def fail(message):
    """Exit with message, printed by rank 0; the others wait for torchrun to stop them (exiting
    first, they could get rank 0 stopped before it prints)."""
    if not is_master():
        # torchrun's SIGTERM stops this rank, whatever a run set
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(30)
    raise SystemExit(message) from None


def all_reduce_sum(values, device):
    """Sum a list of floats over all ranks in one collective: sums and counts, divided afterwards,
    average exactly."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def all_reduce_max(value, device):
    """The largest of an int over all ranks, in one collective."""
    t = torch.tensor(value, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def wrap_model(model, parallel, world_size, param_dtype):
    """DDP, or FSDP2 `fully_shard` per block then on the root (torchtitan's layout): float32 sharded
    master weights, computing in param_dtype, gradients reduced in float32. parallel None: the model
    as it is."""
    if world_size == 1 or parallel is None:
        return model
    if parallel == "ddp":
        device = model.embed_tokens.weight.device
        # gradients as views of DDP's all-reduce buckets: one copy of them per rank, not two
        # (plan.py plans one)
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                   gradient_as_bucket_view=True)
    if parallel == "fsdp":
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        for block in model.layers:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        return model
    raise ValueError(f"parallel={parallel!r}: choose 'ddp' or 'fsdp'")


def sync_gradients(model, enabled):
    """DDP reduces gradients only when enabled (a step's last micro-batch). FSDP2 reduce-scatters
    each one, as torchtitan does: skipping would hold the whole unsharded float32 gradient (30 GiB
    for an 8B), not 1/world of it."""
    return model.no_sync() if hasattr(model, "no_sync") and not enabled else nullcontext()


def precision(device, dtype, parallel, world_size):
    """-> (dtype name, torch dtype, autocast context); 'auto': bfloat16 on CUDA. FSDP2: its policy
    casts instead."""
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    ptdtype = getattr(torch, dtype)
    fsdp = parallel == "fsdp" and world_size > 1
    return dtype, ptdtype, (torch.autocast(device.type, dtype=ptdtype) if ptdtype != torch.float32
                            and not fsdp
                            else nullcontext())
