r"""
Chat records, JSON Lines, JSON or Parquet as downloaded from the Hugging Face hub -> the token files
packing.py reads.

    python data/prepare.py --input chats.jsonl --out_dir data/chats --tokenizer byte
    python data/prepare.py --input prefs.jsonl --out_dir data/prefs \
        --tokenizer ~/models/Qwen2.5-0.5B --max_len 4096 --overlong truncate --val_fraction 0.01
    python data/prepare.py --input ultrafeedback_binarized/data --data_split train_prefs \
        --val_input 'ultrafeedback_binarized/data/test_prefs-*.parquet' --out_dir data/uf \
        --tokenizer byte

--input (and --val_input): a .jsonl file (a record a line), a .json file (a JSON array of records,
or JSON Lines), either gzipped (.jsonl.gz, .json.gz), a .parquet file (a record a row, read row
group by row group: pip install pyarrow; a null field is read as absent, since Arrow gives every row
every key of a column), a folder of such shards, a quoted glob, or files and globs separated by
commas ('a.jsonl,b.jsonl'). A glob or a list is one split; a folder's files form splits by name
(train_prefs-00000-of-00001.parquet: split train_prefs), several need --data_split (--val_split). A
hub name (org/name[/config][@revision]; --tokenizer's too) is downloaded as the scripts download it.

Records (the first good one decides SFT or DPO, one kind per input; other fields, e.g. id, ignored):
  SFT  {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
       (e.g. Tulu 3 SFT mixture)
  DPO  {"chosen": [messages], "rejected": [messages]}: the prompt is their longest common prefix,
       then assistant turns (and the tool results between them)
  DPO  {"prompt": str | [messages], "chosen": str | [assistant messages], "rejected": the same};
       whole conversations in chosen/rejected are read as above (ultrafeedback_binarized, whose
       "messages" must equal "chosen")
  DPO  {"chosen": "\n\nHuman: ...\n\nAssistant: ...", "rejected": ...}  (Anthropic HH-RLHF):
       split into turns, as above
A message keeps every field for the model's own chat template, as apply_chat_template takes them:
"reasoning_content" (or "thinking", "reasoning"), "tool_calls" ([{"type": "function", "function":
{"name", "arguments": a dict or JSON string}}], content then optional), roles "tool"
("tool_call_id", "name") and Llama-3.1's "ipython". A record may add "tools" (JSON schemas) and
"chat_template_kwargs" (e.g. {"enable_thinking": false}, over --chat_template_kwargs). A field, role
or variable the template does not write is an error. Templates that leave earlier turns' reasoning
out of the history (Qwen3) train those turns as rendered there, as transformers renders the
conversation; --reasoning_turns each makes each such turn an example of its own: the conversation up
to it, its reasoning included.

Output in out_dir, per split (train, val): <split>_ids.npy (uint16 if the vocab fits, else uint32),
<split>_offsets.npy (int64, example i = ids[offsets[i]:offsets[i+1]]), <split>_mask.npy (uint8, 1 on
trained tokens), and meta.json. A DPO pair i is examples 2i (chosen) and 2i+1 (rejected); load()
reads them back. A record goes to val with probability val_fraction (random.Random(seed), record by
record), or val is --val_input.

Sequences longer than --max_len tokens follow --overlong: error (default: stop, naming the line);
truncate (keep the first max_len tokens of each sequence; a DPO pair left without response tokens on
a side, or with equal sides, is skipped); skip (drop the example, a DPO pair as a whole). A record
that cannot be read, parsed or rendered follows --bad_records: error (default: the whole input is
read, then one error counts them and names the first 5); skip (leave them out: counted, the first 5
named, in meta.json).
"""
import argparse
import copy
import itertools
import json
import os
import random
import sys
from array import array

import numpy as np

# python data/prepare.py
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data.records import (BAD_RECORDS, BadRecords, DataError, data_files,  # noqa: E402, F401
                          parse_fields, read_records)
