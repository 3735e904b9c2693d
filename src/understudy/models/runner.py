"""Drive one Transformer through one token sequence: prefill, extend, roll back.

Invariant: the KV cache holds valid entries for exactly the first `length` tokens of the
sequence; everything past it is garbage that the next pass overwrites. Rolling back is
`truncate(n)`: position arithmetic, no copying (docs/design.md).

With `rows` set (the target), every decode pass scores exactly `rows` query rows, real
tokens first and filler after, over a fixed window of key slots chosen once per request
(`prefill(..., span=)`), so a real row's logits depend neither on how many other rows are
real nor on where the pass starts: verification is bitwise the same as decoding one token
at a time. (Measured: with a key window that grows with the pass, SDPA's key blocking changes
once the window crosses a block boundary and rows differ in the last bits.)

Trees (understudy.verify.token_tree): `tree_pass` scores the nodes of a token tree in one pass, node i at
slot base + i and position base + depth_i under an ancestor mask, and leaves `length`
alone; `keep_path` then copies the accepted path's keys/values to the slots right after the
prefix (Transformer.keep_slots) and sets `length`, so the cache again holds exactly the
committed tokens, laid out as a chain would have written them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from understudy.models.key_groups import KeyGroup
from understudy.models.split_attention import SplitKeys, split_keys
from understudy.models.transformer import Transformer

if TYPE_CHECKING:
    from understudy.models.hf_fallback import FallbackLM

PREFILL_CHUNK = 512
WINDOW_QUANTUM = 256  # key windows are multiples of this many slots


def path_slots(slots: torch.Tensor, visible: torch.Tensor, base: int) -> torch.Tensor:
    """Write each tree node's path into its row of `slots` [R, L] in chain order, in place:
    row i gets slots base + j for the j where visible[i, j] (its ancestors and itself, in
    increasing order: ancestors precede descendants) at chain positions base.. on. visible:
    [n, span] bool, n <= R. Returns `slots`."""
    for i in range(visible.shape[0]):
        path = base + visible[i].nonzero().flatten().to(slots.device)  # [depth_i + 1]
        slots[i, base : base + path.shape[0]] = path
    return slots


class Runner:
    def __init__(
        self,
        model: Transformer | FallbackLM,  # FallbackLM: chain passes only (hf_fallback.py)
        max_context: int,
        rows: int | None = None,
        pad: bool = True,
        first_slot: int = 0,
    ) -> None:
        self.model = model
        self.rows = rows
        # pad=False: the model's matmuls are row-invariant by construction (kernels/rowgemm),
        # so passes hold only their real rows; the key window stays fixed all the same
        self.pad = pad
        self.max_context = max_context
        self.length = 0
        self.slots = max_context + max(rows or 0, PREFILL_CHUNK)  # this runner's region
        # the region's first cache slot: chain position j lives in slot first_slot + j. One
        # model, many runners (engine/batch.py): each sequence of a batch has its own region
        assert first_slot == 0 or rows is None or not pad, "padded passes read keys from slot 0"
        self.first_slot = first_slot
        self.window: int | None = None  # fixed key window for this request (None: grows)
        # keep_hidden: remember the final hidden states of the real rows of the latest pass
        # (the whole prompt after `prefill`; a tree pass's nodes in tree order) in
        # `last_hidden` [n, hidden], for method="eagle"; where the model names feature
        # layers (Transformer.feature_layers), their outputs instead, side by side
        # [n, layers * hidden]
        self.keep_hidden = False
        self.last_hidden: torch.Tensor | None = None
        if model.cache_slots < first_slot + self.slots:
            model.allocate_cache(first_slot + self.slots)

    @property
    def vocab_size(self) -> int:
        return self.model.cfg.vocab_size

    def truncate(self, length: int) -> None:
        """Forget every token from `length` on."""
        assert 0 <= length <= self.length, (length, self.length)
        self.length = length

    def place_chain(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where the next n tokens go, as an unpadded pass scores them: positions [n], slots
        [n] and mask [n, L] over this runner's region (L fixed by the request's window)."""
        start, device = self.length, self.model.device
        positions = torch.arange(start, start + n, device=device)  # [n]
        keys = max(self.window or 0, start + n)
        mask = torch.arange(keys, device=device)[None, :] <= positions[:, None]  # [n, L]
        return positions, self.first_slot + positions, mask

    def place_tree(
        self,
        depths: torch.Tensor,  # [n] the nodes' depths (root = 0)
        offsets: torch.Tensor,  # [n] their slots relative to the root's
        visible: torch.Tensor,  # [n, span] bool: the slots base + j each node sees
        base: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where an unpadded tree pass puts its nodes and which keys each sees, in chain
        order: positions [n], slots [n], mask [n, L] and key_slots [n, L] (absolute slots:
        the prefix, then the node's path root..node, then filler it cannot see). Ancestors
        precede descendants in node order, so the visible slots in increasing order are the
        path; with row-invariant kernels every node's logits are then bitwise those of plain
        decoding along its path."""
        device, n = self.model.device, depths.shape[0]
        keys = max(self.window or 0, base + visible.shape[1])
        key_slots = torch.zeros(n, keys, dtype=torch.long, device=device)  # [n, L]
        key_slots[:, :base] = torch.arange(base, device=device)
        path_slots(key_slots, visible, base)
        depths = depths.to(device)
        mask = torch.arange(keys, device=device)[None, :] <= (base + depths)[:, None]  # [n, L]
        slots = self.first_slot + base + offsets.to(device)
        return base + depths, slots, mask, key_slots + self.first_slot

    def _pass(
        self, tokens: torch.Tensor, rows: int, logit_rows: slice, decode: bool = False
    ) -> torch.Tensor:
        """Score `tokens` [n] at positions length..length+n-1 in one pass of `rows` rows
        (`decode`: a padded decode pass, whose rows attend through split_attention)."""
        n, start, device = tokens.shape[0], self.length, self.model.device
        padded = torch.zeros(rows, dtype=torch.long, device=device)  # [rows], filler = id 0
        padded[:n] = tokens
        positions = torch.arange(start, start + rows, device=device)  # [rows]
        keys = max(self.window or 0, start + rows)
        mask = torch.arange(keys, device=device)[None, :] <= positions[:, None]  # [rows, L]
        split = split_keys(positions, keys) if decode and self.pad else None
        slots = self.first_slot + positions
        logits = self._score(n, padded, positions, slots, mask, logit_rows, split=split)
        self.length = start + n
        return logits

    def _score(
        self,
        n: int,
        tokens: torch.Tensor,  # [R]
        positions: torch.Tensor,  # [R]
        slots: torch.Tensor,  # [R]
        mask: torch.Tensor,  # [R, L]
        logit_rows: slice | None = None,
        key_slots: torch.Tensor | None = None,
        split: SplitKeys | None = None,
    ) -> torch.Tensor:
        """Transformer.forward; with keep_hidden, the first `n` (real) rows' features are
        kept in `last_hidden` (see __init__; the same operations). A runner whose region
        starts past slot 0 attends through one KeyGroup (models/key_groups.py): the same
        keys in the same order, from its own region."""
        if not self.keep_hidden and not self.first_slot:
            return self.model(tokens, positions, slots, mask, logit_rows, key_slots, split)
        groups = None
        if self.first_slot:
            groups = [KeyGroup(slice(0, tokens.shape[0]), self.first_slot, mask, key_slots)]
            key_slots = None
        taps: list[torch.Tensor] | None = [] if self.keep_hidden else None
        hidden = self.model.hidden_states(
            tokens, positions, slots, mask, key_slots, split, groups=groups, features=taps
        )
        if self.keep_hidden:
            self.last_hidden = (torch.cat(taps, dim=-1) if taps else hidden)[:n]
        rows = hidden if logit_rows is None else hidden[logit_rows]
        return self.model.logits(rows)  # [R, V] float32 (final soft cap included)

    @torch.inference_mode()
    def tree_pass(
        self,
        tokens: torch.Tensor,  # [n] tree nodes to score
        depths: torch.Tensor,  # [n] their depths (root = 0)
        offsets: torch.Tensor,  # [n] their slots relative to the root's
        visible: torch.Tensor,  # [n, span] bool: which slots base + j (j < span) each sees
        base: int | None = None,
    ) -> torch.Tensor:
        """Score tree nodes in one pass; return their logits [n, vocab] (understudy.verify.token_tree).

        The tree's root sits at slot `base` (default `length`: the target scores the root in
        this pass). Node i is written to slot base + offsets[i] at position base + depths[i]
        and attends to the prefix (slots < base) and to slots base + j where visible[i, j]
        (its ancestors and itself; nodes of earlier passes must already be in their slots:
        the draft scores its tree depth by depth, its root already cached, base = length -
        1). `length` is not changed: call `keep_path` or `truncate` afterwards. With `rows`
        set, the pass is padded to `rows` rows over the request's fixed key window like
        every target pass; filler rows sit after the tree's region and see the prefix and
        themselves."""
        base = self.length if base is None else base
        n, span, device = tokens.shape[0], visible.shape[1], self.model.device
        assert visible.shape[0] == n and int(offsets.max()) < span, (visible.shape, n)
        rows = self.rows if self.rows is not None and self.pad else n
        assert self.rows is None or n <= self.rows, (
            f"a pass holds at most {self.rows} rows, got {n}"
        )
        padded = torch.zeros(rows, dtype=torch.long, device=device)  # [rows], filler = id 0
        padded[:n] = tokens
        filler = torch.arange(base + span, base + span + rows - n, device=device)  # [rows-n]
        slots = self.first_slot + torch.cat([base + offsets.to(device), filler])  # [rows]
        positions = torch.cat([base + depths.to(device), filler])  # [rows]
        keys = max(self.window or 0, base + span + rows - n)
        assert keys <= self.slots, (keys, self.slots)
        mask = torch.zeros(rows, keys, dtype=torch.bool, device=device)  # [rows, keys]
        mask[:, :base] = True
        mask[:n, base : base + span] = visible.to(device)
        mask[torch.arange(n, rows, device=device), filler] = True
        if not self.pad:  # row-invariant kernels: each node sees its path where a chain would
            return self._tree_pass_as_chains(tokens, depths, offsets, visible, base)
        if self.rows is None:  # a drafter's pass: the mask alone
            return self._score(n, padded, positions, slots, mask)[:n]
        assert int(depths.max()) < rows, "a tree deeper than the pass cannot be split"
        chain_slots = torch.arange(keys, device=device).repeat(rows, 1)  # [rows, keys]
        split = split_keys(positions, keys, path_slots(chain_slots, visible, base))
        return self._score(n, padded, positions, slots, mask, split=split)[:n]

    def _tree_pass_as_chains(
        self,
        tokens: torch.Tensor,  # [n]
        depths: torch.Tensor,  # [n]
        offsets: torch.Tensor,  # [n]
        visible: torch.Tensor,  # [n, span]
        base: int,
    ) -> torch.Tensor:
        """The tree pass with each node's keys gathered in chain order (place_tree)."""
        positions, slots, mask, key_slots = self.place_tree(depths, offsets, visible, base)
        n, device = tokens.shape[0], self.model.device
        return self._score(n, tokens.to(device), positions, slots, mask, None, key_slots)

    @torch.inference_mode()
    def keep_path(self, offsets: torch.Tensor | list[int], base: int | None = None) -> None:
        """Keep a tree's accepted path: `offsets` [m] are the slots (relative to the root's
        slot `base`, default `length`) of the path's nodes, root first. Copies slot base +
        offsets[i] to slot base + i and sets length = base + m; later slots are garbage."""
        base = self.length if base is None else base
        offsets = torch.as_tensor(offsets, dtype=torch.long)
        assert offsets.ndim == 1 and offsets.shape[0] >= 1
        m = offsets.shape[0]
        if not torch.equal(offsets.cpu(), torch.arange(m)):  # else already in place
            start = self.first_slot + base
            self.model.keep_slots(start + offsets.to(self.model.device), start)
        self.length = base + m

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, span: int | None = None) -> torch.Tensor:
        """Feed a whole prompt [n] from an empty cache; return the last row's logits [vocab].
        `span`: the most tokens this request will hold (prompt + budget); with `rows` set,
        every pass then attends over the same fixed window of key slots."""
        self.length = 0
        self.window = None
        if self.rows is not None:
            need = (span or self.max_context) + self.rows
            self.window = min(self.slots, -(-need // WINDOW_QUANTUM) * WINDOW_QUANTUM)
        hidden = []
        for begin in range(0, tokens.shape[0], PREFILL_CHUNK):
            chunk = tokens[begin : begin + PREFILL_CHUNK]
            logits = self._pass(chunk, chunk.shape[0], slice(chunk.shape[0] - 1, chunk.shape[0]))
            if self.keep_hidden:
                hidden.append(self.last_hidden)
        if self.keep_hidden:
            self.last_hidden = torch.cat(hidden)  # [n, hidden]: the whole prompt
        return logits[0]

    @torch.inference_mode()
    def extend(self, tokens: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Feed tokens [n] after the cache; return their logits [n, vocab] ([1, vocab] with
        last_only). With `rows` set the pass is padded to `rows` rows (the target's path)."""
        n = tokens.shape[0]
        if self.rows is None:
            return self._pass(tokens, n, slice(n - 1, n) if last_only else slice(0, n))
        assert n <= self.rows, f"a pass holds at most {self.rows} rows, got {n}"
        logits = self._pass(tokens, self.rows if self.pad else n, slice(None), decode=True)
        return logits[n - 1 : n] if last_only else logits[:n]
