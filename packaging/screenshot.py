"""Render the README screenshot (docs/screenshot.svg) with Textual's own SVG export: the app on the embedded
demo model, one question answered with draft highlights and the timing pane open.

    MTPCHAT_HOME=$(mktemp -d) python packaging/screenshot.py
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from app.tui import MtpChatApp

OUT = Path(__file__).resolve().parent.parent / "docs" / "screenshot.svg"


async def main() -> None:
    app = MtpChatApp()
    async with app.run_test(size=(132, 40)) as pilot:
        deadline = time.monotonic() + 120
        while app.engine_state == "loading" and time.monotonic() < deadline:
            await pilot.pause(0.1)
        prompt = app.query_one("#prompt")
        prompt.focus()
        prompt.load_text("Explain the word river.")
        await pilot.press("enter")
        await pilot.pause(0.5)
        while app.request is not None and time.monotonic() < deadline:
            await pilot.pause(0.1)
        if not app.query_one("#timing").display:  # the timing pane (f3) beside the transcript
            await pilot.press("f3")
        await pilot.pause(1.0)
        OUT.parent.mkdir(exist_ok=True)
        app.save_screenshot(str(OUT.name), path=str(OUT.parent))
    print(OUT)


if __name__ == "__main__":
    asyncio.run(main())