# as_messages: data/dataset.py reads it from here
from data.messages import as_messages, parse, template_inputs  # noqa: E402, F401
from nanopack.tokenizer import get_tokenizer  # noqa: E402

OVERLONG = ("error", "truncate", "skip")
REASONING_TURNS = ("conversation", "each")
def render(tok, kind, example, where, inputs, reasoning_turns):
    """-> [(ids, mask)]: SFT one, or one per turn with reasoning_turns='each'; DPO chosen, rejected.
    inputs: template_inputs'."""
    try:
        return (list(tok.render_pair(*example, **inputs)) if kind == "dpo"
                else tok.render_turns(example, **inputs)
                if reasoning_turns == "each" else [tok.render(example, **inputs)])
    except ValueError as e:
        # the template refused the conversation (raise_exception), or leaves part of it out
        raise DataError(f"{where}: {e}") from None


def fit(seqs, kind, where, max_len, overlong):
    """-> (sequences, status): sequences within max_len as `overlong` says, [] when skipped; status
    "ok", "truncated" or "skipped"."""
    longest = max(len(ids) for ids, _ in seqs)
    if longest <= max_len:
        return seqs, "ok"
    if overlong == "error":
        what = "the example" if kind == "sft" else "the longer side of the pair"
        raise DataError(f"{where}: {what} is {longest} tokens, more than max_len={max_len} — raise "
                        "--max_len, or pass --overlong=truncate (keep the first max_len tokens) "
                        "or --overlong=skip")
    if overlong == "skip":
        return [], "skipped"
    seqs = [(ids[:max_len], mask[:max_len]) for ids, mask in seqs]
    # reasoning_turns='each': keep what trains
    seqs = [s for s in seqs if sum(s[1])] if kind == "sft" else seqs
    if not seqs or any(sum(mask) == 0 for _, mask in seqs) or (kind == "dpo"
                                                               and seqs[0] == seqs[1]):
        return [], "skipped"  # truncation left nothing to learn or nothing to compare
    return seqs, "truncated"


class TokenWriter:
    """One split's sequences, appended to temporary files; close() turns them into .npy files.
    units: each record's sequences are one unit (reasoning_turns='each': a conversation's turn
    examples), kept in <split>_units.npy."""

    def __init__(self, out_dir, split, vocab_size, units=False):
        self.prefix = os.path.join(out_dir, split)
        self.dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
        self.ids, self.mask = array("H" if self.dtype == np.uint16 else "I"), array("B")
        self.offsets, self.target_tokens = array("q", [0]), 0
        self.units = array("q", [0]) if units else None
        assert self.ids.itemsize == np.dtype(self.dtype).itemsize
        self.files = {name: open(f"{self.prefix}_{name}.tmp", "wb") for name in ("ids", "mask")}

    def add(self, ids, mask):
        self.ids.extend(ids)
        self.mask.extend(mask)
        self.offsets.append(self.offsets[-1] + len(ids))
        self.target_tokens += sum(mask)
        if len(self.ids) >= 1 << 22:  # bounded memory on files of millions of lines
            self.flush()

    def end_unit(self):
        if self.units is not None and self.units[-1] < len(self.offsets) - 1:
            self.units.append(len(self.offsets) - 1)

    def flush(self):
        for name, buf in (("ids", self.ids), ("mask", self.mask)):
            buf.tofile(self.files[name])
            del buf[:]

    def close(self):
        self.flush()
        n = self.offsets[-1]
        for name, dtype in (("ids", self.dtype), ("mask", np.uint8)):
            self.files[name].close()
            tmp = f"{self.prefix}_{name}.tmp"
            # paged, not read in
            data = np.memmap(tmp, dtype, "r", shape=(n,)) if n else np.zeros(0, dtype)
            np.save(f"{self.prefix}_{name}.npy", data)
            del data
            os.remove(tmp)
        np.save(f"{self.prefix}_offsets.npy", np.frombuffer(self.offsets, dtype=np.int64))
        if self.units is not None:
            np.save(f"{self.prefix}_units.npy", np.frombuffer(self.units, dtype=np.int64))
        return dict(sequences=len(self.offsets) - 1, tokens=n, target_tokens=self.target_tokens)

    def abort(self):
        for name, f in self.files.items():
            f.close()
            if os.path.exists(f"{self.prefix}_{name}.tmp"):
                os.remove(f"{self.prefix}_{name}.tmp")


