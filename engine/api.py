"""The engine's public face: load a model, then stream events for a prompt or a conversation."""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from .checkpoint import read_json
from .drafters import MTPDrafter
from .errors import EngineError
from .events import Fallback, Finished, Started, Tokens
from .limits import MAX_DEPTH, MAX_NEW_TOKENS, SEED_MAX, SEED_MIN
from .model import Loaded, load
from .reuse import TurnCache
from .sampling import SamplingParams
from .speculative import Flight, Request, StateLost, cycle, drop_in_flight, pick, prefill
from .timing import PhaseTimer

EMBEDDED = Path(__file__).parent / "assets" / "demo"


@dataclass
class GenerationSettings:
    max_new_tokens: int = 512
    depth: int = 2
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    prefill_chunk: int = 512
    reuse: bool = True  # continue from the state the previous request left (see reuse.py)

    def validate(self) -> None:
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise EngineError(f"--max-new-tokens {self.max_new_tokens}: must be between 1 and {MAX_NEW_TOKENS:,}")
        if not 0 <= self.depth <= MAX_DEPTH:
            raise EngineError(f"--depth {self.depth}: must be between 0 and {MAX_DEPTH}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):  # (NaN fails every comparison)
            raise EngineError(f"--temperature {self.temperature}: must be a finite number >= 0")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise EngineError(f"--top-p {self.top_p}: must be in (0, 1]")
        if self.top_k < 0:
            raise EngineError(f"--top-k {self.top_k}: must be >= 0")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise EngineError(f"--seed {self.seed}: must be between -2**63 and 2**64 - 1")
        if self.prefill_chunk < 1:
            raise EngineError("prefill_chunk must be at least 1")


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


class Engine:
    def __init__(self, loaded: Loaded, tokenizer=None, stop_ids: set[int] = frozenset(), cuda_graphs: bool | None = None,
                 compile: bool | None = None):
        self.loaded, self.tokenizer, self.stop_ids = loaded, tokenizer, frozenset(stop_ids)
        self.trunk = loaded.trunk
        self.caches = self.trunk.new_caches()
        self.mtp_drafter = MTPDrafter(loaded.mtp) if loaded.mtp is not None else None
        self.turns = TurnCache()
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

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The chat template's token ids. Message contents are text: a user who types `<|im_end|>` gets the
        characters, never the control token (only the template's own markers are special)."""
        tok = self.tokenizer
        try:
            rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:
            raise EngineError(f"chat template failed: {str(e).splitlines()[0][:200] if str(e) else e!r}") from None
        contents = [m.get("content") for m in messages if isinstance(m.get("content"), str)]
        specials = [t for t in tok.all_special_tokens + list(tok.added_tokens_encoder) if t]
        if not any(t in c for c in contents for t in specials):
            return list(tok.encode(rendered, add_special_tokens=False))  # (the common case: one encode)
        ids, at = [], 0
        for text in contents:  # each content where the template put it: encoded with special tokens split
            start = rendered.find(text, at) if text else -1
            if start < 0:
                if any(t in text for t in specials):
                    raise EngineError("a message holds control-token text that the chat template rewrote; "
                                      "remove the <|...|> markers from it")
                continue
            ids += tok.encode(rendered[at:start], add_special_tokens=False)
            ids += tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            at = start + len(text)
        return ids + tok.encode(rendered[at:], add_special_tokens=False)

    def encode_raw(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def chat(self, messages, settings: GenerationSettings, control: DecodeControl | None = None):
        return self.generate(self.encode_chat(messages), settings, control)

    # -- decoding -----------------------------------------------------------------------------------------------

    def fallbacks(self, settings: GenerationSettings, drafter) -> list[Fallback]:
        out = [f for f in self.loaded.fallbacks if f.feature != "speculation"]
        runner = self.graph_runner
        for graphs in (runner, getattr(self.mtp_drafter, "graphs", None),
                       getattr(self.mtp_drafter, "chains", None)):
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
        if settings.depth > 0 or drafter is not None:
            if drafter is None and self.mtp_drafter is None:
                out += [f for f in self.loaded.fallbacks if f.feature == "speculation"]
        return out

    def generate(self, prompt_ids: list[int], settings: GenerationSettings, control: DecodeControl | None = None,
                 drafter=None) -> Iterator:
        """Yield Started, then Tokens / Cycle per cycle, then Finished. The engine stays usable after an exception."""
        settings.validate()
        if not prompt_ids:
            raise EngineError("empty prompt")
        vocab = self.trunk.config.vocab_size
        if max(prompt_ids) >= vocab or min(prompt_ids) < 0:
            raise EngineError(f"prompt token id out of range for vocabulary of {vocab}")
        control = control or DecodeControl(settings.depth)
        fallbacks = self.fallbacks(settings, drafter)
        speculative_ok = not any(f.feature == "speculation" for f in fallbacks)
        drafter = (drafter or self.mtp_drafter) if speculative_ok else None
        timer = PhaseTimer(self.trunk.device)
        dev = self.trunk.device
        gen = None
        if settings.seed is not None:
            gen = torch.Generator(device=dev).manual_seed(settings.seed)
        elif self.trunk.group is not None and settings.temperature > 0:
            # tensor parallelism: every rank must draw the same samples from the same (gathered) logits
            gen = torch.Generator(device=dev).manual_seed(self.trunk.group.shared_seed())
        ids = torch.tensor(prompt_ids, dtype=torch.long, device=dev)
        req = Request(seq=torch.empty(len(prompt_ids) + settings.max_new_tokens + 8, dtype=torch.long, device=dev),
                      length=0, prompt_len=len(prompt_ids), max_new=settings.max_new_tokens,
                      stop_ids=frozenset() if settings.ignore_eos else self.stop_ids,
                      sampling=SamplingParams(settings.temperature, settings.top_k, settings.top_p), generator=gen)
        req.append(ids)
        turns = self.turns
        if not settings.reuse:
            turns.reset()
        start, snap = turns.plan(prompt_ids, drafter)
        yield Started(len(prompt_ids), start, fallbacks)

        t0 = time.perf_counter()
        detok = TextStream(self.tokenizer)
        flight = Flight()
        ttft, ok, depth_cap = None, False, None
        with torch.inference_mode():
            try:
                if snap is not None:
                    turns.restore(snap, self.caches, drafter)
                elif start == 0:
                    self.caches.reset()
                    if drafter is not None:
                        drafter.reset()
                    turns.reset()
                turns.drafter = drafter
                if self.trunk.graphs is not None:  # one reservation for the request: no re-capture mid-reply
                    self.caches.kv.reserve(len(prompt_ids) - self.caches.processed + settings.max_new_tokens + 16)
                    if getattr(drafter, "graphs", None) is not None:
                        drafter.reserve(len(prompt_ids) - drafter.covered + settings.max_new_tokens + 16)
                if start < len(prompt_ids):
                    logits = prefill(self.trunk, self.caches, drafter, ids[start:], settings.prefill_chunk, timer)
                    turns.history = list(prompt_ids)
                    turns.take(len(prompt_ids), logits, self.caches, drafter)
                else:
                    logits = snap.logits
                with timer.phase("sampling"):
                    first = pick(logits, req)
                req.append(first)
                first_id = int(first[0])
                req.generated.append(first_id)
                if first_id in req.stop_ids:
                    req.finish = "eos"
                elif len(req.generated) >= req.max_new:
                    req.finish = "length"
                timer.collect()
                ttft = (time.perf_counter() - t0) * 1e3
                with timer.phase("detokenize"):
                    pieces = detok.pieces([first_id])
                yield Tokens([first_id], ["target"], "".join(pieces), pieces)
                sync = getattr(control, "sync", None)  # tensor parallelism: rank 0 decides depth and stop
                while req.finish is None:
                    if sync is not None:
                        sync()
                    if control.stopped:
                        req.finish = "stop"
                        break
                    depth = settings.depth if control.depth is None else control.depth
                    depth = max(0, int(depth)) if depth_cap is None else min(depth_cap, max(0, int(depth)))
                    try:
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
                    yield stats
                    yield Tokens(out, sources, "".join(pieces), pieces)
                ok = True
            except GeneratorExit:  # the consumer stopped reading: the committed state is consistent
                ok = True
                raise
            finally:
                drop_in_flight(self.caches, drafter, flight)  # a cycle launched ahead of a stop is not finished
                # What the caches hold is the committed sequence minus its last (unprocessed) token. After any
                # other exception the state is dropped, cleanly: the next request starts from zero.
                if ok:
                    turns.history = req.seq[: self.caches.processed].tolist()
                else:
                    self.caches.reset()
                    turns.reset()
        timer.collect(block=True)
        elapsed = time.perf_counter() - t0
        decode_s = max(elapsed - ttft / 1e3, 1e-9)
        stats = {
            "depth": settings.depth if control.depth is None else control.depth,
            "drafter": getattr(drafter, "name", None),
            "prompt_tokens": len(prompt_ids),
            "reused_tokens": start,
            "prefilled_tokens": len(prompt_ids) - start,
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
        }
        yield Finished(req.finish, stats, fallbacks)

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
        for graphs in (getattr(self.mtp_drafter, "graphs", None), getattr(self.mtp_drafter, "chains", None)):
            if graphs is not None:
                graphs.reset()  # (a captured step's closure holds the drafter)
        self.graph_runner = self.caches = self.mtp_drafter = self.turns = None
        self.trunk = self.loaded = None


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


def load_tokenizer(root: Path):
    from transformers import AutoTokenizer

    if not (root / "tokenizer.json").exists() and not (root / "tokenizer_config.json").exists():
        raise EngineError(f"{root}: no tokenizer files (tokenizer.json / tokenizer_config.json)")
    try:
        return AutoTokenizer.from_pretrained(str(root), local_files_only=True, trust_remote_code=False)
    except Exception as e:
        raise EngineError(f"{root}: tokenizer does not load ({str(e)[:200]})") from None


def load_engine(path: str | None = None, device: str | None = None, dtype: str | None = None,
                cuda_graphs: bool | None = None, tp=None, compile: bool | None = None) -> Engine:
    """Load `path`, or the best model discovered; out of memory at load moves on to the next candidate.
    tp: a tp.TPGroup: this process is one rank of a tensor-parallel group and loads only its shard."""
    if path is not None:
        return _load_engine(path, device, dtype, cuda_graphs, tp, compile)
    notes, tried = [], set()
    while True:
        candidate = default_model_path(exclude=tried)
        try:
            engine = _load_engine(candidate, device, dtype, cuda_graphs, tp, compile)
        except (torch.OutOfMemoryError, EngineError) as e:  # the next candidate, with the reason on record
            tried.add(candidate)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            why = "out of memory at load" if isinstance(e, torch.OutOfMemoryError) else "does not load"
            notes.append(Fallback("model", f"{Path(candidate).name}: {why} "
                                           f"({str(e).splitlines()[0][:160]}); trying the next candidate"))
            continue
        engine.loaded.fallbacks[:0] = notes
        return engine


def _load_engine(path, device, dtype, cuda_graphs, tp, compile=None) -> Engine:
    loaded = load(path, device, dtype, tp=tp)
    root = Path(loaded.path)
    tok = load_tokenizer(root)
    return Engine(loaded, tok, stop_ids_for(root, tok, loaded.raw_config), cuda_graphs, compile)


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
