"""
nanoGPT-style configuration: a script keeps its config as plain globals at the top, then calls
`config = configure(globals(), machinery=keys, rules=...)`, which applies every config/*.py file
named on the command line, then every --key=value. Only keys the script defines, or the machinery
module (nanopack/keys.py) declares, can be set, each with the type of its default (None or 'auto':
any type), and each value must pass the script's rules: a tuple of choices, or an interval such as
"[1, inf)" (its ends may name other keys: "[0, learning_rate]"). --help prints the config block
with its comments, then the machinery's: it is the documentation.
init_from='resume' takes the run's saved config; FIXED_ON_RESUME keys cannot change.
"""
import ast
import json
import math
import os
import re
import sys

from nanopack.checkpoint import load_checkpoint
from nanopack import hub
from nanopack.parallel import fail, is_master

FIXED_ON_RESUME = ("data", "data_split", "val_data", "val_split", "preset", "tokenizer",
                   "batch_size", "seed", "max_len", "overlong", "val_fraction", "lora_rank",
                   "lora_alpha", "lora_dropout", "lora_targets", "quantize_base",
                   "chat_template_kwargs", "reasoning_turns", "bad_records",
                   "fields")
DATA_SUFFIXES = (".jsonl", ".json", ".gz", ".parquet", ".csv", ".txt")


class ConfigError(ValueError):
    pass


def _check(config, key, value, text, where):
    if key not in config:
        close = [k for k in config if k.split("_")[0] == key.split("_")[0]][:5]
        hint = f" (similar: {', '.join(close)})" if close else ""
        raise ConfigError(f"{where}: unknown config key {key!r}{hint}; the keys are the globals "
                          f"at the top of the script and those of nanopack/keys.py (--help lists "
                          f"them)")
    default = config[key]
    if default in (None, "auto"):
        # None and 'auto' defaults take values of other types too; the rules check them
        return value
    if isinstance(default, str) and text is not None:
        return text  # a string key takes the text as written: --wandb_run_name=123
    if isinstance(default, dict) and isinstance(value, str) and text is not None:
        value = parse_dict(text, key, where)
    # True is an int to Python, not a batch size
    same_kind = isinstance(value, bool) == isinstance(default, bool)
    if same_kind and isinstance(value, type(default)):
        return value
    if same_kind and isinstance(default, float) and isinstance(value, int):
        return float(value)
    raise ConfigError(f"{where}: {key}={value!r} is of type {type(value).__name__}, "
                      f"but {key} must be of type {type(default).__name__} (default {default!r})")


def parse_dict(text, key, where):
    """A dict as a Python literal ({'enable_thinking': False}) or as JSON
    ({"enable_thinking": false})."""
    try:
        return json.loads(text)
    except ValueError:
        raise ConfigError(f"{where}: {key}={text!r} is neither a Python dict "
                          f"({{'enable_thinking': False}}) nor JSON "
                          f"({{\"enable_thinking\": false}})") from None


def _parse(text):
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare word is a string: --init_from=resume


def configure(script, argv=None, finetune=None, rules=None, presets=None, read_by=None,
              machinery=None):
    """Update `script` (a script's globals()) in place from argv (and a resumed run's saved config)
    -> the checked values, the machinery module's keys among them. finetune: values for keys argv
    does not set when starting from a pretrained model; presets: {key: {value: {key: default}}},
    the defaults a key's value names (train_rl.py's loss) for keys argv does not set."""
    # read_by: {key: (other key, its values that read key (None: any but None), a hint)}: key set
    # with another, an error
    argv = sys.argv[1:] if argv is None else argv
    # the script's own keys first; a key the script declares wins over the machinery's
    config = dict(script, **{k: v for k, v in declared(machinery).items() if k not in script})
    if {"-h", "--help"} & set(argv):
        print_help(config, presets, machinery)
        raise SystemExit(0)
    values = read_values(config, argv, finetune, rules, presets, read_by)
    # the script reads its own keys as globals, the machinery's from the values
    script.update((k, v) for k, v in values.items() if k in script)
    return values


def declared(module):
    """The config keys a module (nanopack/keys.py) declares, with their defaults."""
    return {k: v for k, v in vars(module).items() if is_key(k, v)} if module else {}


