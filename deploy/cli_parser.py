"""The argument parser every ``tandem`` command uses: no abbreviated flags (``--token``
must not silently mean ``--tokens-per-page``), and ``--help`` shows each flag's default."""

from __future__ import annotations

import argparse


def is_secret(dest: str) -> bool:
    """Flags whose defaults (read from the environment) ``--help`` must not print."""
    return dest == "token" or dest.endswith(("_token", "_secret"))


class DefaultsFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to a flag's help unless the help already names its default,
    the default is empty, or the flag carries a secret."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        empty = default is None or default is False or default == "" or default is argparse.SUPPRESS
        if "default" in text or empty or not action.option_strings or is_secret(action.dest):
            return text
        return f"{text} (default: %(default)s)"


class TandemParser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)
