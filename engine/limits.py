"""What a request may ask for: the engine checks these, and the CLI's and the chat's settings are checked against
the same numbers before anything slow starts. (No torch import here: the CLI reads them at parse time.)"""

MAX_DEPTH = 16  # drafts per cycle; the graphs' widths and the stash are sized from it
AUTO = "auto"  # --depth auto: the engine picks each cycle's depth (autodepth.py) ...
AUTO_MAX_DEPTH = 4  # ... from 0 to this (deeper drafts of one-layer MTP heads are rarely accepted)
MAX_NEW_TOKENS = 1_000_000  # per request: the committed sequence is allocated for it up front
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # what torch.Generator.manual_seed accepts
# --max-context: below this a chat cannot hold one exchange (and the warm-up's prompts would not fit)
MIN_CONTEXT = 128
