"""`plait train`'s command line and config file: flags and ``--config FILE`` to a checked
`TrainConfig`, and a config back to TOML."""

from __future__ import annotations

import dataclasses
import json
import sys

import tyro

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser, before it joined the standard library
    import tomli as tomllib

from plait.app.config.sections import (
    FIELD_FLAGS,
    SECTIONS,
    CheckpointSection,
    DataSection,
    ModelSection,
    OptimizerSection,
    ParallelSection,
    RunSection,
)
from plait.app.config.train_config import TrainConfig


class ConfigFileError(ValueError):
    """A config file that cannot be read, or holds a section or key `plait train` does not know."""


def _config_file_args(path: str) -> list[str]:
    """A TOML config file as the flags it stands for, so one parser checks both the same way."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as e:
        raise ConfigFileError(f"--config {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigFileError(f"--config {path}: not valid TOML: {e}") from None
    flags = FIELD_FLAGS
    args: list[str] = []
    for section, table in doc.items():
        if section not in SECTIONS:
            raise ConfigFileError(f"--config {path}: unknown section [{section}]; the sections are "
                                  f"{', '.join(f'[{s}]' for s in SECTIONS)}")
        if not isinstance(table, dict):
            raise ConfigFileError(f"--config {path}: {section} must be a [{section}] table, got "
                                  f"{type(table).__name__} {table!r}")
        keys = {f.name for f in dataclasses.fields(SECTIONS[section])}
        for key, value in table.items():
            if key not in keys:
                raise ConfigFileError(f"--config {path}: [{section}] has no option {key!r}; it has "
                                      f"{', '.join(sorted(keys))}")
            flag = "--" + flags[(section, key)].replace("_", "-")
            if isinstance(value, bool):
                args.append(flag if value else "--no-" + flag[2:])
            elif isinstance(value, (int, float, str)):
                args += [flag, str(value)]
            else:
                raise ConfigFileError(f"--config {path}: [{section}] {key} = {value!r}: expected a "
                                      "number, a string or a boolean")
    return args


def _config_path(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ConfigFileError("--config needs a path: --config run.toml")
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def _command(model: ModelSection, parallel: ParallelSection, optimizer: OptimizerSection,
             data: DataSection, checkpoint: CheckpointSection, run: RunSection, config: str | None = None,
             print_config: bool = False) -> tuple[TrainConfig, bool]:
    """Train plait's GPT on a byte-level corpus under any layout.

    Args:
        config: a TOML file of these options, one table per section; flags given here override it
        print_config: print the whole configuration as TOML (what --config reads) and exit
    """
    # A function, not the dataclass, is what tyro calls: the ValueError a bad combination raises
    # reaches parse_args, which reports it as one line naming the flag.
    return TrainConfig(model, parallel, optimizer, data, checkpoint, run), print_config


def parse_args(argv: list[str]) -> TrainConfig:
    """``plait train``'s flags (and ``--config FILE``) as a checked `TrainConfig`; exits 2 on bad input
    with one line naming the flag and what it allows. ``--print-config`` prints it and exits 0."""
    try:
        path = _config_path(argv)
        file_args = _config_file_args(path) if path is not None else []
        # The file's options come first, so the same flag given on the command line wins.
        cfg, show = tyro.cli(_command, args=_resume_valued([*file_args, *argv]), prog="plait train",
                             config=(tyro.conf.OmitArgPrefixes,))
    except ValueError as e:
        print(f"plait train: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if show:
        print(to_toml(cfg), end="")
        raise SystemExit(0)
    return cfg


_RESUME_VALUES = {"auto": "auto", "true": "True", "false": "False"}


def _resume_valued(args: list[str]) -> list[str]:
    """``--resume`` is a switch that may take one value: alone it means True (a checkpoint must
    exist), ``--resume auto`` resumes if there is one; ``--no-resume`` is False. The parser sees
    each as ``--resume VALUE``."""
    out: list[str] = []
    for i, arg in enumerate(args):
        if arg == "--no-resume":
            out += ["--resume", "False"]
        elif arg.startswith("--resume="):
            out += ["--resume", _RESUME_VALUES.get(arg.split("=", 1)[1].lower(), arg.split("=", 1)[1])]
        elif arg == "--resume":
            following = args[i + 1].lower() if i + 1 < len(args) else ""
            out.append("--resume")
            if following not in _RESUME_VALUES:
                out.append("True")
        elif i and args[i - 1] == "--resume" and arg.lower() in _RESUME_VALUES:
            out.append(_RESUME_VALUES[arg.lower()])
        else:
            out.append(arg)
    return out


def given_flags(argv: list[str]) -> set[str]:
    """The options set explicitly, on the command line or in its ``--config`` file (underscored names)."""
    path = _config_path(argv)
    words = [*(_config_file_args(path) if path is not None else []), *argv]
    given = {w[2:].split("=", 1)[0].replace("-", "_") for w in words if w.startswith("--")}
    return given | {name[3:] for name in given if name.startswith("no_")}


def to_toml(cfg: TrainConfig) -> str:
    """The configuration as a TOML file that ``--config`` reads back to the same config (options
    left unset, such as the default ``seq_len``, are omitted: TOML has no null)."""
    lines: list[str] = []
    for section in SECTIONS:
        lines.append(f"[{section}]")
        for f in dataclasses.fields(getattr(cfg, section)):
            value = getattr(getattr(cfg, section), f.name)
            if value is None:
                continue
            # JSON's strings, numbers and booleans are TOML's too (finite floats: the config refuses others).
            lines.append(f"{f.name} = {json.dumps(value)}")
        lines.append("")
    return "\n".join(lines)