def read_values(config, argv, finetune, rules, presets, read_by):
    """Update `config` in place from argv and a resumed run -> the checked values."""
    given = set()  # keys set by argv: a config file or --key=value
    try:
        values, reads = apply_overrides(config, argv, given), None
        if values.get("init_from") == "resume":
            values, reads = restore_saved(config, values, given)
        # hub names -> their local snapshot folders; the commits recorded
        folders, pins = hub.resolve(values, reads)
        if folders:  # as given: the same command, with --init_from=resume, continues the run
            values["hub_names"] = {k: values[k] for k in folders}
        values.update(folders)
        config.update(folders)
        if pins:
            values["hub"] = pins
        if values.get("init_from") != "resume":
            for key, table in (presets or {}).items():
                set_defaults(config, values, given, table.get(values[key], {}))
            chosen = set_defaults(config, values, given, finetune) if finetune and pretrained(
                values.get("init_from", "")) else {}
            if chosen and is_master():
                shown = ', '.join(f'{k}={v}' for k, v in chosen.items())
                print(f"fine-tuning a pretrained model: {shown} "
                      f"(defaults for real models; set them to change)", flush=True)
        for key, rule in (rules or {}).items():
            if key in values:  # shared rules (keys.RULES) name keys some scripts lack
                check_rule(values, key, rule)
        check_read(values, given, read_by or {})
    except ConfigError as e:
        fail(f"config error: {e}")
    except SystemExit as e:  # a damaged ckpt.pt: its one line
        fail(e.code)
    return values


def set_defaults(config, values, given, defaults):
    """Keys argv did not set take `defaults` -> those taken."""
    chosen = {k: v for k, v in defaults.items() if k not in given}
    for key, value in chosen.items():
        values[key] = config[key] = value
    return chosen


def check_read(values, given, read_by):
    """A key set explicitly that the run does not read changes nothing: the user meant something."""
    for key, (other, readers, hint) in read_by.items():
        # readers None: any value of other (of any of a tuple of others) but None
        others = other if isinstance(other, tuple) else (other,)
        if key in given and readers is None and all(values[o] is None for o in others):
            raise ConfigError(f"{key}={values[key]!r} does nothing without {' or '.join(others)}: "
                              f"{hint}; set {others[0]}, or drop {key}")
        if key in given and readers is not None and values[other] not in readers:
            names = ", ".join(map(repr, readers[:-1])) + " or " * (len(readers) > 1)
            hint = f" ({hint})" if hint else ""
            raise ConfigError(f"{key}={values[key]!r} does nothing with {other}={values[other]!r}: "
                              f"only {other} {names}{readers[-1]!r} reads it{hint}; drop {key}, or "
                              f"choose such a {other}")


def check_rule(c, key, rule):
    value = c[key]
    if value is None:  # only a key whose default is None can hold it
        return
    if isinstance(rule, tuple):
        if value not in rule:
            why = ("; float16 needs loss scaling that nanopack does not do: bfloat16 has "
                   "float32's range") * (value in ("float16", "fp16", "half"))
            raise ConfigError(f"{key}={value!r}; choose one of {', '.join(map(str, rule))}{why}")
        return
    left, low, high, right = re.fullmatch(r"([\[(])(.+), (.+)([\])])", rule).groups()
    # our own rules only
    lo, hi = (eval(end, {"__builtins__": {}}, dict(c, inf=math.inf)) for end in (low, high))
    if ((value >= lo if left == "[" else value > lo)
            and (value <= hi if right == "]" else value < hi)):
        return
    if hi == math.inf:
        need = f"at least {lo}" if left == "[" else f"a finite number greater than {lo}"
    else:
        need = f"in {left}{low}, {high}{right}" + (f" ({high}={hi})" if high in c else "")
    raise ConfigError(f"{key}={value!r}; it must be {need}")


def print_help(config, presets=None, machinery=None):
    """The script's config block as written, each key with its value now, then the machinery's
    block, then the presets' values."""
    path = config.get("__file__", sys.argv[0])
    print(f"{os.path.basename(path)}: set a key with --key=value, or in a config file named "
          f"before them. The keys:")
    print_block(path, config)
    if machinery:
        where = machinery.__name__.replace(".", "/") + ".py"
        print(f"The machinery keys, the same in every training script ({where}):")
        print_block(machinery.__file__, config)
    for key, table in (presets or {}).items():
        print(f"Presets of --{key} (a key set explicitly wins):")
        for value, defaults in table.items():
            print(f"    {value}: " + " ".join(f"--{k}={v!r}" for k, v in defaults.items()))


def print_block(path, config):
    """The file at `path` from the comments above its first key to its last key: each key with
    its value in `config` and its comment, and the comment lines between."""
    lines = open(path).read().splitlines()
    # sample.py keeps its keys under __main__
    stmts = [stmt for node in ast.parse("\n".join(lines)).body
             for stmt in (node.body if isinstance(node, ast.If) else [node])]
    # the block ends at `config = configure(...)`: a key reassigned below it is the run's, not a key
    end = min([s.lineno for s in stmts if isinstance(s, ast.Assign) and "configure(" in
               ast.get_source_segment("\n".join(lines), s.value)] or [len(lines) + 1])
    keys = {stmt.lineno: stmt.targets[0].id for stmt in stmts if stmt.lineno < end
            and isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name)
            and stmt.targets[0].id in config
            and is_key(stmt.targets[0].id, config[stmt.targets[0].id])}
    first = min(keys)
    while lines[first - 2].strip().startswith("#"):  # the comments above the first key
        first -= 1
    for n in range(first, max(keys) + 1):
        line = lines[n - 1]
        if n in keys:
            comment = line[line.find('#'):] if '#' in line else ''
            print(f"  --{keys[n]}={config[keys[n]]!r}  {comment}".rstrip())
        elif line.strip().startswith("#") and "-----" not in line:
            print(f"  {line.strip()}")


