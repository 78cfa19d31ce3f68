"""Where mtpchat keeps its files.

Settings live in ``platformdirs.user_config_dir("mtpchat")``, conversations and exports in
``platformdirs.user_data_dir("mtpchat")``, compiled kernels in ``platformdirs.user_cache_dir("mtpchat")``.
``MTPCHAT_HOME`` overrides the three roots (tests point it at a temporary folder): config goes to
``$MTPCHAT_HOME/config``, data to ``$MTPCHAT_HOME/data`` and the cache to ``$MTPCHAT_HOME/cache``.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP_NAME = "mtpchat"


def _home() -> Path | None:
    home = os.environ.get("MTPCHAT_HOME")
    return Path(home).expanduser() if home else None


def config_dir() -> Path:
    home = _home()
    return home / "config" if home else Path(platformdirs.user_config_dir(APP_NAME))


def data_dir() -> Path:
    home = _home()
    return home / "data" if home else Path(platformdirs.user_data_dir(APP_NAME))


def settings_path() -> Path:
    return config_dir() / "settings.json"


def database_path() -> Path:
    return data_dir() / "conversations.sqlite3"


def exports_dir() -> Path:
    return data_dir() / "exports"


def log_path() -> Path:
    return data_dir() / "mtpchat.log"


def private_dir(path: Path) -> Path:
    """``path`` as a folder, each missing part created 0700 (conversations, exports and logs are the user's
    own); folders that exist keep their mode. OSError when it cannot be made (a file in the way)."""
    target = path = Path(path)
    missing = []
    while not path.is_dir():
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:
            if not folder.is_dir():
                raise
    return target


def private_file(path: Path) -> Path:
    """Create ``path`` empty and 0600 when it does not exist yet (SQLite and logging would create it with the
    umask's mode, often world-readable); an existing file keeps its mode."""
    private_dir(Path(path).parent)
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        pass
    return Path(path)


def write_private(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path``, a new file created 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)


def cache_dir() -> Path:
    home = _home()
    return home / "cache" if home else Path(platformdirs.user_cache_dir(APP_NAME))


def kernels_dir() -> Path:
    return cache_dir() / "kernels"


# Triton keeps its compiled kernels and its autotuning results (FLA's kernels autotune with cache_results=True,
# stored through Triton's cache manager: FLA has no cache folder of its own) under TRITON_CACHE_DIR; inductor
# (--compile) under TORCHINDUCTOR_CACHE_DIR. Their defaults (~/.triton, /tmp/torchinductor_USER) are not ours
# and the second is gone after a reboot: the first reply on a machine would pay the compilation again.
KERNEL_CACHE_VARS = {"TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "inductor"}


def use_kernel_cache() -> None:
    """Point Triton's and inductor's caches into kernels_dir(), so that compiling kernels is paid once per
    machine. Called before torch is imported (app/cli.py's main), so that nothing has read the variables
    yet. A user's own setting wins."""
    for var, sub in KERNEL_CACHE_VARS.items():
        os.environ.setdefault(var, str(kernels_dir() / sub))


def kernel_cache_empty() -> bool:
    """True when no kernel has been compiled into the caches in force yet: the first run on this machine (or
    after the cache was cleared), whose warm-up compiles every kernel."""
    folders = [Path(os.environ[var]) if os.environ.get(var) else kernels_dir() / sub
               for var, sub in KERNEL_CACHE_VARS.items()]
    return not any(_has_files(folder) for folder in folders)


def _has_files(folder: Path) -> bool:
    try:
        return any(True for _ in folder.iterdir())
    except OSError:  # missing (nothing compiled yet) or unreadable
        return False
