"""How the sequential chunk passes are cut into segments: the launch models that choose
the cut and the tables the kernels read.

A pass over chunks runs one program per (column tile, head, sequence), each walking its
sequence's chunks in order. Where that leaves the GPU underused, the sequences are cut
(``fla.ops.common.chunk_fwd_inter``'s module text has the algebra: transitions, combine,
output launch):

- the uniform split (:func:`segment_chunks_for`): every sequence in segments of one
  length, for passes with fewer programs than the GPU holds at once;
- the lead split (:func:`lead_chunks_for`): each sequence cut once, a short lead piece and
  the rest, launched longest first, for passes whose programs outnumber the SMs but not
  the program slots (without the delta only: the lead pieces' transitions are cheap);
- the checkpointed lead split (:func:`checkpoint_lead_chunks_for`): the same cut for a
  pass that restarts the rest from a state an earlier pass kept at the cut, with no
  transitions at all (the delta rule's backward states pass, its forward run as two
  launches to keep that state).

The tables are ``[P, 4]`` int32 rows (sequence, first chunk, end chunk, state row): the
state row indexes the per-segment buffers (entering states, transitions), so that a
launch may list its segments in any order. The passes of the vector gate
(``chunk_gk_fwd``) and the reverse pass (``chunk_delta_h_bwd``) use the uniform split's
tables and model too.
"""
from __future__ import annotations

import bisect

import torch

from fla.ops.utils.index import chunk_counts
from fla.utils.grid import cdiv
from fla.utils.triton_facts import multiprocessor_count

__all__ = ["segment_chunks_for", "lead_chunks_for", "checkpoint_lead_chunks_for",
           "segment_tables", "split_tables", "lead_split_tables", "checkpoint_tables",
           "sequence_chunks", "transition_width", "program_slots"]

CHUNK = 64  # tokens a chunk, in every chunk pass

# Segment lengths are multiples of this many chunks.
MIN_SEGMENT_CHUNKS = 8
# The split's launch model. The pass compiles to 4 warps at 255 registers (sm_90, Triton
# 3.6, every variant; so does the delta's K x K combine), so two programs fit an SM, and a
# launch of n programs over segments of L chunks takes ceil(n / (2·SMs)) waves of L chunk
# steps. In units of an output program's chunk step (~3.5 µs on H100 at K = V = 128, with
# or without the delta, timed unsplit), a transition program's step costs TRANSITION_STEP,
# and each segment adds COMBINE_STEP to its sequence's serial combine (a K x K product per
# segment with the delta, a scaled add without). Keyed by the transitions' form.
# "scalar" (simple GLA, no delta): fitted (least squares) to the simple GLA pass at
# 2x16384x16x128 with X-only transitions, timed unsplit and at seven segment lengths on
# 2026-11-25 (0.40-0.91 ms; the model within 15%, its pick 64 chunks at 0.408 ms against
# the best measured, 32 chunks at 0.403; the step folds in the slower output steps of a
# full wave next to the unsplit pass's). "delta": fitted to the delta rule's 32 programs
# over 1024 chunks (3.74 ms unsplit, 1.38 at 64 chunks) and 128 programs over 256 chunks
# (splitting lost: 0.99 -> 1.27 ms), when its output pass ran BV = 32; since 2026-11-26 it
# runs BV = 64 (half the output programs) and the model's picks measured well:
# 1x65536x8x128 op 1.59 -> 1.20 ms. "vector" (the GLA / RWKV6 pass,
# fla.ops.common.chunk_gk_fwd): NOT FITTED YET, the scalar form's numbers copied. Its
# transition step is the pass's own step without Q, A or the output, plus a K-vector of
# log decay; its combine step a scaled add with a K-vector of scales. One point timed
# (H100, 2026-11-26): GLA 2x16384x16x128, the model's pick (64-chunk segments) took the
# forward's pass from 0.445 to 0.377 ms (transitions 0.115-0.148, combine 0.007, output
# 0.243), the op's forward 1.023 -> 0.967 ms. (Offline sm_90 build, Triton 3.6,
# K = V = 128, BV = 64, 4 warps: the output program 172 registers and 104 KB of shared
# memory, two an SM as assumed here; the transition 118 and 48 KB, four an SM.) Since
# 2026-11-27 chunk_fwd_inter's split runs no transition for a sequence's last segment;
# the model still counts one, as when it was fitted (at the fitted shapes the transitions
# fit in one wave either way), and chunk_gk_fwd's split still runs them all. Since
# 2026-11-27 the scalar form has no combine launch (each output program walks its
# sequence's earlier transitions: H100, 2x16384x16x128, the 5 µs launch gone and the
# output launch 3.8 µs longer); its COMBINE_STEP was not refitted. Since 2026-11-28 the
# delta's transitions run 64 columns (4 programs a head and segment at K = V = 128, not
# 8) at three stages: at 1x65536x8x128 (15 transition segments of 64 chunks, 480
# programs, two waves) they took 0.312 ms, 0.70 of an output step a chunk step, as
# fitted, so the model keeps 0.7 and now counts 4 tiles; its combine's step measures
# ~1.0 there (54 µs over 16 segments: its walk in registers), against 4.0 here, not
# refitted. With it the model splits 2x16384x16x128 too (64 chunks; op forward 0.987 ->
# 0.902 ms), and other shapes that it left whole before (offline, 132 SMs: e.g.
# 2x4096x8x128 now in 16-chunk segments, 1x65536x32x128 in 256), not timed; the
# issues' other shapes keep their choice.
PROGRAMS_PER_SM = 2
TRANSITION_STEP = {"scalar": 0.44, "delta": 0.7, "vector": 0.44}
COMBINE_STEP = {"scalar": 2.0, "delta": 4.0, "vector": 2.0}
# A split must save at least this share of the unsplit pass in the model. It costs two
# more launches and their host work, and where the model saw 3-22% the pass gained at
# most 7% and the op lost 2-80 µs (H100, 2026-11-25: simple GLA at 8x1024x8x64,
# 4x2048x16x128 and Mamba2's 4x4096x32 heads with K = 128, V = 64).
MIN_SPLIT_SAVING = 0.25
_segment_tables: dict = {}
_segment_lengths: dict = {}


