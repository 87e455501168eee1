"""
nanoGPT-style configuration: a training script keeps its config as plain globals at the top, then calls

    config = configure(globals())

which applies, in order, every config/*.py file named on the command line and every --key=value.
Only keys the script already defines can be set, and each value must have the type of the script's default
(an int is accepted where a float is expected; a default of None accepts any value). Anything else is one
clear error naming the file or argument, the key and the value.
"""

import ast
import sys


class ConfigError(ValueError):
    pass


def _check(config, key, value, where):
    if key not in config:
        close = [k for k in config if k.split("_")[0] == key.split("_")[0]][:5]
        hint = f" (similar: {', '.join(close)})" if close else ""
        raise ConfigError(f"{where}: unknown config key {key!r}{hint}; the keys are the globals at the top of the script")
    default = config[key]
    if default is None or value is None or isinstance(value, type(default)):
        return value
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    raise ConfigError(f"{where}: {key}={value!r} is of type {type(value).__name__}, "
                      f"but {key} must be of type {type(default).__name__} (default {default!r})")


def _parse(text):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare word is a string: --init_from=resume


def configure(config, argv=None):
    """Update the dict `config` (a script's globals()) in place from argv; returns the plain config values.
    A mistake ends the program with its one-line message (no traceback)."""
    try:
        return apply_overrides(config, sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}") from None


def apply_overrides(config, argv):
    keys = {k: v for k, v in config.items()
            if not k.startswith("_") and isinstance(v, (int, float, bool, str, type(None)))}
    for arg in argv:
        if arg.startswith("--"):
            if "=" not in arg:
                raise ConfigError(f"argument {arg!r}: write --key=value")
            key, text = arg[2:].split("=", 1)
            value = _check(keys, key, _parse(text), f"argument {arg!r}")
            keys[key] = config[key] = value
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
    return keys
