"""Test oracles for bagf_torch/iobound.py: each ``brute_force_*`` replays one kernel's loop nest in Python
(every block, thread and load, as csrc/kernels/*.cuh are written) and counts the words it requests from global
memory element by element. tests/test_iobound.py checks that each closed-form traffic model in iobound.py
equals its oracle exactly. Small shapes only: the cost is blocks * steps * threads.

Test code, not package code: nothing in bagf_torch imports it. Tests import it as ``import iobound_oracles``
(tests/ is on sys.path in pytest's default prepend import mode). The oracles use iobound.py's problem checks,
launch geometry and fast-memory helpers, so the comparison checks the word counts, not those helpers.
"""

from __future__ import annotations

from types import ModuleType
from typing import Mapping

from bagf_torch.iobound import (
    Traffic,
    _check_direct_problem,
    _check_problem,
    _check_winograd_gemm_problem,
    _check_winograd_problem,
    _gemm_shape,
    _geometry,
    _tc_geometry,
    _u_planes,
    direct_fast_memory_words,
    implicit_gemm_fast_memory_words,
    implicit_gemm_tc_fast_memory_words,
    implicit_gemm_tma_tf32_fast_memory_words,
    implicit_gemm_wgmma_fast_memory_words,
    winograd_fast_memory_words,
    winograd_gemm_fast_memory_words,
    winograd_gemm_tile,
)
from bagf_torch.problem import ConvProblem

__all__ = [
    "brute_force_traffic", "brute_force_tc_traffic", "brute_force_wgmma_traffic", "brute_force_tma_tf32_traffic",
    "brute_force_winograd_traffic",
    "brute_force_winograd_gemm_traffic", "brute_force_direct_traffic",
]


def _counted(n_in: int, n_w: int, n_b: int, n_out: int, out: int, fast: int,
             grid: tuple[int, int, int]) -> Traffic:
    """The Traffic of a brute-force walk: the words it counted (``n_out`` output accesses: stores, or with
    grid.z = SPLIT > 1 one atomic read-modify-write each) plus, when split, the host's memset of the ``out``
    output words."""
    split = grid[2]
    memset = out if split > 1 else 0
    return Traffic(words_read_input=n_in, words_read_weight=n_w, words_read_bias=n_b, words_written=n_out + memset,
                   fast_memory_words=fast, blocks=grid[0] * grid[1] * split, grid=grid,
                   words_read_output=n_out if split > 1 else 0, words_memset=memset)