def program_slots() -> int:
    """Programs of the pass resident on the GPU at once (the launch model's wave)."""
    return PROGRAMS_PER_SM * multiprocessor_count()


def split_time(length: int, seq_chunks: list[int], heads: int, output_tiles: int,
               transition_tiles: int, form: str, slots: int) -> float:
    """The launch model's time of the pass (in output chunk steps) with segments of
    ``length`` chunks (0: unsplit) on ``slots`` resident programs; ``form`` the
    transitions' (``"scalar"``: simple GLA, ``"delta"``, ``"vector"``: GLA / RWKV6)."""
    longest = max(seq_chunks)
    if not length:
        return cdiv(len(seq_chunks) * heads * output_tiles, slots) * longest
    pieces = sum(cdiv(c, length) for c in seq_chunks)
    steps = min(length, longest)
    return ((cdiv(pieces * heads * transition_tiles, slots) * TRANSITION_STEP[form]
             + cdiv(pieces * heads * output_tiles, slots)) * steps
            + COMBINE_STEP[form] * cdiv(longest, length))


def segment_chunks_for(seq_chunks: list[int], heads: int, output_tiles: int,
                       transition_tiles: int, form: str) -> int:
    """Chunks per segment for the pass over sequences of ``seq_chunks`` chunks each, with
    ``output_tiles`` (``transition_tiles``) programs per head and segment in the output
    (transition) launch; 0 means no split. The launch model above (:func:`split_time`)
    picks the length; only a pass that fills less than one wave is considered for a split,
    and a split is kept only if the model saves MIN_SPLIT_SAVING of the unsplit pass.

    Candidates (multiples of MIN_SEGMENT_CHUNKS): every one up to 64 of them, and for
    each count p of pieces of the longest sequence, up to four waves of output programs'
    worth, the shortest length giving it. Remembered per argument set: the layers of a
    model repeat them.
    """
    slots = program_slots()
    longest = max(seq_chunks)
    if len(seq_chunks) * heads * output_tiles >= slots or longest < 2 * MIN_SEGMENT_CHUNKS:
        return 0
    key = (tuple(seq_chunks), heads, output_tiles, transition_tiles, form, slots)
    chosen = _segment_lengths.get(key)
    if chosen is None:
        step = MIN_SEGMENT_CHUNKS
        most_pieces = min(cdiv(longest, step), cdiv(4 * slots, heads * output_tiles))
        lengths = ({0} | set(range(step, min(longest, 64 * step), step))
                   | {cdiv(longest, p * step) * step for p in range(2, most_pieces + 1)})
        shape = (seq_chunks, heads, output_tiles, transition_tiles, form, slots)
        chosen = min(sorted(n for n in lengths if n < longest),
                     key=lambda n: split_time(n, *shape))
        if split_time(chosen, *shape) > (1 - MIN_SPLIT_SAVING) * split_time(0, *shape):
            chosen = 0
        _remember(_segment_lengths, key, chosen, limit=256)
    return chosen


