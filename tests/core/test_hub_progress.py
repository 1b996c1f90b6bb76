"""The download bar counts bytes on disk once on huggingface_hub's Xet path (the real
hub's; the loopback hub serves plain HTTP, whose bar tests/hub/test_pull.py reads)."""

from __future__ import annotations

import types

from butter.hub import ByteSink, tqdm_class_for


class Counter(ByteSink):
    def __init__(self) -> None:
        self.bytes = 0

    def advance(self, n: int) -> None:
        self.bytes += n


def test_xet_reports_disk_bytes_once_though_it_reports_network_bytes_too():
    # What hf_hub_download does with a tqdm_class on a Xet-stored file (the real hub's).
    from huggingface_hub.utils._xet_progress_reporting import XetDownloadProgressReporter

    sink = Counter()
    with XetDownloadProgressReporter(reconstruction_desc="m.gguf", total=100, log_level=20,
                                     tqdm_class=tqdm_class_for(sink)) as progress:
        for written, received in ((10, 5), (60, 30), (100, 50)):
            progress.update_progress(types.SimpleNamespace(
                total_bytes_completed=written, total_transfer_bytes_completed=received,
                total_bytes_completion_rate=1.0, total_transfer_bytes_completion_rate=1.0,
                total_bytes=100))
    assert sink.bytes == 100

