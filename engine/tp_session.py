"""Tensor parallelism for a long-lived session (the chat): rank 0 owns the UI and the command stream, the other
ranks follow. Every command rank 0 runs is first broadcast to the followers; inside a reply, depth and stop are
decided on rank 0 and broadcast once per cycle, so every rank runs the same cycle with the same depth.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict

import torch
import torch.distributed as dist

from .api import DecodeControl, GenerationSettings, load_engine
from .errors import EngineError
from .limits import AUTO
from .tp import DEFAULT_TIMEOUT_S, _backend_and_devices, _free_port, check_split, die_with_parent, init_group


AUTO_CODE = -2  # --depth auto in the per-cycle broadcast (-1: no depth set)


class SyncedControl(DecodeControl):
    """A DecodeControl whose per-cycle values come from rank 0 (`leader` is rank 0's own control)."""

    def __init__(self, group, leader: DecodeControl | None = None):
        super().__init__(leader.depth if leader is not None else None)
        self.group, self.leader = group, leader

    def sync(self) -> None:
        """Called by the decode loop at the top of every cycle, on every rank (a collective)."""
        t = torch.tensor([-1, 0], dtype=torch.long, device=self.group.device)
        if self.leader is not None:
            depth = self.leader.depth
            t[0] = -1 if depth is None else AUTO_CODE if depth == AUTO else int(depth)
            t[1] = int(self.leader.stopped)
        self.group.broadcast_(t)
        depth, stop = t.tolist()
        self.depth = None if depth == -1 else AUTO if depth == AUTO_CODE else depth
        if stop:
            self.stop()

    def agree(self, depth: int) -> int:
        """--depth auto: rank 0's pick for this cycle (each rank's chooser times its own cycles, and every rank
        must run the same depth)."""
        t = torch.tensor([depth], dtype=torch.long, device=self.group.device)
        self.group.broadcast_(t)
        return int(t.item())


def _send(group, command) -> list:
    box = [command]
    dist.broadcast_object_list(box, src=group.src, group=group.pg)
    return box


def _follower(rank: int, world: int, port: int, kind: str, model, device, dtype, parent: int,
              max_context: int | None = None) -> None:
    die_with_parent(parent)  # a follower ends with the chat, however the chat ends
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    sys.stdout = sys.stderr = open(os.devnull, "w")  # the terminal belongs to rank 0's UI
    if kind == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    group = init_group(rank, world, kind)
    # the same context limit as rank 0: a reply clipped at the limit must end at the same cycle on every rank
    engine = load_engine(model, None if kind == "cpu" else "cuda", dtype, tp=group, max_context=max_context)
    while True:
        command = _send(group, None)[0]
        if command[0] == "chat":
            for _ in engine.chat(command[1], GenerationSettings(**command[2]), SyncedControl(group)):
                pass
        elif command[0] == "warm_up":  # the leader's plan, step for step: the same collectives in the same order
            engine.warm_up(depths=command[1])
        else:  # "close"
            break
    dist.destroy_process_group()
    os._exit(0)


class TPLeader:
    """Rank 0 of a chat session: behaves like an Engine for the app's decode thread."""

    def __init__(self, model: str | None, device: str | None, dtype: str | None, world: int,
                 max_context: int | None = None):
        import torch.multiprocessing as mp

        if model is None:
            from .api import default_model_path

            model = default_model_path()  # every rank must load the same checkpoint
        kind = _backend_and_devices(device, world)
        check_split(world, model)  # heads that do not split fail here, before any process starts
        port = _free_port()
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE=str(world))
        ctx = mp.get_context("spawn")
        self.followers = [ctx.Process(target=_follower, args=(r, world, port, kind, model, device, dtype,
                                                              os.getpid(), max_context),
                                      name=f"mtpchat-tp{r}", daemon=True) for r in range(1, world)]
        try:
            for p in self.followers:
                p.start()
            self.group = init_group(0, world, kind, timeout_s=DEFAULT_TIMEOUT_S)
            self.engine = load_engine(model, None if kind == "cpu" else "cuda", dtype, tp=self.group,
                                      max_context=max_context)
        except BaseException:
            self._kill()
            raise

    def __getattr__(self, name):  # info, tokenizer, diagnostics(), ... are rank 0's
        return getattr(self.engine, name)

    def chat(self, messages, settings: GenerationSettings, control: DecodeControl | None = None):
        dead = [p.name for p in self.followers if not p.is_alive()]
        if dead:
            raise EngineError(f"tensor-parallel worker {dead[0]} has exited: restart mtpchat")
        _send(self.group, ("chat", messages, asdict(settings)))
        return self.engine.chat(messages, settings, SyncedControl(self.group, control or DecodeControl()))

    def warm_up(self, depths=(0, 1, 2, 3), progress=None) -> dict:
        """Engine.warm_up on every rank at once (each step's collectives need all of them). A progress callback
        that raises (the chat quitting) stops rank 0 only: the others then wait in a collective until close()
        terminates them."""
        depths = list(depths)
        _send(self.group, ("warm_up", depths))
        return self.engine.warm_up(depths=depths, progress=progress)

    def close(self) -> None:
        try:
            _send(self.group, ("close",))
            for p in self.followers:
                p.join(timeout=10)
        finally:
            self._kill()
            if dist.is_initialized():
                dist.destroy_process_group()

    def _kill(self) -> None:
        for p in self.followers:
            if p.pid is not None and p.is_alive():
                p.terminate()


def loader(world: int, max_context: int | None = None):
    """An app loader (model, device, dtype) -> engine that starts a tensor-parallel session of `world` ranks."""
    def load(model, device, dtype):
        return TPLeader(model, device, dtype, world, max_context)

    return load
