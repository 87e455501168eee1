"""
Talk to a checkpoint: ours (out_dir/ckpt.pt, or the out_dir/hf folder a run leaves) or any Hugging Face
Llama / Qwen2 / Qwen3 / Mistral / SmolLM3 folder.

    python sample.py --model=out/sft/hf --prompt="What is 12+30?"     # one chat turn, greedy
    python sample.py --model=out/sft/hf                                # interactive chat
    python sample.py --model=out/sft/ckpt.pt --temperature=0.8 --top_k=50 --num_samples=3

`generate` is also what the training scripts use for exact-match evaluation: it decodes a whole batch of
prompts at once as one packed stream (no padding). With the KV cache (model.KVCache) the prompts are read
once, in one packed prefill, and each new token is one packed decode step over the unfinished sequences.
"""

import os
import sys

import torch

from configurator import configure
from model import KVCache, Transformer
from tokenizer import Tokenizer, get_tokenizer


@torch.no_grad()
def generate(model, prompts, max_new_tokens, stop_ids=(), temperature=0.0, top_k=None, generator=None,
             sync_ranks=False, kv_cache=True):
    """prompts: list of token-id lists. Returns the new tokens of each (the stop token included when hit).
    temperature 0 is greedy decoding. sync_ranks: under FSDP every forward is a collective, so all ranks
    step together until every rank is done (a rank with nothing left runs a one-token dummy forward).
    kv_cache=False re-reads every sequence whole for each new token: the reference the cache is tested against."""
    device = next(model.parameters()).device
    seqs = [list(p) for p in prompts]
    new = [[] for _ in prompts]
    active = list(range(len(prompts)))
    stop_ids = set(stop_ids)
    cache = KVCache(len(prompts), max(map(len, prompts)) + max_new_tokens) if kv_cache and prompts else None
    for step in range(max_new_tokens):
        if sync_ranks:
            busy = torch.tensor(len(active), device=device)
            torch.distributed.all_reduce(busy, op=torch.distributed.ReduceOp.MAX)
            if busy.item() == 0:
                break
            if not active:
                model(torch.zeros(1, dtype=torch.long, device=device))
                continue
        elif not active:
            break
        if cache is None or step == 0:  # whole sequences (with a cache: the prefill of the prompts)
            lens = [len(seqs[i]) for i in active]
            ids = [t for i in active for t in seqs[i]]
            pos = torch.cat([torch.arange(n, device=device) for n in lens])
        else:  # one decode step: each sequence's newest token, at its position
            lens = [1] * len(active)
            ids = [seqs[i][-1] for i in active]
            pos = torch.tensor([len(seqs[i]) - 1 for i in active], device=device)
        cu = torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)
        max_len = max(len(seqs[i]) for i in active)  # cached tokens included
        # through forward, not the trunk directly, so that FSDP2's root hooks gather the embeddings and head
        logits = model(torch.tensor(ids, device=device), pos, cu, max_len, logits_at=cu[1:].long() - 1,
                       cache=cache).float()  # (B, V): each sequence's last token
        if temperature == 0.0:
            next_ids = logits.argmax(-1)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_ids = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator).squeeze(1)
        still, rows = [], []
        for row, (i, t) in enumerate(zip(active, next_ids.tolist())):
            seqs[i].append(t)
            new[i].append(t)
            if t not in stop_ids:
                still.append(i)
                rows.append(row)
        if cache is not None and len(still) < len(active):
            cache.keep(rows)  # a finished sequence's row leaves the cache: decode steps skip it
        active = still
    return new


def load_model(path, device):
    """A Hugging Face folder (config.json) or one of our training checkpoints (ckpt.pt) -> (model, tokenizer):
    the folder's tokenizer files, or the tokenizer the checkpoint's run trained with."""
    if os.path.isdir(path):
        tok = Tokenizer.from_dir(path) if Tokenizer.has_files(path) else Tokenizer.byte_level()
        return Transformer.from_pretrained(path, dtype=torch.float32, device=device), tok
    if not os.path.exists(path):
        sys.exit(f"sample.py: {path} does not exist; pass --model=<Hugging Face folder or ckpt.pt>")
    from common import checkpoint_model  # not at the top: common -> data.arithmetic -> sample
    model, ckpt = checkpoint_model(path, device)  # the weights from its DCP folder; the optimizer state stays on disk
    return model, get_tokenizer(ckpt["tokenizer"])


if __name__ == "__main__":
    model = "out/sft/hf"  # a Hugging Face folder or a ckpt.pt
    tokenizer = ""  # 'byte' or a folder with tokenizer files; default: the model's (see load_model)
    prompt = ""  # one user message; empty: interactive chat
    system = ""
    max_new_tokens = 256
    temperature = 0.0
    top_k = 0
    num_samples = 1
    seed = 1337
    device = "cuda" if torch.cuda.is_available() else "cpu"
    configure(globals())
    for key, ok in (("max_new_tokens", max_new_tokens >= 1), ("num_samples", num_samples >= 1),
                    ("temperature", temperature >= 0), ("top_k", top_k >= 0),
                    ("device", device == "cpu" or (device.startswith("cuda") and torch.cuda.is_available()))):
        if not ok:
            sys.exit(f"sample.py: {key}={globals()[key]!r} is not usable (max_new_tokens, num_samples >= 1; "
                     f"temperature, top_k >= 0; device 'cpu', or 'cuda' on a machine with a GPU)")
    if os.path.isdir(model) and not os.path.exists(os.path.join(model, "config.json")):
        sys.exit(f"sample.py: {model} has no config.json; pass a Hugging Face folder (a run's out_dir/hf) "
                 f"or a run's out_dir/ckpt.pt")

    torch.manual_seed(seed)
    try:
        net, tok = load_model(model, device)
        tok = get_tokenizer(tokenizer) if tokenizer else tok
    except (ValueError, OSError, RuntimeError, KeyError) as e:  # a folder or file we cannot read: one line
        sys.exit(f"sample.py: cannot load {model}: {e}")
    net.eval()
    messages = [{"role": "system", "content": system}] if system else []

    def reply(messages):
        ids = tok.render_prompt(messages)
        outs = generate(net, [ids] * num_samples, max_new_tokens, stop_ids=tok.stop_ids,
                        temperature=temperature, top_k=top_k or None)
        return [tok.decode([t for t in out if t not in tok.stop_ids]) for out in outs]

    if prompt:
        for text in reply(messages + [{"role": "user", "content": prompt}]):
            print(text)
            print("---")
    else:
        print(f"chatting with {model} (empty line or Ctrl-D to quit)")
        def read_line():
            try:
                return input("> ").strip()
            except EOFError:  # Ctrl-D, or the end of piped input
                return ""

        while (line := read_line()):
            messages.append({"role": "user", "content": line})
            answer = reply(messages)[0]
            print(answer)
            messages.append({"role": "assistant", "content": answer})