def write_records(items, writers, tok, bad, want, max_len, overlong, reasoning_turns):
    """Each (where, split, record) item -> its split's writer. -> what meta.json counts of them
    (kind None: no record was read)."""
    kind, first, lengths, longest_example = None, None, array("q"), 0
    status_counts, turn_examples, turns_dropped = dict(ok=0, truncated=0, skipped=0), 0, 0
    for where, split, record in items:
        try:
            k, example = parse(record, where, want)
            inputs = template_inputs(record, where)
            seqs = render(tok, k, example, where, inputs, reasoning_turns)
        except DataError as e:
            bad.add(e)
            continue
        if kind is None:
            kind, first = k, where
        elif k != kind:
            raise DataError(f"{where}: a {k.upper()} line in a file that began as "
                            f"{kind.upper()} at {first} — keep SFT and DPO data in separate files")
        if kind == "dpo" and reasoning_turns == "each":
            raise DataError(f"{where}: reasoning_turns='each' is for SFT conversations, "
                            f"and this is a DPO pair")
        rendered, (seqs, status) = len(seqs), fit(seqs, kind, where, max_len, overlong)
        status_counts[status] += 1
        # 'each': turns truncated to nothing trained
        turns_dropped += (rendered - len(seqs)) * (status == "truncated")
        turn_examples += max(len(seqs) - 1, 0) * (kind == "sft")
        for ids, mask in seqs:
            writers[split].add(ids, mask)
            lengths.append(len(ids))
        writers[split].end_unit()
        longest_example = max(longest_example, sum(len(ids) for ids, _ in seqs))
    return dict(kind=kind, lengths=lengths, longest_example=longest_example,
                status_counts=status_counts, turn_examples=turn_examples,
                turns_dropped=turns_dropped)


