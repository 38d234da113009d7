"""The ``tapas`` command line (an absl app): one module per command, each defining its own
flags (``tapas.cli.common`` those several commands read).

    tapas inspect --model=NAME [--batch_size=N] [--graph_out=ir.json] [--top=10]
    tapas mine    --model=NAME [--min_size=N] [--min_support=K] [--draw=folded.png]
    tapas models
    tapas profile --devices=N [--sizes=1KiB:16MiB] [--repeats=7] --out=cluster.json
                  [--plot=residuals.png] [--nogamma]
    tapas search  --model=NAME --nodes=M --devices_per_node=N [--mode=gp|es] [--out=s.json]
                  [--cluster=file.json [--compute_scale=measure] [--kernel_times=measure]
                  [--communication_scale=measure] [--elementwise_scale=measure]]
                  [--meshes | --mesh=ROWSxCOLS]
                  [--draw=strategy.png]
    tapas train   --model=NAME --devices=N --steps=K [--strategy=s.json|random:SEED] [--verify]
                  [--workers=K [--devices_per_worker=D] [--elastic [--elastic_wait_s=S]]] [--optimizer=NAME|config.json]
                  [--learning_rate=LR]
                  [--data=file.npz|file.tfrecord] [--epochs=E] [--checkpoint_dir=DIR]
                  [--checkpoint_every=K] [--resume] [--tensorboard=LOGDIR] [--mesh=ROWSxCOLS]
    tapas export  --model=NAME --nodes=M --devices_per_node=N [--strategy=s.json]
                  [--mesh=ROWSxCOLS] --format=keras-layoutmap --out=layout.json|layout.py
                  [--pin_from=edited.json]

``--model`` takes a model-zoo name (``tapas models`` lists them) or the path of a saved
Keras model (``.keras``). Each command prints a report to stdout; ``--json_out`` writes the
same numbers as JSON. ``tapas COMMAND --help`` lists that command's flags with their help;
``tapas --help`` lists the commands.

In:  the command line (``sys.argv``).
Out: the command's report on stdout (and ``--json_out``); help on stdout, exit 0.
Raises: ``absl.app.UsageError`` (exit 1, the message on stderr) for an unknown command or a
     bad flag; a failed run prints ``tapas COMMAND: <why>`` and exits 1.
"""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

from absl import app

from tapas.cli import (export_cmd, inspect_cmd, mine_cmd, models_cmd, profile_cmd,
                       search_cmd, train_cmd)
from tapas.cli.common import FLAGS, LoadedModel, load_model, write
from tapas.cli.export_cmd import cmd_export
from tapas.cli.inspect_cmd import cmd_inspect, format_inspect, inspect_report
from tapas.cli.mine_cmd import cmd_mine
from tapas.cli.models_cmd import cmd_models
from tapas.cli.profile_cmd import cmd_profile
from tapas.cli.search_cmd import SearchProgress, cmd_search
from tapas.cli.train_cmd import cmd_train

__all__ = ["run", "main", "COMMANDS", "FLAGS", "LoadedModel", "load_model", "inspect_report",
           "format_inspect", "SearchProgress", "command_help", "overview", "cmd_inspect",
           "cmd_mine", "cmd_models", "cmd_profile", "cmd_search", "cmd_train", "cmd_export"]

_MODULES = {"inspect": inspect_cmd, "mine": mine_cmd, "models": models_cmd,
            "search": search_cmd, "train": train_cmd, "profile": profile_cmd,
            "export": export_cmd}
COMMANDS = tuple(_MODULES)
_HANDLERS = {"inspect": cmd_inspect, "mine": cmd_mine, "models": cmd_models,
             "search": cmd_search, "train": cmd_train, "profile": cmd_profile,
             "export": cmd_export}
# `train` writes its own report (worker 0 only, when it runs as several workers: the
# others' audits record nothing and must not overwrite it)
_WRITES_OWN_JSON = frozenset({"train"})
_HELP = ("--help", "-help", "-h", "--helpshort", "-?")


# ---- help ------------------------------------------------------------------------------------

def _flag_form(name: str) -> str:
    flag = FLAGS[name]
    kind = flag.flag_type()
    if kind == "bool":
        return f"--[no]{name}"
    if kind.startswith("enum") or getattr(flag.parser, "enum_values", None):
        return f"--{name}={'|'.join(flag.parser.enum_values)}"
    return f"--{name}=<{kind}>"


def _default(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value)) or "empty"
    return str(value)


def command_help(command: str) -> str:
    """``tapas COMMAND --help``: what the command does, its usage, and each of its flags
    with its default and help text."""
    module = _MODULES[command]
    lines = [f"tapas {command}: {module.SUMMARY}", "", "usage: " + module.USAGE, "",
             "flags:"]
    for name in module.FLAG_NAMES:
        flag = FLAGS[name]
        text = re.sub(r"^<[^>]*>: ", "", flag.help)   # absl's enum prefix: in the form
        lines.append(f"  {_flag_form(name)}  (default: {_default(flag.default)})")
        lines += textwrap.wrap(text, 88, initial_indent="      ", subsequent_indent="      ")
    lines += ["", "`tapas --help` lists the commands; --helpfull lists every flag of "
              "every command and absl's own."]
    return "\n".join(lines)


def overview() -> str:
    """``tapas --help``: the commands, one line each."""
    width = max(map(len, COMMANDS))
    rows = [f"  {c:<{width}}  {m.SUMMARY}" for c, m in _MODULES.items()]
    return "\n".join(["usage: tapas COMMAND [--flags]", "", "commands:", *rows, "",
                      "`tapas COMMAND --help` lists that command's flags."])


def _help(args: Sequence[str]) -> int:
    """Print the help ``args`` ask for; the exit code (1 for an unknown command)."""
    words = [a for a in args if not a.startswith("-")]
    if words and words[0] in _MODULES:
        print(command_help(words[0]))
        return 0
    if words:
        print(f"tapas: unknown command {words[0]!r}\n", file=sys.stderr)
        print(overview(), file=sys.stderr)
        return 1
    print(overview())
    return 0


# ---- entry point -----------------------------------------------------------------------------

def main(argv: Sequence[str]) -> None:
    if len(argv) < 2 or argv[1] not in COMMANDS:
        got = f" (got {argv[1]!r})" if len(argv) >= 2 else ""
        raise app.UsageError(f"usage: tapas {{{'|'.join(COMMANDS)}}} [--flags]{got}; "
                             "`tapas COMMAND --help` lists a command's flags, `tapas --help` "
                             "the commands")
    if len(argv) > 2:
        raise app.UsageError(f"unexpected arguments {list(argv[2:])}: flags are written "
                             "--name=value")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    report: Any = _HANDLERS[argv[1]]()
    if FLAGS.json_out and argv[1] not in _WRITES_OWN_JSON:
        write(FLAGS.json_out, json.dumps(report, indent=2, default=str))


def run() -> None:
    """Console entry point (``tapas``)."""
    if any(a in _HELP for a in sys.argv[1:]):
        raise SystemExit(_help(sys.argv[1:]))
    app.run(main)
