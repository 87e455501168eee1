"""
Memory per rank while loading a Hugging Face folder into FSDP2 and exporting it again, on CPU with gloo, at world
sizes 1, 2, 4 (each a fresh torchrun), two ways side by side:

  whole    what train_*.py did before issue 19: every rank loads the whole model (from_pretrained), then fully_shard
           frees what is not its own; export gathers the full state dict on rank 0 (get_model_state_dict), then writes;
           a checkpoint is the full model + AdamW state gathered to rank 0 (one file) and read whole by every rank
  sharded  what they do now: the model is built on the meta device, sharded, and each rank reads only its own rows of
           each tensor from the memory-mapped files (hf.load_hf_weights); export gathers one tensor at a time and
           rank 0 writes one shard file's worth at a time (hf.save_pretrained, called by every rank); a checkpoint
           is a DCP folder each rank writes and reads its own part of (checkpoint.save_checkpoint / restore_checkpoint)

Peak memory is each process's private memory (RssAnon in /proc/self/status, sampled every 5 ms) above what it held
before the phase, the largest over the ranks; resident pages of the memory-mapped files (page cache the kernel can
drop) are reported apart (RSS = private + mapped). The folder is written in bfloat16, as published checkpoints are;
the ranks hold float32 master weights.

    python bench/bench_scale.py                       # qwen2.5-0.5b shape (494M parameters): 0.9 GiB bf16 folder
    python bench/bench_scale.py --preset tiny         # seconds; what the smoke test runs
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class PeakRSS:
    """Highest private memory (and whole RSS) seen while the `with` block runs, minus what it was when it began."""

    def __enter__(self):
        self.start, self.start_rss = self.rss()
        self.peak, self.peak_rss = self.start, self.start_rss
        self.running = True
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.sample_once()

    @staticmethod
    def rss():
        """(RssAnon, VmRSS) in bytes."""
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f)
        return tuple(int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "VmRSS"))

    def sample_once(self):
        anon, rss = self.rss()
        self.peak, self.peak_rss = max(self.peak, anon), max(self.peak_rss, rss)

    def sample(self):
        while self.running:
            self.sample_once()
            time.sleep(0.005)

    @property
    def grown(self):
        return self.peak - self.start

    @property
    def grown_rss(self):
        return self.peak_rss - self.start_rss


def child(method, folder, export, load_whole_checkpoint=True):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                         get_state_dict, set_model_state_dict, set_optimizer_state_dict)
    from nanopack.checkpoint import restore_checkpoint, rng_state
    from nanopack.hf import from_pretrained, load_hf_weights, read_hf_config, save_pretrained
    from model import Transformer
    from nanopack.parallel import wrap_model
    full_options = StateDictOptions(full_state_dict=True, cpu_offload=True)

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    with PeakRSS() as load:
        if method == "whole":
            model = from_pretrained(folder, dtype=torch.float32)
            if world_size > 1:
                wrap_model(model, "fsdp", world_size, torch.float32)
        else:
            with torch.device("meta"):
                model = Transformer(read_hf_config(folder))
            if world_size > 1:
                wrap_model(model, "fsdp", world_size, torch.float32)
            model.to_empty(device="cpu")
            load_hf_weights(model, folder)
    held = PeakRSS.rss()[0]
    dist.barrier()
    with PeakRSS() as save:
        if method == "whole":
            full = get_model_state_dict(model, options=full_options)
            if rank == 0:
                with torch.device("meta"):
                    out = Transformer(model.config)
                out.load_state_dict(full, assign=True)
                save_pretrained(out, export)  # plain tensors: no collective, rank 0 alone writes
            del full
        else:
            save_pretrained(model, export)  # every rank sends its rows, rank 0 writes
        dist.barrier()
    # checkpoints with AdamW state (two float32 moments per parameter, sharded like the parameters)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    ckpt = export + ".ckpt"
    with PeakRSS() as ckpt_save:
        if method == "whole":  # before: the full state gathered to rank 0 and written as one file
            state = dict(model=get_model_state_dict(model, options=full_options),
                         optimizer=get_optimizer_state_dict(model, optimizer, options=full_options))
            if rank == 0:
                torch.save(state, ckpt + ".pt")
            del state
        else:  # now: DCP, each rank writing its own shards (checkpoint.save_checkpoint)
            model_sd, optim_sd = get_state_dict(model, optimizer)
            dcp.save(dict(model=model_sd, optimizer=optim_sd), checkpoint_id=ckpt)
            del model_sd, optim_sd
        dist.barrier()
    ckpt_load = None
    if method == "sharded" or load_whole_checkpoint:
        with PeakRSS() as ckpt_load:
            if method == "whole":  # before: every rank read the whole file
                state = torch.load(ckpt + ".pt", map_location="cpu", weights_only=True)
                set_model_state_dict(model, state["model"], options=full_options)
                set_optimizer_state_dict(model, optimizer, state["optimizer"], options=full_options)
                del state
            else:
                restore_checkpoint(dict(weights=os.path.basename(ckpt), rng=rng_state()), os.path.dirname(ckpt), model,
                                   optimizer)
            dist.barrier()
    with open(f"{export}.rank{rank}.json", "w") as f:  # a file each: the ranks' stdout lines interleave
        json.dump(dict(rank=rank, load=load.grown, load_rss=load.grown_rss, held=held - load.start,
                       save=save.grown, save_rss=save.grown_rss, ckpt_save=ckpt_save.grown,
                       ckpt_load=ckpt_load.grown if ckpt_load else None), f)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen2.5-0.5b")
    p.add_argument("--world_sizes", default="1,2,4")
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(*args.child[:3], load_whole_checkpoint=args.child[3] == "1")

    import torch
    from nanopack.hf import save_pretrained
    from model import Transformer, config_from_preset
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "hf")
        torch.manual_seed(0)
        model = Transformer(config_from_preset(args.preset))
        n_params = model.num_params()
        save_pretrained(model.to(torch.bfloat16), folder)
        model.float()
        full = sum(p.numel() * p.element_size() for p in model.parameters())
        largest = max(p.numel() * p.element_size() for p in model.parameters())
        del model
        gib = 2 ** 30
        print(f"{args.preset}: {n_params / 1e6:.1f}M parameters, float32: full model {full / gib:.2f} GiB, largest "
              f"tensor {largest / gib:.3f} GiB | CPU ({os.cpu_count()} cores), gloo, torch {torch.__version__}")
        with open("/proc/meminfo") as f:
            mem_total = int(f.readline().split()[1]) * 1024
        print("| world size | method | load: peak private GiB per rank | (RSS incl. mapped file) | held after load | "
              "export: peak private GiB, any rank | (RSS) | checkpoint save (model + AdamW) | checkpoint load | "
              "bound: full / world + largest |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for world_size in map(int, args.world_sizes.split(",")):
            for method in ("whole", "sharded"):
                export = os.path.join(tmp, f"export_{method}_{world_size}")
                # every rank reads a whole checkpoint (3 x the float32 model) and holds a copy while it loads: world
                # size 2 was killed for memory (SIGKILL) on a 23 GiB machine, so run it only where it fits twice over
                whole_fits = 2 * 3 * full * world_size < 0.5 * mem_total
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}",
                       __file__, "--child", method, folder, export, str(int(whole_fits))]
                out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
                rows = [json.load(open(f"{export}.rank{r}.json")) for r in range(world_size)
                        if os.path.exists(f"{export}.rank{r}.json")]
                if out.returncode or len(rows) != world_size:
                    print(f"| {world_size} | {method} | failed: {(out.stderr.strip().splitlines() or [''])[-1][:100]} | | | | | | | |")
                    continue
                peak = lambda key: max(r[key] for r in rows) / gib
                ckpt_load = (f"{peak('ckpt_load'):.2f}" if rows[0]["ckpt_load"] is not None else
                             f"not run: {world_size} ranks x 2 x {3 * full / gib:.1f} GiB > half this machine's memory")
                print(f"| {world_size} | {method} | {peak('load'):.2f} | {peak('load_rss'):.2f} | {peak('held'):.2f} | "
                      f"{peak('save'):.2f} | {peak('save_rss'):.2f} | {peak('ckpt_save'):.2f} | {ckpt_load} | "
                      f"{(full / world_size + largest) / gib:.2f} |", flush=True)


if __name__ == "__main__":
    main()
