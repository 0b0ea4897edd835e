"""The ``pwrun`` console script: the runtime's commands (``pwrun.cli``) plus ``pwrun eval`` (``pweval.cli``).

It installs the SIGTERM handler before importing the CLI: the CLI modules import torch and the model code (~2 s),
and a SIGTERM in that time must still exit with 143 and one line. That is why the CLI import sits inside ``main``.
"""

from __future__ import annotations

from pwrun.signals import exit_quietly_on_sigterm


def main() -> None:
    exit_quietly_on_sigterm()
    from pweval.cli import runtime_cli  # after the handler (module docstring); mounts `eval` on the runtime CLI

    runtime_cli.app()
