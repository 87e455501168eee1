"""Run by tests/test_plan.py under torchrun (gloo on CPU), not collected by pytest itself: the real step whose memory
fake_step.plan_step plans, on every rank of the group; rank 0 prints its figures as one JSON line.
    torchrun --nproc_per_node=W tests/plan_check.py SCRIPT [--key=value ...]"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanopack import fake_step  # noqa: E402

r = fake_step.plan_step(sys.argv[1], sys.argv[2:], gpus=int(os.environ["WORLD_SIZE"]), device="cpu", fake=False)
if os.environ["RANK"] == "0":
    print("PLAN " + json.dumps(dict(by_category=r["by_category"], phase=r["phase"], tokens=r["tokens"])))
