"""What happened, when: spans recorded on every rank, aligned, exportable to Chrome trace JSON."""

from .events import Recorder, align, current_phase, phase, recorder, span

__all__ = ["Recorder", "align", "current_phase", "phase", "recorder", "span"]
