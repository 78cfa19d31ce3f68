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
