"""
How far one JSONL line travels before it is a loss: the distinct project functions (and files) called while one
chat line is prepared into token files, loaded, packed and scored by the model in one process. A measure of shape,
not speed; run it in two checkouts to compare layouts.

    python bench/hops.py
"""
import argparse
import json
import os
import sys
import tempfile
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from data.prepare import load, prepare  # noqa: E402
from model import Transformer, config_from_preset  # noqa: E402
from packing import PackedLoader  # noqa: E402


def pipeline(folder):
    path = os.path.join(folder, "one.jsonl")
    with open(path, "w") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "What is 2+2?"},
                                         {"role": "assistant", "content": "2+2 = 4"}]}) + "\n")
    prepare(path, os.path.join(folder, "data"), tokenizer="byte", val_fraction=0.0, verbose=False)
    data, _ = load(os.path.join(folder, "data"), "train")
    step = next(PackedLoader(data, batch_size=1, microbatch_tokens=256))
    loss, n = model(**step.microbatches[0].inputs())
    return loss / n


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    torch.manual_seed(0)
    model = Transformer(config_from_preset("tiny", vocab_size=261))
    seen, depth = Counter(), [0, 0]  # (file, function) -> calls; current and deepest chain of project calls

    def profile(frame, event, arg):
        code = frame.f_code
        if not code.co_filename.startswith(ROOT) or "<" in code.co_qualname:  # comprehensions are not hops
            return
        if event == "call":
            seen[(os.path.relpath(code.co_filename, ROOT), code.co_qualname)] += 1
            depth[0] += 1
            depth[1] = max(depth)
        elif event == "return":
            depth[0] -= 1

    with tempfile.TemporaryDirectory() as tmp:
        sys.setprofile(profile)
        loss = pipeline(tmp)
        sys.setprofile(None)
    seen.pop((os.path.relpath(__file__, ROOT), "pipeline"))
    files = Counter(f for f, _ in seen)
    for (file, name), calls in sorted(seen.items()):
        print(f"{file:22s} {name:40s} {calls:5d} calls")
    print(f"loss {loss.item():.4f}: {len(seen)} distinct functions in {len(files)} files, deepest chain {depth[1]} "
          f"({', '.join(f'{f} {n}' for f, n in sorted(files.items()))})")
