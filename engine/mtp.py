"""The MTP head: fc([norm_e(embed(t_{p+1})); norm_h(h_p)]) -> full-attention decoder layer -> norm -> lm_head.

At position p it takes the trunk's hidden after the final norm and the next token, and predicts t_{p+2}. It has no
embedding or lm_head of its own (both are the trunk's) and its own KV cache. Chaining feeds back its own
post-`mtp.norm` hidden.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from . import fp8, int4, swiglu_triton
from .cache import KVCache
from .errors import EngineError
from .families import fuse_experts
from .fusion import fuse_all
from .model import first_pending
from .modules import quantize_like_releases
from .fp8_triton import install as install_fp8
from .cpu_linear import install as install_cpu_linear
from .linear16_triton import install as install_linear16
from .cycle_triton import argmax
from .norm_triton import add_then_norm, install as install_norms, two_norms, two_norms_check


class MTPUnusable(EngineError):
    """The checkpoint's mtp.* tensors do not make a head this engine can run (the trunk is fine)."""


class MTPHead(nn.Module):
    def __init__(self, config, family, n_layers: int):
        super().__init__()
        layer_cls, norm_cls = family.decoder_layer_class()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = norm_cls(H, eps=eps)
        self.pre_fc_norm_hidden = norm_cls(H, eps=eps)
        self.norm = norm_cls(H, eps=eps)
        self.layers = nn.ModuleList([layer_cls(config, 0) for _ in range(n_layers)])
        self.trunk = None  # set by build(); not a submodule (its weights belong to the trunk)
        self.one_launch_input = False  # norm_triton.two_norms for the input (attach decides)

    @staticmethod
    def layer_config(config, has_experts: bool):
        """A copy of the trunk config whose layer 0 is full attention, with an MoE MLP iff the checkpoint's is."""
        c = copy.deepcopy(config)
        c.layer_types = ["full_attention"]
        c.num_hidden_layers = 1
        if hasattr(c, "mlp_only_layers"):
            c.mlp_only_layers = [] if has_experts else [0]
        if hasattr(c, "decoder_sparse_step"):
            c.decoder_sparse_step = 1
        return c

    @classmethod
    def build(cls, family, config, trunk, n_layers, keys, files, dtype, quantize: str = "bf16") -> "MTPHead":
        """The head from its mtp.* tensors `keys` in `files`, bound to trunk; quantize: as model.load's."""
        if n_layers != 1:  # loading more would keep weights no step runs
            raise MTPUnusable(f"the checkpoint declares {n_layers} MTP layers; mtpchat drafts with one-layer MTP "
                              f"heads (every released Qwen3-Next / Qwen3.5 head has one)")
        has_experts = any(".mlp.experts." in k or k.endswith(".mlp.gate.weight") for k in keys)
        with torch.device("meta"):
            head = cls(cls.layer_config(config, has_experts), family, n_layers)
        expected = head.state_dict()
        sd = files.load(keys, device="cpu" if trunk.device.type == "cpu" else str(trunk.device))
        sd = {k[len("mtp."):]: v for k, v in sd.items()}
        if files.fp8:  # the head's linears are FP8 too (only its norms are not): as the trunk's (model.load)
            try:
                sd = fp8.adopt(head, sd, dtype, lambda k: files.root / files.file_of.get("mtp." + k, "?"),
                               named="mtp.")
            except EngineError as e:  # the trunk still chats
                raise MTPUnusable(str(e)) from None
            expected = head.state_dict()
        if files.int4 is not None:  # GPTQ / AWQ heads: 4-bit or bf16 linears, whichever the tensors are
            try:
                sd = int4.adopt(head, sd, files.int4, dtype, lambda k: files.root / files.file_of.get("mtp." + k, "?"),
                                named=lambda k: "mtp." + k)
            except EngineError as e:  # the trunk still chats
                raise MTPUnusable(str(e)) from None
            expected = head.state_dict()
        sd = fuse_experts(sd)
        missing = [k for k in expected if k not in sd]
        if missing:
            raise MTPUnusable(f"partial MTP head: tensor 'mtp.{missing[0]}' is missing "
                              f"({len(missing)} missing in all)")
        extra = [k for k in sd if k not in expected]
        if extra:
            raise MTPUnusable(f"unexpected MTP tensor 'mtp.{extra[0]}'")
        for k, t in expected.items():
            if tuple(sd[k].shape) != tuple(t.shape):
                raise MTPUnusable(f"MTP tensor 'mtp.{k}' has shape {tuple(sd[k].shape)}, expected {tuple(t.shape)}")
        head.load_state_dict({k: v if fp8.keeps_dtype(k, v) else v.to(dtype) for k, v in sd.items()}, strict=True,
                             assign=True)
        quantize_like_releases(head, quantize)
        head.to(trunk.device).eval()
        return head.attach(trunk)

    def attach(self, trunk) -> "MTPHead":
        """Bind the head to the trunk whose embedding and lm_head it uses; fuse its projections (fusion.py)."""
        self.trunk = trunk
        fuse_all(self.layers)
        install_norms(self.modules(), trunk.device, trunk.dtype)  # as the trunk's (model.choose_norm)
        install_fp8(self.modules(), trunk.device, trunk.dtype)  # the head's FP8 linears (model.choose_fp8)
        install_linear16(self.modules(), trunk.device, trunk.dtype)  # its 16-bit ones (model.choose_linear16)
        install_cpu_linear(self.modules(), trunk.device, trunk.dtype)  # its float32 ones (model.choose_cpu_linear)
        int4.choose(None, self.modules(), trunk.device, trunk.dtype)  # and its 4-bit ones
        swiglu_triton.install(None, self.modules(), trunk.device, trunk.dtype)  # its MLP's activation
        # its input (the embedding's gather, both norms, the cat) in one launch where that equals the torch form
        self.one_launch_input = two_norms_check(trunk.embed, self.pre_fc_norm_embedding, self.pre_fc_norm_hidden)
        return self

    def new_cache(self) -> KVCache:
        c = self.trunk.config
        return KVCache(1, c.num_key_value_heads, c.head_dim, self.trunk.dtype, self.trunk.device,
                       fp8=self.trunk.backends.kv_cache == "fp8")

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, pos: int, cache: KVCache, last_only: bool = False,
                row: torch.Tensor | None = None, rope=None, upcast: bool = True, into: torch.Tensor | None = None,
                argmax_of: torch.Tensor | None = None):
        """hidden [1, T, H] at positions pos..pos+T-1, tokens [1, T] = the token after each position.

        Returns (logits [1, T, V] float32, post-norm hidden [1, T, H]); with last_only, logits of the last
        position only (priming a long prompt must not materialise T x vocab logits); with row (a device index [1]),
        the logits and hidden of that position only, the hidden written into `into` [1, 1, H] where given (a
        cycle graph's buffer: no copy after); rope: the trunk's (cos, sin) of these positions, when it has them;
        upcast=False: logits in the lm_head's dtype (Trunk.logits), for greedy drafting's argmax; argmax_of: logits
        [T, V] whose argmax the tokens are, written into tokens first (a greedy chain's previous step: in the input's
        launch where the argmax kernel is chosen). Writes KV at pos..pos+T-1.
        """
        trunk = self.trunk
        if argmax_of is not None and not (self.one_launch_input and trunk.backends.argmax == "triton"):
            argmax(argmax_of, trunk.backends, out=tokens)  # (no kernel to fold it into)
            argmax_of = None
        x = (two_norms(trunk.embed, self.pre_fc_norm_embedding, self.pre_fc_norm_hidden, tokens, hidden, argmax_of)
             if self.one_launch_input else None)
        if x is None:
            if argmax_of is not None:  # (two_norms declined: nothing launched)
                argmax(argmax_of, trunk.backends, out=tokens)
            x = torch.cat([self.pre_fc_norm_embedding(trunk.embed(tokens)), self.pre_fc_norm_hidden(hidden)], -1)
        h = self.fc(x)  # embedding first, hidden second
        pos = trunk.positions(pos, h.shape[1])
        cos, sin = rope or trunk.rope(pos, h.shape[1])
        step = trunk.layer_step(pos)
        h, pending = step(trunk, self.layers[0], "full_attention", h, first_pending(step, h), pos, cos, sin,
                          cache.layer(0), None)
        out = add_then_norm(self.norm, h, pending)[1]
        if row is not None:
            out = out.index_select(1, row) if into is None else torch.index_select(out, 1, row, out=into)
        elif last_only:
            out = out[:, -1:]
        return trunk.logits(out, upcast), out
