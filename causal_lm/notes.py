"""Notes: what a person should know about a run or a workdir that is not an error (a damaged checkpoint skipped,
a metrics history found truncated, settings changed on resume). They are Python warnings of category `Note`, so
library callers can filter or record them and the CLI prints each as one `note:` line; unlike the progress
output they are never muted by `train.progress=false`."""

from __future__ import annotations

import warnings


class Note(UserWarning):
    """A note about a run or a workdir (see the module docstring)."""


def note(message: str, stacklevel: int = 3) -> None:
    warnings.warn(message, Note, stacklevel=stacklevel)
