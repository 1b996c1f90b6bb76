"""What every ``butter`` command shares: the console, usage errors, the parser class,
flag types and logging. ``cli/main.py`` builds the commands; each command's module
imports from here, never from ``main`` (no import cycle)."""

from __future__ import annotations

import argparse
import logging

from rich.console import Console
from rich.logging import RichHandler

console = Console(stderr=True)

MAX_BATCH = 512  # tokens one engine step feeds (the prefill chunk's limit)
BACKEND_OPTION = "backend_option:"  # dests of back-end flags: backend_option:NAME:OPTION
DEFAULT_WINDOW_KEEP = 4  # mlx-lm's sink slots for a bounded cache (llama-server: 0)


class UsageError(Exception):
    """A flag that cannot work: reported in one line naming the flag, exit status 2."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"{flag}: {message}")


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line and exits 2, without usage spam."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


class ModelsAction(argparse.Action):
    """``--model``, repeatable: ``model`` is the first given (the one a request naming no
    model gets), ``models`` every one in order. Only Ray Serve serves more than one
    (``butter serve`` refuses several without ``--replicas``)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        models = [*namespace.models, values]  # a new list: the default () is shared
        namespace.models = models
        namespace.model = models[0]


def integer(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least {minimum}")
    return value


def positive(text: str) -> int:
    return integer(text, 1)


def count(text: str) -> int:
    return integer(text, 0)


def port(text: str) -> int:
    value = positive(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number")
    return value


def setup_logging(level: str) -> None:
    handler = RichHandler(console=console, show_path=False, rich_tracebacks=False)
    logging.basicConfig(level=level.upper(), format="%(message)s", handlers=[handler], force=True)
    quiet = max(logging.WARNING, logging.getLevelName(level.upper()))
    logging.getLogger("uvicorn.error").setLevel(quiet)
    # huggingface_hub's HTTP client logs every request at INFO: a hub download shows its
    # progress bar instead (butter.hub), and failures as one line.
    for name in ("httpx", "httpx2"):
        logging.getLogger(name).setLevel(quiet)
