"""
Talk to a checkpoint: ours (out_dir/ckpt.pt, or the out_dir/hf folder a run leaves) or any
Hugging Face Llama / Qwen2 / Qwen3 / Mistral / SmolLM3 folder.

    python sample.py --model=out/sft/hf --prompt="What is 12+30?"     # one chat turn, greedy
    python sample.py --model=out/sft/hf                                # interactive chat
    python sample.py --model=out/sft/ckpt.pt --temperature=0.8 --top_p=0.95 --num_samples=3
    python sample.py --model=~/models/Qwen3-0.6B \
        --chat_template_kwargs="{'enable_thinking': False}"
    # a hub name: downloaded once
    python sample.py --model=HuggingFaceTB/SmolLM2-135M-Instruct --prompt="Hi"

A reply is printed as the model writes it, special tokens included (<think>...</think>,
<tool_call>...), the token that ends it left out, and goes back into a chat's history as written.
It ends at max_new_tokens, or where prompt + reply fill the model's max_seq_len (a note says so);
a chat that outgrows the model drops its oldest turns, and says so.
"""

import os
import sys

import torch

from nanopack.checkpoint import checkpoint_model
from nanopack.configurator import configure
from nanopack.generate import generate
from nanopack.hf import from_pretrained
from nanopack.tokenizer import Tokenizer, get_tokenizer


def load_model(path, device):
    """A Hugging Face folder or one of our ckpt.pt -> (model, its tokenizer: the folder's files,
    or the run's)."""
    if os.path.isdir(path):
        tok = Tokenizer.from_dir(path) if Tokenizer.has_files(path) else Tokenizer.byte_level()
        return from_pretrained(path, dtype=torch.float32, device=device), tok
    if not os.path.exists(path):
        sys.exit(f"sample.py: {path} does not exist; "
                 "pass --model=<Hugging Face folder, hub name or ckpt.pt>")
    # the weights from its DCP folder; the optimizer state stays on disk
    model, ckpt = checkpoint_model(path, device)
    return model, get_tokenizer(ckpt["tokenizer"])


if __name__ == "__main__":
    model = "out/sft/hf"  # a Hugging Face folder, a hub name (org/name[@revision]) or a ckpt.pt
    # 'byte' or a folder (or hub name) with tokenizer files; default: the model's
    tokenizer = ""
    prompt = ""  # one user message; empty: interactive chat
    system = ""
    # variables for the model's chat template, e.g. {'enable_thinking': False}
    chat_template_kwargs = {}
    max_new_tokens = 256
    temperature = 0.0
    top_k = 0
    top_p = 1.0  # nucleus sampling: 1.0 keeps every token
    num_samples = 1
    seed = 1337
    device = "cuda" if torch.cuda.is_available() else "cpu"
    configure(globals())
    for key, ok in (("max_new_tokens", max_new_tokens >= 1), ("num_samples", num_samples >= 1),
                    ("temperature", temperature >= 0), ("top_k", top_k >= 0),
                    ("top_p", 0 < top_p <= 1),
                    ("device", device == "cpu"
                     or (device.startswith("cuda") and torch.cuda.is_available()))):
        if not ok:
            sys.exit(f"sample.py: {key}={globals()[key]!r} is not usable (max_new_tokens, "
                     "num_samples >= 1; temperature, top_k >= 0; 0 < top_p <= 1; device 'cpu', or "
                     "'cuda' on a machine with a GPU)")
    if os.path.isdir(model) and not os.path.exists(os.path.join(model, "config.json")):
        sys.exit(f"sample.py: {model} has no config.json; pass a Hugging Face folder (a run's "
                 "out_dir/hf) or a run's out_dir/ckpt.pt")

    torch.manual_seed(seed)
    try:
        net, tok = load_model(model, device)
        tok = (get_tokenizer(tokenizer) if tokenizer else tok).configure_chat(chat_template_kwargs)
    except (ValueError, OSError, RuntimeError, KeyError) as e:
        # a folder or file we cannot read: one line
        sys.exit(f"sample.py: cannot load {model}: {e}")
    net.eval()
    messages = [{"role": "system", "content": system}] if system else []

    def refusal(messages):
        """Why the template cannot render messages and a user turn (None: it can)."""
        try:
            tok.render_prompt(messages + [{"role": "user", "content": "Hi"}])
        except ValueError as e:
            return e

    # one line, before any chat: Gemma's template refuses a system role
    if why := refusal(messages):
        sys.exit(f"sample.py: the chat template has no system role ({why}); drop --system, or put "
                 "it in the prompt" if system and not refusal([]) else f"sample.py: {why}")
    positions = net.config.max_seq_len  # prompt + reply: generate() stops a reply there

    def reply(messages):
        """-> [(text, whether it reached max_seq_len before it ended)], one per sample."""
        ids = tok.render_prompt(messages)
        # each turn its own random stream: the chat's length is its key
        outs = generate(net, [ids], max_new_tokens, stop_ids=tok.stop_ids, num_samples=num_samples,
                        temperature=temperature, top_k=top_k or None, top_p=top_p, seed=seed,
                        keys=[len(messages)])
        return [(tok.decode_reply(out),
                 len(ids) + len(out) == positions and out[-1] not in tok.stop_ids)
                for out in outs]

    def show(text, cut):
        note = f"\n(cut: prompt and reply reached the model's max_seq_len={positions} tokens)"
        print(text + note * cut)

    def too_long(messages):
        n = len(tok.render_prompt(messages))
        if n < positions:
            return ""
        return f"the prompt is {n} tokens and {model} reads at most max_seq_len={positions}"

    if prompt:
        messages.append({"role": "user", "content": prompt})
        if why := too_long(messages):
            sys.exit(f"sample.py: {why}; shorten the prompt (or the system prompt)")
        for text, cut in reply(messages):
            show(text, cut)
            print("---")
    else:
        print(f"chatting with {model} (empty line or Ctrl-D to quit)")
        def read_line():
            try:
                return input("> ").strip()
            except EOFError:  # Ctrl-D, or the end of piped input
                return ""

        # the oldest turn after the system prompt: dropped first when the chat outgrows the model
        first = len(messages)
        while (line := read_line()):
            turn = {"role": "user", "content": line}
            if why := too_long(messages[:first] + [turn]):
                print(f"({why}: not sent; write a shorter message)")
                continue
            messages.append(turn)
            dropped = 0
            while (len(messages) > first + 1
                   and len(tok.render_prompt(messages)) + max_new_tokens > positions):
                del messages[first:first + 2]  # a user turn and its reply
                dropped += 1
            if dropped:
                print(f"(the model no longer sees the {dropped} oldest turn(s): prompt and reply "
                      f"must fit its max_seq_len={positions}, with room for "
                      f"max_new_tokens={max_new_tokens})")
            text, cut = reply(messages)[0]
            show(text, cut)
            messages.append({"role": "assistant", "content": text})
