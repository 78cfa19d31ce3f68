"""Out-of-memory fallbacks: at load the next candidate is tried; while decoding the depth is lowered once."""

from dataclasses import replace

import pytest
from fixtures import oom, oom_on_the_second_verify, tokens_of

import engine.api as api
from engine import GenerationSettings
from engine.errors import EngineError
from engine.events import Fallback, Tokens


def test_oom_at_load_moves_to_the_next_candidate(ckpt, monkeypatch):
    big, small = str(ckpt("next_moe")), str(ckpt("next"))
    order = iter([big, small])
    monkeypatch.setattr(api, "default_model_path", lambda exclude=frozenset(): next(order))
    real = api.load

    def load(path, *a, **k):
        if path == big:
            oom()
        return real(path, *a, **k)

    monkeypatch.setattr(api, "load", load)
    engine = api.load_engine()
    assert engine.info.path == small
    assert any(f.feature == "model" and "out of memory at load" in f.reason for f in engine.loaded.fallbacks)


def test_a_candidate_that_does_not_load_is_skipped_with_the_reason(ckpt, tmp_path, monkeypatch):
    """The automatic pick moves on from a model that fails to load (here a corrupt config.json), as from one that
    does not fit, and says why."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(ckpt("next"), broken)
    (broken / "config.json").write_text("{not json")
    good = str(ckpt("next_moe"))
    order = iter([str(broken), good])
    monkeypatch.setattr(api, "default_model_path", lambda exclude=frozenset(): next(order))
    engine = api.load_engine()
    assert engine.info.path == good
    notes = [f.reason for f in engine.loaded.fallbacks if f.feature == "model"]
    assert notes and notes[0].startswith("broken: does not load (") and "config.json" in notes[0]


def test_oom_at_load_of_every_candidate_is_one_clear_error(ckpt, monkeypatch):
    monkeypatch.setattr(api, "load", lambda *a, **k: oom())
    monkeypatch.setattr(api, "EMBEDDED", ckpt("next"))
    monkeypatch.setattr("engine.discovery.discover", lambda *a, **k: [])
    with pytest.raises(EngineError, match="no candidate model loads"):
        api.load_engine()


def test_oom_while_decoding_lowers_depth_once_then_errors(engines, monkeypatch):
    engine = engines("next")
    prompt = engine.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}])
    settings = GenerationSettings(max_new_tokens=20, depth=4, ignore_eos=True)
    plain = tokens_of(engine.generate(prompt, GenerationSettings(max_new_tokens=20, depth=0, ignore_eos=True)))
    monkeypatch.setattr(engine.trunk, "forward", oom_on_the_second_verify(engine.trunk.forward))
    events = list(engine.generate(prompt, settings))
    out = tokens_of(events)
    notes = [e for e in events if isinstance(e, Fallback)]
    assert out == plain  # decoding went on from the last committed state
    assert len(notes) == 1 and "depth lowered to 2" in notes[0].reason
    assert any(f.feature == "memory" for f in events[-1].fallbacks)

    monkeypatch.setattr(engine.trunk, "forward", lambda tokens, *a, **k: oom() if tokens.shape[1] >= 1 else None)
    with pytest.raises(EngineError, match="out of memory while decoding"):
        for _ in engine.generate(prompt, settings):
            pass


def oom_on_prefill_wider_than(forward, width: int):
    """forward, except that a prefill pass (verify=False) of more than `width` tokens runs out of memory."""
    def flaky(tokens, pos, caches, verify, *a, **k):
        if not verify and tokens.shape[1] > width:
            oom()
        return forward(tokens, pos, caches, verify, *a, **k)

    return flaky


def test_oom_while_prefilling_retries_the_prompt_from_its_start_in_narrower_chunks_once(engines, monkeypatch):
    """A prefill chunk that runs out of memory may have written part of the state in place: the prompt is
    prefilled again from its start (a reused prefix too) in chunks a quarter as wide, with the fallback said, and
    the reply is the one without the failure; when those run out too, one clear error, and the next request is
    exact."""
    engine = engines("next")
    words = " ".join(f"cat{i % 13} sun{i % 7}" for i in range(40))
    prompt = engine.encode_chat([{"role": "user", "content": f"Summarise: {words}"}])
    settings = GenerationSettings(max_new_tokens=16, depth=2, ignore_eos=True, prefill_chunk=128, reuse=False)
    assert len(prompt) > 128
    plain = tokens_of(engine.generate(prompt, settings))
    forward = engine.trunk.forward
    monkeypatch.setattr(engine.trunk, "forward", oom_on_prefill_wider_than(forward, 64))
    events = list(engine.generate(prompt, settings))
    notes = [e for e in events if isinstance(e, Fallback)]
    assert tokens_of(events) == plain
    assert len(notes) == 1 and "in 128-token chunks" in notes[0].reason and "in 64-token chunks" in notes[0].reason
    assert events[-1].stats["prefilled_tokens"] == len(prompt)

    # a follow-up turn that reuses the first one's state: prefilled again from zero, the same tokens
    monkeypatch.setattr(engine.trunk, "forward", forward)
    list(engine.generate(prompt, replace(settings, reuse=True)))
    turn = engine.turns.history + engine.encode_chat([{"role": "user", "content": f"Again: {words}"}])[1:]
    monkeypatch.setattr(engine.trunk, "forward", oom_on_prefill_wider_than(forward, 64))
    events = list(engine.generate(turn, replace(settings, reuse=True)))
    assert events[-1].stats["reused_tokens"] == 0 and any(isinstance(e, Fallback) for e in events)
    monkeypatch.setattr(engine.trunk, "forward", forward)
    assert tokens_of(events) == tokens_of(engine.generate(turn, settings))  # (reuse=False: from zero)

    monkeypatch.setattr(engine.trunk, "forward", oom_on_prefill_wider_than(forward, 0))
    with pytest.raises(EngineError, match="out of memory while prefilling the prompt in 64-token chunks"):
        for _ in engine.generate(prompt, settings):
            pass
    monkeypatch.setattr(engine.trunk, "forward", forward)
    assert tokens_of(engine.generate(prompt, settings)) == plain


def test_oom_after_an_in_place_decoding_step_is_not_retried(ckpt, engines, monkeypatch):
    """Plain decoding's graph step writes the state in place, so a cycle that fails after it cannot be retried
    from the last committed state (that would process the token twice): the request fails with a clear error,
    the state is dropped, and the next request decodes exactly."""
    from engine import load_engine

    engine = load_engine(str(ckpt("next")), cuda_graphs=True)  # on the CPU a re-run stands in for each graph
    prompt = engine.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}])
    settings = GenerationSettings(max_new_tokens=12, depth=0, ignore_eos=True)
    plain = tokens_of(engines("next").generate(prompt, settings))
    calls = {"n": 0}
    keep = engine.mtp_drafter.keep

    def flaky(hidden):
        calls["n"] += 1
        if calls["n"] == 4:  # the prefill, then the third plain step
            oom()
        return keep(hidden)

    monkeypatch.setattr(engine.mtp_drafter, "keep", flaky)
    with pytest.raises(EngineError, match="in an in-place step .*OutOfMemoryError.*state was dropped"):
        for _ in engine.generate(prompt, settings):
            pass
    assert engine.caches.processed == 0  # dropped, cleanly
    monkeypatch.setattr(engine.mtp_drafter, "keep", keep)
    out = tokens_of(engine.generate(prompt, settings))
    assert out == plain and engine.diagnostics()["compile"]["cuda_graphs"]["decode"]["replays"]["1"] > 5


# the CPU's dtype by memory --------------------------------------------------------------------------------
def memory_between_the_dtypes(path, monkeypatch):
    """Patch the host's available memory to halfway between what the model needs in bfloat16 and in float32;
    returns (its need in float32, in bfloat16)."""
    from engine import environment
    from engine.discovery import estimate_memory, inspect_model

    cand, cpu = inspect_model(path), environment.cpu_device()
    (_, f32), (_, bf16) = estimate_memory(cand, cpu, "float32"), estimate_memory(cand, cpu, "bfloat16")
    assert bf16 < f32
    monkeypatch.setattr(environment, "cpu_memory", lambda: (8 << 30, (bf16 + f32) // 2))
    return f32, bf16


@pytest.mark.parametrize("name", ["next", "q35_moe"])
def test_a_model_that_fits_the_cpu_only_in_bfloat16_runs_in_bfloat16_with_the_reason(name, ckpt, monkeypatch):
    """Discovery and the loader agree: float32 when it fits (the exact reference), else bfloat16 with the reason,
    where the model would otherwise not fit at all. The reply still drafts, accepts and rejects."""
    import torch
    from engine import environment
    from engine.discovery import choose, fallbacks_for, inspect_model

    path = ckpt(name)
    f32, bf16 = memory_between_the_dtypes(path, monkeypatch)
    cpu = environment.cpu_device()
    cand = inspect_model(path, device=cpu)
    assert (cand.run_dtype, cand.mem_bytes, cand.fits_device) == ("bfloat16", bf16, True)
    assert cand.dtype_reason.startswith("float32 needs") and "running in bfloat16" in cand.dtype_reason
    assert choose([cand], cpu).candidate is not None  # (in float32 it would not fit: no pick)
    reasons = {f["feature"]: f["reason"] for f in fallbacks_for(cpu, cand)}
    assert reasons["dtype"] == cand.dtype_reason and "in bfloat16 with torch kernels" in reasons["cuda"]

    engine = api.load_engine(str(path), device="cpu")
    assert engine.trunk.dtype == torch.bfloat16
    assert [f.reason for f in engine.loaded.fallbacks if f.feature == "dtype"] == [cand.dtype_reason]
    events = list(engine.generate(engine.encode_chat([{"role": "user", "content": "Hello"}]),
                                  GenerationSettings(max_new_tokens=24, depth=3, ignore_eos=True)))
    assert 0 < events[-1].stats["accepted"] < events[-1].stats["drafted"]
    assert sum(len(e.token_ids) for e in events if isinstance(e, Tokens)) == 24

    insisted = api.load_engine(str(path), device="cpu", dtype="float32")  # the user's --dtype stands
    assert insisted.trunk.dtype == torch.float32 and not any(f.feature == "dtype" for f in insisted.loaded.fallbacks)


def test_the_cpu_keeps_float32_when_it_fits_and_takes_bfloat16_when_neither_fits(ckpt, monkeypatch):
    """float32 whenever it fits; when even bfloat16 does not, the picker passes the model over and, asked for it
    by path, the loader tries bfloat16: its best chance."""
    import torch
    from engine import environment
    from engine.discovery import inspect_model

    path = ckpt("next")
    f32, bf16 = memory_between_the_dtypes(path, monkeypatch)
    for available, dtype, fits in ((f32 + (1 << 20), torch.float32, True),
                                   (bf16 - (1 << 20), torch.bfloat16, False)):
        monkeypatch.setattr(environment, "cpu_memory", lambda: (8 << 30, available))
        cand = inspect_model(path, device=environment.cpu_device())
        assert (cand.run_dtype, cand.fits_device, bool(cand.dtype_reason)) == (str(dtype)[6:], fits, not fits)
        assert api.load_engine(str(path), device="cpu").trunk.dtype == dtype