# The lead split: a pass that leaves program slots idle (more programs than SMs, fewer
# than slots: some SMs walk two sequences' chunks, the others one) cuts each sequence once,
# a short lead piece and the long rest, and launches the pieces longest first, so that the
# lead pieces fill the slots the long ones leave. Only the lead pieces need a transition.
# The launch model lists the pieces on the slots in launch order (each slot takes the next
# piece when it frees), in output chunk steps as above. H100, Triton 3.6, bf16, simple
# GLA's no-grad pass at 1x8192x96x128 (192 programs, 128 chunks; 2026-11-27, by hand-made
# tables; `python -m benchmarks.lead_split` times it through the launcher): unsplit 0.550
# ms; lead pieces of 16 / 24 / 32 / 40 / 48 chunks 0.503 / 0.480 / 0.465 / 0.539 / 0.579
# (transitions 0.032-0.071 of it); the model picks 32 (112 steps against 128). At
# 1x8192x80x128 through the launcher: 0.539 unsplit, 0.479 / 0.459 / 0.434 / 0.426 / 0.460
# at 24 / 32 / 40 / 42 / 48 (the model picks 42). Where every program has an SM of its own
# the split would put two on an SM and slow every step (Mamba2's 128 heads on 132 SMs:
# a uniform split measured no faster), so it is not considered there; nor for short
# sequences, whose passes are host-bound.
LEAD_SPLIT_MIN_CHUNKS = 64
MIN_LEAD_SAVING = 0.10
_lead_lengths: dict = {}


def _list_schedule(pieces: list[tuple[int, int]], slots: int) -> int:
    """The time the last of ``pieces`` ((length, count) groups in launch order) ends when
    each of ``slots`` takes the next piece as soon as it is free."""
    free = [(0, slots)]          # (time a group of slots frees, how many), by time
    end = 0
    for length, count in pieces:
        while count:
            t, n = free.pop(0)
            m = min(n, count)
            count -= m
            if n > m:
                free.insert(0, (t, n - m))
            bisect.insort(free, (t + length, m))
            end = max(end, t + length)
    return end


def lead_pieces(seq_chunks: list[int], lead: int) -> list[list[int]]:
    """Each sequence's pieces in time order: ``[lead, c - lead]`` where it has more than
    ``lead`` chunks, else ``[c]``."""
    return [[lead, c - lead] if c > lead else [c] for c in seq_chunks]


def _pieces_time(lead: int, seq_chunks: list[int], heads: int, tiles: int,
                 slots: int) -> int:
    """Steps until the last piece of a lead split ends, every piece (``tiles`` programs a
    head) launched longest first on ``slots`` programs."""
    counts: dict = {}
    for ps in lead_pieces(seq_chunks, lead):
        for p in ps:
            counts[p] = counts.get(p, 0) + heads * tiles
    return _list_schedule(sorted(counts.items(), reverse=True), slots)


def lead_split_time(lead: int, seq_chunks: list[int], heads: int, output_tiles: int,
                    transition_tiles: int, slots: int) -> float:
    """The launch model's time (output chunk steps) of the scalar-decay pass with lead
    pieces of ``lead`` chunks: the lead pieces' transitions, the combine, then every
    piece, longest first, on ``slots`` programs."""
    cut = sum(1 for c in seq_chunks if c > lead)
    return (_pieces_time(lead, seq_chunks, heads, output_tiles, slots)
            + cdiv(cut * heads * transition_tiles, slots) * TRANSITION_STEP["scalar"] * lead
            + COMBINE_STEP["scalar"])


def _fills_slots_unevenly(seq_chunks: list[int], heads: int, tiles: int) -> bool:
    """Whether a pass of ``tiles`` programs a head and sequence has more programs than SMs
    and fewer than program slots, over sequences long enough to cut (see above)."""
    programs = len(seq_chunks) * heads * tiles
    return (multiprocessor_count() < programs < program_slots()
            and max(seq_chunks) >= LEAD_SPLIT_MIN_CHUNKS)