def brute_force_traffic(problem: ConvProblem, config: Mapping[str, int]) -> Traffic:
    """Replay the kernel's loop nest (every block, K-step, thread and load of implicit_gemm.cuh) in Python and
    count requested words element by element, plus the distinct input elements per block. Small shapes
    only: the cost is blocks * K-steps * threads."""
    _check_problem(problem)
    g = _geometry(config)
    bm, bn, bk, vec = config["BM"], config["BN"], config["BK"], config["VEC"]
    p, q = problem.out_hw
    rs, pq = problem.r * problem.s, p * q
    crs, npq = problem.c * rs, problem.n * pq
    (sh, sw), (ph, pw), (dh, dw) = problem.stride, problem.padding, problem.dilation
    vec_ok = crs % 4 == 0  # the alignment half of the kernel's test holds for torch allocations
    gx, gy = -(-npq // bn), -(-problem.k // bm)
    num_k = -(-crs // bk)
    n_in = n_w = n_b = n_out = n_unique = 0
    for by in range(gy):
        for bx in range(gx):
            m0, n0 = by * bm, bx * bn
            seen: set[tuple[int, int, int, int]] = set()
            for tid in range(g["T"]):
                b_col, b_row0 = tid % bn, tid // bn
                pix = n0 + b_col
                pix_ok = pix < npq
                if pix_ok:
                    img, rem = divmod(pix, pq)
                    oh, ow = divmod(rem, q)
                    ih0, iw0 = oh * sh - ph, ow * sw - pw
                for t in range(num_k):
                    k0 = t * bk
                    for i in range(g["A_LOADS"]):
                        e = tid + i * g["T"]
                        am, ak = e // (bk // vec), (e % (bk // vec)) * vec
                        gm, gk = m0 + am, k0 + ak
                        if vec == 4 and vec_ok:
                            n_w += 4 if (e < g["A_VECS"] and gm < problem.k and gk < crs) else 0
                        else:
                            n_w += sum(1 for v in range(vec) if e < g["A_VECS"] and gm < problem.k and gk + v < crs)
                    for i in range(g["B_LOADS"]):
                        kk = k0 + b_row0 + i * g["STEP"]
                        if pix_ok and kk < crs:
                            c, rr = divmod(kk, rs)
                            r, s = divmod(rr, problem.s)
                            ih, iw = ih0 + r * dh, iw0 + s * dw
                            if 0 <= ih < problem.h and 0 <= iw < problem.w:
                                n_in += 1
                                seen.add((img, c, ih, iw))
                ty, tx = tid // g["TX"], tid % g["TX"]
                for i in range(config["TM"]):
                    gm = m0 + ty + i * g["TY"]
                    if gm < problem.k:
                        n_b += 1 if problem.bias else 0
                        n_out += sum(1 for j in range(config["TN"]) if n0 + tx + j * g["TX"] < npq)
            n_unique += len(seen)
    return Traffic(words_read_input=n_in, words_read_weight=n_w, words_read_bias=n_b, words_written=n_out,
                   fast_memory_words=implicit_gemm_fast_memory_words(config), blocks=gx * gy, grid=(gx, gy),
                   words_read_input_unique=n_unique,
                   words_read_bias_unique=gx * problem.k if problem.bias else 0)


def brute_force_tc_traffic(problem: ConvProblem, config: Mapping[str, int]) -> Traffic:
    """Replay implicit_gemm_tc.cuh's loop nest in Python - every block (x, y, z), the cp.async pipeline's
    ``load_tile`` calls in issue order with the loader's incremental (c, r, s) counters, and the epilogue's
    fragment mapping - and count the words requested element by element. Small shapes only."""
    _check_problem(problem)
    g = _tc_geometry(config)
    bm, bn, bk, stages, split = config["BM"], config["BN"], config["BK"], config["STAGES"], config["SPLIT"]
    p, q = problem.out_hw
    rs, pq = problem.r * problem.s, p * q
    crs, npq = problem.c * rs, problem.n * pq
    (sh, sw), (ph, pw), (dh, dw) = problem.stride, problem.padding, problem.dilation
    vec_ok = crs % 4 == 0  # torch allocations are 16-byte aligned
    gx, gy = -(-npq // bn), -(-problem.k // bm)
    num_k = -(-crs // bk)
    per_split = -(-num_k // split)
    mi, ni = g["WTM"] // 16, g["WTN"] // 8
    d_c, d_rs = bk // rs, bk % rs
    d_r, d_s = d_rs // problem.s, d_rs % problem.s
    n_in = n_w = n_b = n_out = 0
    for bz in range(split):
        t_begin = bz * per_split if split > 1 else 0
        t_end = min(num_k, t_begin + per_split) if split > 1 else num_k
        for by in range(gy):
            for bx in range(gx):
                m0, n0 = by * bm, bx * bn
                for tid in range(g["T"]):
                    b_col, b_row0 = tid % bn, tid // bn
                    pix = n0 + b_col
                    pix_ok = pix < npq
                    ih0 = iw0 = 0
                    if pix_ok:
                        rem = pix % pq
                        ih0, iw0 = (rem // q) * sh - ph, (rem % q) * sw - pw
                    cur = []
                    for i in range(g["B_LOADS"]):
                        kk = t_begin * bk + b_row0 + i * g["STEP"]
                        cur.append([kk // rs, (kk % rs) // problem.s, (kk % rs) % problem.s])

                    def load_tile(t: int) -> None:
                        nonlocal n_in, n_w
                        k0 = t * bk
                        for i in range(g["A_LOADS"]):
                            e = tid + i * g["T"]
                            if e < g["A_VECS"]:
                                gm, gk = m0 + e // (bk // 4), k0 + (e % (bk // 4)) * 4
                                if vec_ok:
                                    n_w += 4 if gm < problem.k and gk < crs else 0
                                else:
                                    n_w += sum(1 for v in range(4) if gm < problem.k and gk + v < crs)
                        for i in range(g["B_LOADS"]):
                            row = b_row0 + i * g["STEP"]
                            c, r, s = cur[i]
                            if row < bk:
                                ih, iw = ih0 + r * dh, iw0 + s * dw
                                if pix_ok and k0 + row < crs and 0 <= ih < problem.h and 0 <= iw < problem.w:
                                    n_in += 1
                            s, r, c = s + d_s, r + d_r, c + d_c
                            if s >= problem.s:
                                s, r = s - problem.s, r + 1
                            if r >= problem.r:
                                r, c = r - problem.r, c + 1
                            cur[i] = [c, r, s]

                    for st in range(stages - 1):  # prologue
                        if t_begin + st < t_end:
                            load_tile(t_begin + st)
                    for t in range(t_begin, t_end):
                        if t + stages - 1 < t_end:
                            load_tile(t + stages - 1)
                    warp, lane = tid >> 5, tid & 31
                    wm, wn = warp // config["WN"], warp % config["WN"]
                    gid, tig = lane >> 2, lane & 3
                    add_bias = problem.bias and (split == 1 or bz == 0)
                    for j in range(ni):
                        for h in range(2):
                            gn = n0 + wn * g["WTN"] + j * 8 + 2 * tig + h
                            if gn >= npq:
                                continue
                            for i in range(mi):
                                for hi in range(2):
                                    if m0 + wm * g["WTM"] + i * 16 + gid + 8 * hi < problem.k:
                                        n_b += 1 if add_bias else 0
                                        n_out += 1  # a store, or one atomic read-modify-write
    out = problem.k * npq
    return _counted(n_in, n_w, n_b, n_out, out, implicit_gemm_tc_fast_memory_words(config), (gx, gy, split))


def brute_force_wgmma_traffic(problem: ConvProblem, config: Mapping[str, int]) -> Traffic:
    """Replay implicit_gemm_wgmma.cuh's loads in Python - every block (x, y, z) and thread, the pipeline's
    ``load_tile`` calls in issue order with the warp's shared row cursors (lane j keeps row b_row0 + 2 j's tap, a
    thread's element j reads lane j's), and the epilogue's bias and output accesses - counting the words requested
    element by element. Small shapes only."""
    _check_problem(problem)
    wn, nb, wg, stages, split = config["WN"], config["NB"], config["WG"], config["STAGES"], config["SPLIT"]
    bk, t_count, bm, bn = 32, 128 * wg, wn * nb, 64 * wg
    step, b_loads = t_count // bn, 32 // (t_count // bn)
    p, q = problem.out_hw
    rs, pq = problem.r * problem.s, p * q
    crs, npq = problem.c * rs, problem.n * pq
    (sh, sw), (ph, pw), (dh, dw) = problem.stride, problem.padding, problem.dilation
    vec = crs % 4 == 0  # torch allocations are 16-byte aligned
    gx, gy = -(-npq // bn), -(-problem.k // bm)
    num_k = -(-crs // bk)
    per_split = -(-num_k // split)
    d_c, d_rs = bk // rs, bk % rs
    d_r, d_s = d_rs // problem.s, d_rs % problem.s
    never = -0x40000000
    n_in = n_w = n_b = n_out = 0
    for bz in range(split):
        t_begin = bz * per_split if split > 1 else 0
        t_end = min(num_k, t_begin + per_split) if split > 1 else num_k
        tiles = t_end - t_begin
        for by in range(gy):
            for bx in range(gx):
                m0, n0 = by * bm, bx * bn
                for warp in range(t_count // 32):
                    # the warp's 16 row cursors (lanes j and j + 16 hold the same row)
                    b_row0 = (warp * 32) // bn
                    cur = []
                    for j in range(16):
                        kk = t_begin * bk + b_row0 + step * j
                        cur.append([kk // rs, (kk % rs) // problem.s, (kk % rs) % problem.s])
                    lanes = []
                    for lane in range(32):
                        tid = warp * 32 + lane
                        pix = n0 + tid % bn
                        ih0, iw0 = never, 0
                        if pix < npq:
                            rem = pix % pq
                            ih0, iw0 = (rem // q) * sh - ph, (rem % q) * sw - pw
                        lanes.append((tid, ih0, iw0))
                    issued = [st for st in range(stages - 2) if st < tiles]  # the prologue
                    issued += [i + stages - 2 for i in range(tiles) if i + stages - 2 < tiles]  # one per step
                    for i in issued:  # load_tile(t_begin + i), in issue order
                        k0 = (t_begin + i) * bk
                        for tid, ih0, iw0 in lanes:
                            if vec:
                                for chunk in range(bm * 8 // t_count):
                                    m = (tid >> 3) + chunk * (t_count // 8)
                                    n_w += 4 if m0 + m < problem.k and k0 + 4 * (tid & 7) < crs else 0
                            else:
                                for e in range(tid, bm * bk, t_count):
                                    n_w += 1 if m0 + e // bk < problem.k and k0 + e % bk < crs else 0
                            for j in range(b_loads):
                                c, r, s = cur[j]
                                dr = r * dh if k0 + b_row0 + step * j < crs else never
                                if 0 <= ih0 + dr < problem.h and 0 <= iw0 + s * dw < problem.w:
                                    n_in += 1
                        for j in range(16):
                            c, r, s = cur[j]
                            s, r, c = s + d_s, r + d_r, c + d_c
                            if s >= problem.s:
                                s, r = s - problem.s, r + 1
                            if r >= problem.r:
                                r, c = r - problem.r, c + 1
                            cur[j] = [c, r, s]
                    add_bias = problem.bias and (split == 1 or bz == 0)
                    for tid, _, _ in lanes:
                        lane = tid & 31
                        gid, tig = lane >> 2, lane & 3
                        frag_col = (warp >> 2) * 64 + (warp & 3) * 16 + 2 * gid
                        col_ok = [n0 + frag_col + h < npq for h in range(2)]
                        for j in range(nb):
                            for i in range(wn // 8):
                                for qq in range(2):
                                    if m0 + j * wn + 8 * i + 2 * tig + qq >= problem.k:
                                        continue
                                    n_b += 1 if add_bias else 0
                                    n_out += sum(col_ok)
    out = problem.k * npq
    return _counted(n_in, n_w, n_b, n_out, out, implicit_gemm_wgmma_fast_memory_words(config), (gx, gy, split))


def brute_force_tma_tf32_traffic(problem: ConvProblem, config: Mapping[str, int]) -> Traffic:
    """Replay implicit_gemm_tma_h16.cuh (DT = 2) in Python - every block (x, y, z), its slice's k tiles (the even
    split's ``slice_begin``), each tile's two TMA boxes element by element (the im2col box: BN pixels walked from the
    block's first, 32 channels of one tap, read where pixel, channel and tap lie inside the tensor; the weight box:
    WN rows x 32 channels), and the epilogue per consumer thread (split-K's partial tile, counter and, on the last
    slice to arrive, every slice's partials; the bias and output of each in-bounds element) - counting words. With
    stream-K (SK = 1): each of the launch's blocks walks its share of all tiles' k tiles tile by tile as the kernel
    does, a tile it covers only in part handed over (a partial tile and an atomic; the tile's last part to arrive
    reads them all and finishes it). An NCHW tile without stream-K is stored as wgt::store_nchw_staged stores it
    (each consumer thread reads the bias of its channels of every 8, then stores its pixel's channels). The NCHW
    plan's per-call copies are counted as ``implicit_gemm_tma_tf32_traffic`` counts them. Small shapes only."""
    from bagf_torch.kernels import implicit_gemm_tma_tf32 as tma_tf32

    _check_problem(problem)
    wn, mi, wg, split = config["WN"], config["MI"], config["WG"], config["SPLIT"]
    bm, bn, bk = wn, 64 * mi * wg, 32
    p, q = problem.out_hw
    pq, npq = p * q, problem.n * p * q
    (sh, sw), (ph, pw), (dh, dw) = problem.stride, problem.padding, problem.dilation
    cb_n = -(-problem.c // bk)
    num_k = problem.r * problem.s * cb_n
    gx, gy = -(-npq // bn), -(-problem.k // bm)
    staged = not config["NHWC"] and config.get("SK", 0) != 1  # (stream-K stores from the registers)
    counts = dict(n_in=0, n_w=0, n_b=0, n_out=0)

    def copies(n0, m0, t_begin, t_end):  # the TMA boxes of k tiles [t_begin, t_end) of the tile at (n0, m0)
        for t in range(t_begin, t_end):
            tap, cb = divmod(t, cb_n)
            r, s = divmod(tap, problem.s)
            chans = min(bk, problem.c - cb * bk)
            for i in range(bn):
                pix = n0 + i
                if pix >= npq:
                    continue  # past the last image: the map's zero fill
                rem = pix % pq
                ih = (rem // q) * sh - ph + r * dh
                iw = (rem % q) * sw - pw + s * dw
                if 0 <= ih < problem.h and 0 <= iw < problem.w:
                    counts["n_in"] += chans
            counts["n_w"] += chans * max(0, min(bm, problem.k - m0))

    def epilogue(n0, m0):  # wgh::store's (or the staged store's) rows and channels of each consumer thread
        if staged:
            for tid in range(128 * wg):
                for j in range(wn // 8):
                    ch = m0 + 8 * j + 2 * (tid & 3)
                    counts["n_b"] += ((ch < problem.k) + (ch + 1 < problem.k)) if problem.bias else 0
            for i in range(bn):  # thread i % BN's pixel, each of the tile's channels once
                if n0 + i < npq:
                    counts["n_out"] += max(0, min(bm, problem.k - m0))
            return
        for tid in range(128 * wg):
            warp, lane = tid >> 5, tid & 31
            for m in range(mi):
                for h in range(2):
                    pix = n0 + (warp >> 2) * (mi * 64) + m * 64 + (warp & 3) * 16 + (lane >> 2) + 8 * h
                    if pix >= npq:
                        continue
                    for j in range(wn // 8):
                        ch = m0 + 8 * j + 2 * (lane & 3)
                        for c in (ch, ch + 1):
                            if c < problem.k:
                                counts["n_b"] += 1 if problem.bias else 0
                                counts["n_out"] += 1

    partials_w = partials_r = counter_atomics = 0
    tiles = gx * gy
    if config.get("SK", 0) == 2:  # persistent blocks: whole tiles round-robin over the host's grid
        blocks = tma_tf32.persistent_blocks(config, problem)
        for c in range(blocks):
            for tile in range(c, tiles, blocks):
                n0, m0 = (tile // gy) * bn, (tile % gy) * bm  # channel blocks innermost
                copies(n0, m0, 0, num_k)
                epilogue(n0, m0)
        grid = (blocks, 1, 1)
    elif config.get("SK", 0):
        blocks = tma_tf32.stream_k_blocks(config, problem)
        work = tiles * num_k
        parts: dict[int, int] = {}
        for c in range(blocks):
            x, end = c * work // blocks, (c + 1) * work // blocks
            while x < end:
                tile = x // num_k
                kb, ke = x - tile * num_k, min(num_k, end - tile * num_k)
                n0, m0 = (tile // gy) * bn, (tile % gy) * bm  # channel blocks innermost
                copies(n0, m0, kb, ke)
                if kb == 0 and ke == num_k:
                    epilogue(n0, m0)
                else:
                    partials_w += bm * bn
                    counter_atomics += 1
                    parts[tile] = parts.get(tile, 0) + 1
                x = tile * num_k + ke
        for tile, n in parts.items():  # the last part to arrive reads them all, then finishes the tile
            partials_r += n * bm * bn
            epilogue((tile // gy) * bn, (tile % gy) * bm)
        grid = (blocks, 1, 1)
    else:
        for bz in range(split):
            t_begin, t_end = bz * num_k // split, (bz + 1) * num_k // split
            for by in range(gy):
                for bx in range(gx):
                    m0, n0 = by * bm, bx * bn
                    copies(n0, m0, t_begin, t_end)
                    finishing = split == 1 or bz == split - 1  # (the last slice to arrive: one per tile)
                    if split > 1 and not config.get("CR", 0):  # (a cluster's slices hand over in shared memory)
                        partials_w += bm * bn
                        counter_atomics += 1
                        if finishing:
                            partials_r += split * bm * bn
                    if finishing:
                        epilogue(n0, m0)
        grid = (gx, gy, split)
    written, read = [], []
    if not config["NHWC"]:
        x_words, w_words = problem.n * problem.c * problem.h * problem.w, problem.k * problem.c * problem.r * problem.s
        written += [("x channels_last", x_words), ("w KRSC", w_words)]
        read += [("x channels_last", x_words), ("w KRSC", w_words)]
    if config.get("SK", 0) == 1:
        written += [("stream-K partials", partials_w), ("stream-K counters", tiles + counter_atomics)]
        read += [("stream-K partials", partials_r), ("stream-K counters", counter_atomics)]
    elif split > 1 and not config.get("CR", 0):
        written += [("split-K partials", partials_w), ("split-K counters", tiles + counter_atomics)]
        read += [("split-K partials", partials_r), ("split-K counters", counter_atomics)]
    return Traffic(words_read_input=counts["n_in"], words_read_weight=counts["n_w"], words_read_bias=counts["n_b"],
                   words_written=counts["n_out"], fast_memory_words=implicit_gemm_tma_tf32_fast_memory_words(config),
                   blocks=grid[0] * grid[1] * grid[2], grid=grid, workspace_written=tuple(written),
                   workspace_read=tuple(read))


def brute_force_winograd_traffic(problem: ConvProblem, config: Mapping[str, int],
                                 family: "ModuleType | None" = None) -> Traffic:
    """Replay winograd.cuh's loop nest in Python - every block (x, y, z), its slice's chunks, each thread's
    strided walk over the (channel, tile) input items (A x A bounds-checked loads) and the (k, channel)
    filter items (9 loads), and the output stage's ROUNDS passes over the (k, tile) items (bias load, the
    MT x MT bounds-checked stores or atomics) - and count the words element by element. Small shapes only."""
    from bagf_torch.kernels import winograd

    wg = family or winograd
    _check_winograd_problem(problem)
    mt, bk, bt, bc, split = config["MT"], config["BK"], config["BT"], config["BC"], config["SPLIT"]
    a_, nthr, rounds = mt + 2, wg.threads(config), wg.out_rounds(config)
    p, q = problem.out_hw
    (ph, pw) = problem.padding
    tq = -(-q // mt)
    tpq = -(-p // mt) * tq
    nt = problem.n * tpq
    gx, gy = -(-nt // bt), -(-problem.k // bk)
    chunks = -(-problem.c // bc)
    per = -(-chunks // split)
    btr = bt // rounds
    n_in = n_w = n_b = n_out = 0
    for bz in range(split):
        cb, ce = bz * per, min(chunks, bz * per + per)
        add_bias = problem.bias and bz == 0
        for by in range(gy):
            for bx in range(gx):
                t0, k0 = bx * bt, by * bk
                for ch in range(cb, ce):
                    c0 = ch * bc
                    for tid in range(nthr):
                        for it in range(tid, bc * bt, nthr):  # input tiles
                            t, c = it % bt, it // bt
                            gt, gc = t0 + t, c0 + c
                            if gt < nt and gc < problem.c:
                                r = gt % tpq
                                tp = r // tq
                                h0, w0 = tp * mt - ph, (r - tp * tq) * mt - pw
                                for a in range(a_):
                                    for b in range(a_):
                                        if 0 <= h0 + a < problem.h and 0 <= w0 + b < problem.w:
                                            n_in += 1
                        for it in range(tid, bk * bc, nthr):  # filters
                            c, k = it % bc, it // bc
                            if k0 + k < problem.k and c0 + c < problem.c:
                                n_w += 9
                for rnd in range(rounds):  # output stage
                    for tid in range(nthr):
                        for it in range(tid, bk * btr, nthr):
                            t, k = it % btr, it // btr
                            gt, gk = t0 + rnd * btr + t, k0 + k
                            if gt < nt and gk < problem.k:
                                n_b += 1 if add_bias else 0
                                r = gt % tpq
                                tp = r // tq
                                oh0, ow0 = tp * mt, (r - tp * tq) * mt
                                n_out += sum(1 for a in range(mt) for b in range(mt)
                                             if oh0 + a < p and ow0 + b < q)
    out = problem.k * problem.n * p * q
    return _counted(n_in, n_w, n_b, n_out, out, winograd_fast_memory_words(config, family), (gx, gy, split))


def brute_force_winograd_gemm_traffic(problem: ConvProblem, config: Mapping[str, int]) -> Traffic:
    """Replay the ``winograd_gemm`` pipeline in Python and count its words element by element: stages 0, 1 and
    2 of winograd_gemm.cuh block by block and thread by thread (the ``idx >= items`` exits, stage 1's VL and
    stage 2's ML index split, the patch's bounds checks, the bias condition, the output row ``break`` and
    column checks), and the modelled GEMM (:data:`bagf_torch.iobound.GEMM_TILE`) block by block, reduction step by step, each
    operand tile's and output tile's elements bounds-checked. Small shapes only."""
    _check_winograd_gemm_problem(problem)
    mt, tb, vl, ml = config["MT"], config["TB"], config["VL"], config["ML"]
    planes = _u_planes(config)  # gemm_wgmma's A: U and its small parts, each written by stage 0, read per tile
    a_ = mt + 2
    e = a_ * a_
    p, q = problem.out_hw
    (ph, pw) = problem.padding
    st = problem.stride[0]
    k_, c_ = problem.k, problem.c * st * st  # C' = C s^2 (polyphase channels c' = (c*s + phase row)*s + column)
    tq = -(-q // mt)
    tpq = -(-p // mt) * tq
    nt = problem.n * tpq
    n_w = n_in = n_b = n_out = u_w = v_w = m_w = a_r = b_r = m_r = 0

    def threads_of(items: int):
        blocks = -(-items // tb)
        return blocks, ((blk * tb + tid) for blk in range(blocks) for tid in range(tb))

    b0, ids = threads_of(k_ * c_)  # stage 0: filters
    for idx in ids:
        if idx >= k_ * c_:
            continue
        ci = idx % c_
        fr, fc = (ci // st) % st, ci % st  # the filter phase: taps st*i + fr, st*j + fc, loads inside R x S only
        n_w += sum(1 for i in range(3) for j in range(3) if st * i + fr < problem.r and st * j + fc < problem.s)
        u_w += sum(1 for plane in range(planes) for i in range(a_) for j in range(a_))  # US: small parts too

    b1, ids = threads_of(c_ * nt)  # stage 1: input tiles
    for idx in ids:
        if idx >= c_ * nt:
            continue
        if vl == 0:  # the kernel's split: s = 1 (c', t) with t fastest; s > 1 column phase, then t, fastest
            cph, t = divmod(idx // st, nt)
            cc = cph * st + idx % st
        else:
            t, cc = divmod(idx, c_)
        fr, fc = (cc // st) % st, cc % st
        r = t - (t // tpq) * tpq
        tp = r // tq
        h0, w0 = st * tp * mt + fr - ph, st * (r - tp * tq) * mt + fc - pw
        for i in range(a_):
            row = 0 <= h0 + st * i < problem.h
            n_in += sum(1 for j in range(a_) if row and 0 <= w0 + st * j < problem.w)
        v_w += sum(1 for i in range(a_) for j in range(a_))

    rows, cols = _gemm_shape(problem, config, nt)  # the modelled GEMM, one product per point
    bm, bn, bk, _ = winograd_gemm_tile(config)
    bg = 0
    for _ in range(e):
        for r0 in range(0, rows, bm):
            for c0 in range(0, cols, bn):
                bg += 1
                for k0 in range(0, c_, bk):
                    a_r += sum(1 for plane in range(planes) for i in range(r0, r0 + bm) for kk in range(k0, k0 + bk)
                               if i < rows and kk < c_)
                    b_r += sum(1 for kk in range(k0, k0 + bk) for j in range(c0, c0 + bn) if kk < c_ and j < cols)
                m_w += sum(1 for i in range(r0, r0 + bm) for j in range(c0, c0 + bn) if i < rows and j < cols)
    u_r, v_r = (a_r, b_r) if ml == 0 else (b_r, a_r)

    g_imgs = tb // tpq if config.get("SO") and ml == 0 else 0
    if g_imgs:  # stage 2 staged (SO = 1): a block per (k, G whole images), a thread per tile, then the planes
        nblk = -(-problem.n // g_imgs)
        b2 = k_ * nblk
        for blk in range(b2):
            kk, n0 = blk // nblk, (blk % nblk) * g_imgs
            imgs = min(g_imgs, problem.n - n0)
            for tid in range(tb):
                if kk < k_ and tid // tpq < imgs:
                    m_r += sum(1 for i in range(a_) for j in range(a_))
                    n_b += 1 if problem.bias else 0
            if kk < k_:  # the write-out loop: thread tid stores elements tid, tid + TB, ... of the planes
                n_out += sum(len(range(tid, imgs * p * q, tb)) for tid in range(tb))
        ids = ()
    else:
        b2, ids = threads_of(k_ * nt)  # stage 2: outputs, a thread per (k, tile)
    for idx in ids:
        if idx >= k_ * nt:
            continue
        t = idx % nt if ml == 0 else idx // k_
        m_r += sum(1 for i in range(a_) for j in range(a_))
        n_b += 1 if problem.bias else 0
        r = t - (t // tpq) * tpq
        tp = r // tq
        p0, q0 = tp * mt, (r - tp * tq) * mt
        for i in range(mt):
            if p0 + i >= p:
                break
            n_out += sum(1 for j in range(mt) if q0 + j < q)
    grid = (b0, b1, bg, b2)
    return Traffic(words_read_input=n_in, words_read_weight=n_w, words_read_bias=n_b, words_written=n_out,
                   fast_memory_words=winograd_gemm_fast_memory_words(config), blocks=sum(grid), grid=grid,
                   workspace_written=(("U", u_w), ("V", v_w), ("M", m_w)),
                   workspace_read=(("U", u_r), ("V", v_r), ("M", m_r)))


def brute_force_direct_traffic(problem: ConvProblem, config: Mapping[str, int]) -> Traffic:
    """Replay direct.cuh's loop nest in Python - every block (x, y, z), its slice's chunks, each warp's lines
    of the patch and of the weights with its lanes' columns (a copy reads a word only when it is not
    zero-filled), and each thread's output register tile (bias, bounds-checked stores or atomics) - and count
    the words element by element. Small shapes only."""
    from bagf_torch.kernels import direct as dr

    _check_direct_problem(problem)
    th, tw, bk, bc, tk, px, split = (config[k] for k in ("TH", "TW", "BK", "BC", "TK", "PX", "SPLIT"))
    nthr = dr.threads(config)
    nw = nthr // 32
    p, q = problem.out_hw
    (sh, sw), (ph, pw), (dh, dw) = problem.stride, problem.padding, problem.dilation
    rows = (th - 1) * sh + (problem.r - 1) * dh + 1
    cols = (tw - 1) * sw + (problem.s - 1) * dw + 1
    rs = problem.r * problem.s
    crs = problem.c * rs
    tq = -(-q // tw)
    tpq = -(-p // th) * tq
    gx, gy = problem.n * tpq, -(-problem.k // bk)
    chunks = -(-problem.c // bc)
    per = -(-chunks // split)
    kgn, xg = bk // tk, tw // px
    n_in = n_w = n_b = n_out = 0
    for bz in range(split):
        cb, ce = bz * per, min(chunks, bz * per + per)
        for by in range(gy):
            k0 = by * bk
            for bx in range(gx):
                rem = bx % tpq
                oh0, ow0 = (rem // tq) * th, (rem % tq) * tw
                h0, w0 = oh0 * sh - ph, ow0 * sw - pw
                for ch in range(cb, ce):
                    c0 = ch * bc
                    avail = min(bc * rs, crs - c0 * rs)
                    for warp in range(nw):
                        for line in range(warp, bc * rows, nw):
                            c, ih = line // rows, h0 + line % rows
                            row_ok = c0 + c < problem.c and 0 <= ih < problem.h
                            for lane in range(32):
                                for col in range(lane, cols, 32):
                                    n_in += row_ok and 0 <= w0 + col < problem.w
                        for k in range(warp, bk, nw):
                            for lane in range(32):
                                for e in range(lane, bc * rs, 32):
                                    n_w += k0 + k < problem.k and e < avail
                for tid in range(nthr):
                    kg, pg = tid % kgn, tid // kgn
                    py, px0 = pg // xg, (pg % xg) * px
                    for i in range(tk):
                        if k0 + kg * tk + i >= problem.k:
                            continue
                        n_b += 1 if problem.bias and bz == 0 else 0
                        if oh0 + py < p:
                            n_out += sum(1 for j in range(px) if ow0 + px0 + j < q)
    out = problem.k * problem.n * p * q
    return _counted(n_in, n_w, n_b, n_out, out, direct_fast_memory_words(config, problem), (gx, gy, split))
