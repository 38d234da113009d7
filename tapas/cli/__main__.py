"""usage: tapas COMMAND [--flags] (``python -m tapas.cli``, ``tapas.cli.run``); `tapas --help`
lists the commands, `tapas COMMAND --help` a command's flags.

In:  the command line. Out: what ``tapas`` prints. Raises: what ``tapas`` raises.
"""

from tapas.cli import run

run()
