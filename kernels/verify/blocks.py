"""`@triton.jit` blocks both verify kernels (fused and resident) are built from (docs/math.md §2-3).

Each is inlined where it is called, so sharing them costs nothing at run time. Register tiles are
``b_*``, offsets ``o_*``, masks ``m_*``; rows ``i`` are the nodes being solved, columns ``j`` the
nodes they may descend from.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..common import LOG_DECAY_FLOOR

G_FLOOR = tl.constexpr(LOG_DECAY_FLOOR)


@triton.jit
def floored(b_g):
    """Log-decays at or above `common.LOG_DECAY_FLOOR` (its docstring says why)."""
    return tl.maximum(b_g, G_FLOOR)


@triton.jit
def qk_chunk_gram(q_ptr, k_ptr, k_out_ptr, rows, m_i, o_k, i_hk, write_keys,
                  stride_q_n, stride_q_h, stride_k_n, stride_k_h, H_K,
                  b_qk, b_kk, ssq_q, ssq_k,
                  D_K: tl.constexpr, USE_QK_L2NORM: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  GRAM_DTYPE: tl.constexpr):
    """One ``b_k`` chunk of the rows' q and k: load it, add its Gram products ``Q K^T`` and ``K K^T`` and
    the squared norms, and keep the raw keys for the commit (``write_keys``: one program per key head).

    Returns the chunk (``b_q``, ``b_k``, for the caller's state products) and the updated accumulators.
    ``GRAM_DTYPE`` is the inputs' dtype on a GPU, fp32 in the CPU interpreter (exact; `common.gram_dtype`).
    """
    b_q = tl.load(q_ptr + rows[:, None] * stride_q_n + i_hk * stride_q_h + o_k[None, :], mask=m_i[:, None], other=0)
    b_k = tl.load(k_ptr + rows[:, None] * stride_k_n + i_hk * stride_k_h + o_k[None, :], mask=m_i[:, None], other=0)
    b_qk = tl.dot(b_q.to(GRAM_DTYPE), tl.trans(b_k.to(GRAM_DTYPE)), b_qk, input_precision=DOT_PRECISION)
    b_kk = tl.dot(b_k.to(GRAM_DTYPE), tl.trans(b_k.to(GRAM_DTYPE)), b_kk, input_precision=DOT_PRECISION)
    if USE_QK_L2NORM:
        ssq_q += tl.sum(b_q.to(tl.float32) * b_q.to(tl.float32), axis=1)
        ssq_k += tl.sum(b_k.to(tl.float32) * b_k.to(tl.float32), axis=1)
    tl.store(k_out_ptr + rows[:, None] * (H_K * D_K) + i_hk * D_K + o_k[None, :], b_k, mask=m_i[:, None] & write_keys)
    return b_q, b_k, b_qk, b_kk, ssq_q, ssq_k


@triton.jit
def norm_scales(ssq_q, ssq_k, scale, B_T: tl.constexpr, USE_QK_L2NORM: tl.constexpr):
    """(r_q, r_k): what multiplies each row's raw q and k (the L2 norm, and q's scale)."""
    if USE_QK_L2NORM:
        r_q = scale / tl.sqrt(ssq_q + 1e-6)
        r_k = 1.0 / tl.sqrt(ssq_k + 1e-6)
    else:
        r_q = tl.full([B_T], scale, dtype=tl.float32)
        r_k = tl.full([B_T], 1.0, dtype=tl.float32)
    return r_q, r_k


@triton.jit
def ancestry(enter_i, enter_j, exit_j):
    """``[i, j]``: node j is node i or one of its ancestors (i's pre-order number lies in j's interval)."""
    return (enter_j[None, :] <= enter_i[:, None]) & (enter_i[:, None] <= exit_j[None, :])


@triton.jit
def solve_factors(m_anc, logp_i, logp_j, b_beta, r_q, r_k_i, r_k_j, b_qk, b_kk):
    """The blocks ``G_ij = beta_i exp(logP_i - logP_j) k_i.k_j`` and ``C_ij = exp(logP_i - logP_j) q_i.k_j``
    on the ancestor mask, from the raw Gram products and the norm scales. The decay is taken on the mask
    only, where it is at most 1 (off the mask it could overflow). The caller removes G's diagonal."""
    decay = tl.exp(tl.where(m_anc, logp_i[:, None] - logp_j[None, :], float("-inf")))
    b_g = (b_beta * r_k_i)[:, None] * decay * r_k_j[None, :] * b_kk
    b_c = r_q[:, None] * decay * r_k_j[None, :] * b_qk
    return b_g, b_c


