"""`Context` = model weights + graph type + per-sequence memory; `decode` evaluates a batch.

MAIN: `decode(tokens, positions=None, seq=0, hidden=("post_norm",), layers=())` returns logits for
every row (or `logits="last"` / `None`) and the hidden states asked for: "post_norm" (the input of
the LM head, what the MTP head consumes), "pre_norm" (the residual stream after the last block) and
"layer:J" (the input of block J; J = n_layer gives post_norm).
MTP: `decode(tokens, positions, seq=0, hidden_in=h)` with one target hidden row per token; returns
logits and hidden["nextn"] (the normed output, fed back when chaining drafts) and "pre_norm".
Either: `ids_on_device=True` takes `tokens` as an int64 tensor on the model's device (a draft step's
argmax), unread.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specconv.archs.errors import SpecconvError
from specconv.runtime.backend import INVARIANT_DTYPES, batch_invariant
from specconv.runtime import step_graphs
from specconv.runtime.device import upload
from specconv.runtime.memory import Batch, Memory, SeqCheckpoint
from specconv.runtime.model import Model
from specconv.runtime.types import DecodeOutput, GraphType

ROLLBACK_MODES = ("snapshot", "checkpoint")
GDN_MODES = ("auto", "chunked", "recurrent")


class Context:
    def __init__(self, model: Model, graph_type: GraphType = GraphType.MAIN, n_seq: int = 1, n_ctx: int = 4096,
                 n_rs_seq: int = 8, rollback: str = "snapshot", gdn_mode: str = "auto",
                 state_dtype: torch.dtype | None = None, kv_from: "Context | None" = None):
        model.require(graph_type)
        if rollback not in ROLLBACK_MODES:
            raise SpecconvError(f"rollback must be one of {ROLLBACK_MODES}, not {rollback!r}")
        if gdn_mode not in GDN_MODES:
            raise SpecconvError(f"gdn_mode must be one of {GDN_MODES}, not {gdn_mode!r}")
        if n_seq < 1 or n_ctx < 1 or n_rs_seq < 0:
            raise SpecconvError("n_seq and n_ctx must be ≥ 1 and n_rs_seq ≥ 0")
        self.model, self.graph_type = model, graph_type
        self.rollback = rollback
        self.n_rs_seq = n_rs_seq if rollback == "snapshot" else 0
        self.gdn_mode = gdn_mode
        self.n_seq, self.n_ctx = n_seq, n_ctx
        g, hp = model.graph, model.hparams
        if state_dtype is None:  # the recurrence always runs at least in float32
            state_dtype = torch.float64 if model.dtype == torch.float64 else torch.float32
        layout = (g.main_layout(hp, state_dtype) if graph_type == GraphType.MAIN
                  else g.encoder_layout(hp) if graph_type == GraphType.ENCODER else g.mtp_layout(hp))
        placement = model.weights.placement
        self.memory = Memory(layout, n_seq, n_ctx, self.n_rs_seq, model.device, model.dtype,
                             layer_device=placement.layer_device if placement.multi else None)
        # A drafter with no memory of its own reads this (target) context's K/V (the Gemma 4 assistant).
        self.kv_from = kv_from
        if g.NEEDS_KV_FROM and kv_from is None:
            raise SpecconvError(f"{model.paths[0].name} attends to its target's K/V: create its context with "
                                "kv_from=<the target's context>")
        self.n_evaluated = 0  # tokens evaluated so far (statistics)
        self.n_decode_calls = 0
        # decode steps and verifications replayed as CUDA graphs where the model qualifies (step_graphs.py)
        self.graphs = step_graphs.StepGraphs(self) if step_graphs.enabled_for(self) else None

    # ---- evaluation ---------------------------------------------------------------------------
    def decode(self, tokens, positions=None, seq: int = 0, hidden: Sequence[str] = ("post_norm",),
               layers: Sequence[int] = (), hidden_in: torch.Tensor | None = None,
               logits: str | None = "all", ids_on_device: bool = False) -> DecodeOutput:
        """`ids_on_device`: `tokens` is a one-dimensional int64 tensor on the model's device (a draft
        step's argmax over the vocabulary, in range by construction), taken as it is: not read back to
        be checked, which would cost a host sync per draft on a GPU. The greedy MTP drafters feed each
        draft step the previous step's argmax this way (runtime/drafters/mtp.py); a graphed context
        copies them into its static token slot."""
        self.memory.check_seq(seq)
        if ids_on_device:
            self._check_device_ids(tokens)
            return self._evaluate(None, tokens, tokens.shape[0], positions, seq, hidden, layers, hidden_in, logits)
        # ids and positions are checked on the host and moved to the device once: nothing in a
        # decode reads a device tensor back (a host sync per call on a GPU; tests/runtime/test_backend.py)
        host = torch.as_tensor(tokens, dtype=torch.long, device="cpu").reshape(-1)
        n = host.shape[0]
        if n == 0:
            raise SpecconvError("decode: empty batch")
        if int(host.min()) < 0 or int(host.max()) >= self.model.vocab_size:
            raise SpecconvError(f"decode: token id out of range [0, {self.model.vocab_size})")
        return self._evaluate(host, None, n, positions, seq, hidden, layers, hidden_in, logits)

    def _check_device_ids(self, ids) -> None:
        """What ids taken unread must be (their shape, type and device are known without a read)."""
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype != torch.long or ids.shape[0] == 0:
            raise SpecconvError("decode: ids on the device must be a non-empty one-dimensional int64 tensor")
        dev = torch.device(self.model.device)  # "cuda" names the current device, an argmax's is "cuda:0"
        if ids.device.type != dev.type or dev.index not in (None, ids.device.index):
            raise SpecconvError(f"decode: token ids on {ids.device}, the model on {self.model.device}")

    def _evaluate(self, host: torch.Tensor | None, device_ids: torch.Tensor | None, n: int, positions, seq: int,
                  hidden: Sequence[str], layers: Sequence[int], hidden_in: torch.Tensor | None,
                  logits: str | None) -> DecodeOutput:
        """A batch of n token ids: checked values on the host (`host`) or a device tensor (`device_ids`)."""
        dev = self.model.device
        if positions is None:
            start = self.memory.n_past(seq)
            host_positions = list(range(start, start + n))
            positions = torch.arange(start, start + n, device=dev)
        else:
            given = torch.as_tensor(positions, dtype=torch.long, device="cpu").reshape(-1)
            if given.shape[0] != n:
                raise SpecconvError(f"decode: {n} tokens but {given.shape[0]} positions")
            if n > 1 and bool((given[1:] <= given[:-1]).any()):
                raise SpecconvError("decode: positions must increase within a batch")
            host_positions, positions = given.tolist(), upload(given, dev)
        if logits not in ("all", "last", None):
            raise SpecconvError("decode: logits must be 'all', 'last' or None")
        mtp = self.graph_type == GraphType.MTP
        if mtp and hidden_in is None:
            raise SpecconvError("MTP decode needs hidden_in: one target hidden row per token")
        if self.graph_type not in (GraphType.MAIN, GraphType.MTP):
            raise SpecconvError(f"graph type {self.graph_type.value} takes feature rows: use Context.encode")
        g, hp, w = self.model.graph, self.model.hparams, self.model.weights
        if self.kv_from is not None:  # nothing of its own to store: every decode reads the target's cells
            batch = Batch(self.memory, seq, positions, 0, [], host_positions)
        else:
            batch = self.memory.begin(seq, positions, host_positions)
        # bfloat16 / float16: every row computed as in a one-row batch (runtime/backend.py), so the
        # verification of k drafts gives each row the bits of a decode step
        graphed = self.graphs is not None and self.graphs.takes(n, hidden, layers)
        # a graph's host ids go in with its other static inputs (one host-to-device copy)
        tokens = device_ids if host is None else None if graphed else upload(host, dev)
        with torch.inference_mode(), batch_invariant(self.model.dtype in INVARIANT_DTYPES):
            h = None
            if mtp:
                width = hp.input_width  # the assistant takes target-width rows
                h = torch.as_tensor(hidden_in, device=dev).reshape(n, width).to(self.model.dtype)
            if graphed:
                ids = host.tolist() if host is not None else device_ids
                out = self.graphs.decode(ids, batch, hidden, logits, hidden_in=h)
            elif not mtp:
                out = self._main(tokens, batch, hidden, layers, _logit_rows(logits, n, dev))
            else:
                if self.kv_from is not None:
                    lg, z, pre = g.forward_mtp(w, hp, tokens, h, batch, kv_from=self.kv_from)
                else:
                    lg, z, pre = g.forward_mtp(w, hp, tokens, h, batch)
                if logits != "all":
                    lg = lg[_logit_rows(logits, n, dev)]
                out = DecodeOutput(logits=lg, hidden={"nextn": z, "pre_norm": pre})
        if self.kv_from is None:
            self.memory.commit(batch)
        self.n_evaluated += n
        self.n_decode_calls += 1
        out.positions = positions
        return out

    def encode(self, features: torch.Tensor) -> DecodeOutput:
        """ENCODER graph (EAGLE-3): target feature rows [n, 3·Ht] -> hidden["g"] [n, n_embd]; no memory.

        `logits` is empty ([n, 0]): an encoder has no output head."""
        if self.graph_type != GraphType.ENCODER:
            raise SpecconvError("encode() needs a context of graph type ENCODER")
        x = torch.as_tensor(features, device=self.model.device)
        if x.dim() != 2 or x.shape[0] == 0:
            raise SpecconvError("encode: features must be a non-empty [n, width] matrix")
        with torch.inference_mode(), batch_invariant(self.model.dtype in INVARIANT_DTYPES):
            g = self.model.graph.forward_encoder(self.model.weights, self.model.hparams, x.to(self.model.dtype))
        self.n_decode_calls += 1
        return DecodeOutput(logits=g.new_zeros(g.shape[0], 0), hidden={"g": g})

    def _main(self, tokens, batch, hidden, layers, logit_rows) -> DecodeOutput:
        hp = self.model.hparams
        want = set(layers)
        for name in hidden:
            if name.startswith("layer:"):
                want.add(int(name.split(":", 1)[1]))
            elif name not in ("post_norm", "pre_norm"):
                raise SpecconvError(f"unknown hidden state {name!r} (post_norm, pre_norm, layer:J)")
        bad = [j for j in want if not 0 <= j <= hp.num_hidden_layers]
        if bad:
            raise SpecconvError(f"layer:{bad[0]} out of range 0..{hp.num_hidden_layers}")
        lg, post, pre, per_layer = self.model.graph.forward_main(self.model.weights, hp, tokens, batch, want,
                                                                  self.gdn_mode, logit_rows)
        out = {}
        if "post_norm" in hidden:
            out["post_norm"] = post
        if "pre_norm" in hidden:
            out["pre_norm"] = pre
        for j, h in per_layer.items():
            out[f"layer:{j}"] = h
        return DecodeOutput(logits=lg, hidden=out)

    # ---- memory -------------------------------------------------------------------------------
    def n_past(self, seq: int = 0) -> int:
        self.memory.check_seq(seq)
        return self.memory.n_past(seq)

    def seq_rm(self, seq: int, from_pos: int) -> bool:
        """Forget positions ≥ from_pos of `seq`. False when a recurrent state for from_pos-1 is not
        held (further back than n_rs_seq, or checkpoint mode): then nothing changed."""
        self.memory.check_seq(seq)
        return self.memory.seq_rm(seq, from_pos)

    def checkpoint(self, seq: int = 0) -> SeqCheckpoint:
        self.memory.check_seq(seq)
        return self.memory.checkpoint(seq)

    def restore(self, seq: int, state: SeqCheckpoint):
        self.memory.check_seq(seq)
        self.memory.restore(seq, state)

    def clear(self, seq: int | None = None):
        if seq is not None:
            self.memory.check_seq(seq)
        self.memory.clear(seq)

    def recurrent_state(self, seq: int, layer: int):
        """(conv window, SSM state) of trunk block `layer` now, for tests."""
        return self.memory.recurrent_state(seq, layer)


def _logit_rows(logits: str | None, n: int, device) -> torch.Tensor | None:
    """The rows whose logits a decode returns: all (None), the last, or none."""
    if logits == "all":
        return None
    if logits == "last":  # made on the device: no host-to-device copy
        return torch.arange(n - 1, n, device=device)
    return torch.zeros(0, dtype=torch.long, device=device)
