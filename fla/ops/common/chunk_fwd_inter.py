"""The inter-chunk half of the fused chunked forward: the state pass, with the output
computed on the way (gated delta rule, ALGORITHMS.md §1, chunked form; with
``delta=False`` simple GLA, §2, where Vn = V and Ai, β are not used).

For each chunk in order, with S the state entering it, γ the chunk-local cumulative
decay (γ_C at the chunk's last valid token) and ``Ai``, ``Aqk`` from
``chunk_fwd_intra`` (simple GLA up to K = 128 forms Aqk here instead, see below):

    Vn = Ai · β ⊙ (V − e^γ ⊙ K S)          (= U − W S of the WY form, never stored)
    O  = scale · ( e^γ ⊙ Q S + Aqk Vn )
    S ← e^{γ_C} S + (K ⊙ e^{γ_C − γ})ᵀ Vn

Reading Q, K, V once and writing O once (plus reading the 64-wide Ai and Aqk rows) is all the
memory traffic the pass needs: the per-chunk states h, the new values Vn and the WY
factors W, U stay in registers. The backward recomputes what it needs from the saved
Ai.

One program per (V tile, head, sequence) walks the sequence's chunks; the K x BV fp32
state lives in up to four register tiles of BK = 64 or 128 rows (a tuning choice, see
``_default``; K ≤ 4·BK). Programs of one head's V tiles are adjacent in the grid, so they
run together and share Q, K, Ai and Aqk through the L2 cache.

Simple GLA (no delta) with K ≤ 128 may pass no Aqk (``FORM_AQK``): the pass then
accumulates each chunk's Q Kᵀ beside Q S over the same tiles and gates it itself
(``fla/ops/common/chunk_scores.py``), with no intra-chunk kernel before it; asked to,
it writes those scores out for a backward (``STORE_AQK``). At K = 256 the state's four
register tiles leave no room for the 64 x 64 scores (H100: 2.07 ms against 1.66 reading
them), so there the scores must be given.

Few long sequences (one serving a 64K-token prompt over 8 heads is 32 programs on a
132-SM GPU) are split into segments of chunks. Over a segment the state update is
affine, ``S_out = M S_in + X``, and the same recurrence run on the augmented state
``[I | 0]`` with values ``[0 | V]`` yields ``[M | X]``. So the split runs three launches:
the transitions ``[M | X]`` of the segments in parallel (``TRANSITION``; a sequence's
last segment needs none), a short serial combine per sequence giving every segment its
entering state, and the output pass over all segments in parallel, whose programs that
end a sequence write its final state. Without the delta M is the scalar exp(Σ g) times I:
the transitions then carry only X (K x V, half the columns at K = V), and the combine,
a scaled add a segment instead of a K x K product, needs no launch of its own: each
output program carries its sequence's initial state through the transitions before its
segment (``CHAIN``).

Without the delta a pass with more programs than SMs but fewer than program slots (96
heads over one 8K-token sequence: two programs on some SMs, one on the others) may take
a lead split instead: each sequence cut once, a short lead piece and the long rest, all
pieces in one output launch longest first, so that the lead pieces fill the slots the
long ones leave. Where to cut (both splits' launch models) and the segment tables:
``fla/ops/common/chunk_segments.py``. The vector-gate pass (GLA, RWKV6:
``chunk_gk_fwd``) splits the same way with M = diag(exp(Σ γ_C)); the combine of both
is :mod:`fla.ops.common.chunk_state_combine`.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fla.ops.common import chunk_segments
from fla.ops.common.chunk_scores import gate_causal_scores
from fla.ops.common.chunk_state_combine import combine_segment_states
from fla.ops.common.chunk_segments import (
    CHUNK,
    checkpoint_tables,
    lead_split_tables,
    sequence_chunks,
    split_tables,
    transition_width,
)
from fla.ops.utils.chunk_rows import load_chunk_rows
from fla.ops.utils.index import (
    chunk_counts,
    first_chunk_row,
    locate_sequence,
    runtime_zero,
    varlen_chunk_offsets,
)
from fla.ops.utils.state_tiles import (
    decay_state_tiles,
    identity_state_tiles,
    load_state_tiles,
    store_state_tiles,
)
from fla.ops.utils.tiles import check_buffer, sixteen_bit, state_row_heights, tile_width
from fla.ops.utils.two_term import two_term_dot
from fla.utils.grid import cdiv, sequential_grid_fill
from fla.utils.triton_facts import dot_precision, multiprocessor_count, warp_choices
from fla.utils.tuning import Config, tuned

__all__ = ["chunk_gated_delta_rule_fwd_inter", "MAX_K_FORMING_SCORES"]

# The largest K at which the pass can form the chunk scores itself (FORM_AQK).
MAX_K_FORMING_SCORES = 128


def _default(args) -> Config:
    # Gated delta rule up to K = 128: BV = 64 where the pass has programs enough without
    # splitting V further. H100 (Triton 3.6, bf16, 2026-11-26), the pass at 1x8192x96x128:
    # 0.72 ms against 0.95 at BV = 32 and 1.17 for the BV = 32 kernel before K's tiles
    # were reused and Ai, Aqk loaded by whole rows (which took it from 115 to 99 KB of
    # shared memory: two programs an SM); 4x4096x64x128: 0.82 against 1.01 and 1.66; the
    # split pass's output at 1x65536x8x128: op 1.21 ms against 1.41. The pass is bound by
    # each program's chain of dots a chunk, not by the SM it shares: one 64-column program
    # an SM (1x8192x64x128, 128 programs) took 0.62 ms, two (96 heads) 0.72. So where
    # 64-column tiles leave SMs without a second program (FEW_PROGRAMS, set by the
    # launcher: 1 at most one an SM, 2 at most half an SM), BV = 32 halves each program's
    # work: 0.46 ms against 0.62 at 1x8192x64x128, 0.13 against 0.16 at 4x2048x16x128,
    # and where even the 32-column programs leave an SM to one, a third stage (the shared
    # memory is there): 2x16384x16x128 0.72 against 0.78 at two (1.06 at BV = 64),
    # 8x1024x8x64 0.051 against 0.057. At 1x8192x80x128 (160 programs) BV = 64 still wins,
    # 0.66 against 0.90. A split's delta transitions take 64 columns over 64 rows at three
    # stages (below). Above K = 128, BV = 32 at 4 warps: 2.13 ms at 8x2048x32x256 against
    # 2.23 (2026-11-22; since 2026-11-27 the output pass on a full grid takes 64 columns at 8
    # warps, below, where this Triton builds them). Simple GLA
    # (no delta: three dots a chunk, not eight): BV = 64, 0.58 ms at 1x8192x96x128 against
    # 0.78 at BV = 32.
    # The state's row tiles (BK): 128 rows where the grid is full (H100, Triton 3.6, bf16,
    # 2026-11-27, the pass with BK = 64 -> 128, ms): with the delta 1x8192x96x128 0.701 ->
    # 0.637, 4x4096x64x128 0.815 -> 0.724, 8x2048x32x256 2.119 -> 2.076; simple GLA's
    # pass above K = 128 1.345 -> 1.286. On thin grids (32-column tiles) 64 rows: the
    # delta's 4x2048x16x128 0.118 -> 0.124, 2x16384x16x128 0.721 -> 0.717. The pass that
    # forms its scores keeps 64: 0.581 -> 0.713 at 1x8192x96x128 (it spills), and so does
    # the backward's states pass (4x4096x64x128, its space timed: 0.608 against 0.622).
    if args["FORM_AQK"]:
        return Config(BV=64, BK=tile_width(args["K"], 64), num_warps=4, num_stages=2)
    if args.get("TWO_TERM") and args.get("STATES_ONLY", False):
        # The backward's states pass with two-term dots (the bf16 delta rules). Timed on the
        # H200 (Triton 3.6, bf16, FLA_TUNE=1, 2026-11-28 22:00 UTC): on a full grid 64
        # columns over 64 rows at three stages, 0.700 ms at 1x8192x96x128 against 0.910 at
        # 32 columns (the 64-column configs spill 72-320 B offline, and are faster all
        # the same); on a thin grid 32 columns, 0.221 at 4x4096x16x128 (64: 0.249). At
        # K = 256 (untimed) 64 rows, 32 columns and two stages: the one config that kept
        # no stack offline (252 registers; benchmarks/NOTES.md, 2026-11-28 19:15-).
        wide = args["K"] <= 128 and not args.get("FEW_PROGRAMS", 0)
        return Config(BV=tile_width(args["V"], 64 if wide else 32),
                      BK=tile_width(args["K"], 64), num_warps=4,
                      num_stages=3 if args["K"] <= 128 else 2)
    few = args.get("FEW_PROGRAMS", 0) if args["DELTA"] else 0
    if args["K"] > 128:
        if (not few and not args["TRANSITION"]
                and not args.get("SPLIT", False) and not args.get("STATES_ONLY", False)
                and sixteen_bit(args) and 8 in warp_choices(stmatrix_prone=True)):
            # The output pass on a full grid: 64 columns at 8 warps, half the programs
            # re-reading each chunk's [64, K] Q and K tiles through L2. With the delta
            # (H100, Triton 3.6, bf16, 8x2048x32x256, each config forced in its own
            # process, the op's forward): 2.061 ms against 2.684 at 32 columns / 4 warps,
            # 2.159 at 64 rows; 32 columns at one stage 2.548, 64 at 4 warps one stage
            # 2.504. Without it (simple GLA's pass; H200, Triton 3.6, bf16, FLA_TUNE=1,
            # 2026-11-29 00:40 UTC, 8x2048x32x256): 1.022 ms against 1.259 at 32 columns /
            # 4 warps. Not a split's output pass (untimed there; its launch model counts
            # 32 columns).
            return Config(BV=tile_width(args["V"], 64), BK=tile_width(args["K"], 128),
                          num_warps=8, num_stages=2)
        return Config(BV=tile_width(args["V"], 32),
                      BK=tile_width(args["K"], 64 if few else 128), num_warps=4, num_stages=2)
    if args["DELTA"] and args["TRANSITION"]:
        # The delta's transitions ([M | X], K + V columns, no Q tiles): 64 columns over
        # 64 rows and three stages. H100, Triton 3.6, bf16, 1x65536x8x128 (15 of 16
        # segments, 64 chunks each, 480 programs), the space timed by `profile_case
        # --tune` on 2026-11-28: 0.312 ms against 0.468 at the 32 columns / two stages
        # the launch model had been fitted with (0.324 at 128 rows, 0.354 at two
        # stages). Two stages where that saves a wave (FEW_PROGRAMS = 1 from
        # `_transition_hint`): on an H200, 2x16384x16x128 (384 programs), 0.227 ms
        # against 0.320 at three.
        two = args.get("FEW_PROGRAMS", 0) == 1
        return Config(BV=tile_width(args["V"], 64), BK=tile_width(args["K"], 64),
                      num_warps=4, num_stages=3 if sixteen_bit(args) and not two else 2)
    # The backward's state pass (STATES_ONLY: no Q tiles, no output) has the shared memory
    # for a third stage with two programs an SM: 0.53 ms against 0.59 at 1x8192x96x128.
    # So have a split's transitions without the delta (simple GLA's, no Q tiles either):
    # 0.104 ms against 0.129 at 2x16384x16x128 (H100, Triton 3.6, bf16, 2026-11-27, the
    # space timed by `profile_case --tune`; 64 or 128 rows alike).
    deep = (few >= 2 or args.get("STATES_ONLY", False)
            or (args["TRANSITION"] and not args["DELTA"]))
    rows = 64 if few or args.get("STATES_ONLY", False) else 128
    return Config(BV=tile_width(args["V"], 32 if few else 64), BK=tile_width(args["K"], rows),
                  num_warps=4, num_stages=3 if deep and sixteen_bit(args) else 2)


def _space(args) -> list[Config]:
    # 4 warps only. On H100 with Triton 3.6, BV = 32 at 8 warps (2 stages) compiled to
    # kernels that faulted with an illegal address at K = 128 and K = 256 (after running
    # correctly at another shape), and at K = 256 so did BV = 64 at any warps; 3 stages
    # at K = 256 need more than the 227 KB of shared memory. One program per head (BV =
    # 128 on 8 warps) was 1-2% faster at K = 128 and spilled. 2 warps spilled: 1.2-4.4 ms.
    if args["FORM_AQK"]:
        # The scores formed in the pass feed a dot as the A operand straight from another
        # dot's accumulator. With BV = 32 that compiled wrong on H100 / Triton 3.6 (V = 64:
        # relative error ~1 at 1 stage; V = 128: an illegal address); BV = 64 is right at
        # every stage count (GPU config sweep), and is kept even for V < 64 (masked).
        return [Config(BV=64, BK=tile_width(args["K"], 64), num_warps=4, num_stages=s)
                for s in (1, 2, 3)]
    rows = state_row_heights(args["K"])
    if args["K"] > 128:
        # 64 columns at 8 warps and two stages (one program an SM by its registers, ~172
        # KB of shared memory in 16-bit, past the 227 KB in fp32): correct at K = 256 on
        # H100 / Triton 3.6 on 2026-11-27, as was every 32- and 64-column config forced
        # there (the faults above were the kernel of 2026-11-22, before the K tiles'
        # reuse and the whole-row loads). Triton 3.3.1 aborts building them (offline
        # sm_90, ConvertTritonGPUToLLVM), as it does the other 8-warp state passes.
        wide = ([Config(BV=tile_width(args["V"], 64), BK=bk, num_warps=8, num_stages=2)
                 for bk in rows]
                if sixteen_bit(args) and 8 in warp_choices(stmatrix_prone=True) else [])
        return [Config(BV=tile_width(args["V"], 32), BK=bk, num_warps=4, num_stages=s)
                for bk in rows for s in (1, 2)] + wide
    widths = sorted({tile_width(args["V"], bv) for bv in (32, 64)})
    # With the delta, BV = 32 at one stage faulted with an illegal address at K = V = 64
    # once the update reused K's tiles (H100, Triton 3.6; every other config of the space
    # passed at K = 64 and 128, each run in its own process); never the fastest (1.76 ms
    # against 0.72 at 1x8192x96x128), it is left out up to K = 128.
    return [Config(BV=bv, BK=bk, num_warps=4, num_stages=s)
            for bv in widths for bk in rows for s in (1, 2, 3)
            if not (args["DELTA"] and bv == 32 and s == 1)]


@triton.jit
def _state_tile_dots(k, q, p_qk, m_tk, b_h, b_ks, b_qs, b_qk, WITH_K: tl.constexpr,
                     WITH_Q: tl.constexpr, WITH_QK: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, TWO_TERM: tl.constexpr):
    """K S and/or Q S accumulated over one BK-row tile of the state (16-bit operands;
    with ``TWO_TERM`` K S takes S as two, see ``fla.ops.utils.two_term``), and with
    ``WITH_QK`` the chunk's Q Kᵀ over the same 64 channels; also returns the K tile (for
    the state update) when one was loaded."""
    b_hc = b_h.to(k.dtype.element_ty)
    if WITH_K or WITH_QK:
        b_k = tl.load(k + p_qk, mask=m_tk, other=0.)
    else:
        b_k = tl.zeros([1, 1], dtype=k.dtype.element_ty)  # not loaded: the caller reloads
    if WITH_K:
        b_ks = two_term_dot(b_k, b_h, b_ks, TWO_TERM, DOT_PRECISION)
    if WITH_Q or WITH_QK:
        b_q = tl.load(q + p_qk, mask=m_tk, other=0.)
    if WITH_Q:
        b_qs = tl.dot(b_q, b_hc, b_qs, input_precision=DOT_PRECISION)
    if WITH_QK:
        b_qk = tl.dot(b_q, tl.trans(b_k), b_qk, input_precision=DOT_PRECISION)
    return b_ks, b_qs, b_qk, b_k


@triton.jit
def segment_of_program(i_p, segments, cu_seqlens, T, BT: tl.constexpr, SPLIT: tl.constexpr,
                       IS_VARLEN: tl.constexpr):
    """``(n, bos, T, first, end)`` for program ``i_p`` along the sequences of a chunk
    pass: its sequence n, the sequence's first token (an int64 row) and length, and the
    chunks [first, end) the program walks: all of the sequence's, or with ``SPLIT`` those
    of row i_p of ``segments [P, 4]`` (:func:`segment_tables`)."""
    if SPLIT:
        i_n = tl.load(segments + i_p * 4)
        first = tl.load(segments + i_p * 4 + 1)
        end = tl.load(segments + i_p * 4 + 2)
    else:
        i_n = i_p
        first = runtime_zero(T)  # not a constant 0: the K = 128 passes spilled more
    bos, T = locate_sequence(i_n, T, cu_seqlens, IS_VARLEN)
    if not SPLIT:
        end = tl.cdiv(T, BT)
    return i_n, bos, T, first, end


@triton.jit
def segment_state_row(i_p, segments, SPLIT: tl.constexpr):
    """The row of the per-segment state buffers (entering states, transitions) that
    program ``i_p`` of a chunk pass reads and writes: column 3 of its ``segments`` row
    (its own index in :func:`segment_tables`' tables; a lead split launches its pieces
    longest first, :func:`lead_split_tables`), or ``i_p`` (one program a sequence)."""
    if SPLIT:
        return tl.load(segments + i_p * 4 + 3).to(tl.int64)
    return i_p.to(tl.int64)


@triton.jit
def state_columns(i_w, BV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  AUGMENTED: tl.constexpr):
    """``(o_w, m_w, o_v, m_v)`` of column tile ``i_w`` of a state with V columns, or with
    ``AUGMENTED`` K + V (``[M | X]``: the first K columns M's, the rest X's): the state
    columns and their mask, and the value column each one reads (o_w − K when augmented;
    M's columns masked out of m_v)."""
    o_w = i_w * BV + tl.arange(0, BV)
    if AUGMENTED:
        m_w = o_w < K + V
        o_v = o_w - K              # (< 0: an M column)
        m_v = m_w & (o_w >= K)
    else:
        m_w = o_w < V
        o_v = o_w
        m_v = m_w
    return o_w, m_w, o_v, m_v


@triton.jit
def entering_state(h0, transitions, seg_decay, seg_offsets, i_n, row, i_h, H, o_s, o_k, m_w,
                   K: tl.constexpr, W: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   USE_INITIAL_STATE: tl.constexpr):
    """The state entering the segment at state row ``row`` of sequence ``i_n`` in a split
    without the delta, as row tiles: the sequence's initial state ``h0 [N, H, K, W]`` (or
    zeros) carried through the transitions of its earlier segments, S ← e^d S + X each
    (``transitions [P, H, K, W]``, ``seg_decay [P, H]``; a sequence's segments have
    consecutive state rows from ``seg_offsets[i_n]``). The combine launch's work, done
    by each output program for its own segment: a few K x BV loads, no launch."""
    b_1, b_2, b_3, b_4 = load_state_tiles(h0, (i_n.to(tl.int64) * H + i_h) * (K * W), o_s,
                                          o_k, m_w, K, W, BK, BV, USE_INITIAL_STATE)
    for i_s in range(tl.load(seg_offsets + i_n), row):
        # int64 offsets (P·H·K·W can pass 2³¹; the add keeps the interpreter's int loop
        # counter usable).
        base = tl.full([], 0, tl.int64) + i_s * H + i_h
        b_d = tl.exp(tl.load(seg_decay + base))
        b_x1, b_x2, b_x3, b_x4 = load_state_tiles(transitions, base * (K * W), o_s, o_k, m_w,
                                                  K, W, BK, BV, True)
        b_1, b_2, b_3, b_4 = decay_state_tiles(b_1, b_2, b_3, b_4, b_d, K, BK)
        b_1 += b_x1
        b_2 += b_x2
        b_3 += b_x3
        b_4 += b_x4
    return b_1, b_2, b_3, b_4


@tuned(key=["K", "V", "k", "h0", "SPLIT", "TRANSITION", "DELTA", "FORM_AQK", "STORE_AQK",
            "FEW_PROGRAMS", "STATES_ONLY", "TWO_TERM"],
       default=_default, space=_space)
@triton.jit(do_not_specialize=["T", "H"])
def chunk_gated_delta_rule_fwd_inter_kernel(
    q, k, v, g_cum, beta, Ai, Aqk, o, h0, ht, seg_decay, cu_seqlens, segments, scale, T,
    H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
    IS_VARLEN: tl.constexpr, SPLIT: tl.constexpr, TRANSITION: tl.constexpr,
    DELTA: tl.constexpr, FORM_AQK: tl.constexpr, STORE_AQK: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FEW_PROGRAMS: tl.constexpr,
    h=None, v_new=None, chunk_offsets=None, STATES_ONLY: tl.constexpr = False,
    TWO_TERM: tl.constexpr = False,
    transitions=None, seg_offsets=None, entry_out=None, CHAIN: tl.constexpr = False,
    STORE_ENTRY: tl.constexpr = False, exit_out=None, STORE_EXIT: tl.constexpr = False,
):
    """Grid ``(NW, H, P)``: W-column tiles of the state, heads, and P programs along the
    sequences: one per sequence, or with ``SPLIT`` one per row of ``segments``
    ``[P, 4]`` (sequence, first chunk, end chunk, state row), whose states ``h0``/``ht``
    (and ``seg_decay``) are then indexed by the state row; ``ht`` of an output launch
    (no transition) is indexed by sequence instead, written by the program that walks the
    sequence's last chunk.

    ``q, k [B, T, H, K]``, ``v, o [B, T, H, V]``, ``g_cum, beta [B, T, H]``,
    ``Ai, Aqk [B, T, H, 64]`` (with ``FORM_AQK``, simple GLA only, Aqk is not read:
    each chunk's scores are formed here from the Q and K tiles that Q S loads anyway;
    with ``STORE_AQK`` too, the first V tile's program writes them to Aqk for the
    backward).
    The state is ``K x W``: W = V, or with ``TRANSITION`` and ``DELTA`` W = K + V,
    starting from ``[I | 0]`` with values ``[0 | V]`` and no output; its final value
    ``[M | X]`` goes to ``ht [P, H, K, K + V]``. Without the delta M is the scalar
    ``exp(Σ g)`` over the segment: a transition then runs the K x V state from zeros into
    ``ht [P, H, K, V]`` (X) and writes ``Σ g`` to ``seg_decay [P, H]``.
    ``FEW_PROGRAMS`` (0, 1 or 2, :func:`fla.utils.grid.grid_fill`; for a transition
    launch with the delta, :func:`_transition_hint`'s 0 or 1) is read by the tuning layer
    only (the default tile width and stages).
    With ``CHAIN`` (a split's output launch without the delta) each program forms the
    state entering its segment itself, with no combine launch before it: ``h0`` is then
    indexed by sequence (the initial states), carried through the transitions of the
    sequence's earlier segments (``transitions [P, H, K, V]`` and ``seg_decay [P, H]``
    by state row, the sequence's first row at ``seg_offsets [N + 1]``); with
    ``STORE_ENTRY`` it is also written to ``entry_out [P, H, K, V]`` by state row.
    With ``STORE_EXIT`` (a split's output launch) a program whose piece ends before its
    sequence does writes the state it leaves with to ``exit_out [P, H, K, V]`` by state
    row: the checkpoint from which a later launch runs the sequence's rest.
    With ``STATES_ONLY`` (no transition) the pass computes no output: it stores each
    chunk's entering state to ``h [B, NT, H, K, V]`` (``[1, NT_total, ...]`` with varlen,
    sequence n's chunks from ``chunk_offsets[n]``) and, with the delta, Vn to ``v_new [B,
    T, H, V]`` (what the backward's staged ``chunk_delta_h`` would recompute from W and
    U).
    """
    AUGMENTED: tl.constexpr = TRANSITION and DELTA
    W: tl.constexpr = K + V if AUGMENTED else V
    BT: tl.constexpr = 64  # (a module-level int is not readable inside @jit on Triton 3.6)
    i_w, i_h, i_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, bos, T, first, end = segment_of_program(i_p, segments, cu_seqlens, T, BT, SPLIT,
                                                 IS_VARLEN)
    if STATES_ONLY:
        boh = first_chunk_row(i_n, chunk_offsets, T, BT, IS_VARLEN)   # the sequence's h rows

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_w, m_w, o_v, m_v = state_columns(i_w, BV, K, V, AUGMENTED)
    # The state as row tiles of the K x W matrix (fla.ops.utils.state_tiles): a transition
    # with the delta starts from [I | 0], every other pass from h0 or zeros.
    o_s = o_k[:, None] * W + o_w[None, :]
    row = segment_state_row(i_p, segments, SPLIT)
    state = (row * H + i_h) * (K * W)
    if CHAIN:
        b_h1, b_h2, b_h3, b_h4 = entering_state(
            h0, transitions, seg_decay, seg_offsets, i_n, row, i_h, H, o_s, o_k, m_w, K, W,
            BK, BV, USE_INITIAL_STATE)
        if STORE_ENTRY:
            store_state_tiles(entry_out, state, b_h1, b_h2, b_h3, b_h4, o_s, o_k, m_w, K, W,
                              BK)
    else:
        b_h1, b_h2, b_h3, b_h4 = load_state_tiles(h0, state, o_s, o_k, m_w, K, W, BK, BV,
                                                  USE_INITIAL_STATE and not AUGMENTED)
    if AUGMENTED:
        b_h1, b_h2, b_h3, b_h4 = identity_state_tiles(b_h1, b_h2, b_h3, b_h4, o_k, o_w, K, BK)

    for_out: tl.constexpr = not TRANSITION and not STATES_ONLY
    form_qk: tl.constexpr = FORM_AQK and not TRANSITION
    b_log_decay = tl.zeros([], dtype=tl.float32)   # Σ g over a transition's chunks
    for i_t in range(first, end):
        row0 = bos + i_t * BT
        m_t = (i_t * BT + o_t) < T
        p_qk = (row0 * H + i_h) * K + o_t[:, None] * (H * K) + o_k[None, :]
        if STATES_ONLY:
            store_state_tiles(h, ((boh + i_t) * H + i_h) * (K * W), b_h1, b_h2, b_h3, b_h4,
                              o_s, o_k, m_w, K, W, BK)

        # K S (and Q S for the output), one row tile of the state at a time.
        b_ks = tl.zeros([BT, BV], dtype=tl.float32)
        b_qs = tl.zeros([BT, BV], dtype=tl.float32)
        b_qk = tl.zeros([BT, BT], dtype=tl.float32)
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        b_ks, b_qs, b_qk, b_k1 = _state_tile_dots(k, q, p_qk, m_tk, b_h1, b_ks, b_qs, b_qk,
                                                  DELTA, for_out, form_qk, DOT_PRECISION,
                                                  TWO_TERM)
        if K > BK:
            m_tk = m_t[:, None] & (BK + o_k < K)[None, :]
            b_ks, b_qs, b_qk, b_k2 = _state_tile_dots(k, q, p_qk + BK, m_tk, b_h2, b_ks, b_qs,
                                                      b_qk, DELTA, for_out, form_qk,
                                                      DOT_PRECISION, TWO_TERM)
        if K > 2 * BK:
            m_tk = m_t[:, None] & (2 * BK + o_k < K)[None, :]
            b_ks, b_qs, b_qk, b_k3 = _state_tile_dots(k, q, p_qk + 2 * BK, m_tk, b_h3, b_ks,
                                                      b_qs, b_qk, DELTA, for_out, form_qk,
                                                      DOT_PRECISION, TWO_TERM)
        if K > 3 * BK:
            m_tk = m_t[:, None] & (3 * BK + o_k < K)[None, :]
            b_ks, b_qs, b_qk, b_k4 = _state_tile_dots(k, q, p_qk + 3 * BK, m_tk, b_h4, b_ks,
                                                      b_qs, b_qk, DELTA, for_out, form_qk,
                                                      DOT_PRECISION, TWO_TERM)

        p_tv = (row0 * H + i_h) * V + o_t[:, None] * (H * V) + o_v[None, :]
        b_v = tl.load(v + p_tv, mask=m_t[:, None] & m_v[None, :], other=0.).to(tl.float32)
        p_tt = (row0 * H + i_h) * BT + o_t[:, None] * (H * BT) + o_t[None, :]
        m_tt = m_t[:, None] & m_t[None, :]
        if USE_G:
            # γ is chunk-local and ≤ 0 for decays: exp(γ) ≤ 1 needs no difference trick.
            b_g = tl.load(g_cum + (row0 + o_t) * H + i_h, mask=m_t, other=0.).to(tl.float32)
            b_eg = tl.exp(b_g)
            if for_out:
                b_qs *= b_eg[:, None]
        if DELTA:
            # Vn = Ai · β(V − e^γ K S): the residual is formed in fp32 before the one cast,
            # so the cancellation between V and the state's prediction loses nothing.
            b_beta = tl.load(beta + (row0 + o_t) * H + i_h, mask=m_t, other=0.).to(tl.float32)
            if USE_G:
                b_ks *= b_eg[:, None]
            b_r = (b_v - b_ks) * b_beta[:, None]
            if not TWO_TERM:
                # One term: rounded here, before Ai's tile loads (rounded at the dot, the
                # forward spilled 48 B more, offline at 1x8192x96x128).
                b_r = b_r.to(k.dtype.element_ty)
            b_vn = two_term_dot(load_chunk_rows(Ai + p_tt, m_t, m_tt), b_r,
                                tl.zeros([BT, BV], dtype=tl.float32), TWO_TERM,
                                DOT_PRECISION)
        else:
            b_vn = b_v
        if STATES_ONLY and DELTA:
            tl.store(v_new + p_tv, b_vn.to(v_new.dtype.element_ty),
                     mask=m_t[:, None] & m_v[None, :])

        if for_out:
            if FORM_AQK:
                b_aqk = gate_causal_scores(b_qk, m_t, b_g if USE_G else None, BT,
                                           USE_G).to(k.dtype.element_ty)
                if STORE_AQK:
                    # Every V tile's program forms the same scores; one writes them
                    # (all 64 columns of the valid rows, zeros past the end, as the
                    # intra-chunk kernel's Aqk).
                    if i_w == 0:
                        tl.store(Aqk + p_tt, b_aqk, mask=m_t[:, None])
            else:
                b_aqk = load_chunk_rows(Aqk + p_tt, m_t, m_tt)
            b_o = tl.dot(b_aqk, b_vn.to(k.dtype.element_ty), b_qs,
                         input_precision=DOT_PRECISION)
            tl.store(o + p_tv, (b_o * scale).to(o.dtype.element_ty),
                     mask=m_t[:, None] & m_v[None, :])

        if USE_G:
            # Decay to the chunk's last valid token: exponents γ_C − γ_t ≤ 0, rows past
            # the end masked to 0 before they could overflow.
            last = tl.minimum((i_t + 1) * BT, T) - 1
            b_g_last = tl.load(g_cum + (bos + last) * H + i_h).to(tl.float32)
            b_vn = b_vn * tl.where(m_t, tl.exp(b_g_last - b_g), 0.)[:, None]
            if TRANSITION:
                b_log_decay += b_g_last
            b_h1, b_h2, b_h3, b_h4 = decay_state_tiles(b_h1, b_h2, b_h3, b_h4,
                                                       tl.exp(b_g_last), K, BK)
        if not TWO_TERM:
            b_vn = b_vn.to(k.dtype.element_ty)    # one term: rounded once for every K tile

        # S += Kᵀ Vn. Where this step loaded K's tiles already (for K S or Q Kᵀ), their
        # transposes: reading K again as [BK, BT] tiles cost the delta rule's pass at
        # K = 128 16 KB more of shared memory (its pipelined copies), one program an SM
        # instead of two. The transitions without the delta load K only here.
        if DELTA or form_qk:
            b_h1 = two_term_dot(tl.trans(b_k1), b_vn, b_h1, TWO_TERM, DOT_PRECISION)
            if K > BK:
                b_h2 = two_term_dot(tl.trans(b_k2), b_vn, b_h2, TWO_TERM, DOT_PRECISION)
            if K > 2 * BK:
                b_h3 = two_term_dot(tl.trans(b_k3), b_vn, b_h3, TWO_TERM, DOT_PRECISION)
            if K > 3 * BK:
                b_h4 = two_term_dot(tl.trans(b_k4), b_vn, b_h4, TWO_TERM, DOT_PRECISION)
        else:
            p_kt = k + (row0 * H + i_h) * K + o_k[:, None] + o_t[None, :] * (H * K)
            b_h1 = two_term_dot(tl.load(p_kt, mask=(o_k < K)[:, None] & m_t[None, :],
                                        other=0.), b_vn, b_h1, TWO_TERM, DOT_PRECISION)
            if K > BK:
                b_kt = tl.load(p_kt + BK, mask=(BK + o_k < K)[:, None] & m_t[None, :], other=0.)
                b_h2 = two_term_dot(b_kt, b_vn, b_h2, TWO_TERM, DOT_PRECISION)
            if K > 2 * BK:
                b_kt = tl.load(p_kt + 2 * BK, mask=(2 * BK + o_k < K)[:, None] & m_t[None, :],
                               other=0.)
                b_h3 = two_term_dot(b_kt, b_vn, b_h3, TWO_TERM, DOT_PRECISION)
            if K > 3 * BK:
                b_kt = tl.load(p_kt + 3 * BK, mask=(3 * BK + o_k < K)[:, None] & m_t[None, :],
                               other=0.)
                b_h4 = two_term_dot(b_kt, b_vn, b_h4, TWO_TERM, DOT_PRECISION)

    if STORE_EXIT:
        # After the loop, not in it: a branch in the chunk loop costs every step.
        if end < tl.cdiv(T, BT):
            store_state_tiles(exit_out, state, b_h1, b_h2, b_h3, b_h4, o_s, o_k, m_w, K, W,
                              BK)
    if STORE_FINAL_STATE:
        if SPLIT and not TRANSITION:
            # The output launch of a split: the piece that ends the sequence holds its
            # final state.
            if end == tl.cdiv(T, BT):
                store_state_tiles(ht, (i_n.to(tl.int64) * H + i_h) * (K * W), b_h1, b_h2,
                                  b_h3, b_h4, o_s, o_k, m_w, K, W, BK)
        else:
            store_state_tiles(ht, state, b_h1, b_h2, b_h3, b_h4, o_s, o_k, m_w, K, W, BK)
    if TRANSITION and not DELTA:
        if i_w == 0:
            tl.store(seg_decay + row * H + i_h, b_log_decay)


def default_lead_chunks(offsets: list[int] | None, B: int, T: int, H: int, K: int, V: int,
                        form_scores: bool) -> int:
    """What the scalar-decay pass's launcher picks for ``lead_chunks=None`` (0: no lead
    split), for the host ``offsets`` of packed sequences or (None) B sequences of T."""
    output_tiles, transition_tiles = _pass_tiles(K, V, False, form_scores)
    return chunk_segments.lead_chunks_for(sequence_chunks(offsets, B, T), H, output_tiles,
                                          transition_tiles)


def default_checkpoint_lead_chunks(offsets: list[int] | None, B: int, T: int, H: int,
                                   K: int, V: int) -> int:
    """What the delta's pass picks for ``lead_chunks=None`` with ``return_segment_states``
    (0: no checkpoint): the lead that the backward's states pass (64 columns a program up
    to K = 128, as its defaults take) runs best from. Above K = 128 none (the split's
    output pass takes other tiles there than the whole pass; untimed)."""
    if K > 128:
        return 0
    return chunk_segments.checkpoint_lead_chunks_for(sequence_chunks(offsets, B, T), H,
                                                     cdiv(V, 64))


def default_segment_chunks(offsets: list[int] | None, B: int, T: int, H: int, K: int,
                           V: int, delta: bool, form_scores: bool) -> int:
    """What the pass's launcher picks for ``segment_chunks=None`` (0: no split), given
    the host ``offsets`` of packed sequences (token boundaries from 0), or None for B
    sequences of T tokens."""
    output_tiles, transition_tiles = _pass_tiles(K, V, delta, form_scores)
    return chunk_segments.segment_chunks_for(sequence_chunks(offsets, B, T), H,
                                             output_tiles, transition_tiles,
                                             "delta" if delta else "scalar")


@functools.lru_cache(maxsize=64)
def _pass_tiles(K: int, V: int, delta: bool, form_scores: bool) -> tuple[int, int]:
    """V tiles of the output and of the transition programs at their default configs
    (remembered: every call of every layer asks)."""
    bv = _default(dict(V=V, K=K, DELTA=delta, FORM_AQK=form_scores, TRANSITION=False,
                       FEW_PROGRAMS=0, SPLIT=True)).meta["BV"]
    bw = _default(dict(V=V, K=K, DELTA=delta, FORM_AQK=False, TRANSITION=True,
                       FEW_PROGRAMS=0, SPLIT=True)).meta["BV"]
    return cdiv(V, bv), cdiv(transition_width(K, V, delta), bw)


def _states_shape(k: torch.Tensor, V: int, offsets: list[int], varlen: bool) -> tuple:
    """h's shape for ``states_out``: ``[B, NT, H, K, V]``, ``[1, NT_total, H, K, V]`` with
    packed sequences (``offsets``: the host token offsets)."""
    B, _, H, K = k.shape
    NT = sum(chunk_counts(offsets, CHUNK))
    return (1, NT, H, K, V) if varlen else (B, NT // B, H, K, V)


def state_buffers(k: torch.Tensor, v: torch.Tensor, offsets: list[int] | None,
                  varlen: bool, delta: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Empty ``(h, v_new)`` for :func:`chunk_gated_delta_rule_fwd_inter`'s ``states_out``
    (``offsets`` None: B sequences of T tokens; ``delta`` False: v_new None)."""
    B, T = k.shape[:2]
    if offsets is None:
        offsets = list(range(0, B * T + 1, T))
    h = k.new_empty(_states_shape(k, v.shape[-1], offsets, varlen))
    return h, torch.empty_like(v) if delta else None


def chunk_gated_delta_rule_fwd_inter(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g_cum: torch.Tensor | None,
    beta: torch.Tensor | None,
    Ai: torch.Tensor | None,
    Aqk: torch.Tensor | None,
    scale: float,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    offsets: list[int] | None = None,
    segment_chunks: int | None = None,
    scores_out: torch.Tensor | None = None,
    states_out: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    segment_states: torch.Tensor | None = None,
    return_segment_states: bool = False,
    lead_chunks: int | None = 0,
    return_segment_maps: bool = False,
    two_term: bool = False,
):
    """The sequential pass over chunks, producing the output (inputs validated,
    time-major and contiguous by the op's entry point).

    Args:
        q, k: ``[B, T, H, K]``, K ≤ 256; v: ``[B, T, H, V]``, V ≤ 256 (one dtype).
        g_cum: ``[B, T, H]`` float32 chunk-local cumulative decay γ, or None.
        beta: ``[B, T, H]``.
        Ai, Aqk: ``[B, T, H, 64]`` from :func:`chunk_gated_delta_rule_fwd_intra` (Ai and
            beta None: the simple GLA pass, Vn = V; then Aqk may be None too, and the
            pass forms each chunk's scores itself, needing no intra-chunk kernel).
        scale: the output scale.
        initial_state: ``[N, H, K, V]`` or None (zeros).
        output_final_state: also return the state after each sequence.
        cu_seqlens: ``[N + 1]`` packed-sequence offsets on q's device (B == 1), with
            ``offsets`` its host copy.
        segment_chunks: split sequences into segments of this many chunks (0: never;
            None: when the GPU would otherwise be underused).
        scores_out: with Aqk None, a ``[B, T, H, 64]`` tensor in k's dtype that receives
            the scores the pass forms (what ``chunk_fwd_intra`` would have written as
            Aqk), for a backward; None: they are not kept.
        states_out: ``(h, v_new)`` for a backward: contiguous ``h [B, NT, H, K, V]``
            (``[1, NT_total, H, K, V]`` with cu_seqlens) and ``v_new`` like v, both in k's
            dtype, receive each chunk's entering state and Vn = Ai β(V − e^γ K S) (U − W S
            of the WY form, with no W or U formed); without the delta (Ai None) v_new is
            None (Vn = V) and only h is stored. The output is then not computed (q, Aqk
            and scale are unused, o is None).
        segment_states: ``[P, H, K, V]`` float32, the state entering each segment of the
            split, as an earlier pass over the same inputs and ``segment_chunks``
            returned it (``return_segment_states``): the transitions and their combine
            are skipped and every segment starts from its row (the backward's states
            without the sequential walk).
        return_segment_states: also return those states (None when the pass did not
            split), for a later pass's ``segment_states``.
        lead_chunks: where ``segment_chunks`` leaves the sequences whole, cut each
            sequence after this many chunks; None: the launch model's choice; 0: never.
            Without the delta a lead split (the lead pieces' transitions, then every
            piece in one launch, longest first; see ``fla.ops.common.chunk_segments``),
            not with ``states_out`` or ``segment_states``, its segment states not
            returned (None: a backward walks the sequences whole). With the delta a
            checkpoint, only with ``return_segment_states`` or ``segment_states``: the
            pass runs in two launches, the sequences' first pieces and then their rests
            from the states the first left at the cut, and returns ``[2N, H, K, V]``
            segment states (the initial states, then the states at the cuts); a later
            pass given them and the same ``lead_chunks`` runs every piece in one launch,
            longest first (the backward's states pass: no transition to pay).
        return_segment_maps: with ``return_segment_states`` and the delta, also return
            the split's transitions ``[P, H, K, K + V]`` float32 (``[M | X]`` of each
            segment; each sequence's last row unset), None when the pass did not split:
            the reverse pass's maps are their transposes
            (:func:`fla.ops.common.chunk_delta_h_bwd.chunk_gated_delta_rule_bwd_dhu`'s
            ``segment_maps``).
        two_term: the recurrence's dots (K S, Ai·r, Kᵀ Vn) take their fp32 operand as
            two 16-bit tiles (``fla.ops.utils.two_term``): ~16 mantissa bits of S and Vn
            instead of 8, at twice those dots' work. Ignored for fp32 inputs.

    Returns:
        ``(o, final_state)``: ``o [B, T, H, V]`` in v's dtype (None with
        ``states_out``); ``final_state [N, H, K, V]`` float32 or None. With
        ``return_segment_states``, ``(o, final_state, segment_states)``, and with
        ``return_segment_maps`` too, ``(o, final_state, segment_states, segment_maps)``.
    """
    if return_segment_maps and not return_segment_states:
        raise ValueError("return_segment_maps: only with return_segment_states")
    if states_out is not None and (Ai is None) != (states_out[1] is None):
        raise ValueError("states_out: (h, v_new) with the delta (Ai given), (h, None) "
                         "without")
    if Aqk is None and Ai is not None and states_out is None:
        raise ValueError("the delta rule's pass needs the intra-chunk Aqk (only simple GLA "
                         "forms it in the pass)")
    if Aqk is None and k.shape[-1] > MAX_K_FORMING_SCORES and states_out is None:
        raise ValueError(f"the pass forms its own scores only for K <= "
                         f"{MAX_K_FORMING_SCORES} (got K = {k.shape[-1]}): pass Aqk")
    if scores_out is not None and Aqk is not None:
        raise ValueError("scores_out is for a pass that forms its own scores (Aqk None)")
    B, T, H, K = k.shape
    V = v.shape[-1]
    if offsets is None:
        offsets = list(range(0, B * T + 1, T))
    N = len(offsets) - 1
    varlen = cu_seqlens is not None
    o = torch.empty_like(v) if states_out is None else None
    states = {}
    if states_out is not None:
        h, v_new = states_out
        check_buffer("states_out: h", h, _states_shape(k, V, offsets, varlen), k.dtype,
                     k.device)
        if v_new is not None:
            check_buffer("states_out: v_new", v_new, v.shape, k.dtype, k.device)
        states = dict(h=h, v_new=v_new, STATES_ONLY=True, chunk_offsets=(
            varlen_chunk_offsets(cu_seqlens, CHUNK, offsets) if varlen else None))
    final_state = (torch.empty(N, H, K, V, dtype=torch.float32, device=k.device)
                   if output_final_state else None)
    form_scores = Aqk is None and states_out is None
    if scores_out is not None:
        check_buffer("scores_out", scores_out, (B, T, H, CHUNK), k.dtype, k.device)
        Aqk = scores_out
    common = dict(q=q, k=k, v=v, g_cum=g_cum, beta=beta, Ai=Ai, Aqk=Aqk, o=o,
                  cu_seqlens=cu_seqlens, scale=scale, T=T, H=H, K=K, V=V,
                  USE_G=g_cum is not None, IS_VARLEN=varlen,
                  DELTA=Ai is not None, FORM_AQK=form_scores,
                  STORE_AQK=form_scores and scores_out is not None,
                  DOT_PRECISION=dot_precision(k.dtype),
                  TWO_TERM=two_term and k.dtype != torch.float32)
    kernel = chunk_gated_delta_rule_fwd_inter_kernel
    if segment_chunks is None:
        segment_chunks = default_segment_chunks(offsets, B, T, H, K, V, Ai is not None,
                                                form_scores)
    if not segment_chunks and Ai is not None and K <= 128:
        if states_out is None and segment_states is None and return_segment_states:
            if lead_chunks is None:
                lead_chunks = default_checkpoint_lead_chunks(offsets, B, T, H, K, V)
            if lead_chunks:
                seg_h0 = _checkpointed_pass(kernel, common, *checkpoint_tables(
                    offsets, lead_chunks, k.device)[:2], initial_state, final_state)
                return _returned(o, final_state, seg_h0, None, True, return_segment_maps)
        elif segment_states is not None and lead_chunks and not output_final_state:
            pieces = checkpoint_tables(offsets, lead_chunks, k.device)[2]
            check_buffer("segment_states", segment_states, (2 * N, H, K, V), torch.float32,
                         k.device)
            _split_pass(kernel, common, states, None, pieces, None, True, initial_state,
                        final_state, segment_states)
            return _returned(o, final_state, None, None, return_segment_states,
                             return_segment_maps)
    if segment_states is not None and (not segment_chunks or output_final_state):
        raise ValueError("segment_states: given for a pass that does not split, or with "
                         "output_final_state (the skipped combine computes the final state)")
    if not segment_chunks and Ai is None and states_out is None and segment_states is None:
        if lead_chunks is None:
            lead_chunks = default_lead_chunks(offsets, B, T, H, K, V, form_scores)
        if lead_chunks:
            _split_pass(kernel, common, states, *lead_split_tables(offsets, lead_chunks,
                                                                   k.device),
                        False, initial_state, final_state, keep_entries=False)
            return _returned(o, final_state, None, None, return_segment_states,
                             return_segment_maps)
    if not segment_chunks:
        # A hint for the delta rule's tile width and stages (see _default). Always 0
        # without the delta, where it would only compile identical variants.
        few = sequential_grid_fill(N, H, V) if Ai is not None else 0
        kernel[lambda meta: (cdiv(V, meta["BV"]), H, N)](
            h0=initial_state, ht=final_state, seg_decay=None, segments=None,
            USE_INITIAL_STATE=initial_state is not None,
            STORE_FINAL_STATE=output_final_state, SPLIT=False, TRANSITION=False,
            FEW_PROGRAMS=few, **common, **states)
        return _returned(o, final_state, None, None, return_segment_states,
                         return_segment_maps)

    transitions, outputs, seg_offsets = split_tables(offsets, segment_chunks, k.device)
    if segment_states is not None:
        # Read by row offsets from the segment table: another split's states would start
        # segments from the wrong state.
        check_buffer("segment_states", segment_states, (outputs.shape[0], H, K, V),
                     torch.float32, k.device)
    seg_h0, maps = _split_pass(kernel, common, states, transitions, outputs, seg_offsets,
                               Ai is not None, initial_state, final_state, segment_states,
                               keep_entries=return_segment_states)
    return _returned(o, final_state, seg_h0, maps if Ai is not None else None,
                     return_segment_states, return_segment_maps)


def _returned(o, final_state, segment_states, maps, with_states: bool, with_maps: bool):
    """The pass's return value for its ``return_segment_*`` flags."""
    if not with_states:
        return o, final_state
    return (o, final_state, segment_states, maps) if with_maps else \
        (o, final_state, segment_states)


def _split_pass(kernel, common: dict, states: dict, transitions: torch.Tensor,
                outputs: torch.Tensor, seg_offsets: torch.Tensor, delta: bool,
                initial_state, final_state, segment_states=None,
                keep_entries: bool = True
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The pass over segments (tables from :func:`split_tables` or
    :func:`lead_split_tables`): the transitions of every segment but each sequence's last,
    the combine (the state entering every segment), then every segment's output, the
    segments that end a sequence writing its final state. With ``segment_states`` (the
    entering states from an earlier pass) only the last launch runs.

    Without the delta there is no combine launch: each output program carries its
    sequence's initial state through the earlier segments' transitions itself (``CHAIN``;
    H100, Triton 3.6, simple GLA: the 5 µs combine launch gone, the output launch 3.8 µs
    longer; the op's forward at 2x16384x16x128 0.369 -> 0.367 ms, 1x8192x96x128 0.469 ->
    0.461, three alternating runs), and writes it out only with ``keep_entries``.

    Returns ``(entering, maps)``: the entering states ``[P, H, K, V]`` float32, or None
    (no delta and no ``keep_entries``); the transitions ``[P, H, K, W]`` float32 the
    pass computed (None with ``segment_states``: none computed)."""
    H, K, V = common["H"], common["K"], common["V"]
    P = outputs.shape[0]
    entry = dict(h0=segment_states, seg_decay=None, USE_INITIAL_STATE=True)
    seg_h0, mx = segment_states, None
    if seg_h0 is None:
        W = transition_width(K, V, delta)
        mx = torch.empty(P, H, K, W, dtype=torch.float32, device=outputs.device)
        seg_decay = None if delta else torch.empty(P, H, dtype=torch.float32,
                                                   device=outputs.device)
        if transitions.shape[0]:
            kernel[lambda meta: (cdiv(W, meta["BV"]), H, transitions.shape[0])](
                h0=None, ht=mx, seg_decay=seg_decay, segments=transitions,
                USE_INITIAL_STATE=False, STORE_FINAL_STATE=True, SPLIT=True,
                TRANSITION=True,
                FEW_PROGRAMS=_transition_hint(cdiv(W, 64) * H * transitions.shape[0], K,
                                              delta),
                # The transitions use no scores: one compiled variant (and space) for all.
                **dict(common, FORM_AQK=False, STORE_AQK=False))
        if delta:
            # The combine reads the transitions of the segments it walks past (no
            # sequence's last); the final states come from the output launch.
            seg_h0 = combine_segment_states(mx, seg_decay, "delta", seg_offsets, V,
                                            initial_state)
            entry["h0"] = seg_h0
        else:
            seg_h0 = (torch.empty(P, H, K, V, dtype=torch.float32, device=outputs.device)
                      if keep_entries else None)
            entry = dict(h0=initial_state, seg_decay=seg_decay,
                         USE_INITIAL_STATE=initial_state is not None, CHAIN=True,
                         transitions=mx, seg_offsets=seg_offsets, entry_out=seg_h0,
                         STORE_ENTRY=keep_entries)
    kernel[lambda meta: (cdiv(V, meta["BV"]), H, P)](
        ht=final_state, segments=outputs, STORE_FINAL_STATE=final_state is not None,
        SPLIT=True, TRANSITION=False, FEW_PROGRAMS=0, **entry, **common, **states)
    return seg_h0, mx


def _checkpointed_pass(kernel, common: dict, firsts: torch.Tensor, rests: torch.Tensor,
                       initial_state, final_state) -> torch.Tensor:
    """The delta's pass in two launches (tables from :func:`checkpoint_tables`): every
    sequence's first piece, then the cut sequences' rests from the states the first
    launch left at the cut. The same chunk steps as one launch, and the states at the cuts
    kept: returns ``[2N, H, K, V]`` float32, the initial states (zeros where None), then
    the states at the cuts (rows of uncut sequences unset), every piece's entering state
    by its row in the tables' ``pieces``."""
    H, K, V = common["H"], common["K"], common["V"]
    N = firsts.shape[0]
    entering = torch.empty(2 * N, H, K, V, dtype=torch.float32, device=firsts.device)
    if initial_state is None:
        entering[:N].zero_()
    else:
        entering[:N].copy_(initial_state)
    at_cut = entering[N:]
    for table, h0, given in ((firsts, initial_state, initial_state is not None),
                             (rests, at_cut, True)):
        if table.shape[0]:
            kernel[lambda meta, P=table.shape[0]: (cdiv(V, meta["BV"]), H, P)](
                h0=h0, ht=final_state, seg_decay=None, segments=table,
                USE_INITIAL_STATE=given, STORE_FINAL_STATE=final_state is not None,
                SPLIT=True, TRANSITION=False, FEW_PROGRAMS=0, exit_out=at_cut,
                STORE_EXIT=table is firsts, **common)
    return entering


# Programs an SM of the delta's transitions at their default tiles (64 x 64, 4 warps,
# 16-bit operands) by pipeline stages, from an offline sm_90 build (Triton 3.9,
# `scripts/compile_check.py --resources`): at K = V = 128 two stages take 165 registers
# and 64 KB of shared memory (three an SM), three 228 and 97 KB (two); at K = 64 four
# and two (the table keeps K = 128's: the hint fires a little less often there than it
# could). Timed at K = 128 only (H200, Triton 3.6: the shapes in the default's comment).
_TRANSITION_PROGRAMS_PER_SM = {2: 3, 3: 2}


def _transition_hint(programs: int, K: int, delta: bool) -> int:
    """``FEW_PROGRAMS`` of a transition launch: 1 where its ``programs`` (at 64 columns)
    take fewer waves of the GPU at two stages' occupancy than at three's (the default then
    takes two stages, whose programs are slower one by one), else 0. With the delta up to
    K = 128 only (the transitions without it take other tiles)."""
    if not delta or K > 128:
        return 0
    sms = multiprocessor_count()
    fits = {s: cdiv(programs, n * sms) for s, n in _TRANSITION_PROGRAMS_PER_SM.items()}
    return int(fits[2] < fits[3])


def split_states(segment_states: torch.Tensor | None) -> torch.Tensor | None:
    """A step's ``segment_states`` output as its backward takes it: None where the pass did
    not split (a custom op returns an empty placeholder for None, eager code None)."""
    return None if segment_states is None or segment_states.numel() == 0 else segment_states