@triton.jit
def state_products(b_q, b_k, b_s, b_qs, b_ks, DOT_PRECISION: tl.constexpr, GRAM_DTYPE: tl.constexpr,
                   STATE_SPLIT: tl.constexpr):
    """``Q S^T`` and ``K S^T`` of one ``b_k`` chunk, added to ``b_qs`` and ``b_ks``.

    With ``STATE_SPLIT`` (the planner's ``state_split``: bf16 inputs on 64-row node blocks) the fp32
    state tile is taken as two bf16 parts, ``hi = bf16(S)`` and ``lo = bf16(S - hi)``, each multiplied
    by the bf16 q/k tiles as they are: 16 significant bits of S (tf32 keeps 11), fp32 accumulation,
    bf16 tensor cores (twice the tf32 rate) and no q/k widening. Otherwise q/k are widened to fp32
    and multiplied at ``DOT_PRECISION``.
    """
    if STATE_SPLIT:
        b_hi = b_s.to(tl.bfloat16)
        b_lo = tl.trans((b_s - b_hi.to(tl.float32)).to(tl.bfloat16)).to(GRAM_DTYPE)
        b_hi = tl.trans(b_hi).to(GRAM_DTYPE)
        b_q = b_q.to(GRAM_DTYPE)
        b_k = b_k.to(GRAM_DTYPE)
        b_qs = tl.dot(b_q, b_lo, tl.dot(b_q, b_hi, b_qs))
        b_ks = tl.dot(b_k, b_lo, tl.dot(b_k, b_hi, b_ks))
    else:
        b_qs = tl.dot(b_q.to(tl.float32), tl.trans(b_s), b_qs, input_precision=DOT_PRECISION)
        b_ks = tl.dot(b_k.to(tl.float32), tl.trans(b_s), b_ks, input_precision=DOT_PRECISION)
    return b_qs, b_ks


@triton.jit
def state_products_rows_first(b_q, b_k, b_s, b_qs, b_ks, DOT_PRECISION: tl.constexpr):
    """``S Q^T`` and ``S K^T`` of one ``b_k`` chunk, ``[b_v, b_k] x [b_k, B_T]``, added to the ``[b_v, B_T]`` tiles
    ``b_qs`` and ``b_ks`` (the resident kernel's ``ROWS_FIRST``): q/k widened to fp32, at ``DOT_PRECISION``."""
    b_qs = tl.dot(b_s, tl.trans(b_q.to(tl.float32)), b_qs, input_precision=DOT_PRECISION)
    b_ks = tl.dot(b_s, tl.trans(b_k.to(tl.float32)), b_ks, input_precision=DOT_PRECISION)
    return b_qs, b_ks


@triton.jit
def path_hits(enter_ptr, exit_ptr, depth_ptr, bos, o_j, m_j, enter_a, o_d):
    """``[len(o_d), len(o_j)]``: local node ``o_j`` (of the request whose rows start at ``bos``; ``m_j`` the
    nodes to look at) lies on the path from the root to the node whose pre-order number is ``enter_a`` (its
    depth-first interval contains it), at depth ``o_d``."""
    enter_j = tl.load(enter_ptr + bos + o_j, mask=m_j, other=0)
    exit_j = tl.load(exit_ptr + bos + o_j, mask=m_j, other=-1)
    depth_j = tl.load(depth_ptr + bos + o_j, mask=m_j, other=-1)
    on_path = m_j & (enter_j <= enter_a) & (enter_a <= exit_j)
    return on_path[None, :] & (depth_j[None, :] == o_d[:, None])


