"""What torch.compile did in this process: graphs compiled, recompiles (and why), seconds spent compiling.

    import compile_stats; compile_stats.watch()   # before the first compiled call
    ...; compile_stats.read()                     # -> graphs, recompiles (and why), compile seconds
"""
import logging

RECOMPILES = []  # the message of each recompile, in order


class _Recorder(logging.Handler):
    def emit(self, record):
        RECOMPILES.append(record.getMessage())


def watch():
    """Record every recompile from now on (dynamo's 'recompiles' log, the one TORCH_LOGS=recompiles prints)."""
    import torch
    torch._logging.set_logs(recompiles=True)
    logging.getLogger("torch._dynamo.guards.__recompiles").addHandler(_Recorder())


def read():
    """graphs: every compile and recompile of a graph (dynamo's unique_graphs); compile_s: dynamo's compile wall time
    (Inductor included); recompile_reasons: {the first guard that failed: how many recompiles it caused}."""
    from torch._dynamo.utils import calculate_time_spent, counters
    spent = calculate_time_spent()
    reasons = {}
    for message in RECOMPILES:  # "...guard failure(s):\n    - 0/0: GLOBAL_STATE changed: grad_mode" -> the guard
        first = message.split("guard failure(s):")[-1].strip().splitlines()[0]
        reason = first.split(": ", 1)[-1].split("  #")[0].strip()[:120]
        reasons[reason] = reasons.get(reason, 0) + 1
    return dict(graphs=counters["stats"]["unique_graphs"], recompiles=len(RECOMPILES),
                compile_s=spent.get("total_wall_time", spent.get("entire_frame_compile", 0.0)),
                recompile_reasons=reasons)
