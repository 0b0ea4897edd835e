"""The ``pwcal`` console script. It installs the SIGTERM handler (and, until the CLI is imported, the Ctrl-C one)
before importing the CLI: the stages import torch and the model code (~2 s), and a SIGTERM or Ctrl-C in that time
must still exit with one line (143 / 130). That is why the CLI import sits inside ``main``.
"""

from __future__ import annotations

from pwrun.signals import exit_quietly_on_sigterm, quiet_interrupt_while_starting


def main() -> None:
    exit_quietly_on_sigterm()
    started = quiet_interrupt_while_starting()
    from pwcal.cli import console_main  # after the handlers (module docstring)

    started()
    console_main()