@triton.jit
def path_factors(accepted, bos, i_p, i_h, i_hk, enter_ptr, exit_ptr, depth_ptr, logp_ptr, k_scale_ptr, H_V, H_K,
                 B_T: tl.constexpr, B_P: tl.constexpr):
    """The commit's factors of the nodes at depths ``i_p * B_P ..`` on the path to ``accepted`` (a local node
    of the request whose rows start at ``bos``; docs/math.md §4): their packed rows ``[B_P]``, mask, and
    weights ``exp(logP_a - logP_j) * k_scale_j`` (0 off the path), and ``logP_a``.

    The path holds one node per depth 0..depth(a): the nodes whose depth-first interval contains ``a``,
    gathered ``B_T`` candidates at a time by depth (no walk up the parents).
    """
    enter_a = tl.load(enter_ptr + bos + accepted)
    depth_a = tl.load(depth_ptr + bos + accepted)
    logp_a = tl.load(logp_ptr + (bos + accepted) * H_V + i_h)
    o_p = i_p * B_P + tl.arange(0, B_P)
    node = tl.zeros([B_P], dtype=tl.int64)
    for j_b in range(0, accepted // B_T + 1):
        o_j = j_b * B_T + tl.arange(0, B_T)
        hit = path_hits(enter_ptr, exit_ptr, depth_ptr, bos, o_j, o_j <= accepted, enter_a, o_p)
        node += tl.sum(tl.where(hit, o_j[None, :], 0), axis=1)
    m_p = o_p <= depth_a
    rows = bos + node
    logp_p = tl.load(logp_ptr + rows * H_V + i_h, mask=m_p, other=0)
    scale_p = tl.load(k_scale_ptr + rows * H_K + i_hk, mask=m_p, other=0)
    weight = tl.where(m_p, tl.exp(logp_a - logp_p) * scale_p, 0.0)
    return rows, m_p, weight, logp_a


@triton.jit
def pending_path(i_r, i_h, i_hk, map_ptr, path_rows_ptr, logp_ptr, k_scale_ptr, committed_ptr, epoch, H_V, H_K,
                 B_P: tl.constexpr):
    """The previous round's accepted path of request ``i_r``'s slot, to fold into its state before this round
    reads it: ``map_ptr[i_r]`` is the previous round's request of that slot (-1: nothing pending) and
    ``path_rows_ptr`` the ``[B, B_P]`` table of its path's packed rows by depth (`PendingPaths.path_rows`, -1
    past the accepted node). Returns (rows, mask, weights ``exp(logP_a - logP_j) * k_scale_j``, decay ``P_a``,
    pending); a request with nothing pending (or a path an earlier launch committed: its mark in
    ``committed_ptr`` is neither 0 nor this launch's ``epoch``) gets weights 0 and decay 1, an exact no-op;
    the others are marked committed with ``epoch``. Two dependent loads: the path, then its factors."""
    prev = tl.load(map_ptr + i_r).to(tl.int64)
    prev_safe = tl.maximum(prev, 0)
    rows = tl.load(path_rows_ptr + i_r * B_P + tl.arange(0, B_P)).to(tl.int64)
    mark = tl.load(committed_ptr + prev_safe)
    m_p = rows >= 0
    row_a = tl.max(rows, axis=0)  # the accepted node: a path's rows grow with depth (parents come first)
    pending = (prev >= 0) & (row_a >= 0) & ((mark == 0) | (mark == epoch))
    tl.store(committed_ptr + prev_safe, epoch, mask=pending)
    rows = tl.where(m_p, rows, 0)
    logp_a = tl.load(logp_ptr + tl.maximum(row_a, 0) * H_V + i_h)
    logp_p = tl.load(logp_ptr + rows * H_V + i_h, mask=m_p, other=0)
    scale_p = tl.load(k_scale_ptr + rows * H_K + i_hk, mask=m_p, other=0)
    m_p = m_p & pending
    weight = tl.where(m_p, tl.exp(logp_a - logp_p) * scale_p, 0.0)
    decay = tl.where(pending, tl.exp(logp_a), 1.0)
    return rows, m_p, weight, decay, pending


@triton.jit
def fold_updates(rows_p, m_p, weight_p, o_v, i_h, u_ptr, H_V, D_V: tl.constexpr):
    """``[len(o_v), B_P]``: the pending path's updates ``w_j u_j`` on value rows ``o_v``, transposed for `fold_apply`
    (loaded once per value tile, used by every key step)."""
    b_up = tl.load(u_ptr + rows_p[:, None] * (H_V * D_V) + i_h * D_V + o_v[None, :], mask=m_p[:, None], other=0)
    return tl.trans(b_up * weight_p[:, None])


@triton.jit
def tf32_head(x):
    """fp32 ``x`` with its 13 low mantissa bits cleared: a tf32 value, and ``x - tf32_head(x)`` is exact in fp32."""
    return (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def path_product(acc, a, b, PRODUCT: tl.constexpr):
    """``acc + a @ b``, the update of a state tile by an accepted path (``a`` ``[b_v, path]`` fp32 weighted values,
    ``b`` ``[path, b_k]`` keys widened to fp32; docs/math.md §4), in ``PRODUCT`` precision:

    - "ieee": fp32 FMAs; "tf32x3": Triton's three tf32 passes (both operands split).
    - "split3": ``a`` cut into three tf32 pieces that sum to it exactly (`tf32_head` twice, then the remainder,
      at most 2 bits); ``b`` must hold 16-bit keys (bf16 or fp16: each exactly a tf32 value). Three tensor-core
      passes whose products are all exact, accumulated in fp32 into ``acc`` itself: the fp32 FMAs' accuracy at
      a tensor core's registers (no fp32 operand tiles held for an FMA product).
    - "split2": two pieces, the remainder rounded to tf32 (about 2^-21 relative per product).
    """
    if (PRODUCT == "split3") | (PRODUCT == "split2"):
        head = tf32_head(a)
        acc = tl.dot(head, b, acc, input_precision="tf32")
        rest = a - head
        if PRODUCT == "split3":
            mid = tf32_head(rest)
            acc = tl.dot(mid, b, acc, input_precision="tf32")
            rest = rest - mid
        acc = tl.dot(rest, b, acc, input_precision="tf32")
    else:
        acc = acc + tl.dot(a, b, input_precision=PRODUCT)
    return acc


@triton.jit
def fold_apply(b_s, b_upw, rows_p, m_p, decay_p, o_k, i_hk, k_ptr, H_K, D_K: tl.constexpr,
               FOLD_DOT: tl.constexpr = "ieee"):
    """A ``[b_v, b_k]`` state tile after the pending commit: ``P_a S + sum_j w_j u_j k_j^T`` (docs/math.md §4),
    ``b_upw`` from `fold_updates`; the product in ``FOLD_DOT`` precision (`path_product`)."""
    b_kp = tl.load(k_ptr + rows_p[:, None] * (H_K * D_K) + i_hk * D_K + o_k[None, :], mask=m_p[:, None],
                   other=0).to(tl.float32)
    return path_product(decay_p * b_s, b_upw, b_kp, FOLD_DOT)


@triton.jit
def ring_tokens(slot, i_h, i_hk, rows_ptr, last_ptr, logp_ptr, k_scale_ptr, H_V, H_K, row_length,
                B_P: tl.constexpr):
    """The pending tokens of a `PendingRing` slot (docs/math.md §4, "A ring of pending rounds"): ``rows_ptr`` the
    ring's ``[num_slots, row_length]`` table of arena rows (-1: empty), ``last_ptr`` its flags (1 on each round's
    accepted node), in the order the rounds were accepted; the first ``B_P`` entries of the slot's row are read (a
    round's `RingRound.width`: its pending rounds fill no more). A token ``j`` of round ``rho`` decays by its own path
    (``logP_a(rho) - logP_j``) and by every later round's accepted ``logP``: with ``t`` the accepted nodes' ``logP``
    (0 elsewhere), ``L - L_j = sum_{i >= j} t_i - logP_j``. Returns (rows, mask, weights ``exp(L - L_j) * k_scale_j``,
    decay ``exp(L)``, pending: the slot holds a token)."""
    o_p = tl.arange(0, B_P)
    rows = tl.load(rows_ptr + slot * row_length + o_p).to(tl.int64)
    last = tl.load(last_ptr + slot * row_length + o_p)
    m_p = rows >= 0
    rows = tl.where(m_p, rows, 0)
    logp_p = tl.load(logp_ptr + rows * H_V + i_h, mask=m_p, other=0)
    scale_p = tl.load(k_scale_ptr + rows * H_K + i_hk, mask=m_p, other=0)
    ends = tl.where(m_p & (last != 0), logp_p, 0.0)
    weight = tl.where(m_p, tl.exp(tl.cumsum(ends, 0, reverse=True) - logp_p) * scale_p, 0.0)
    decay = tl.exp(tl.sum(ends, 0))
    pending = tl.max(m_p.to(tl.int32), 0) > 0
    return rows, m_p, weight, decay, pending


@triton.jit
def pending_tokens(RING: tl.constexpr, i_r, slot, i_h, i_hk, map_ptr, rows_ptr, logp_ptr, k_scale_ptr, committed_ptr,
                   fold_word, H_V, H_K, B_P: tl.constexpr):
    """The tokens a launch folds in or corrects for (both kernels' ``FOLD``): a `PendingRing` slot's (``RING``:
    `ring_tokens`, ``map_ptr`` its row table and ``rows_ptr`` its flags, ``fold_word`` the table's row length) or the
    previous round's accepted path of request ``i_r`` (`pending_path`, ``fold_word`` the commit's epoch). Returns
    (rows, mask, weights, decay, pending)."""
    if RING:
        return ring_tokens(slot, i_h, i_hk, map_ptr, rows_ptr, logp_ptr, k_scale_ptr, H_V, H_K, fold_word, B_P)
    else:
        return pending_path(i_r, i_h, i_hk, map_ptr, rows_ptr, logp_ptr, k_scale_ptr, committed_ptr, fold_word, H_V,
                            H_K, B_P)


@triton.jit
def pending_corrections(b_qs, b_ks, q_ptr, k_ptr, rows, m_i, i_hk, stride_q_n, stride_q_h, stride_k_n, stride_k_h,
                        rows_p, m_p, weight_p, decay_p, o_v, i_h, u_ptr, kp_ptr, H_V, H_K,
                        D_K: tl.constexpr, D_V: tl.constexpr, GRAM_DTYPE: tl.constexpr, GRAM_DOT: tl.constexpr,
                        DOT: tl.constexpr):
    """The products ``Q S'^T`` and ``K S'^T`` of the state the pending tokens would leave, from the products with
    the state as it is (``b_qs``, ``b_ks``, ``[B_T, b_v]``), without writing it (docs/math.md §4):

        S' x = P (S x) + sum_j w_j (k_j . x) u_j

    The dot products ``Q Kp^T`` and ``K Kp^T`` are taken once, from whole key rows on the inputs' 16-bit operands
    (as the Gram products are, at ``GRAM_DOT``), after the state's stream: its key steps stay the plain verify's;
    the final ``[B_T, B_P] x [B_P, b_v]`` products at ``DOT``."""
    o_d = tl.arange(0, D_K)
    b_q = tl.load(q_ptr + rows[:, None] * stride_q_n + i_hk * stride_q_h + o_d[None, :], mask=m_i[:, None], other=0)
    b_k = tl.load(k_ptr + rows[:, None] * stride_k_n + i_hk * stride_k_h + o_d[None, :], mask=m_i[:, None], other=0)
    b_kp = tl.load(kp_ptr + rows_p[:, None] * (H_K * D_K) + i_hk * D_K + o_d[None, :], mask=m_p[:, None],
                   other=0).to(GRAM_DTYPE)
    b_qp = tl.dot(b_q.to(GRAM_DTYPE), tl.trans(b_kp), input_precision=GRAM_DOT)
    b_kq = tl.dot(b_k.to(GRAM_DTYPE), tl.trans(b_kp), input_precision=GRAM_DOT)
    b_up = tl.load(u_ptr + rows_p[:, None] * (H_V * D_V) + i_h * D_V + o_v[None, :], mask=m_p[:, None], other=0)
    b_up = b_up * weight_p[:, None]
    b_qs = decay_p * b_qs + tl.dot(b_qp, b_up, input_precision=DOT)
    b_ks = decay_p * b_ks + tl.dot(b_kq, b_up, input_precision=DOT)
    return b_qs, b_ks


@triton.jit
def stacked_rows(q_ptr, k_ptr, rows, m_i, is_k, o_k, i_hk, stride_q_n, stride_q_h, stride_k_n, stride_k_h):
    """``[B_T, len(o_k)]``: the rows' q on the top half of the tile and their k on the bottom half (``is_k``), the
    stacked tile of a ``STACK`` launch (trees of at most ``B_T / 2`` nodes; docs/math.md §3, "Stacked rows")."""
    b_q = tl.load(q_ptr + rows[:, None] * stride_q_n + i_hk * stride_q_h + o_k[None, :], mask=(m_i & ~is_k)[:, None],
                  other=0)
    b_k = tl.load(k_ptr + rows[:, None] * stride_k_n + i_hk * stride_k_h + o_k[None, :], mask=(m_i & is_k)[:, None],
                  other=0)
    return tl.where(is_k[:, None], b_k, b_q)


@triton.jit
def stacked_chunk_gram(q_ptr, k_ptr, k_out_ptr, rows, m_i, is_k, o_k, i_hk, write_keys,
                       stride_q_n, stride_q_h, stride_k_n, stride_k_h, H_K, b_xx, ssq,
                       D_K: tl.constexpr, USE_QK_L2NORM: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       GRAM_DTYPE: tl.constexpr):
    """`qk_chunk_gram` on the stacked tile ``X = [Q; K]`` (`stacked_rows`): one Gram product ``X X^T`` holds
    ``Q K^T`` (top right) and ``K K^T`` (bottom right), one sum of squares every row's norm. Returns the chunk,
    the Gram product and the sums of squares."""
    b_x = stacked_rows(q_ptr, k_ptr, rows, m_i, is_k, o_k, i_hk, stride_q_n, stride_q_h, stride_k_n, stride_k_h)
    b_xg = b_x.to(GRAM_DTYPE)
    b_xx = tl.dot(b_xg, tl.trans(b_xg), b_xx, input_precision=DOT_PRECISION)
    if USE_QK_L2NORM:
        ssq += tl.sum(b_x.to(tl.float32) * b_x.to(tl.float32), axis=1)
    tl.store(k_out_ptr + rows[:, None] * (H_K * D_K) + i_hk * D_K + o_k[None, :], b_x,
             mask=(m_i & is_k)[:, None] & write_keys)
    return b_x, b_xx, ssq


@triton.jit
def stacked_corrections(b_zs, q_ptr, k_ptr, rows, m_i, is_k, i_hk, stride_q_n, stride_q_h, stride_k_n, stride_k_h,
                        rows_p, m_p, weight_p, decay_p, o_v, i_h, u_ptr, kp_ptr, H_V, H_K,
                        D_K: tl.constexpr, D_V: tl.constexpr, GRAM_DTYPE: tl.constexpr, GRAM_DOT: tl.constexpr,
                        DOT: tl.constexpr):
    """`pending_corrections` on the stacked products ``X S^T`` (``[B_T, b_v]``): one ``X Kp^T`` and one product
    with the pending updates instead of two of each."""
    b_x = stacked_rows(q_ptr, k_ptr, rows, m_i, is_k, tl.arange(0, D_K), i_hk, stride_q_n, stride_q_h, stride_k_n,
                       stride_k_h)
    b_kp = tl.load(kp_ptr + rows_p[:, None] * (H_K * D_K) + i_hk * D_K + tl.arange(0, D_K)[None, :],
                   mask=m_p[:, None], other=0).to(GRAM_DTYPE)
    b_xp = tl.dot(b_x.to(GRAM_DTYPE), tl.trans(b_kp), input_precision=GRAM_DOT)
    b_up = tl.load(u_ptr + rows_p[:, None] * (H_V * D_V) + i_h * D_V + o_v[None, :], mask=m_p[:, None], other=0)
    return decay_p * b_zs + tl.dot(b_xp, b_up * weight_p[:, None], input_precision=DOT)
