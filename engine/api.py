"""The engine's public face: load a model, then stream events for a prompt or a conversation."""

from __future__ import annotations

import math
import os
import re
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator

import torch

from .checkpoint import read_json
from .context import Fitted, check_max_context, context_info, context_limit, fit_messages, limit_source
from .drafters import MTPDrafter
from .errors import EngineError
from .events import FORCED, TARGET, Fallback, Finished, Started, Tokens
from .host_embedding import check_mode
from .autodepth import AutoDrafter, DepthChooser, drafter_cycles
from .limits import AUTO, AUTO_MAX_DEPTH, MAX_DEPTH, MAX_NEW_TOKENS, SEED_MAX, SEED_MIN
from .model import Loaded, kernel_serves, load
from .reasoning import ThinkingInfo, ReplyParts, last_open, reasoning_apart, thinking_info
from .reuse import TurnCache
from .sampling import SamplingParams
from .speculative import Flight, Request, StateLost, cycle, drop_in_flight, pick, prefill
from .timing import PhaseTimer

EMBEDDED = Path(__file__).parent / "assets" / "demo"


@dataclass
class GenerationSettings:
    max_new_tokens: int = 512
    depth: int | str = 2  # drafts per cycle, or AUTO
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    prefill_chunk: int | None = None  # tokens per prefill pass; None: the engine's choice (Engine.prefill_chunk)
    reuse: bool = True  # continue from the state the previous request left (see reuse.py)
    think: bool | None = None  # the chat template's enable_thinking; None: the template's default
    think_budget: int | None = None  # reasoning tokens before the engine closes the reasoning itself
    template_vars: dict | None = None  # other variables the chat template reads (e.g. preserve_thinking)

    def validate(self) -> None:
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise EngineError(f"--max-new-tokens {self.max_new_tokens}: must be between 1 and {MAX_NEW_TOKENS:,}")
        if self.depth != AUTO and not (isinstance(self.depth, int) and 0 <= self.depth <= MAX_DEPTH):
            raise EngineError(f"--depth {self.depth}: must be between 0 and {MAX_DEPTH}, or {AUTO}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):  # (NaN fails every comparison)
            raise EngineError(f"--temperature {self.temperature}: must be a finite number >= 0")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise EngineError(f"--top-p {self.top_p}: must be in (0, 1]")
        if self.top_k < 0:
            raise EngineError(f"--top-k {self.top_k}: must be >= 0")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise EngineError(f"--seed {self.seed}: must be between -2**63 and 2**64 - 1")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise EngineError("prefill_chunk must be at least 1")
        if self.think_budget is not None and not 1 <= self.think_budget <= MAX_NEW_TOKENS:
            raise EngineError(f"--think-budget {self.think_budget}: must be between 1 and {MAX_NEW_TOKENS:,}")


class DecodeControl:
    """Shared with another thread: depth is read at every cycle; stop() ends the request after the cycle."""

    def __init__(self, depth: int | None = None):
        self.depth = depth
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()


@dataclass
class ModelInfo:
    name: str
    path: str
    family: str
    model_type: str
    mtp_layers: int
    params: int
    device: str
    dtype: str


class TextStream:
    """Token ids -> the text each one completes, decoded once (tokenizers' DecodeStream: a token inside a
    multi-byte character completes nothing yet, its piece is "")."""

    def __init__(self, tokenizer):
        from tokenizers.decoders import DecodeStream

        self.backend = getattr(tokenizer, "backend_tokenizer", None)  # (random-weight benchmarks: no tokenizer)
        self.stream = DecodeStream(skip_special_tokens=True)

    def pieces(self, ids: list[int]) -> list[str]:
        if self.backend is None:
            return [""] * len(ids)
        return [self.stream.step(self.backend, i) or "" for i in ids]


# positions reserved beyond a request when spare KV capacity is free to carry (Engine.kv_reservation): 27B
# shape, 64 KiB a position, 256 MiB
KV_AHEAD = 4096

MIN_PREFILL_CHUNK = 64  # the narrowest prefill chunks a prompt is retried in after running out of memory


class Engine:
    def __init__(self, loaded: Loaded, tokenizer=None, stop_ids: set[int] = frozenset(), cuda_graphs: bool | None = None,
                 compile: bool | None = None, max_context: int | None = None):
        self.loaded, self.tokenizer, self.stop_ids = loaded, tokenizer, frozenset(stop_ids)
        self.trunk = loaded.trunk
        # the context every request must fit: the model's (max_position_embeddings), capped by the user's
        check_max_context(max_context)
        self.context = context_info(loaded.trunk.config, loaded.mtp_layers)
        self.max_context = max_context
        self.context_limit = context_limit(self.context.max_position_embeddings, max_context)
        self.kv_bytes_per_token = self.context.kv_bytes_per_token(str(loaded.trunk.dtype).replace("torch.", ""),
                                                                  loaded.trunk.backends.kv_cache)
        self.thinking = thinking_info(tokenizer) if tokenizer is not None else ThinkingInfo(False, "no tokenizer", None)
        self.caches = self.trunk.new_caches()
        self.mtp_drafter = MTPDrafter(loaded.mtp) if loaded.mtp is not None else None
        self.draft_drafter = None  # a separate draft model (attach_draft, --draft-model)
        self.auto_drafter = None  # both, chosen per cycle (--drafter auto; attach_draft)
        self.drafter_choice = None  # "mtp" | "draft" | "auto" | None: auto when both exist, else the one there is
        self.turns = TurnCache()
        # --depth auto's estimates per drafter kind (DepthChooser.estimates), kept from one request to the next:
        # the running cost of a cycle at each depth (auto's and fixed depths' cycles) and of a switch from plain
        # decoding, this model's and this device's, instead of guesses (depth 0 guessed from the speculative
        # depths kept a plain-text reply at depth 3 for its first 16 cycles)
        self.auto_estimates: dict[str, dict] = {}
        self.graph_runner = None
        if cuda_graphs is None:
            cuda_graphs = self.trunk.device.type == "cuda" and os.environ.get("MTPCHAT_CUDA_GRAPHS", "1") != "0"
        if cuda_graphs:
            from .graphs import GraphRunner, StepGraphs

            if compile is None:
                compile = os.environ.get("MTPCHAT_COMPILE", "0") == "1"
            self.graph_runner = self.trunk.graphs = GraphRunner(self.trunk, compile=compile)
            if self.mtp_drafter is not None:
                self.mtp_drafter.graphs = StepGraphs(self.trunk.device, group=self.trunk.group)
                self.mtp_drafter.chains = StepGraphs(self.trunk.device, group=self.trunk.group)
        t = self.trunk
        self.info = ModelInfo(loaded.name, loaded.path, t.family.name, loaded.raw_config.get("model_type", ""),
                              loaded.mtp_layers, loaded.params, str(t.device), str(t.dtype).replace("torch.", ""))

    # -- prompts ------------------------------------------------------------------------------------------------

    def encode_chat(self, messages: list[dict], think: bool | None = None, template_vars: dict | None = None) -> list[int]:
        """The chat template's token ids. Message contents are text: a user who types `<|im_end|>` gets the
        characters, never the control token (only the template's own markers are special). think: the
        template's enable_thinking (None: its default; ignored by a template without the switch)."""
        tok = self.tokenizer
        messages = [reasoning_apart(m) for m in messages]
        variables = dict(template_vars or {})
        if think is not None and self.thinking.switch:
            variables["enable_thinking"] = think
        try:
            rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **variables)
        except Exception as e:
            raise EngineError(f"chat template failed: {str(e).splitlines()[0][:200] if str(e) else e!r}") from None
        contents = [(m.get(k), k == "content") for m in messages for k in ("reasoning_content", "content")
                    if isinstance(m.get(k), str)]
        specials = [t for t in tok.all_special_tokens + list(tok.added_tokens_encoder) if t]
        if not any(t in c for c, _ in contents for t in specials):
            return list(tok.encode(rendered, add_special_tokens=False))  # (the common case: one encode)
        ids, at = [], 0
        for text, is_content in contents:  # each where the template put it: encoded with special tokens split
            start = rendered.find(text, at) if text else -1
            if start < 0:  # (a reasoning the template dropped: nothing of it reaches the model)
                if is_content and any(t in text for t in specials):
                    raise EngineError("a message holds control-token text that the chat template rewrote; "
                                      "remove the <|...|> markers from it")
                continue
            ids += tok.encode(rendered[at:start], add_special_tokens=False)
            ids += encode_as_text(tok, text)
            at = start + len(text)
        return ids + tok.encode(rendered[at:], add_special_tokens=False)

    def encode_raw(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    # -- the context --------------------------------------------------------------------------------------------

    def check_context(self, prompt_tokens: int, max_new_tokens: int | None = None) -> None:
        """EngineError (one line) when a prompt of `prompt_tokens` leaves no room for one new token within the
        context, or, given max_new_tokens, for that many."""
        limit = self.context_limit
        if limit is None:
            return
        why = limit_source(self.context.max_position_embeddings, self.max_context)
        if prompt_tokens + 1 > limit:
            raise EngineError(f"the prompt is {prompt_tokens:,} tokens; the context is {limit:,} ({why})")
        if max_new_tokens is not None and prompt_tokens + max_new_tokens > limit:
            raise EngineError(f"--max-new-tokens {max_new_tokens}: with the prompt's {prompt_tokens:,} tokens it "
                              f"exceeds the context of {limit:,} tokens ({why}); at most "
                              f"{limit - prompt_tokens:,} new tokens here")

    def fit_messages(self, messages: list[dict], reply_tokens: int, think: bool | None = None,
                     template_vars: dict | None = None) -> Fitted:
        """The conversation to send so that it and `reply_tokens` of reply fit the context: the system prompt
        kept, the oldest turns dropped (context.fit_messages). A conversation that fits comes back whole. think,
        template_vars: as the request renders it (encode_chat)."""
        return fit_messages(lambda m: self.encode_chat(m, think, template_vars), messages, self.context_limit,
                            reply_tokens)

    def chat(self, messages, settings: GenerationSettings, control: DecodeControl | None = None):
        return self.generate(self.encode_chat(messages, settings.think, settings.template_vars), settings, control)

    # -- decoding -----------------------------------------------------------------------------------------------

    def prefill_chunk(self, settings: GenerationSettings) -> int:
        """Tokens per prefill pass. On CUDA 2048: at 512 launches and small GEMMs held an 8k-token prompt of the
        27B shape to 3,500 tok/s, at 2048 it runs at 8,500 (8192 adds nothing but activation memory). The CPU
        keeps 512: its activations (and the attention block, chunk x context) stay small next to the model."""
        if settings.prefill_chunk is not None:
            return settings.prefill_chunk
        return 2048 if self.trunk.device.type == "cuda" else 512

    def narrower_prefill(self, settings: GenerationSettings, error: BaseException, retried: bool) -> tuple:
        """After running out of memory while prefilling: (the settings with chunks a quarter as wide, the fallback
        that says so), with the cached memory freed; EngineError (one line) if these were the narrower ones
        (retried) or as narrow as chunks go."""
        chunk = self.prefill_chunk(settings)
        narrower = max(MIN_PREFILL_CHUNK, chunk // 4)
        first = str(error).splitlines()[0][:160] if str(error) else type(error).__name__
        if retried or narrower >= chunk:
            raise EngineError(f"out of memory while prefilling the prompt in {chunk}-token chunks: {first}") from None
        if self.trunk.device.type == "cuda":
            torch.cuda.empty_cache()
        return replace(settings, prefill_chunk=narrower), Fallback(
            "memory", f"out of memory prefilling the prompt in {chunk}-token chunks: freed cached memory, prefilled "
                      f"it again from its start in {narrower}-token chunks")

    def attach_draft(self, path: str | None, choice: str | None = None) -> None:
        """Use the model at `path` as the drafter (draft_model.py; EngineError, one line, when it cannot draft
        for this model). choice: "mtp", "draft" or "auto" (each cycle the one expected to be faster,
        autodepth.AutoDrafter; the default when both exist); None path: only the choice changes."""
        if choice not in (None, "mtp", "draft", "auto"):
            raise EngineError(f"--drafter {choice!r}: expected mtp, draft or auto")
        if path is not None:
            from .draft_model import load_draft

            self.draft_drafter = load_draft(path, self)
            self.auto_drafter = None
        if choice in ("draft", "auto") and self.draft_drafter is None:
            raise EngineError(f"--drafter {choice}: no draft model (pass --draft-model PATH)")
        if choice in ("mtp", "auto") and self.mtp_drafter is None:
            raise EngineError(f"--drafter {choice}: {self.loaded.name} has no MTP head")
        if self.auto_drafter is None and self.mtp_drafter is not None and self.draft_drafter is not None:
            self.auto_drafter = AutoDrafter(self.mtp_drafter, self.draft_drafter)
        self.drafter_choice = choice

    def default_drafter(self):
        """The drafter a request gets when it names none: --drafter's choice, else both chosen per cycle
        (AutoDrafter) when there are both, else the one there is (None: plain decoding)."""
        if self.drafter_choice == "mtp" or self.draft_drafter is None:
            return self.mtp_drafter
        if self.drafter_choice == "draft" or self.auto_drafter is None:
            return self.draft_drafter
        return self.auto_drafter

    def fallbacks(self, settings: GenerationSettings, drafter) -> list[Fallback]:
        out = [f for f in self.loaded.fallbacks if f.feature != "speculation"]
        runner = self.graph_runner
        for graphs in (runner, getattr(self.mtp_drafter, "graphs", None),
                       getattr(self.mtp_drafter, "chains", None), getattr(self.draft_drafter, "graphs", None)):
            if graphs is not None and graphs.failure:
                out.append(Fallback("cuda_graphs", f"{graphs.failure}: eager steps"))
        if runner is not None:
            if runner.compile_failure:
                out.append(Fallback("compile", runner.compile_failure))
            if runner.decodes.failure:
                out.append(Fallback("cuda_graphs", f"{runner.decodes.failure}: plain decoding verifies one token "
                                                   f"and commits it (the verify graph)"))
            if runner.refreshing.failure and not runner.steps.failure:
                out.append(Fallback("cuda_graphs", f"{runner.refreshing.failure}: the MTP head refreshes in a "
                                                   f"graph of its own after each verify pass"))
        if settings.depth != 0 or drafter is not None:
            if drafter is None and self.default_drafter() is None:
                out += [f for f in self.loaded.fallbacks if f.feature == "speculation"]
        return out

    def kv_reservation(self, end: int) -> int:
        """How many positions the KV caches hold for a request that may reach position `end`. The masked graph-mode
        attention reads the whole capacity (on the H200, 27B shape, 8k positions of spare capacity cost a 200-token
        prompt 12 ms), so it gets no more than `end`; the split-K kernel reads only the filled length, so where it
        serves the cache (every cache where it timed faster at load, else those over TRITON_MIN_CAPACITY positions,
        an fp8 cache's at every capacity) the next turns get KV_AHEAD positions of room too (up to the context
        limit) and do not re-capture the CUDA graphs (about 400 ms on the 27B shape) whenever the cache grows."""
        b = self.trunk.backends
        if not kernel_serves(b.decode_attention, end + KV_AHEAD, b.kv_cache == "fp8"):
            return end
        ahead = end + KV_AHEAD
        return ahead if self.context_limit is None else max(end, min(ahead, self.context_limit + 16))

    def generate(self, prompt_ids: list[int], settings: GenerationSettings, control: DecodeControl | None = None,
                 drafter=None) -> Iterator:
        """Yield Started, then Tokens / Cycle per cycle, then Finished. The engine stays usable after an exception."""
        settings.validate()
        self.check_context(len(prompt_ids))
        if self.context_limit is not None:  # a reply stops at the end of the context, finish reason "length"
            settings = replace(settings, max_new_tokens=min(settings.max_new_tokens,
                                                            self.context_limit - len(prompt_ids)))
        if not prompt_ids:
            raise EngineError("empty prompt")
        vocab = self.trunk.config.vocab_size
        if max(prompt_ids) >= vocab or min(prompt_ids) < 0:
            raise EngineError(f"prompt token id out of range for vocabulary of {vocab}")
        control = control or DecodeControl(settings.depth)
        fallbacks = self.fallbacks(settings, drafter)
        speculative_ok = not any(f.feature == "speculation" for f in fallbacks)
        drafter = (drafter or self.default_drafter()) if speculative_ok else None
        timer = PhaseTimer(self.trunk.device)
        req = self.new_request(prompt_ids, settings)
        turns = self.turns
        if not settings.reuse:
            turns.reset()
        start, snap = turns.plan(prompt_ids, drafter)
        parts = ReplyParts(self.thinking, prompt_ids, settings.think_budget)
        if settings.think is not None and not self.thinking.switch:
            fallbacks.append(Fallback("thinking", f"{self.thinking.reason}: --think / --no-think has no effect"))
        yield Started(len(prompt_ids), start, fallbacks, parts.opened)

        t0 = time.perf_counter()
        detok = TextStream(self.tokenizer)
        flight = Flight()
        ttft, ok, depth_cap = None, False, None
        # (the first cycles count fully; what the requests before learned: DepthChooser.estimates)
        learned = self.auto_estimates.get(type(drafter).__name__, {})
        chooser, chosen = DepthChooser(AUTO_MAX_DEPTH, mean_first=True, **learned), {}
        with torch.inference_mode():
            try:
                logits, retried = None, False
                while logits is None:
                    self.start_from(start, snap, drafter, len(prompt_ids) + settings.max_new_tokens)
                    try:
                        logits = self.prompt_logits(req, prompt_ids, start, snap, drafter, parts, settings, timer)
                    except torch.OutOfMemoryError as e:
                        # the chunk that ran out may have written part of the state in place: the prompt again
                        # from its start, in narrower chunks (their activations a quarter), once
                        settings, note = self.narrower_prefill(settings, e, retried)
                        fallbacks.append(note)
                        yield note
                        start, snap, retried = 0, None, True
                first_id = take_first(req, logits, timer)
                timer.collect()
                ttft = (time.perf_counter() - t0) * 1e3
                with timer.phase("detokenize"):
                    pieces = detok.pieces([first_id])
                labels = parts.label([first_id], pieces)
                yield Tokens([first_id], [TARGET], "".join(pieces), pieces, labels)
                parts.cap(req)
                sync = getattr(control, "sync", None)  # tensor parallelism: rank 0 decides depth and stop
                # --depth auto stops a chain on a doubtful draft (drafters.stops_after) on the CPU only: on a GPU
                # the chain is one graph launched ahead of the host, and reading a probability would make the host
                # wait; and not under tensor parallelism, whose ranks time their own cycles but must draft alike
                floors_apply = self.trunk.device.type == "cpu" and sync is None
                while req.finish is None:
                    if sync is not None:
                        sync()
                    if control.stopped:
                        req.finish = "stop"
                        break
                    if parts.over_budget(req):
                        yield self.close_reasoning(req, parts, drafter, flight, detok, settings, timer)
                        continue
                    auto, depth = next_depth(settings, control, chooser, drafter, depth_cap)
                    req.draft_floors = chooser.floors(depth) if auto and floors_apply else []
                    try:
                        part, t_cycle = parts.tracker.part, time.perf_counter()
                        out, sources, stats = cycle(self.trunk, self.caches, drafter, req, flight, depth, timer)
                    except StateLost as e:  # (the finally below drops the state)
                        raise EngineError(f"{e}; the cached conversation state was dropped, the next reply "
                                          f"starts afresh") from e
                    except torch.OutOfMemoryError as e:
                        # cycle() left the committed state; free, lower the depth, retry once, then give up clearly
                        if depth_cap is not None:
                            raise EngineError(f"out of memory while decoding, again after lowering the depth to "
                                              f"{depth_cap}: {str(e).splitlines()[0][:160]}") from None
                        depth_cap = max(0, depth // 2)
                        if self.trunk.device.type == "cuda":
                            torch.cuda.empty_cache()
                        note = Fallback("memory", f"out of memory at depth {depth}: freed cached memory, "
                                                  f"depth lowered to {depth_cap} for this request")
                        fallbacks.append(note)
                        yield note
                        continue
                    with timer.phase("detokenize"):
                        pieces = detok.pieces(out)
                    labels = parts.label(out, pieces)
                    ms = (time.perf_counter() - t_cycle) * 1e3
                    parts.cycle(part, stats.drafted, stats.accepted, ms)
                    # A plain cycle whose call also launched the drafting cycle after it (a depth change: with
                    # graphs the next cycle is launched before this call returns, the head's catch-up and the
                    # cycle) took more than plain decoding costs: not a plain cost to go by. Taken as one, each
                    # switch raised plain's running cost by up to WEIGHT times the launch, and drafting
                    # looked cheaper next to it (the demo model on an H100, stop 66: auto 0.885-0.931 of plain,
                    # drafting a quarter to two thirds of its cycles, where a constant chooser ran 1.0)
                    launched = stats.depth == 0 and depth > 0
                    cost_ms = None if launched else ms
                    if auto:
                        chooser.observe(stats.depth, stats.accepted_per_position, cost_ms)
                        if launched:  # (the switch's: DepthChooser.owe)
                            chooser.owe(ms)
                        stats.why = chooser.why + (f"; stopped after draft {stats.depth}" if stats.stopped else "")
                        chosen[stats.depth] = chosen.get(stats.depth, 0) + 1
                    else:  # (what a cycle at this depth costs, for the next reply at depth auto)
                        chooser.observe_cost(stats.depth, cost_ms)
                    if stats.drafted and getattr(drafter, "note", None):  # --drafter auto: which drafted, why
                        stats.why = f"{drafter.note}; {stats.why}" if stats.why else drafter.note
                    yield stats
                    yield Tokens(out, sources, "".join(pieces), pieces, labels)
                    if parts.over_budget(req):
                        req.finish = None  # the budget's cap, not the reply's end: the loop closes the reasoning
                    else:
                        parts.resume(req)  # (a cycle the budget's cap stopped after the reasoning closed)
                ok = True
            except GeneratorExit:  # the consumer stopped reading: the committed state is consistent
                ok = True
                raise
            finally:
                drop_in_flight(self.caches, drafter, flight)  # a cycle launched ahead of a stop is not finished
                self.auto_estimates[type(drafter).__name__] = chooser.estimates()
                # What the caches hold is the committed sequence minus its last (unprocessed) token. After any
                # other exception the state is dropped, cleanly: the next request starts from zero.
                if ok:
                    turns.history = req.seq[: self.caches.processed].tolist()
                else:
                    self.caches.reset()
                    turns.reset()
        timer.collect(block=True)
        stats = request_stats(req, settings, control, drafter, start, ttft, time.perf_counter() - t0, timer, parts,
                              chosen)
        yield Finished(req.finish, stats, fallbacks)

    def new_request(self, prompt_ids: list[int], settings: GenerationSettings) -> Request:
        """The request's committed sequence (the prompt), its stop ids, sampling and generator."""
        dev = self.trunk.device
        gen = None
        if settings.seed is not None:
            gen = torch.Generator(device=dev).manual_seed(settings.seed)
        elif self.trunk.group is not None and settings.temperature > 0:
            # tensor parallelism: every rank must draw the same samples from the same (gathered) logits
            gen = torch.Generator(device=dev).manual_seed(self.trunk.group.shared_seed())
        req = Request(seq=torch.empty(len(prompt_ids) + settings.max_new_tokens + 8, dtype=torch.long, device=dev),
                      length=0, prompt_len=len(prompt_ids), max_new=settings.max_new_tokens,
                      stop_ids=frozenset() if settings.ignore_eos else self.stop_ids,
                      sampling=SamplingParams(settings.temperature, settings.top_k, settings.top_p), generator=gen)
        req.append(torch.tensor(prompt_ids, dtype=torch.long, device=dev))
        return req

    def start_from(self, start: int, snap, drafter, end: int) -> None:
        """The caches at `start` (a snapshot's state restored, or nothing at 0), with room up to position `end`."""
        turns = self.turns
        if snap is not None:
            turns.restore(snap, self.caches, drafter)
        elif start == 0:
            self.caches.reset()
            if drafter is not None:
                drafter.reset()
            turns.reset()
        turns.drafter = drafter
        if self.trunk.graphs is not None:  # one reservation for the request: no re-capture mid-reply
            end = self.kv_reservation(end + 16)
            self.caches.kv.reserve(end - self.caches.processed)
            if getattr(drafter, "graphs", None) is not None:
                drafter.reserve(end - drafter.covered)

    def prompt_logits(self, req: Request, prompt_ids: list[int], start: int, snap, drafter, parts, settings,
                      timer) -> torch.Tensor:
        """The logits after the prompt: its tokens past `start` prefilled (snapshots taken for the next turn's
        reuse), or the reused snapshot's own."""
        if start >= len(prompt_ids):
            return snap.logits
        turns, chunk = self.turns, self.prefill_chunk(settings)
        # a prompt that opens the reply's reasoning: a snapshot before the opening marker too, where the next
        # turn's prompt (earlier reasoning dropped by the template) still agrees with it
        opened_at = last_open(prompt_ids, self.thinking.open_id) if parts.opened else None
        if opened_at is not None and start < opened_at:
            turns.take(opened_at, prefill(self.trunk, self.caches, drafter, req.seq[:opened_at], chunk, timer),
                       self.caches, drafter)
        logits = prefill(self.trunk, self.caches, drafter, req.seq[: req.length], chunk, timer)
        turns.history = list(prompt_ids)
        turns.take(len(prompt_ids), logits, self.caches, drafter)
        return logits

    def close_reasoning(self, req, parts, drafter, flight, detok, settings, timer) -> Tokens:
        """The thinking budget ran out inside the reasoning: commit the closing marker and a blank line as a
        prompt's tokens are (prefill; the MTP head primed over them), then the target's next token; decoding
        resumes after them, at every depth from the same token. Within the request's cap: what does not fit is
        cut, and the reply ends there."""
        forced = [self.thinking.close_id] + self.encode_raw("\n\n")
        room = parts.max_new - len(req.generated)
        drop_in_flight(self.caches, drafter, flight)  # (a cycle launched ahead drafted past the budget)
        req.append(torch.tensor(forced[:room], dtype=torch.long, device=req.seq.device))
        ids, sources = forced[:room], [FORCED] * min(room, len(forced))
        if room > len(forced):
            logits = prefill(self.trunk, self.caches, drafter, req.seq[: req.length], self.prefill_chunk(settings),
                             timer)
            with timer.phase("sampling"):
                token = pick(logits, req)
            req.append(token)
            ids, sources = ids + [int(token[0])], sources + [TARGET]
        req.generated.extend(ids)
        req.finish = "eos" if ids[-1] in req.stop_ids else "length" if len(req.generated) >= parts.max_new else None
        with timer.phase("detokenize"):
            pieces = detok.pieces(ids)
        labels = parts.label(ids, pieces)
        parts.cap(req)
        return Tokens(ids, sources, "".join(pieces), pieces, labels)

    def warm_up(self, depths=(0, 1, 2, 3), progress=None) -> dict:
        """Pay, at load, what the first replies of a chat would: kernel compilation and autotuning (FLA's JIT,
        the Triton kernels), and the CUDA graphs of every depth in `depths`, for a first prompt and a follow-up
        turn (prefill at an offset). progress(done, total, what) after each step. Leaves no conversation state:
        the next request starts from zero. Returns {"seconds": wall time, "steps": steps run}."""
        from .graphs import PREFILL_WIDTHS

        depths = [d for d in dict.fromkeys(depths) if d == 0 or self.default_drafter() is not None]
        # a prompt wider than the prefill graphs (the chunked GDN kernel's JIT and autotuning), then each depth's
        # first prompt and follow-up turn (every graph of the decode loop, a prefill graph at an offset)
        plan = [(0, "long", PREFILL_WIDTHS[-1] + 44)] + [(d, turn, 48) for d in depths for turn in ("first", "turn")]
        t0 = time.perf_counter()
        try:
            for done, (d, turn, n) in enumerate(plan, 1):
                settings = GenerationSettings(max_new_tokens=8, depth=d, ignore_eos=True, reuse=turn == "turn")
                ids = [1 + i % 64 for i in range(n)]  # (synthetic ids: any vocabulary has them)
                for _ in self.generate(self.turns.history + ids if turn == "turn" else ids, settings):
                    pass
                if progress is not None:
                    progress(done, len(plan), f"depth {d}: {turn} prompt")
        finally:
            self.turns.reset()
            self.caches.reset()
        return {"seconds": time.perf_counter() - t0, "steps": len(plan)}

    # -- reporting ----------------------------------------------------------------------------------------------

    def diagnostics(self) -> dict:
        from .diagnostics import snapshot

        return snapshot(self)

    def close(self) -> None:
        """Free the model now: the trunk and its graph runner point at each other, so without this a model
        switch would keep the old model alive until the garbage collector runs (two models in memory)."""
        if self.graph_runner is not None:
            self.graph_runner.reset()
            self.graph_runner.trunk = None
        if self.trunk is not None:
            self.trunk.graphs = None
        for graphs in (getattr(self.mtp_drafter, "graphs", None), getattr(self.mtp_drafter, "chains", None),
                       getattr(self.draft_drafter, "graphs", None)):
            if graphs is not None:
                graphs.reset()  # (a captured step's closure holds the drafter)
        self.graph_runner = self.caches = self.mtp_drafter = self.draft_drafter = self.auto_drafter = None
        self.turns = None
        self.trunk = self.loaded = None


def encode_as_text(tok, text: str) -> list[int]:
    """text's ids with nothing in it read as a marker: special tokens split (split_special_tokens), and the
    added tokens that are not special (Qwen's <think>, </think>, <tool_call>, which splitting keeps whole)
    spelled as ordinary tokens, their first character apart."""
    encode = lambda t: tok(t, add_special_tokens=False, split_special_tokens=True)["input_ids"] if t else []
    special = set(tok.all_special_tokens)
    added = sorted((t for t in tok.added_tokens_encoder if t and t not in special), key=len, reverse=True)
    if not added:
        return encode(text)
    ids, at = [], 0
    for m in re.finditer("|".join(map(re.escape, added)), text):
        ids += encode(text[at : m.start()]) + encode(m.group()[:1]) + encode(m.group()[1:])
        at = m.end()
    return ids + encode(text[at:])


def stop_ids_for(root: Path, tokenizer, raw_config: dict) -> set[int]:
    ids: set[int] = set()
    gen = root / "generation_config.json"
    if gen.exists():
        eos = read_json(gen, "generation_config.json").get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if not ids:
        eos = raw_config.get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
    return ids


def take_first(req: Request, logits: torch.Tensor, timer) -> int:
    """The reply's first token, from the prompt's logits: committed, and the reply finished if it ends there."""
    with timer.phase("sampling"):
        first = pick(logits, req)
    req.append(first)
    first_id = int(first[0])
    req.generated.append(first_id)
    if first_id in req.stop_ids:
        req.finish = "eos"
    elif len(req.generated) >= req.max_new:
        req.finish = "length"
    return first_id


def next_depth(settings: GenerationSettings, control, chooser: DepthChooser, drafter, depth_cap: int | None):
    """(auto?, the next cycle's depth): the live control's depth over the request's, auto's pick (tensor
    parallelism: rank 0's, see tp_session.SyncedControl.agree), capped after an out-of-memory retry."""
    depth = settings.depth if control.depth is None else control.depth
    auto = depth == AUTO
    if auto:
        depth = getattr(control, "agree", int)(chooser.pick() if drafter is not None else 0)
    else:
        depth = max(0, int(depth))
    return auto, depth if depth_cap is None else min(depth_cap, depth)


def request_stats(req: Request, settings, control, drafter, start: int, ttft: float, elapsed: float, timer, parts,
                  chosen: dict) -> dict:
    """Finished.stats: what the request did and where its time went."""
    decode_s = max(elapsed - ttft / 1e3, 1e-9)
    return {
        "depth": settings.depth if control.depth is None else control.depth,
        "drafter": getattr(drafter, "name", None),
        "prompt_tokens": req.prompt_len,
        "reused_tokens": start,
        "prefilled_tokens": req.prompt_len - start,
        "generated_tokens": len(req.generated),
        "cycles": req.cycles,
        "drafted": req.drafted,
        "accepted": req.accepted,
        "acceptance_rate": req.accepted / req.drafted if req.drafted else 0.0,
        "mean_accepted_length": (len(req.generated) - 1) / req.cycles if req.cycles else 0.0,
        "per_position_acceptance": [a / d if d else 0.0 for d, a in req.per_position],
        "per_position_counts": [list(x) for x in req.per_position],  # [drafted, accepted] per position
        "tokens_per_s": (len(req.generated) - 1) / decode_s if len(req.generated) > 1 else 0.0,
        "ttft_ms": ttft,
        "total_s": elapsed,
        "phase_ms": dict(timer.totals),
        "parts": parts.to_json(),
        "auto_depths": {str(k): n for k, n in sorted(chosen.items())},  # --depth auto: cycles per depth
        "drafter_cycles": drafter_cycles(req, drafter),  # cycles each drafter drafted (--drafter auto: both)
    }


def load_tokenizer(root: Path):
    from transformers import AutoTokenizer

    if not (root / "tokenizer.json").exists() and not (root / "tokenizer_config.json").exists():
        raise EngineError(f"{root}: no tokenizer files (tokenizer.json / tokenizer_config.json)")
    try:
        return AutoTokenizer.from_pretrained(str(root), local_files_only=True, trust_remote_code=False)
    except Exception as e:
        raise EngineError(f"{root}: tokenizer does not load ({str(e)[:200]})") from None


def load_engine(path: str | None = None, device: str | None = None, dtype: str | None = None,
                cuda_graphs: bool | None = None, tp=None, compile: bool | None = None,
                max_context: int | None = None, draft_model: str | None = None,
                drafter: str | None = None, mtp_from: str | None = None,
                embed_on_host: str | None = None, quantize: str | None = None) -> Engine:
    """Load `path`, or the best model discovered; out of memory at load moves on to the next candidate.
    tp: a tp.TPGroup: this process is one rank of a tensor-parallel group and loads only its shard.
    max_context: cap the context (and so the KV cache's memory) at this many tokens.
    draft_model: a separate draft model's folder (default: MTPCHAT_DRAFT_MODEL, which `mtpchat chat
    --draft-model` sets for the chat's engine thread); drafter: "mtp" | "draft" (Engine.attach_draft).
    mtp_from: another release of the model whose mtp.* tensors make the MTP head (default: MTPCHAT_MTP_FROM,
    which `--mtp-from` sets; model.load).
    embed_on_host: auto | on | off, the input embedding table in page-locked host memory (default:
    MTPCHAT_EMBED_ON_HOST, which `--embed-on-host` sets, else auto; host_embedding.py).
    quantize: "fp8" | "int4": a 16-bit checkpoint quantized at load as the quantized releases are (model.load)."""
    check_max_context(max_context)  # before the (slow) load
    embed_on_host = check_mode(embed_on_host, "embed_on_host")
    draft_model = draft_model or os.environ.get("MTPCHAT_DRAFT_MODEL") or None
    drafter = drafter or os.environ.get("MTPCHAT_DRAFTER") or None
    mtp_from = mtp_from or os.environ.get("MTPCHAT_MTP_FROM") or None
    if path is not None:
        return _with_draft(_load_engine(path, device, dtype, cuda_graphs, tp, compile, max_context, mtp_from,
                                        embed_on_host, quantize), draft_model, drafter)
    notes, tried = [], set()
    while True:
        candidate = default_model_path(exclude=tried)
        try:
            engine = _load_engine(candidate, device, dtype, cuda_graphs, tp, compile, max_context, mtp_from,
                                  embed_on_host, quantize)
        except (torch.OutOfMemoryError, EngineError) as e:  # the next candidate, with the reason on record
            tried.add(candidate)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            why = "out of memory at load" if isinstance(e, torch.OutOfMemoryError) else "does not load"
            notes.append(Fallback("model", f"{Path(candidate).name}: {why} "
                                           f"({str(e).splitlines()[0][:160]}); trying the next candidate"))
            continue
        engine.loaded.fallbacks[:0] = notes
        return _with_draft(engine, draft_model, drafter)


def _with_draft(engine: Engine, draft_model: str | None, drafter: str | None) -> Engine:
    if draft_model is not None or drafter is not None:
        try:
            engine.attach_draft(draft_model, drafter)
        except BaseException:
            engine.close()
            raise
    return engine


def _load_engine(path, device, dtype, cuda_graphs, tp, compile=None, max_context=None, mtp_from=None,
                 embed_on_host=None, quantize=None) -> Engine:
    loaded = load(path, device, dtype, tp=tp, mtp_from=mtp_from, embed_on_host=embed_on_host, quantize=quantize)
    root = Path(loaded.path)
    tok = load_tokenizer(root)
    return Engine(loaded, tok, stop_ids_for(root, tok, loaded.raw_config), cuda_graphs, compile, max_context)


def default_model_path(exclude: set[str] = frozenset()) -> str:
    """The discovered model `choose` prefers (see discovery.py), skipping paths already tried."""
    from .discovery import choose, discover
    from .environment import probe_device, visible_gpus

    candidates = [c for c in discover() if c.path not in exclude]
    device = probe_device(None)
    choice = choose(candidates, device, gpus=visible_gpus(device))
    if choice.candidate is not None:
        return choice.candidate.path
    if EMBEDDED.exists() and str(EMBEDDED) not in exclude:
        return str(EMBEDDED)
    if exclude:
        raise EngineError(f"no candidate model loads ({len(exclude)} tried: out of memory or unreadable): pass "
                          f"--model with another one, or --device cpu")
    raise EngineError("no model found: pass --model PATH (a Hugging Face model folder)")
