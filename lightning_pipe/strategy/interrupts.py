"""`CtrlC`: Ctrl-C still works in the next fit of the process after a fit that Ctrl-C stopped.

On a KeyboardInterrupt, Lightning's ``fit`` ignores SIGINT for its graceful shutdown
(``signal.signal(SIGINT, SIG_IGN)`` in ``lightning.pytorch.trainer.call``) and relies on its
signal connector's teardown to put the earlier handler back. The connector records that handler
only once the fit is set up, after the strategy's ``setup``, so a Ctrl-C while the pipeline is being
built left SIGINT ignored for the rest of the process: in a notebook, the next Ctrl-C did nothing.
The strategy remembers the handler when its fit starts and puts it back in its teardown.
"""

from __future__ import annotations

import signal
import threading
from typing import Any


class CtrlC:
    """The SIGINT handler found when a fit started; `restore` puts it back if the fit's shutdown ignored SIGINT."""

    def __init__(self) -> None:
        self._found: Any = None

    def remember(self) -> None:
        """Called when a fit (validate, test, predict) starts."""
        if threading.current_thread() is threading.main_thread():
            self._found = signal.getsignal(signal.SIGINT)

    def restore(self) -> None:
        """Called at the end of the strategy's teardown: SIGINT as it was when the fit started."""
        found, self._found = self._found, None
        if found is None or found is signal.SIG_IGN or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # set by Lightning's handling of the Ctrl-C
            signal.signal(signal.SIGINT, found)