def _best_lead(seq_chunks: list[int], time) -> int:
    """The lead length (at most 64 candidates up to half the longest sequence) with the
    least ``time(lead)``, or 0 where it saves less than MIN_LEAD_SAVING of the unsplit
    pass (the longest sequence's steps)."""
    longest = max(seq_chunks)
    # At most 64 candidate lengths (every one up to 128-chunk sequences): packed batches
    # bring new lengths every step, and each candidate lists every piece.
    step = cdiv(longest, 128)
    chosen = min(range(step, longest // 2 + 1, step), key=time)
    return 0 if time(chosen) > (1 - MIN_LEAD_SAVING) * longest else chosen


def lead_chunks_for(seq_chunks: list[int], heads: int, output_tiles: int,
                    transition_tiles: int) -> int:
    """The lead piece's length (chunks) for the scalar-decay pass over sequences of
    ``seq_chunks`` chunks, or 0: no lead split (see LEAD_SPLIT_MIN_CHUNKS above). The
    model's best of at most 64 lengths, remembered per argument set."""
    if not _fills_slots_unevenly(seq_chunks, heads, output_tiles):
        return 0
    slots = program_slots()
    key = (tuple(seq_chunks), heads, output_tiles, transition_tiles, slots)
    chosen = _lead_lengths.get(key)
    if chosen is None:
        shape = (seq_chunks, heads, output_tiles, transition_tiles, slots)
        chosen = _best_lead(seq_chunks, lambda n: lead_split_time(n, *shape))
        _remember(_lead_lengths, key, chosen, limit=256)
    return chosen


def checkpoint_lead_chunks_for(seq_chunks: list[int], heads: int, tiles: int) -> int:
    """The lead piece's length (chunks) for a pass that restarts each sequence's rest from
    a state kept at the cut, or 0 (see LEAD_SPLIT_MIN_CHUNKS above): no transitions to
    pay, only the pieces' schedule (``tiles`` programs a head and piece). The delta
    rule's backward states pass, whose forward keeps the state at the cut
    (``chunk_fwd_inter``'s checkpointed pass). Remembered per argument set."""
    if not _fills_slots_unevenly(seq_chunks, heads, tiles):
        return 0
    slots = program_slots()
    key = ("checkpoint", tuple(seq_chunks), heads, tiles, slots)
    chosen = _lead_lengths.get(key)
    if chosen is None:
        chosen = _best_lead(seq_chunks,
                            lambda n: _pieces_time(n, seq_chunks, heads, tiles, slots))
        _remember(_lead_lengths, key, chosen, limit=256)
    return chosen


def transition_width(K: int, V: int, delta: bool) -> int:
    """Columns of a segment's transition state: K + V for the delta's ``[M | X]``; V
    without it, where M is exp(Σ g)·I (X alone, plus the scalar log decay per segment
    and head)."""
    return K + V if delta else V


def sequence_chunks(offsets: list[int] | None, B: int, T: int) -> list[int]:
    """64-token chunks of each sequence: of the packed host ``offsets``, or (None) of B
    sequences of T tokens."""
    return [cdiv(T, CHUNK)] * B if offsets is None else chunk_counts(offsets, CHUNK)


def segment_tables(offsets: list[int], chunks: int, device,
                   reverse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``segments [P, 4]`` int32 rows (sequence, first chunk, end chunk, state row: the
    row's own index) cutting each sequence of the token offsets into pieces of ``chunks``
    chunks, and ``seg_offsets [N + 1]`` int32, the first segment of each sequence.
    ``reverse``: each sequence's segments listed last to first (the order a reverse pass
    meets them, so that the combine walks them as it walks a forward pass's). Cached per
    (offsets, size, order)."""
    key = (tuple(offsets), chunks, str(device), reverse)
    cached = _segment_tables.get(key)
    if cached is not None:
        return cached
    rows, starts = _uniform_rows(offsets, chunks, reverse)
    tables = (_table(rows, device), torch.tensor(starts, dtype=torch.int32).to(device))
    _remember(_segment_tables, key, tables)
    return tables


def _uniform_rows(offsets: list[int], chunks: int, reverse: bool = False
                  ) -> tuple[list[tuple[int, int, int]], list[int]]:
    """The uniform split's rows (sequence, first chunk, end chunk) and each sequence's
    first row, on the host."""
    rows, starts = [], [0]
    for n, total in enumerate(chunk_counts(offsets, CHUNK)):
        pieces = [(n, c, min(c + chunks, total)) for c in range(0, total, chunks)]
        rows += pieces[::-1] if reverse else pieces
        starts.append(len(rows))
    return rows, starts


def _table(rows: list[tuple[int, int, int]], device, state_rows=None) -> torch.Tensor:
    """``[P, 4]`` int32 segment rows (sequence, first chunk, end chunk, state row); the
    state row is the row's own index unless ``state_rows`` are given."""
    if state_rows is None:
        state_rows = range(len(rows))
    return torch.tensor([(*r, i) for r, i in zip(rows, state_rows)],
                        dtype=torch.int32).reshape(-1, 4).to(device)


def _remember(cache: dict, key, value, limit: int = 64) -> None:
    """``cache[key] = value``, the cache emptied first once it holds ``limit`` entries."""
    if len(cache) >= limit:
        cache.clear()
    cache[key] = value


def split_tables(offsets: list[int], chunks: int, device
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The uniform split's tables for ``chunk_fwd_inter``'s split pass: ``(transitions,
    outputs, seg_offsets)``, ``outputs`` and ``seg_offsets`` those of
    :func:`segment_tables`, ``transitions`` its rows but each sequence's last (whose
    transition only the final state would need, and the output launch writes that).
    Built on the host, cached per (offsets, size)."""
    key = ("split", tuple(offsets), chunks, str(device))
    cached = _segment_tables.get(key)
    if cached is not None:
        return cached
    outputs, seg_offsets = segment_tables(offsets, chunks, device)
    rows, starts = _uniform_rows(offsets, chunks)
    walked = [i for n in range(len(starts) - 1) for i in range(starts[n], starts[n + 1] - 1)]
    tables = (_table([rows[i] for i in walked], device, walked), outputs, seg_offsets)
    _remember(_segment_tables, key, tables)
    return tables


def lead_split_tables(offsets: list[int], lead: int, device
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tables of a lead split (each sequence longer than ``lead`` chunks cut into a
    lead piece and the rest): ``(transitions, outputs, seg_offsets)``. The pieces are
    numbered sequence by sequence in time order (the state rows, and ``seg_offsets [N +
    1]`` the first of each sequence, as the combine walks them); ``transitions`` holds the
    cut sequences' lead pieces, ``outputs`` every piece, longest first (the launch order
    the model assumes), each with its state row. Cached per (offsets, lead)."""
    key = ("lead", tuple(offsets), lead, str(device))
    cached = _segment_tables.get(key)
    if cached is not None:
        return cached
    rows, starts = [], [0]
    for n, c in enumerate(chunk_counts(offsets, CHUNK)):
        ends = [min(lead, c), c] if c > lead else [c]
        rows += [(n, first, end) for first, end in zip([0] + ends[:-1], ends)]
        starts.append(len(rows))
    lead_rows = [i for i, (n, first, end) in enumerate(rows)
                 if first == 0 and starts[n + 1] - starts[n] > 1]
    longest_first = sorted(range(len(rows)), key=lambda i: rows[i][1] - rows[i][2])
    tables = (_table([rows[i] for i in lead_rows], device, lead_rows),
              _table([rows[i] for i in longest_first], device, longest_first),
              torch.tensor(starts, dtype=torch.int32).to(device))
    _remember(_segment_tables, key, tables)
    return tables


def checkpoint_tables(offsets: list[int], lead: int, device
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tables of a lead split run from a checkpoint (each sequence longer than
    ``lead`` chunks cut once; no transitions): ``(firsts, rests, pieces)``. ``firsts``
    holds each sequence's first piece (the lead, or the whole sequence), state row n;
    ``rests`` each cut sequence's rest, state row n; ``pieces`` all of them longest first,
    the firsts at state row n and the rests at N + n, so that one ``[2N, H, K, V]``
    buffer, the initial states and then the states at the cuts, holds every piece's
    entering state. Cached per (offsets, lead)."""
    key = ("checkpoint", tuple(offsets), lead, str(device))
    cached = _segment_tables.get(key)
    if cached is not None:
        return cached
    counts = chunk_counts(offsets, CHUNK)
    N = len(counts)
    firsts = [(n, 0, min(lead, c), n) for n, c in enumerate(counts)]
    rests = [(n, lead, c, n) for n, c in enumerate(counts) if c > lead]
    pieces = sorted(firsts + [(n, f, e, N + n) for n, f, e, _ in rests],
                    key=lambda r: r[1] - r[2])
    tables = tuple(torch.tensor(rows, dtype=torch.int32).reshape(-1, 4).to(device)
                   for rows in (firsts, rests, pieces))
    _remember(_segment_tables, key, tables)
    return tables
