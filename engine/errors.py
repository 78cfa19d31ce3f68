"""One exception type for everything a user can get wrong: the CLI prints its message on one line."""


class EngineError(Exception):
    """A user-facing failure (bad path, corrupt tensor, unsupported model, bad setting)."""