def pretrained(init_from):
    """A model folder with its own tokenizer files, not an export of our byte-level toy runs."""
    return any(os.path.exists(os.path.join(init_from, f))
               for f in ("tokenizer.json", "tokenizer.model"))


def restore_saved(config, values, given):
    path = os.path.join(values["out_dir"], "ckpt.pt")
    if not os.path.exists(path):
        raise ConfigError(f"init_from='resume' but {path} does not exist; run without "
                          f"init_from='resume' first, or point out_dir at the run to continue")
    ckpt = load_checkpoint(path)
    check_same_script(ckpt, os.path.basename(config.get("__file__") or ""), values["out_dir"])
    saved = ckpt["config"]
    pins, names = saved.get("hub") or {}, saved.get("hub_names") or {}
    for key, old in saved.items():
        # where the run is now, and that it resumes
        if key not in values or key in ("init_from", "out_dir"):
            continue
        new = values[key]
        if key not in given or new == old or hub.recorded_as(new, pins.get(key), names.get(key)):
            values[key] = config[key] = old
        elif key in FIXED_ON_RESUME:
            # a hub name: as the run recorded it, not its cache folder
            old = (saved.get("hub") or {}).get(key, old)
            raise ConfigError(f"{key}={new!r} differs from the run being resumed ({key}={old!r}), "
                              f"and {key} cannot change on resume; drop --{key}, or start a new "
                              f"run in another out_dir")
        elif is_master():
            print(f"resume: overriding {key} {old!r} -> {new!r}", flush=True)
    if pins:  # the commits the run read: it reads them again
        values["hub"], values["hub_names"] = pins, names
    return values, resume_reads(ckpt)


def resume_reads(ckpt):
    """What a resumed run reads of the repos its config names, besides config and tokenizer files: a
    base model's weights only for LoRA's frozen base or a live reference model (a full fine-tune
    resumes from its DCP checkpoint); data only without a prepared copy in out_dir (RL's
    prompts)."""
    c = ckpt["config"]
    live = c.get("reference") == "live" or c.get("kl_coef") or c.get("loss") == "online_dpo"
    data_dir = ckpt.get("data_dir")
    data = not data_dir or os.path.isabs(data_dir)
    return dict(weights=bool(c.get("lora_rank") or live), data=data)


def check_same_script(ckpt, script, out_dir):
    """A run is resumed by the script that made it: another would train its own objective from the
    checkpoint and replace the run's files with its own."""
    saved = ckpt["config"]
    # a ckpt.pt of an older nanopack did not record its script: its config's keys tell
    made_by = ckpt.get("script") or ("train_rl.py" if "reward" in saved else
                                     "train_dpo.py" if "loss_type" in saved else "train_sft.py")
    if script.startswith("train_") and script != made_by:
        hf = os.path.join(out_dir, "hf")
        raise ConfigError(f"{out_dir} holds a {made_by} run; resume it with {made_by}, or start "
                          f"{script} from {hf} (--init_from={hf}, in another --out_dir)")


def is_key(name, value):
    """A config key: a global of the script of a plain type; a _private or CONSTANT name is none."""
    return (not (name.startswith("_") or name.isupper())
            and isinstance(value, (int, float, bool, str, dict, type(None))))


def apply_overrides(config, argv, given=None):
    given = set() if given is None else given
    keys = {k: v for k, v in config.items() if is_key(k, v)}
    for arg in argv:
        if arg.startswith("--"):
            if "=" not in arg:
                raise ConfigError(f"argument {arg!r}: write --key=value")
            key, text = arg[2:].split("=", 1)
            value = _check(keys, key, _parse(text), text, f"argument {arg!r}")
        elif not (arg.endswith(".py") and os.path.isfile(arg)):
            data = arg.endswith(DATA_SUFFIXES) or os.path.isdir(arg)
            raise ConfigError(f"argument {arg!r}: " + (
                f"a config file is a .py file that exists; is it data? pass --data={arg}" if data
                else "no such config file (a .py file), and not --key=value"))
        else:  # a config file: plain Python assignments
            scope = {}
            exec(compile(open(arg).read(), arg, "exec"), {}, scope)
            for key, value in scope.items():
                if not (key.startswith("_") or callable(value) or type(value).__name__ == "module"):
                    keys[key] = config[key] = _check(keys, key, value, None, f"config file {arg}")
                    given.add(key)
            continue
        keys[key] = config[key] = value
        given.add(key)
    return keys
