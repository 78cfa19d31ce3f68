"""The model's context: how many positions a sequence may use, and what each position costs in memory.

The usable context is the text config's max_position_embeddings. Under YaRN (or another scaled RoPE) the config
also names the context the model was pretrained at (original_max_position_embeddings) and the factor that stretched
it: max_position_embeddings already includes the stretch, so it is the limit, and the other two are reported beside
it. Only full-attention layers keep per-token state (keys and values): a GDN layer's state has one size however
long the sequence, so the KV cache is what grows with the context, and capping the context caps it.

Everything here reads either a transformers config object (the loaded engine) or a config.json dict (discovery,
which never imports transformers): `_field` reads both.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from .errors import EngineError
from .limits import MIN_CONTEXT

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
KV_DTYPES = ("auto", "fp8")  # the KV cache's storage (--kv-cache-dtype): auto, the model's dtype; fp8 (cache.py)
KV_DTYPE_ENV = "MTPCHAT_KV_CACHE_DTYPE"
DEFAULT_FULL_ATTENTION_INTERVAL = 4  # transformers' Qwen3-Next / Qwen3.5 default when layer_types is absent


def _field(cfg, name: str, default=None):
    value = cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)
    return default if value is None else value


def _positive_int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def text_part(raw: dict) -> dict:
    """The text model's fields of a config.json dict: Qwen3.5's vision-language releases nest them."""
    nested = raw.get("text_config")
    return nested if isinstance(nested, dict) else raw


@dataclass(frozen=True)
class ContextInfo:
    max_position_embeddings: int | None  # the usable context (None: the config does not say)
    rope_type: str
    rope_factor: float | None  # YaRN & co.: how far the pretrained context was stretched
    original_max_position_embeddings: int | None  # YaRN & co.: the context the model was pretrained at
    attention_layers: int  # full-attention layers of the trunk plus the MTP head's (one each)
    kv_heads: int
    head_dim: int

    def kv_bytes_per_token(self, dtype: str, kv_cache: str = "auto") -> int:
        """Keys and values of one position over every attention layer, in `dtype` (a name: DTYPE_BYTES) or as an
        fp8 cache stores them (a byte an element, a float32 scale a vector)."""
        vector = self.head_dim + 4 if kv_cache == "fp8" else self.head_dim * DTYPE_BYTES.get(dtype, 2)
        return self.attention_layers * 2 * self.kv_heads * vector

    def to_json(self) -> dict:
        return asdict(self)


def kv_cache_dtype() -> str:
    """MTPCHAT_KV_CACHE_DTYPE (which --kv-cache-dtype sets: every trunk, draft models and tensor-parallel ranks
    included, reads it as it is built), else auto; anything else is refused in one line."""
    mode = os.environ.get(KV_DTYPE_ENV) or "auto"
    if mode not in KV_DTYPES:
        raise EngineError(f"{KV_DTYPE_ENV} {mode!r}: expected one of {', '.join(KV_DTYPES)}")
    return mode


def rope_scaling(cfg) -> dict:
    """The RoPE parameters as transformers v5 names them (rope_parameters), or as older configs do
    (rope_scaling, with `type` for `rope_type`)."""
    rope = _field(cfg, "rope_parameters") or _field(cfg, "rope_scaling") or {}
    if not isinstance(rope, dict):
        return {}
    rope = dict(rope)
    rope.setdefault("rope_type", rope.get("type", "default"))
    return rope


def attention_layer_count(cfg) -> int:
    kinds = _field(cfg, "layer_types")
    if isinstance(kinds, (list, tuple)):
        return sum(1 for k in kinds if k == "full_attention")
    n = _positive_int(_field(cfg, "num_hidden_layers")) or 0
    if _field(cfg, "model_type") == "qwen3":
        return n  # dense Qwen3 (config.json without layer_types): every layer attention (sliding ones as full)
    interval = _positive_int(_field(cfg, "full_attention_interval")) or DEFAULT_FULL_ATTENTION_INTERVAL
    return sum(1 for i in range(n) if (i + 1) % interval == 0)


def context_info(cfg, mtp_layers: int = 0) -> ContextInfo:
    """What the text config `cfg` (a config object or a config.json text dict) says about the context."""
    rope = rope_scaling(cfg)
    kind = str(rope.get("rope_type") or "default")
    scaled = kind != "default"
    factor = rope.get("factor") if scaled and isinstance(rope.get("factor"), (int, float)) else None
    original = _positive_int(rope.get("original_max_position_embeddings")) if scaled else None
    heads = _positive_int(_field(cfg, "num_attention_heads")) or 1
    head_dim = _positive_int(_field(cfg, "head_dim")) or (_positive_int(_field(cfg, "hidden_size")) or 0) // heads
    kv_heads = _positive_int(_field(cfg, "num_key_value_heads")) or heads
    return ContextInfo(
        max_position_embeddings=_positive_int(_field(cfg, "max_position_embeddings")),
        rope_type=kind, rope_factor=float(factor) if factor is not None else None,
        original_max_position_embeddings=original,
        attention_layers=attention_layer_count(cfg) + max(int(mtp_layers or 0), 0),
        kv_heads=kv_heads, head_dim=head_dim,
    )


def check_max_context(max_context) -> None:
    """A max_context given to the engine's API (the CLI's parser already refused a bad --max-context)."""
    if max_context is not None and (_positive_int(max_context) or 0) < MIN_CONTEXT:
        raise EngineError(f"--max-context {max_context!r}: must be a whole number of tokens, at least {MIN_CONTEXT}")


def context_limit(model_limit: int | None, max_context: int | None) -> int | None:
    """The context a request may use: the model's, capped by the user's max_context. None: no limit is known."""
    limits = [n for n in (model_limit, max_context) if n is not None]
    return min(limits) if limits else None


def limit_source(model_limit: int | None, max_context: int | None) -> str:
    """Where the context limit comes from, for the one line that refuses a prompt."""
    if max_context is not None and (model_limit is None or max_context < model_limit):
        model = f"the model's is {model_limit:,}" if model_limit is not None else "the model does not say its own"
        return f"--max-context {max_context}; {model}"
    return "the model's max_position_embeddings; --max-context caps it"


def tokens_that_fit(free_bytes: int | None, weight_bytes: int | None, kv_bytes_per_token: int,
                    limit: int | None) -> int | None:
    """How many positions of KV cache fit in the memory left once the weights are in, at most `limit`.
    None when the memory or the per-token cost is unknown."""
    if free_bytes is None or weight_bytes is None or kv_bytes_per_token <= 0:
        return None
    fit = max(free_bytes - weight_bytes, 0) // kv_bytes_per_token
    return fit if limit is None else min(fit, limit)


def format_tokens(n: int | None) -> str:
    """12345 -> '12.3k', 262144 -> '262k', 1048576 -> '1.0M': the context meter's and the model lists' unit
    (decimal, as people say "a 262k context")."""
    if n is None:
        return "?"
    if n < 1000:
        return str(n)
    if n < 100_000:
        return f"{n / 1000:.1f}k"
    if n < 1_000_000:
        return f"{n / 1000:.0f}k"
    return f"{n / 1e6:.1f}M"


def fit_text(fits: int | None, limit: int | None) -> str:
    """'131k of 262k': how much of the model's context fits in memory (doctor, models, the model picker)."""
    if fits is None:
        return "?"
    return f"{format_tokens(fits)} of {format_tokens(limit)}" if limit is not None else format_tokens(fits)


