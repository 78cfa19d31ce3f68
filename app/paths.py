"""Where mtpchat keeps its files.

Settings live in ``platformdirs.user_config_dir("mtpchat")``, conversations and exports in
``platformdirs.user_data_dir("mtpchat")``. ``MTPCHAT_HOME`` overrides both roots (tests point it at a
temporary folder): config goes to ``$MTPCHAT_HOME/config`` and data to ``$MTPCHAT_HOME/data``.
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
