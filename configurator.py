"""
nanoGPT-style configuration: a training script keeps its config as plain globals at the top, then calls

    config = configure(globals())

which applies, in order, every config/*.py file named on the command line and every --key=value.
Only keys the script already defines can be set, and each value must have the type of the script's default
(an int is accepted where a float is expected; a default of None or 'auto' accepts any value). Anything else is one
clear error naming the file or argument, the key and the value.

With `finetune` values, a run that starts from a pretrained model (init_from a folder that ships its own tokenizer,
as real checkpoints do; not one of our toy runs' exports) uses them for the keys argv does not set, and says so:
toy learning rates destroy a real model.

With init_from='resume' the run continues with the config saved in out_dir/ckpt.pt: keys not given again keep
the run's values, keys given with another value are printed ("overriding learning_rate 1e-05 -> 2e-05"), and
keys that fix what the run trains on (FIXED_ON_RESUME) cannot change.
"""

import ast
import os
import sys

import torch

FIXED_ON_RESUME = ("data", "preset", "tokenizer", "batch_size", "seed", "max_len", "overlong", "val_fraction")


class ConfigError(ValueError):
    pass


def _check(config, key, value, where):
    if key not in config:
        close = [k for k in config if k.split("_")[0] == key.split("_")[0]][:5]
        hint = f" (similar: {', '.join(close)})" if close else ""
        raise ConfigError(f"{where}: unknown config key {key!r}{hint}; the keys are the globals at the top of the script")
    default = config[key]
    if default in (None, "auto"):
        return value  # None and 'auto' defaults take values of other types too; the script checks them
    same_kind = isinstance(value, bool) == isinstance(default, bool)  # True is an int to Python, not a batch size
    if same_kind and isinstance(value, type(default)):
        return value
    if same_kind and isinstance(default, float) and isinstance(value, int):
        return float(value)
    raise ConfigError(f"{where}: {key}={value!r} is of type {type(value).__name__}, "
                      f"but {key} must be of type {type(default).__name__} (default {default!r})")


def _parse(text):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare word is a string: --init_from=resume


def configure(config, argv=None, finetune=None):
    """Update the dict `config` (a script's globals()) in place from argv, and from the saved config of the run
    being resumed; returns the plain config values. A mistake ends the program with its one-line message."""
    given = set()  # keys set by argv: a config file or --key=value
    try:
        values = apply_overrides(config, sys.argv[1:] if argv is None else argv, given)
        if values.get("init_from") == "resume":
            values = restore_saved(config, values, given)
        elif finetune and pretrained(values.get("init_from", "")):
            chosen = {k: v for k, v in finetune.items() if k not in given}
            for key, value in chosen.items():
                values[key] = config[key] = value
            if chosen and int(os.environ.get("RANK", 0)) == 0:
                print(f"fine-tuning a pretrained model: {', '.join(f'{k}={v}' for k, v in chosen.items())} "
                      f"(defaults for real models; set them to change)", flush=True)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}") from None
    return values


def pretrained(init_from):
    """A model folder with its own tokenizer files: a real checkpoint, not an export of our byte-level toy runs."""
    return any(os.path.exists(os.path.join(init_from, f)) for f in ("tokenizer.json", "tokenizer.model"))


def restore_saved(config, values, given):
    path = os.path.join(values["out_dir"], "ckpt.pt")
    if not os.path.exists(path):
        raise ConfigError(f"init_from='resume' but {path} does not exist; run without init_from='resume' first, "
                          f"or point out_dir at the run to continue")
    saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)["config"]  # mmap: reads only this
    for key, old in saved.items():
        if key not in values or key in ("init_from", "out_dir"):  # where the run is now, and that it resumes
            continue
        new = values[key]
        if key not in given or new == old:
            values[key] = config[key] = old
        elif key in FIXED_ON_RESUME:
            raise ConfigError(f"{key}={new!r} differs from the run being resumed ({key}={old!r}), and {key} cannot "
                              f"change on resume; drop --{key}, or start a new run in another out_dir")
        elif int(os.environ.get("RANK", 0)) == 0:
            print(f"resume: overriding {key} {old!r} -> {new!r}", flush=True)
    return values


def apply_overrides(config, argv, given=None):
    given = set() if given is None else given
    keys = {k: v for k, v in config.items()
            if not k.startswith("_") and isinstance(v, (int, float, bool, str, type(None)))}
    for arg in argv:
        if arg.startswith("--"):
            if "=" not in arg:
                raise ConfigError(f"argument {arg!r}: write --key=value")
            key, text = arg[2:].split("=", 1)
            value = _check(keys, key, _parse(text), f"argument {arg!r}")
            keys[key] = config[key] = value
            given.add(key)
        else:  # a config file: plain Python assignments
            try:
                with open(arg) as f:
                    source = f.read()
            except OSError as e:
                raise ConfigError(f"config file {arg!r} cannot be read: {e.strerror}") from None
            scope = {}
            exec(compile(source, arg, "exec"), {}, scope)
            for key, value in scope.items():
                if key.startswith("_") or callable(value) or type(value).__name__ == "module":
                    continue
                value = _check(keys, key, value, f"config file {arg}")
                keys[key] = config[key] = value
                given.add(key)
    return keys