# --- a conversation within the context ----------------------------------------------------------------------


@dataclass
class Fitted:
    messages: list[dict]  # what to send: the leading system message(s) and the most recent turns
    dropped: int  # messages left out, the oldest ones
    tokens: int | None  # the kept messages' prompt tokens (None: nothing was encoded, no limit is known)


def turn_starts(body: list[dict]) -> list[int]:
    """Where each turn begins: a user message and the replies after it are one turn (a reply before the first
    user message is a turn of its own)."""
    starts = [i for i, m in enumerate(body) if m.get("role") == "user"]
    return starts if starts and starts[0] == 0 else [0, *starts]


def fit_messages(encode, messages: list[dict], limit: int | None, reserve: int) -> Fitted:
    """The messages to send so that their prompt plus `reserve` positions for the reply fit `limit`: the
    leading system message(s) are kept, whole turns are dropped oldest first, and the last turn is always kept
    (a prompt too long on its own is then refused by Engine.generate, in words). `encode` is the chat template's
    encoder. Fewer turns never encode longer, so the number to drop is found by bisection."""
    if limit is None or not messages:
        return Fitted(list(messages), 0, None)
    n_system = next((i for i, m in enumerate(messages) if m.get("role") != "system"), len(messages))
    head, body = list(messages[:n_system]), list(messages[n_system:])
    starts = turn_starts(body) if body else [0]

    def kept(k: int) -> list[dict]:  # the conversation without its k oldest turns
        return head + body[starts[k]:]

    def tokens(k: int) -> int:
        return len(encode(kept(k)))

    used = tokens(0)
    if used + reserve <= limit:
        return Fitted(list(messages), 0, used)
    lo, hi = 1, len(starts) - 1  # the smallest k that fits lies in [lo, hi]; hi (the last turn) is kept anyway
    while lo < hi:
        mid = (lo + hi) // 2
        if tokens(mid) + reserve <= limit:
            hi = mid
        else:
            lo = mid + 1
    k = min(lo, len(starts) - 1)  # (one turn only: k = 0, nothing to drop)
    return Fitted(kept(k), starts[k], tokens(k))
