"""``butter pull ID``: download a hub model into the HF cache without serving it; and the
download step ``butter serve --model`` runs before loading."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from butter.cli.common import console
from butter.hub import RichSink, download, parse_hub_id

if TYPE_CHECKING:
    from butter.library import ModelLoader


def hub_id_argument(text: str) -> str:
    """argparse type of ``ID``: a hub id, or a usage error naming the forms (exit 2)."""
    if parse_hub_id(text) is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a Hugging Face id (owner/repo, "
                                         "owner/repo:QUANT or owner/repo/file.gguf)")
    return text


def run_pull(args: argparse.Namespace) -> int:
    """Download ``args.id`` (with a progress bar on stderr) unless cached; print its local
    path on stdout."""
    from butter.library import ModelLoader

    loader = ModelLoader()
    if not fetch_model(loader, args.id):
        console.print(f"[bold]{args.id}[/bold] is in the cache already", highlight=False)
    print(loader.find(args.id, trusted=True).path)
    return 0


def fetch_model(loader: ModelLoader, model_id: str) -> bool:
    """Download ``model_id`` with a progress bar when it is a hub id not cached yet;
    whether it downloaded. Failures raise a one-line :class:`~butter.errors.ButterError`."""
    from huggingface_hub.utils import are_progress_bars_disabled

    target = loader.download_target(model_id, trusted=True)
    if target is None:
        return False
    # HF_HUB_DISABLE_PROGRESS_BARS keeps its meaning: no bar, the same download.
    download(target, sink=None if are_progress_bars_disabled() else RichSink(console))
    return True
