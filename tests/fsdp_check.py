"""Run by tests/test_scale_out.py under torchrun (gloo on CPU), not collected by pytest itself:
    torchrun --nproc_per_node=W tests/fsdp_check.py MODEL_FOLDER EXPORT_FOLDER
Builds the model on the meta device, shards it with FSDP2, lets each rank read only its own rows of each tensor, and
checks that every gathered parameter and the logits equal the one-process load; then exports it one tensor at a time."""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanopack.hf import from_pretrained, load_hf_weights, read_hf_config, save_pretrained  # noqa: E402
from model import Transformer  # noqa: E402
from nanopack.parallel import wrap_model  # noqa: E402

folder, export = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
whole = from_pretrained(folder, dtype=torch.float32)  # the one-process path
with torch.device("meta"):
    model = Transformer(read_hf_config(folder))
wrap_model(model, "fsdp", world_size, torch.float32)
model.to_empty(device="cpu")
load_hf_weights(model, folder)
for name, p in model.named_parameters():
    assert p.to_local().shape[0] < p.shape[0], f"{name} is not sharded"
    assert torch.equal(p.full_tensor(), whole.get_parameter(name)), name  # the same bytes, padding rows included
lens = [5, 17, 1, 9]
ids = torch.randint(0, model.config.vocab_size, (sum(lens),), generator=torch.Generator().manual_seed(0))
pos = torch.cat([torch.arange(n) for n in lens])
cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
with torch.no_grad():
    # float32, the same weights and ops: FSDP2 only all-gathers them first
    torch.testing.assert_close(model(ids, pos, cu, max(lens)), whole(ids, pos, cu, max(lens)), atol=1e-6, rtol=0)
save_pretrained(model, export, max_shard_bytes=30_000)
dist.barrier()
print(f"rank {rank}: sharded load and export ok")
dist.destroy_process_group()
