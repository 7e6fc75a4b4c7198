"""The ``prefixserve serve`` options: the parser's arguments (the positional model, ``--config``,
``--detach`` and the flag table of ``cluster/cli_flags.py`` in its help groups), the
``--config`` YAML file, and the builder's args from the parsed flags (``args_from_namespace``).

A flag left out stays None here, so the dataclass default applies when the configs are built;
a flag on the command line wins over the same key in the ``--config`` file. Failures are
``ValueError``s naming what is wrong (the file and the key, or the positional model that
disagrees with ``--model``), which ``prefixserve serve`` reports with exit status 2 before it
touches Ray.
"""

from __future__ import annotations

import argparse
import json
import os

from cluster.cli_flags import FLAGS, GROUPS, LIST, MODULES, field_default, flag_rows
from cluster.config import API_KEY_ENV


def _help(section: str, field: str, kind, help_text: str) -> str:
    default = field_default(section, field)
    if default is None or default in ((), ""):
        return help_text  # the text says what unset means
    if kind is None:
        shown = "on" if default else "off"
    elif kind in (LIST, MODULES):
        shown = ",".join(map(str, default))
    else:
        shown = str(default)
    text = help_text[:-1] if help_text.endswith(".") else help_text
    return f"{text} (default: {shown}).".replace("%", "%%")


def _list_arg(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def lora_module(value) -> list[str]:
    """One ``--lora-modules`` value as ``[name, path]``: ``name=path``, vLLM's JSON
    ``{"name": ..., "path": ...}`` (as text or, from a config file, a mapping) or a pair;
    ``ValueError`` saying which forms are accepted."""
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--lora-modules: {value!r} is not valid JSON ({exc.msg})") from None
    if isinstance(value, dict):
        name, path = value.get("name"), value.get("path")
    elif isinstance(value, str):
        name, sep, path = value.partition("=")
        if not sep:
            name = None
    elif isinstance(value, (list, tuple)) and len(value) == 2:
        name, path = value
    else:
        name = path = None
    if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
        raise ValueError(
            f'--lora-modules: {value!r} is neither name=path nor {{"name": "...", "path": "..."}}'
        )
    return [name.strip(), path.strip()]


def _lora_module_arg(text: str) -> list[str]:
    try:
        return lora_module(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--lora-modules: ")) from None


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Every argument of ``prefixserve serve`` on ``parser``, the table's flags in their help
    groups, each with its dataclass default appended to its help."""
    parser.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL", help="The model (same as --model)."
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="YAML file of flags (keys as the flags without '--', dashes or underscores); "
        "flags on the command line win.",
    )
    parser.add_argument(
        "--detach",
        action="store_true",
        help="With --address: deploy, wait until the API answers, print its URL and exit 0, "
        "leaving the app serving (stop it with 'serve delete' or 'serve shutdown').",
    )
    groups = {key: parser.add_argument_group(title) for key, title in GROUPS.items()}
    for flag, section, field, kind, help_text, group in flag_rows():
        text = _help(section, field, kind, help_text)
        if kind is None:
            groups[group].add_argument(
                flag, dest=field, action=argparse.BooleanOptionalAction, default=None, help=text
            )
        elif kind == LIST:
            groups[group].add_argument(
                flag, dest=field, type=_list_arg, action="extend", default=None, help=text
            )
        elif kind == MODULES:
            groups[group].add_argument(
                flag,
                dest=field,
                type=_lora_module_arg,
                nargs="+",
                action="extend",
                default=None,
                metavar="NAME=PATH",
                help=text,
            )
        else:
            groups[group].add_argument(flag, dest=field, type=kind, default=None, help=text)


def _coerce(key: str, kind, value):
    """A config file's value in the flag's type; ValueError naming the key."""
    if kind is None:
        ok = isinstance(value, bool)
    elif kind == MODULES:
        items = list(value.items()) if isinstance(value, dict) else value
        items = [items] if isinstance(items, str) else items
        if not isinstance(items, list):
            raise ValueError(f"{key}: expected a list of name=path, got {value!r}")
        return [lora_module(item) for item in items]
    elif kind == LIST:
        if isinstance(value, str):
            value = _list_arg(value)
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    elif kind is str:
        ok = isinstance(value, str)
    elif isinstance(value, str):
        try:
            value, ok = kind(value), True
        except ValueError:
            ok = False
    else:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = ok and (kind is float or isinstance(value, int))
    if not ok:
        raise ValueError(
            f"{key}: expected {getattr(kind, '__name__', kind or 'bool')}, got {value!r}"
        )
    return float(value) if kind is float else value


def config_file_values(path: str) -> dict:
    """``{dest: value}`` from a YAML file of flags (``max-num-seqs: 8`` or ``max_num_seqs: 8``);
    ValueError naming the file and the key for an unknown key or a wrong type."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--config {path}: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: must be a mapping of flags to values")
    rows = {}
    for row in flag_rows():
        rows[row[0][2:].replace("-", "_")] = row
        rows[row[2]] = row
    values = {}
    for key, value in data.items():
        row = rows.get(str(key).replace("-", "_"))
        if row is None:
            raise ValueError(
                f"--config {path}: unknown key {key!r} (keys are the flags without '--')"
            )
        if value is not None:
            try:
                values[row[2]] = _coerce(str(key), row[3], value)
            except ValueError as exc:
                raise ValueError(f"--config {path}: {exc}") from None
    return values


def merge_command_line(ns: argparse.Namespace) -> argparse.Namespace:
    """The positional model and the ``--config`` file folded into the flags: a flag given on
    the command line wins over the file; a positional model that disagrees with --model is a
    ValueError."""
    ns = argparse.Namespace(**vars(ns))
    tag = getattr(ns, "model_tag", None)
    if tag is not None:
        if ns.model is not None and ns.model != tag:
            raise ValueError(f"the positional model {tag!r} disagrees with --model {ns.model!r}")
        ns.model = tag
    if getattr(ns, "config", None):
        for dest, value in config_file_values(ns.config).items():
            if getattr(ns, dest, None) is None:
                setattr(ns, dest, value)
    return ns


def args_from_namespace(ns: argparse.Namespace) -> dict:
    """The builder's args (``{"engine", "cluster", "router"}``) from the flags that were given."""
    ns = merge_command_line(ns)
    args: dict = {"engine": {}, "cluster": {}, "router": {}}
    for _, section, field, *_ in FLAGS:
        value = getattr(ns, field, None)
        if value is not None:
            args[section][field] = value
    if "api_key" not in args["cluster"] and os.environ.get(API_KEY_ENV):
        args["cluster"]["api_key"] = os.environ[API_KEY_ENV]
    if "redis_url" in args["router"]:
        args["router"]["index_backend"] = "redis"
    return args
