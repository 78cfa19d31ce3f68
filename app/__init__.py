"""mtpchat's Textual application (``app.tui``) and command line (``app.cli``). The app talks to the engine only
through ``engine``'s public API, from one background thread (``app.worker``)."""
