"""Starting the chat from the command line: logging to a file, the UI's CPU core, the loader (--tp,
--max-context)."""

from __future__ import annotations

import gc
import logging
import os
import sys
from functools import partial

from . import paths
from .tui import MtpChatApp
from .worker import default_loader


def reserve_ui_core() -> None:
    """Leave one CPU core to the UI thread: torch's intra-op threads busy-wait, and when they take every core
    the UI thread and they slow each other down badly (measured on 2 cores: the tiny test model decoded at
    ~10 tok/s with 2 torch threads under load, ~190 tok/s with 1). Respects an explicit OMP_NUM_THREADS."""
    cores = os.cpu_count() or 1
    if cores < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    torch = sys.modules.get("torch")  # already imported by the caller: adjust it; else set the env var early
    if torch is not None:
        if torch.get_num_threads() >= cores:
            torch.set_num_threads(cores - 1)
    else:
        os.environ["OMP_NUM_THREADS"] = str(cores - 1)


def run_tui(model: str | None = None, depth: int | None = None, device: str | None = None,
            dtype: str | None = None, tp: int = 1, max_context: int | None = None, think: bool | None = None) -> int:
    """Run the TUI until the user quits; returns the exit status."""
    reserve_ui_core()
    try:  # tracebacks of failed loads and requests go to a file (the terminal belongs to the UI)
        paths.private_file(paths.log_path())  # created 0600, its folders 0700 (the log quotes conversations)
        logging.basicConfig(filename=paths.log_path(), level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    except OSError:
        pass
    loader = partial(default_loader, max_context=max_context)  # --max-context: every model the chat loads
    if tp > 1:  # rank 0 (this process) owns the UI; tp - 1 follower processes run the same cycles
        from multiprocessing import resource_tracker

        from engine import tp_loader

        # start multiprocessing's helper while the real stdio is still ours: spawning it from inside the
        # running app fails (Textual has replaced stderr)
        resource_tracker.ensure_running()
        loader = tp_loader(tp, max_context)
    # under --tp the warm-up runs on every rank (TPLeader.warm_up), like the chat's requests
    app = MtpChatApp(model=model, depth=depth, device=device, dtype=dtype, loader=loader, think=think)
    app.run()
    code = app.return_code or 0
    busy = app.worker.thread.is_alive()
    if tp > 1 and not busy:
        # multiprocessing's exit handlers release what the follower ranks shared, so this process finalizes;
        # settle_heap froze the loaded model's heap out of the collector's reach, and Triton's (nanobind) objects
        # in it would outlive their module's teardown, which then prints ~45 lines of "nanobind: leaked ..."
        gc.unfreeze()
        return code
    # Everything the chat keeps is written by now (the store closed in on_unmount), so the process ends here,
    # without the interpreter's teardown: with the engine thread still inside a load or a step (shutdown waited a
    # few seconds for it), finalizing under it aborts in torch's C++ teardown ("terminate called without an active
    # exception", exit status 134); with the model loaded, freeing its frozen heap took 0.7 s before the shell
    # prompt came back, and Triton's leak report followed (above).
    if busy:
        logging.getLogger(__name__).info("quit while the engine thread was busy: exiting at once")
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
