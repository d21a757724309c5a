"""Per-sequence memory of a context: attention KV cells and Gated DeltaNet state with snapshots.

Attention: every layer has K/V buffers [n_seq, n_ctx, nkv, hd]; a sequence's cells are appended in
order and each remembers its position (the mask compares positions, so rope stays relative and the
row conventions of the MTP head need no special casing). `seq_rm(seq, p)` drops the cells with
position ≥ p, which is a length change.

Recurrent (Gated DeltaNet) layers: every layer has a ring of slots per sequence holding the conv
window [K-1, C] (the last K-1 inputs, oldest first) and the SSM state [nv, dk, dv] (float32;
float64 in a float64 context) after some position; all layers share one bookkeeping per sequence
(`slot_pos`, `cur`). Evaluating n tokens
gives the slots after `cur` to the states after each of the last min(n, R+1) tokens and moves `cur`
to the last one; the R+1 most recent states are held (R = `n_rs_seq`). Rolling back to position p
means finding the slot of the state after p-1 and making it current, with no re-evaluation.

A batch of several tokens writes only its last SSM state: the others stay *pending* (gdn.PendingStates:
the state before the batch plus per-token vectors, a few KB) and a rollback builds the one state it
keeps. A verification of k+1 tokens so writes one 1 MB state per layer instead of k+1 (measured in
docs/benchmarks.md, "Rollback of the recurrent state"). The ring has one slot more than it holds
(R+2), so a batch never writes over the slot its pending states start from; that slot is held
intact until a later batch writes over it, at which point the pending states that start from it
are dropped (`seq_rm` to them returns False, as for any state the ring no longer holds). Rolling
back into the latest batch, or over single-token steps, is therefore always within reach.
R = 0 is the checkpoint mode, in which only whole-sequence removal or `restore` of a `checkpoint`
can move the state back.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

import torch

from specconv.archs.errors import SpecconvError
from specconv.runtime.backend import for_device
from specconv.runtime.device import upload
from specconv.runtime.placement import active_device

EMPTY = -2  # slot holds nothing valid
BEFORE_START = -1  # slot holds the zero state before position 0
# the position an unwritten cell of a whole K/V buffer shows: after every query, so no causal or
# windowed mask lets a query see it
UNWRITTEN = 1 << 62


@dataclass
class MemoryLayout:
    """What one graph needs: attention layer shapes and recurrent layer shapes (by graph-local index)."""

    attn_layers: list[int]  # graph layer ids with a KV cache
    num_key_value_heads: int
    head_dim: int
    rec_layers: list[int]  # graph layer ids with recurrent state
    conv_channels: int = 0
    conv_kernel: int = 0
    ssm_heads: int = 0
    ssm_dk: int = 0
    ssm_dv: int = 0
    state_dtype: torch.dtype = torch.float32  # of the SSM state and the delta-rule arithmetic
    # per-layer (n_head_kv, head_dim) where layers differ (Gemma 4: sliding vs full layers)
    layer_shapes: dict[int, tuple[int, int]] = field(default_factory=dict)
    # > 0: a layer's V cells are the first value_width entries of its K cells (multi-head latent
    # attention's latent row [c | k_pe], whose c is the value): views, no buffer, each entry written
    # once (Batch.attend_kv)
    value_width: int = 0


@dataclass
class SeqCheckpoint:
    """A saved sequence: its cell count and the current recurrent state of every layer."""

    n_cells: int
    slot_pos: int
    conv: list[torch.Tensor]
    ssm: list[torch.Tensor]


class Memory:
    def __init__(self, layout: MemoryLayout, n_seq: int, n_ctx: int, n_rs_seq: int, device, dtype,
                 layer_device=None):
        """`layer_device(l)`: where layer l's cells live when the model spans devices (placement.py)."""
        self.layout = layout
        self.n_seq, self.n_ctx = n_seq, n_ctx
        self.ring = n_rs_seq + 1  # states held
        # physical slots: a spare keeps a batch's starting state intact, also when one state is held
        # (plain decoding): a step then never writes the slot it reads, which lets the CUDA backend
        # run the short conv inside the delta rule's launch (gdn.Recurrence.conv_delta_rule)
        self.slots = self.ring + 1
        self.device, self.dtype = device, dtype
        where = layer_device or (lambda _l: device)

        def shape(l):
            return (n_seq, n_ctx) + tuple(layout.layer_shapes.get(l, (layout.num_key_value_heads, layout.head_dim)))

        self.k = {l: torch.zeros(shape(l), dtype=dtype, device=where(l)) for l in layout.attn_layers}
        self.v = {l: self.k[l][..., :layout.value_width] if layout.value_width
                  else torch.zeros(shape(l), dtype=dtype, device=where(l)) for l in layout.attn_layers}
        # UNWRITTEN where no cell is: a batch's view of the whole buffer is this with its own cells set
        self.cell_pos = torch.full((n_seq, n_ctx), UNWRITTEN, dtype=torch.long, device=device)
        # the same positions on the host: bookkeeping never reads the device tensor back
        self.cell_pos_host: list[list[int]] = [[] for _ in range(n_seq)]
        self.n_cells = [0] * n_seq
        # conv windows token-major [K-1, C]: a window is K-1 whole rows of the inputs, copied as they are
        self.conv = {l: torch.zeros(n_seq, self.slots, layout.conv_kernel - 1, layout.conv_channels,
                                    dtype=layout.state_dtype, device=where(l)) for l in layout.rec_layers}
        self.ssm = {l: torch.zeros(n_seq, self.slots, layout.ssm_heads, layout.ssm_dk, layout.ssm_dv,
                                   dtype=layout.state_dtype, device=where(l)) for l in layout.rec_layers}
        self.slot_pos = [[EMPTY] * self.slots for _ in range(n_seq)]
        # slot -> (Pending of its batch, index in the batch's kept states) for states not yet written
        self.pending: list[dict[int, tuple["Pending", int]]] = [{} for _ in range(n_seq)]
        self.cur = [0] * n_seq
        self.last_pos = [-1] * n_seq  # highest position evaluated in the sequence
        for s in range(n_seq):
            self.slot_pos[s][0] = BEFORE_START
        self._pending = None

    # ---- bookkeeping --------------------------------------------------------------------------
    def check_seq(self, seq: int):
        if not 0 <= seq < self.n_seq:
            raise SpecconvError(f"sequence {seq} out of range (the context has {self.n_seq})")

    def n_past(self, seq: int) -> int:
        return self.last_pos[seq] + 1

    @property
    def has_recurrent(self) -> bool:
        return bool(self.layout.rec_layers)

    def begin(self, seq: int, positions: torch.Tensor, host_positions: list[int]) -> "Batch":
        """Reserve cells for a batch (its positions on the device and, the same, on the host); layers
        then write/read through the returned Batch."""
        n = positions.shape[0]
        start = self.n_cells[seq]
        if start + n > self.n_ctx:
            raise SpecconvError(f"context full: sequence {seq} has {start} cells, {n} more exceed n_ctx={self.n_ctx}")
        first = host_positions[0]
        if first <= self.last_pos[seq]:
            raise SpecconvError(f"position {first} is not after the last position {self.last_pos[seq]} "
                                f"of sequence {seq}; remove it with seq_rm first")
        keep = min(n, self.ring)
        slots = [(self.cur[seq] + 1 + i) % self.slots for i in range(keep)]
        return Batch(self, seq, positions, start, slots, host_positions, src_slot=self.cur[seq])

    def commit(self, batch: "Batch"):
        seq, n = batch.seq, len(batch.host_positions)
        self.cell_pos[seq, batch.start:batch.start + n] = batch.positions
        self.cell_pos_host[seq][batch.start:] = batch.host_positions
        self.n_cells[seq] = batch.start + n
        kept = batch.host_positions[n - len(batch.slots):]
        if self.has_recurrent:
            written = set(batch.slots)
            pend = self.pending[seq]
            for slot in [s for s, (p, _) in pend.items() if s in written or p.base in written]:
                if slot not in written:  # its starting state is overwritten: no longer held
                    self.slot_pos[seq][slot] = EMPTY
                del pend[slot]
            if batch.pending is not None:
                for i, slot in enumerate(batch.slots[:-1]):
                    pend[slot] = (batch.pending, i)
        for slot, pos in zip(batch.slots, kept):
            self.slot_pos[seq][slot] = pos
        self.cur[seq] = batch.slots[-1]
        spare = (self.cur[seq] + 1) % self.slots  # the spare: R+1 states held
        self.slot_pos[seq][spare] = EMPTY
        self.pending[seq].pop(spare, None)
        self.last_pos[seq] = batch.host_positions[-1]

    # ---- rollback -----------------------------------------------------------------------------
    def seq_rm(self, seq: int, from_pos: int) -> bool:
        """Forget positions ≥ from_pos. False (nothing changed) when a recurrent state for
        from_pos-1 is not in the ring."""
        from_pos = max(from_pos, 0)
        if from_pos > self.last_pos[seq]:
            return True
        if from_pos == 0:
            self.clear(seq)
            return True
        if self.has_recurrent:
            slots = self.slot_pos[seq]
            if (from_pos - 1) not in slots:
                return False
            self.cur[seq] = slots.index(from_pos - 1)
            self._materialize(seq, self.cur[seq])
            pend = self.pending[seq]
            for i, p in enumerate(slots):
                if p >= from_pos:
                    slots[i] = EMPTY
                    pend.pop(i, None)
        self._truncate_cells(seq, from_pos)
        self.last_pos[seq] = from_pos - 1
        return True

    def _materialize(self, seq: int, slot: int):
        """Write a pending state into its slot (every recurrent layer)."""
        entry = self.pending[seq].pop(slot, None)
        if entry is None:
            return
        pending, i = entry
        for l, states in pending.layers.items():
            states.state(i, out=self.ssm[l][seq, slot])

    def _truncate_cells(self, seq: int, from_pos: int):
        n = self.n_cells[seq]
        keep = bisect_left(self.cell_pos_host[seq], from_pos)  # cells are in increasing positions
        self.cell_pos[seq, keep:n] = UNWRITTEN
        del self.cell_pos_host[seq][keep:]
        self.n_cells[seq] = keep

    def clear(self, seq: int | None = None):
        for s in range(self.n_seq) if seq is None else [seq]:
            self.n_cells[s] = 0
            self.cell_pos[s] = UNWRITTEN
            self.cell_pos_host[s] = []
            self.last_pos[s] = -1
            self.slot_pos[s] = [EMPTY] * self.slots
            self.slot_pos[s][0] = BEFORE_START
            self.cur[s] = 0
            self.pending[s] = {}
            for l in self.layout.rec_layers:
                self.conv[l][s, 0].zero_()
                self.ssm[l][s, 0].zero_()

    def checkpoint(self, seq: int) -> SeqCheckpoint:
        c = self.cur[seq]
        return SeqCheckpoint(
            n_cells=self.n_cells[seq],
            slot_pos=self.slot_pos[seq][c],
            conv=[self.conv[l][seq, c].clone() for l in self.layout.rec_layers],
            ssm=[self.ssm[l][seq, c].clone() for l in self.layout.rec_layers],
        )

    def restore(self, seq: int, state: SeqCheckpoint):
        """Back to a checkpoint. The attention cells before it must still be the same ones
        (true when the sequence was only extended, or cut back no further than the checkpoint)."""
        if self.n_cells[seq] < state.n_cells:
            raise SpecconvError("restore: the sequence was cut back past its checkpoint; its attention cells are gone")
        # a checkpoint of an empty sequence keeps no cell at all
        self._truncate_cells(seq, self.cell_pos_host[seq][state.n_cells - 1] + 1 if state.n_cells else 0)
        self.slot_pos[seq] = [EMPTY] * self.slots
        self.cur[seq] = 0
        self.pending[seq] = {}
        self.slot_pos[seq][0] = state.slot_pos
        for l, conv, ssm in zip(self.layout.rec_layers, state.conv, state.ssm):
            self.conv[l][seq, 0].copy_(conv)
            self.ssm[l][seq, 0].copy_(ssm)
        self.last_pos[seq] = self.cell_pos_host[seq][state.n_cells - 1] if state.n_cells else state.slot_pos

    def cells(self, seq: int, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(K, V, positions) of the committed cells of an attention layer: read access for a drafter
        that attends to this memory without owning any (the Gemma 4 assistant)."""
        n = self.n_cells[seq]
        return self.k[layer][seq, :n], self.v[layer][seq, :n], self.cell_pos[seq, :n]

    def recurrent_state(self, seq: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The current (conv, ssm) state of a recurrent layer, for tests and drafters."""
        c = self.cur[seq]
        return self.conv[layer][seq, c], self.ssm[layer][seq, c]


class Pending:
    """The pending states of one batch: per recurrent layer a gdn.PendingStates, all starting from the
    state in slot `base` (the slot current before the batch)."""

    def __init__(self, base: int):
        self.base = base
        self.layers: dict = {}


class _HostValueOfAReplayableBatch:
    """Stands for a host integer a replayable batch does not have (Batch.replayable): any use raises,
    so a forward that would bake a stale start, slot or position into a captured graph fails."""

    def _refuse(self, *args, **kwargs):
        raise SpecconvError("a replayable batch's addresses are device tensors (BatchIndex); this forward "
                            "reads a host integer of the batch, which a captured graph would replay stale")

    __index__ = __int__ = __add__ = __radd__ = __sub__ = __rsub__ = __iter__ = __len__ = __getitem__ = _refuse
    __lt__ = __le__ = __gt__ = __ge__ = __eq__ = __hash__ = __bool__ = _refuse


NOT_ON_HOST = _HostValueOfAReplayableBatch()


@dataclass
class BatchIndex:
    """A batch's addresses as int64 tensors on one device: its positions, the K/V cell of each token,
    the ring slot of the recurrent state before it (`src_slot`, one) and the slots of the states after
    its kept tokens (`dst_slots`). A forward that takes its addresses from here reads no host integer
    of the batch, so a captured CUDA graph replays it for another batch once these are overwritten
    (runtime/step_graphs.py)."""

    positions: torch.Tensor
    cells: torch.Tensor
    src_slot: torch.Tensor
    dst_slots: torch.Tensor


class Batch:
    """One evaluation in progress on one sequence: where its cells and snapshots go."""

    def __init__(self, memory: Memory, seq: int, positions: torch.Tensor, start: int, slots: list[int],
                 host_positions: list[int], src_slot: int = 0):
        self.memory, self.seq, self.start, self.slots = memory, seq, start, slots
        self.src_slot = src_slot  # the slot of the recurrent state before the batch
        self.host_positions = host_positions  # the same as `positions`, on the host
        self._positions = {positions.device: positions}
        self._keep = len(slots)
        self._index: dict = {}  # device -> BatchIndex
        self.pending: Pending | None = None
        self._visible: dict = {}  # device -> positions of every visible cell (the same for every layer)
        self._per_device: dict = {}  # (device, what) -> a tensor built once per batch (Batch._on)
        self._slot_index: dict = {}  # device -> the slots as a tensor
        # slots in ring order without a wrap: a batch's conv windows go in with one copy per layer
        self._consecutive = bool(slots) and slots == list(range(slots[0], slots[0] + len(slots)))

    @classmethod
    def replayable(cls, memory: Memory, seq: int, index: BatchIndex) -> "Batch":
        """A batch that knows its addresses only as the tensors of `index` (static buffers a captured
        graph reads): its host fields (start, slots, positions) are NOT_ON_HOST, so a forward that
        reads one fails instead of baking a stale value into the graph."""
        batch = cls(memory, seq, index.positions, NOT_ON_HOST, [], NOT_ON_HOST, src_slot=NOT_ON_HOST)
        batch.slots = NOT_ON_HOST
        batch._keep = index.dst_slots.shape[0]
        batch._index[index.positions.device] = index
        return batch

    def index(self, device) -> BatchIndex:
        """This batch's addresses on `device`, built once (one host-to-device copy for the slots, pinned
        and without blocking on CUDA: an eager forward makes no host sync for them either)."""
        device = torch.device(device)
        if device not in self._index:
            positions = self._positions.get(device)
            if positions is None:
                positions = next(iter(self._positions.values())).to(device)
            n = positions.shape[0]
            slots = upload(torch.tensor([self.src_slot] + self.slots, dtype=torch.long), device)
            self._index[device] = BatchIndex(positions, torch.arange(self.start, self.start + n, device=device),
                                             slots[:1], slots[1:])
        return self._index[device]

    @property
    def positions(self) -> torch.Tensor:
        """The batch's positions, on the device of the block being evaluated (placement.py)."""
        dev = active_device()
        if dev is None:
            return next(iter(self._positions.values()))
        if dev not in self._positions:
            self._positions[dev] = next(iter(self._positions.values())).to(dev)
        return self._positions[dev]

    @property
    def keep(self) -> int:
        return self._keep

    def attend_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, whole: bool = False):
        """Store this batch's K/V and return (K, V, positions) of every visible cell incl. the new ones.

        `whole`: the layer's whole fixed-size buffers [n_ctx, ...] instead, written in place, with
        the position of every cell (UNWRITTEN where no cell is: masked out by any causal mask), so
        the shapes an attention sees do not change from one step to the next. With the layout's
        `value_width` a K cell is [v | k] (the value, then the rest of the key: MLA's [c | rope(k_pe)])
        and V views its first value_width entries: v and k are written side by side, once."""
        m, s, n = self.memory, self.seq, k.shape[0]
        if whole:  # written by a cell index tensor: what a captured graph replays with new cells
            if m.layout.value_width:  # the K cell is [v | k]: both pieces in one launch, no joined copy
                w, cells = m.layout.value_width, self.index(k.device).cells
                for_device(k.device).write_kv(m.k[layer][s][..., :w], m.k[layer][s][..., w:], cells, v, k)
            else:
                for_device(k.device).write_kv(*self.kv_cells(layer, k.device), k, v)  # one launch on CUDA
            return self.attend_written(layer, k.device)
        end = self.start + n
        if m.layout.value_width:
            m.k[layer][s, self.start:end, ..., :m.layout.value_width] = v.to(m.dtype)
            m.k[layer][s, self.start:end, ..., m.layout.value_width:] = k.to(m.dtype)
        else:
            m.k[layer][s, self.start:end] = k.to(m.dtype)
            m.v[layer][s, self.start:end] = v.to(m.dtype)
        pos = self._visible.get(k.device)
        if pos is None:  # built once per batch, not once per attention layer
            pos = self._visible[k.device] = torch.cat([m.cell_pos[s, :self.start].to(k.device),
                                                       self.positions.to(k.device)])
        return m.k[layer][s, :end], m.v[layer][s, :end], pos

    def kv_cells(self, layer: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(K buffer, V buffer, cells): where attend_kv(whole=True) writes this batch's K/V in layer
        `layer` (cells an index tensor on `device`), for a caller that writes them itself and then
        reads them with attend_written; None in a layout whose V is part of K (value_width)."""
        m = self.memory
        if m.layout.value_width:
            return None
        return m.k[layer][self.seq], m.v[layer][self.seq], self.index(device).cells

    def attend_written(self, layer: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(K, V, positions) of attend_kv(whole=True), this batch's K/V already written at kv_cells."""
        m, s = self.memory, self.seq
        cells = self.index(device).cells

        def whole_positions(dev):  # a copy with this batch's cells set: two launches
            return torch.index_copy(m.cell_pos[s].to(dev), 0, cells, self.positions.to(dev))

        return m.k[layer][s], m.v[layer][s], self._on(device, "whole", whole_positions)

    def _on(self, device, what: str, build) -> torch.Tensor:
        """`build(device)`, made once per batch and device (the same for every layer)."""
        key = (device, what)
        if key not in self._per_device:
            self._per_device[key] = build(device)
        return self._per_device[key]

    def _slots_on(self, device) -> torch.Tensor:
        idx = self._slot_index.get(device)
        if idx is None:
            idx = self._slot_index[device] = torch.tensor(self.slots, device=device)
        return idx

    def recurrent_in(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv window, SSM state) before this batch: views of its source slot."""
        m = self.memory
        return m.conv[layer][self.seq, self.src_slot], m.ssm[layer][self.seq, self.src_slot]

    def state_out(self, layer: int) -> torch.Tensor:
        """The slot that receives the SSM state after this batch (recurrent_out writes it; a delta rule
        may write it there first)."""
        return self.memory.ssm[layer][self.seq, self.slots[-1]]

    def recurrent_out(self, layer: int, conv_states: torch.Tensor, ssm_states):
        """States after each of the last `keep` tokens, oldest first: the SSM states as a tensor
        [keep, ...] or as gdn.PendingStates (only the last one is written; see the module doc)."""
        m, s = self.memory, self.seq
        conv = m.conv[layer][s]
        if self._consecutive:
            conv[self.slots[0]:self.slots[0] + len(self.slots)].copy_(conv_states)
        else:  # wrapped around the ring (index_copy_ costs ~0.1 ms where a copy costs microseconds)
            for j, slot in enumerate(self.slots):
                conv[slot].copy_(conv_states[j])
        if isinstance(ssm_states, torch.Tensor):
            if len(self.slots) == 1:
                m.ssm[layer][s, self.slots[0]].copy_(ssm_states[-1])
            else:
                m.ssm[layer][s].index_copy_(0, self._slots_on(conv.device), ssm_states.to(m.layout.state_dtype))
            return
        ssm_states.state(ssm_states.keep - 1, out=m.ssm[layer][s, self.slots[-1]])
        if len(self.slots) > 1:
            if self.pending is None:
                self.pending = Pending(m.cur[s])
            self.pending.layers[layer] = ssm_states
