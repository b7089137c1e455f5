"""The argument parser every ``tandem`` command uses: no abbreviated flags (``--token``
must not silently mean ``--tokens-per-page``), ``--help`` shows each flag's default, and a
subcommand's unknown argument is reported with that subcommand's usage."""

from __future__ import annotations

import argparse


def is_secret(dest: str) -> bool:
    """Flags whose defaults (read from the environment) ``--help`` must not print."""
    return dest == "token" or dest.endswith(("_token", "_secret"))


class DefaultsFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to a flag's help unless the help already names its default,
    the default is empty, the flag is a switch (``--no-prefix-cache``'s default True is the
    setting it turns off, not the switch's) or the flag carries a secret."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        empty = default is None or default is False or default == "" or default is argparse.SUPPRESS
        switch = action.nargs == 0  # store_true, store_false, store_const: takes no value
        if "default" in text or empty or switch or not action.option_strings or is_secret(action.dest):
            return text
        return f"{text} (default: %(default)s)"


class TandemParser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)


class SubcommandParser(TandemParser):
    """A subcommand's parser (``tandem router``): an argument it does not know is its own
    error, with its usage. argparse hands such arguments up to the top-level parser, whose
    usage names no subcommand's flags."""

    def parse_known_args(self, args=None, namespace=None):
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras
