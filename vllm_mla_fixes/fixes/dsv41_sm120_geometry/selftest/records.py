"""What each write left in the pages, and whether each read reads exactly that.

After every write the harness keeps, per cache and request, the record each
token's write left: its bytes at the slot the writer was given, read back at
once (:class:`Stored`).  Those records are

* decoded and compared with the dense reference element by element: the
  writer's check (:func:`.bounds.writer_element_bound`);
* the truth the readers are held to.  Before a read's output is compared, the
  bytes at the addresses the kernel reads, derived from its own arguments as
  the kernel addresses them, must equal the records of the tokens it should
  read, byte for byte (:func:`attention_misreads`, :func:`logits_misreads`):
  one wrong slot, key or page is one record that differs.  The output is then
  compared with the reference computed on those very records, so a reader's
  bound covers only its own arithmetic (:mod:`.bounds`).
"""

from __future__ import annotations

import torch

from . import kernels as kn
from . import reference as ref
from .timeline import Batch


class MissingRecord(LookupError):
    """A read expects a token no write stored."""


class Stored:
    """Per cache and request, the raw record and its decoded values of each
    token (or compressed state) written, the latest write's."""

    def __init__(self, capacity: int, shares: dict[str, tuple[str, int]], ue8m0x4: bool):
        self.capacity = capacity
        # request -> (the request its prompt starts with, tokens shared): a
        # prefix-cache hit reads the records that request's writes left.
        self.shares = shares
        self.ue8m0x4 = ue8m0x4
        self.raw: dict[tuple[str, str], torch.Tensor] = {}
        self.values: dict[tuple[str, str], torch.Tensor] = {}
        self.held: dict[tuple[str, str], torch.Tensor] = {}

    def store(self, cache: str, request: str, index: torch.Tensor, raw: torch.Tensor) -> None:
        key = (cache, request)
        values = ref.decode_records(raw, self.ue8m0x4)
        if key not in self.raw:
            self.raw[key] = torch.zeros(self.capacity, raw.shape[1], dtype=torch.uint8)
            self.values[key] = torch.zeros(self.capacity, values.shape[1])
            self.held[key] = torch.zeros(self.capacity, dtype=torch.bool)
        index = index.to(torch.int64).cpu()
        self.raw[key][index] = raw
        self.values[key][index] = values
        self.held[key][index] = True

    def fetch(
        self, cache: str, request: str, index: torch.Tensor, span: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(raw records, values) of ``request``'s tokens (states of ``span``
        tokens) ``index`` in ``cache``.  Raises :class:`MissingRecord`."""
        index = index.to(torch.int64).cpu()
        key = (cache, request)
        held = (
            self.held[key][index] if key in self.held else torch.zeros_like(index, dtype=torch.bool)
        )
        raw = values = None
        if key in self.raw:
            raw, values = self.raw[key][index], self.values[key][index]
        other, shared = self.shares.get(request, ("", 0))
        theirs = ~held & ((index + 1) * span <= shared)
        if bool(theirs.any()):
            their_raw, their_values = self.fetch(cache, other, index[theirs], span)
            if raw is None or values is None:
                raw = torch.zeros(index.numel(), their_raw.shape[1], dtype=torch.uint8)
                values = torch.zeros(index.numel(), their_values.shape[1])
            raw[theirs], values[theirs] = their_raw, their_values
            held = held | theirs
        if raw is None or values is None or not bool(held.all()):
            missing = int(index[~held][0]) if index.numel() else -1
            raise MissingRecord(f"{request}: no write stored its record {missing} in {cache}")
        return raw, values


def _row_owners(batch: Batch) -> torch.Tensor:
    """Each batch row's request (its index in the batch), -1 for padding."""
    owners = torch.full((batch.num_tokens_padded,), -1, dtype=torch.int64)
    for request, (first, end) in enumerate(batch.token_ranges()):
        owners[first:end] = request
    return owners


def written(
    batch: Batch,
    positions: torch.Tensor,
    slots: torch.Tensor,
    ratio: int,
    rows: torch.Tensor | None = None,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per request, (index, slot) of each record a writer given ``slots`` for
    the batch's rows (or the kept ``rows`` of a decoder replay) at
    ``positions`` writes: every token with a slot where ``ratio`` is 0 (the
    window KV; the index is its position), else the last token of each group
    of ``ratio`` (the index is its state), as the writers' kernels decide."""
    owners = _row_owners(batch)
    if rows is not None:
        owners = owners[rows.cpu()]
    slot = slots.to(torch.int64).cpu()
    count = slot.numel()
    owner, position = owners[:count], positions.to(torch.int64).cpu()[:count]
    keep = (slot >= 0) & (owner >= 0)
    index = position
    if ratio > 0:
        keep &= (position + 1) % ratio == 0
        index = position // ratio
    out = {}
    for request, name in enumerate(batch.names):
        mine = keep & (owner == request)
        if bool(mine.any()):
            out[name] = (index[mine], slot[mine])
    return out


def unmatched(got: torch.Tensor, want: torch.Tensor) -> tuple[int, int]:
    """(records read that are none of the expected ones, expected records not
    read), comparing the two sets of raw records [N, width] as multisets."""
    both = torch.cat([got, want])
    _, inverse = torch.unique(both, dim=0, return_inverse=True)
    size = int(inverse.max()) + 1 if inverse.numel() else 0
    read = torch.bincount(inverse[: got.shape[0]], minlength=size)
    expected = torch.bincount(inverse[got.shape[0] :], minlength=size)
    return int((read - expected).clamp_min(0).sum()), int((expected - read).clamp_min(0).sum())


def _read_at(cache: torch.Tensor, indices: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """The raw records a sparse-MLA segment reads: its valid indices up to its length."""
    width = int(cache.shape[-1])
    return ref.record_bytes(cache, ref.segment_indices(indices, length), int(cache.shape[1]), width)


def launch_rows(launch: kn.Launch, out: torch.Tensor) -> range:
    """The rows of ``out`` a sparse-MLA launch fills: its ``out`` is a slice of it."""
    row_bytes = out.stride(0) * out.element_size()
    first = (launch.kwargs["out"].data_ptr() - out.data_ptr()) // row_bytes
    return range(first, first + int(launch.kwargs["out"].shape[0]))


def attention_misreads(
    launch: kn.Launch, out: torch.Tensor, expected: dict[int, list[torch.Tensor]]
) -> tuple[int, int]:
    """(records read that are no expected token's, expected records not read)
    by one FlashInfer sparse-MLA launch: per query row (its row of ``out``, found
    from the launch's own output slice), the records at its window indices and
    at its compressed indices, each segment against ``expected[row]``'s."""
    kwargs = launch.kwargs
    first = launch_rows(launch, out).start
    segments = [(kwargs["swa_kv_cache"], kwargs["sparse_indices"], kwargs["swa_topk_lens"])]
    if kwargs.get("compressed_kv_cache") is not None:
        segments.append(
            (
                kwargs["compressed_kv_cache"],
                kwargs["extra_sparse_indices"],
                kwargs["extra_sparse_topk_lens"],
            )
        )
    stray = missed = 0
    for j in range(int(kwargs["query"].shape[0])):
        want = expected.get(first + j)
        if want is None:  # a graph-padding row
            continue
        for (cache, indices, lengths), records in zip(segments, want, strict=True):
            extra, lost = unmatched(_read_at(cache, indices[j].cpu(), lengths[j].cpu()), records)
            stray, missed = stray + extra, missed + lost
    return stray, missed


def logits_misreads(launch: kn.Launch, expected: dict[int, torch.Tensor]) -> int:
    """Records one paged MQA logits launch reads for row ``b`` (its state ``s``
    at page ``block_table[b, s // rows]``, row ``s % rows``) that differ from
    ``expected[b]``, the records of that row's states in order."""
    _, cache, _, _, block_table = launch.args[:5]
    rows = int(cache.shape[1])
    table = block_table.to(torch.int64).cpu()
    wrong = 0
    for row, want in expected.items():
        states = torch.arange(want.shape[0])
        slots = table[row, states // rows] * rows + states % rows
        got = ref.record_bytes(cache, slots, rows, ref.INDEX_RECORD)
        wrong += int((got != want).any(dim=1).sum())
    return wrong