def write_token_files(items, out_dir, tok, max_len=4096, overlong="error", extra_meta=None,
                      verbose=True, reasoning_turns="conversation", bad=None, want=None):
    """(where, split, record) items -> token files and meta.json (written last: the files are
    complete) in out_dir. bad: the BadRecords the reader counts into too (None: 'error'); a record
    that fails to parse or render is one. want: 'sft' or 'dpo', the fields read where a record has
    both (parse's kind)."""
    bad = BadRecords() if bad is None else bad
    os.makedirs(out_dir, exist_ok=True)
    if os.path.exists(os.path.join(out_dir, "meta.json")):
        os.remove(os.path.join(out_dir, "meta.json"))
    writers = {split: TokenWriter(out_dir, split, tok.vocab_size, units=reasoning_turns == "each")
               for split in ("train", "val")}
    # the tokenizer counts; this file's own from here
    unwritten = getattr(tok, "reasoning_unwritten", 0)
    try:
        stats = write_records(items, writers, tok, bad, want, max_len, overlong, reasoning_turns)
        kind = stats["kind"]
        source = (extra_meta or {}).get("source", out_dir)
        if bad.count and (kind is None or bad.policy == "error"):
            bad.raise_error(source, usable=kind is not None)
        if kind is None:
            raise DataError(f"{source}: no examples found — is the file empty?")
        counts = {split: w.close() for split, w in writers.items()}
        unwritten = getattr(tok, "reasoning_unwritten", 0) - unwritten
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    for c in counts.values():
        # DPO: pairs
        c["examples"] = c["sequences"] // (2 if kind == "dpo" else 1)
    lengths, status_counts = stats["lengths"], stats["status_counts"]
    q = [0] * 4
    if lengths:
        q = np.percentile(lengths, [0, 50, 99, 100]).round().astype(int).tolist()
    # longest_example: DPO chosen + rejected (a budget >= this); 'each': a whole conversation
    meta = dict(kind=kind, tokenizer=tok.name, template=tok.template_id, vocab_size=tok.vocab_size,
                bos_id=tok.bos_id, eos_id=tok.eos_id, dtype=np.dtype(writers["train"].dtype).name,
                max_len=max_len, overlong=overlong, truncated=status_counts["truncated"],
                skipped=status_counts["skipped"], counts=counts, length_min_median_p99_max=q,
                longest_example=stats["longest_example"],
                chat_template_kwargs=tok.chat_template_kwargs,
                escape_special_text=tok.escape_special_text, reasoning_turns=reasoning_turns,
                turn_examples=stats["turn_examples"], turn_examples_dropped=stats["turns_dropped"],
                reasoning_unwritten=unwritten, bad_records=bad.policy,
                bad_records_skipped=bad.count, bad_records_named=bad.named, **(extra_meta or {}))
    with open(os.path.join(out_dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    if verbose:
        print_summary(out_dir, meta, bad)
    return meta


def print_summary(out_dir, meta, bad):
    """What write_token_files wrote: sizes, lengths, what was cut, skipped or left untrained."""
    kind, counts, max_len = meta["kind"], meta["counts"], meta["max_len"]
    q, longest_example = meta["length_min_median_p99_max"], meta["longest_example"]
    turn_examples, turns_dropped = meta["turn_examples"], meta["turn_examples_dropped"]
    unwritten, reasoning_turns = meta["reasoning_unwritten"], meta["reasoning_turns"]
    unit = "pairs" if kind == "dpo" else "examples"
    sizes = [f"{s} {c['examples']:,} {unit} ({c['tokens']:,} tokens)" for s, c in counts.items()]
    print(f"wrote {out_dir}: {kind}, {', '.join(sizes)}")
    print("sequence length in tokens: min {:,} median {:,} p99 {:,} max {:,}".format(*q)
          + (f"; longest pair {longest_example:,}" if kind == "dpo" else ""))
    dropped = ""
    if turns_dropped:
        dropped = f" ({turns_dropped:,} turn examples cut to nothing trained, dropped)"
    print(f"longer than max_len={max_len}: {meta['truncated']:,} truncated{dropped}, "
          f"{meta['skipped']:,} skipped (--overlong {meta['overlong']})")
    if bad.count:
        print(f"bad records: {bad.count:,} skipped (--bad_records skip), "
              f"the first {len(bad.named)}:\n  " + "\n  ".join(bad.named))
    if unwritten:
        hint = ("; --reasoning_turns=each trains a turn whose reasoning only later turns leave out "
                "(Qwen3) as an example of its own" if reasoning_turns == "conversation" else "")
        print(f"note: {unwritten:,} trained assistant turns have reasoning their rendering leaves "
              f"out (the template's choice, as transformers renders it): that reasoning is not "
              f"trained{hint}")
    if reasoning_turns == "each":
        plural = "s" * (turn_examples != 1)
        print(f"reasoning_turns='each': {turn_examples:,} more example{plural}, each an assistant "
              f"turn the conversation renders without its reasoning, trained as the last turn of "
              f"the conversation up to it")
    if counts["val"]["examples"] == 0 and meta.get("val_fraction"):
        print("note: the val split is empty (raise --val_fraction for a small file)")


def absolute(path):
    """A path, a glob or a comma-separated list of them, each made absolute (meta.json's record of
    the source)."""
    return ",".join(os.path.abspath(p)
                    for p in ([path] if os.path.exists(path) else path.split(",")))


def prepare(input_path, out_dir, tokenizer="byte", max_len=4096, overlong="error",
            val_fraction=0.01,
            seed=1337, verbose=True, data_split=None, val_input=None, val_split=None,
            reasoning_turns="conversation",
            bad_records="error", kind=None, fields=None, **chat):
    """Records (see data_files) -> token files in out_dir; returns meta. tokenizer: a Tokenizer,
    "byte" or a folder. val_input: the val split's records, in place of val_fraction. bad_records:
    'error' or 'skip' (see BadRecords). kind: 'sft' or 'dpo', read where a record has both; fields:
    renames, 'theirs:ours,...' (parse_fields). chat: Tokenizer.configure_chat's settings."""
    if not 0 <= val_fraction < 1:
        raise DataError(f"val_fraction={val_fraction} must be in [0, 1): the share of records held "
                        "out for val")
    if val_split is not None and val_input is None:
        raise DataError(f"val_split={val_split!r} picks a split of val_input, and no val_input is "
                        "given")
    if reasoning_turns not in REASONING_TURNS:
        raise DataError(f"reasoning_turns={reasoning_turns!r}; choose one of "
                        f"{', '.join(REASONING_TURNS)}")
    bad, renames = BadRecords(bad_records), parse_fields(fields)
    tok = get_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    tok = copy.copy(tok).configure_chat(**chat) if chat else tok
    # before out_dir is touched: a wrong path writes nothing
    files = data_files(input_path, data_split)
    val_files = None if val_input is None else data_files(val_input, val_split, "val_split")
    if val_input is None:
        # one draw per record, so the split does not depend on max_len/overlong
        rng = random.Random(seed)
        items = ((where, "val" if rng.random() < val_fraction else "train", record)
                 for where, record in read_records(files, verbose, bad, renames))
    else:
        train, val = (read_records(f, verbose, bad, renames) for f in (files, val_files))
        items = itertools.chain(((where, "train", record) for where, record in train),
                                ((where, "val", record) for where, record in val))
    extra_meta = dict(source=absolute(input_path), data_split=data_split, seed=seed,
                      val_split=val_split,
                      val_source=absolute(val_input) if val_input is not None else None,
                      val_fraction=val_fraction if val_input is None else None, fields=renames
                      or None)
    return write_token_files(items, out_dir, tok, max_len, overlong, extra_meta, verbose,
                             reasoning_turns,
                             bad, kind)


def peek_kind(path, data_split=None, want=None, fields=None):
    """-> (kind, where): "sft" or "dpo" from the first record of `path` that parses (checked, not
    tokenized), and where it is; bad records before it are prepare's to report, and an input of bad
    records only is an error here. want, fields: prepare's kind and parsed fields."""
    bad = BadRecords()
    for where, record in read_records(data_files(path, data_split), verbose=False, bad=bad,
                                      fields=fields):
        try:
            return parse(record, where, want)[0], where
        except DataError as e:
            bad.add(e)
    if bad.count:
        bad.raise_error(path, usable=False)
    raise DataError(f"{path}: no examples found — is the file empty?")


def read_meta(data_dir):
    """A prepared folder's meta.json (kind, tokenizer, template, counts, ...): written last, so
    complete."""
    if not os.path.exists(os.path.join(data_dir, "meta.json")):
        raise FileNotFoundError(f"{data_dir}: no meta.json, so no complete prepared data here — "
                                "run python data/prepare.py --input <file.jsonl> --out_dir "
                                f"{data_dir}")
    with open(os.path.join(data_dir, "meta.json")) as f:
        return json.load(f)


def load(data_dir, split):
    """-> (data, meta): data = {"ids", "offsets", "loss_mask"} (and "units" where
    reasoning_turns='each' wrote them) as read-only memory maps, the dict packing.py takes."""
    meta = read_meta(data_dir)  # first: a folder without it is not complete
    names = (("ids", "ids"), ("offsets", "offsets"), ("loss_mask", "mask"), ("units", "units"))
    return {key: np.load(os.path.join(data_dir, f"{split}_{name}.npy"), mmap_mode="r")
            for key, name in names
            if key != "units"
            or os.path.exists(os.path.join(data_dir, f"{split}_{name}.npy"))}, meta


def template_kwargs(text):
    """--chat_template_kwargs: a JSON object, else a Python dict literal (the scripts' form)."""
    import ast
    for read in (json.loads, ast.literal_eval):
        try:
            if isinstance(value := read(text), dict):
                return value
        except (ValueError, SyntaxError):
            pass
    raise argparse.ArgumentTypeError(f"{text!r} is neither a JSON object ('{{\"enable_thinking\": "
                                     f"false}}') nor a Python dict (\"{{'enable_thinking': "
                                     f"False}}\")")


def resolve_names(args):
    """Hub names among --input, --val_input and --tokenizer -> their snapshot folders in the hub
    cache, downloaded as the scripts download them (a dataset's --data_split files only), a line
    printed for each."""
    from nanopack import hub
    keys = dict(data="input", data_split="data_split", val_data="val_input", val_split="val_split",
                tokenizer="tokenizer")
    values = {key: getattr(args, name) for key, name in keys.items()}
    folders, _ = hub.resolve(values)
    for key, value in folders.items():
        setattr(args, keys[key], value)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True,
                   help="a .jsonl, .json or .parquet file (.gz too), a folder of shards, "
                   "a quoted glob, files and globs separated by commas, or a hub dataset "
                   "(org/name[/config][@rev])")
    p.add_argument("--data_split", default=None,
                   help="the split to read from a folder holding several, e.g. "
                   "train_prefs")
    p.add_argument("--out_dir", required=True)
    p.add_argument("--tokenizer", default="byte",
                   help='"byte", a model folder with tokenizer.json/.model, or a hub '
                   'model (org/name[@revision])')
    p.add_argument("--max_len", type=int, default=4096, help="longest sequence, in tokens")
    p.add_argument("--overlong", choices=OVERLONG, default="error")
    p.add_argument("--bad_records", choices=BAD_RECORDS, default="error",
                   help="error: stop, naming the first bad "
                   "records and their count; skip: leave them out (counted, the first named)")
    p.add_argument("--kind", choices=("sft", "dpo"), default=None,
                   help="where a record has both 'messages' and "
                   "chosen/rejected (ultrafeedback_binarized), which to read; default: the pair")
    p.add_argument("--fields", default=None,
                   help="rename a record's fields to ours, their_field:our_field, "
                   "comma-separated (GSM8K: --fields=question:prompt)")
    p.add_argument("--val_fraction", type=float, default=0.01)
    p.add_argument("--val_input", default=None,
                   help="val records (as --input) instead of --val_fraction")
    p.add_argument("--val_split", default=None,
                   help="the split to read from a --val_input folder holding several")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--chat_template_kwargs", type=template_kwargs, default={},
                   help="template variables for every "
                   "record, as JSON '{\"enable_thinking\": false}' or a Python dict "
                   "\"{'enable_thinking': False}\"")
    p.add_argument("--reasoning_turns", choices=REASONING_TURNS, default="conversation",
                   help="each: a turn the "
                   "conversation renders without its reasoning is also an example of its own (SFT)")
    p.add_argument("--escape_special_text", action="store_true",
                   help="special-token text in messages that the "
                   "template does not parse stays plain text (untrusted data)")
    args = p.parse_args()
    resolve_names(args)
    try:
        prepare(args.input, args.out_dir, args.tokenizer, args.max_len, args.overlong,
                args.val_fraction,
                args.seed, data_split=args.data_split, val_input=args.val_input,
                val_split=args.val_split,
                reasoning_turns=args.reasoning_turns, bad_records=args.bad_records, kind=args.kind,
                fields=args.fields,
                chat_template_kwargs=args.chat_template_kwargs,
                escape_special_text=args.escape_special_text)
    except (ValueError, OSError) as e:
        # DataError, a missing file, an unsupported tokenizer: one line
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
