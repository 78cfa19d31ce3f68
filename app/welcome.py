"""The empty conversation's welcome."""

from __future__ import annotations

import os

from textual.content import Content

from .transcript import DRAFT_STYLE

EMPTY_HINT = Content.assemble(
    ("Ask anything.\n\n", "bold"),
    "The model's MTP head drafts tokens ahead and the model checks them; tokens it accepted are shown ",
    ("like this", DRAFT_STYLE),
    " (f2 toggles). alt+0…alt+4 sets how many tokens are drafted per cycle, even mid-reply; "
    "f3 shows where the time goes. f1 lists every key.",
)
# Added to the welcome while the embedded demo model is loaded: say plainly what it is, what to try on it (the
# kinds of prompt it was trained on: packaging/demo_model) and how to get a real model.
DEMO_HINT = Content.assemble(
    "\n\n",
    ("This is the built-in demo model", "bold"),
    ": a tiny toy for trying the app offline, not an assistant. Its replies read like sentences but mean little; "
    "what it shows is the speculation (the highlights, f3's numbers). It was trained on questions like:\n"
    "  What does the word \"garden\" mean?\n"
    "  What is a dictionary in Python?\n"
    "  Continue this passage: To be, or not to be\n\n",
    ("A real model: ", "bold"),
    "f5 → Download (f9 there) fetches one sized for this machine, or in a shell: mtpchat pull qwen3.5 "
    "(mtpchat models --available lists them).",
)


def is_demo(path: str) -> bool:
    from engine import EMBEDDED_DIR

    return os.path.realpath(path) == os.path.realpath(EMBEDDED_DIR)
