"""Stage 7 -- tensor-core instructions from Numba: ``mma.sync``, ``ldmatrix``, ``cp.async`` and the conversions they
need.

numba-cuda has no API for them.  Each one here is a numba ``@intrinsic`` whose code generation emits one PTX
instruction as LLVM inline assembly: the operands travel as 32-bit registers (packed f16x2 / bf16x2 and tf32 as
``uint32``, accumulators as ``float32``), an instruction with several results returns a literal struct that the
code generation unpacks into a numba tuple, and every call is marked ``convergent`` so LLVM never moves a
``.sync.aligned`` instruction into divergent code.  ``ldmatrix`` and ``cp.async`` touch memory: they have side
effects and clobber memory, and they take an array and an element index (the code generation turns the element's
address into the 32-bit ``.shared`` or 64-bit ``.global`` address the instruction wants).  What ptxas makes of
them (``flashnb sass``): ``HMMA.16816.F32`` / ``.F32.BF16``, ``HMMA.1688.F32.TF32``, ``HMMA.1688.F32`` (sm_75),
``LDSM.16.M88.{1,2,4}`` (``.MT88`` transposed), ``LDGSTS.E.128``, ``LDGDEPBAR``, ``DEPBAR``.

In simulator mode the same names are the twins of :mod:`flashnb.sim.tensorcore` (warp collectives over a NumPy
core that rebuilds the matrices from the fragment layouts), so a kernel written with them runs unchanged there,
under the traffic counter, the sanitizer and the profiler.

==========================  =====================================================  =============================
name                        PTX                                                    architectures
==========================  =====================================================  =============================
``mma_m16n8k16_f16``        ``mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32``   sm_80+
``mma_m16n8k16_bf16``       ``... .m16n8k16.row.col.f32.bf16.bf16.f32``             sm_80+
``mma_m16n8k8_tf32``        ``... .m16n8k8.row.col.f32.tf32.tf32.f32``              sm_80+
``mma_m16n8k8_f16``         ``... .m16n8k8.row.col.f32.f16.f16.f32``                sm_75+
``to_tf32(x)``              ``cvt.rna.tf32.f32``                                    sm_80+
``pack_f16x2(lo, hi)``      ``cvt.rn.f16.f32`` twice, ``mov.b32 {lo, hi}``          sm_75+
``pack_bf16x2(lo, hi)``     ``cvt.rn.bf16x2.f32``                                   sm_80+
``exp2(x)``                 ``ex2.approx.ftz.f32`` (one MUFU.EX2; the softmax's)    sm_75+
``ldmatrix_x{1,2,4}``       ``ldmatrix.sync.aligned.m8n8.x{1,2,4}.shared.b16``     sm_75+
``ldmatrix_x{1,2,4}_trans`` ``... .trans ...``                                      sm_75+
``cp_async_16``             ``cp.async.cg.shared.global [d], [s], 16, n``           sm_80+
``cp_async_commit``         ``cp.async.commit_group``                               sm_80+
``cp_async_wait_group(n)``  ``cp.async.wait_group n`` (``n`` a compile-time int)    sm_80+
``cp_async_wait_all``       ``cp.async.wait_all``                                   sm_80+
==========================  =====================================================  =============================

Signatures (the same on the simulator): ``mma_*(a..., b..., c0, c1, c2, c3) -> (d0, d1, d2, d3)`` with the
fragment registers in the order of the PTX ISA's tables (4 A and 2 B registers for m16n8k16 and tf32 m16n8k8, 2
and 1 for f16 m16n8k8); ``ldmatrix_x4(smem, i) -> (r0, r1, r2, r3)`` (x2: a pair, x1: one ``uint32``), where
``smem`` is a 1-D shared array of 16-bit (or 32-bit, read as b16 pairs) elements and ``i`` the first element of
the row this lane addresses, 16-byte aligned; ``cp_async_16(smem, i, src, idx, nbytes)`` copies ``nbytes`` (0 to
16) from ``src[idx]`` on (``idx`` an int or a tuple) and zero-fills the rest of the 16 bytes at ``smem[i]``.

Shared arrays that ``ldmatrix`` or ``cp.async`` address need 16-byte alignment, which numba gives only when asked
(it emits ``.align 2`` for a uint16 array): declare them ``cuda.shared.array(n, dtype, alignment=SHARED_ALIGN)``,
with the name imported (``from flashnb.kernels.tensorcore.mma import SHARED_ALIGN``: numba takes a module's global as a
constant, a module attribute it does not).  :data:`SHARED_ALIGN` is 16 on a GPU and None on the simulator, whose
arrays are NumPy's (it rejects the argument).

An instruction an architecture lacks is ptxas's error ("... requires .target sm_80 or higher"); a kernel built on
these declares its architectures to the registry (``kernel_factory(archs=...)``), so the PTX guard and
:func:`flashnb.instruments.resources_for` refuse the others by name, and :func:`check_arch` refuses a launch on one.
"""

from __future__ import annotations

from ... import runtime

__all__ = [
    "mma_m16n8k16_f16", "mma_m16n8k16_bf16", "mma_m16n8k8_tf32", "mma_m16n8k8_f16", "to_tf32", "pack_f16x2",
    "pack_bf16x2", "exp2", "ldmatrix_x1", "ldmatrix_x2", "ldmatrix_x4", "ldmatrix_x1_trans", "ldmatrix_x2_trans",
    "ldmatrix_x4_trans", "cp_async_16", "cp_async_commit", "cp_async_wait_group", "cp_async_wait_all",
    "SHARED_ALIGN", "INTRINSICS", "ARCHS", "check_arch",
]

#: Alignment of the shared arrays ldmatrix and cp.async address (None on the simulator: see the module docstring).
SHARED_ALIGN = 16 if runtime.MODE == "gpu" else None

#: The lowest compute capability that has each instruction (PTX ISA, "Target ISA notes").
ARCHS = {"mma_m16n8k16_f16": (8, 0), "mma_m16n8k16_bf16": (8, 0), "mma_m16n8k8_tf32": (8, 0),
         "mma_m16n8k8_f16": (7, 5), "to_tf32": (8, 0), "pack_f16x2": (7, 5), "pack_bf16x2": (8, 0), "exp2": (7, 5),
         "ldmatrix_x1": (7, 5), "ldmatrix_x2": (7, 5), "ldmatrix_x4": (7, 5), "ldmatrix_x1_trans": (7, 5),
         "ldmatrix_x2_trans": (7, 5), "ldmatrix_x4_trans": (7, 5), "cp_async_16": (8, 0),
         "cp_async_commit": (8, 0), "cp_async_wait_group": (8, 0), "cp_async_wait_all": (8, 0)}

INTRINSICS = tuple(ARCHS)


def check_arch(what: str, archs, cc=None) -> tuple:
    """Refuse to run ``what`` (a kernel needing the compute capabilities ``archs``, e.g. ``((8, 0), (9, 0))``) on
    a device of capability ``cc`` (default: the current GPU's; nothing to check on the simulator): ValueError
    naming the architecture and the ones it supports.  Returns the capability checked (None on the simulator)."""
    if cc is None:
        from ...instruments import rehearsal

        if runtime.MODE != "gpu" or rehearsal.active():
            return None
        from numba import cuda

        cc = tuple(cuda.get_current_device().compute_capability)
    cc = tuple(cc)
    lowest = min(tuple(a) for a in archs)
    if cc < lowest:
        names = ", ".join(f"sm_{a[0]}{a[1]}" for a in sorted(tuple(a) for a in archs))
        raise ValueError(f"{what} needs tensor-core instructions this GPU (sm_{cc[0]}{cc[1]}) does not have: it runs "
                         f"on {names} and newer")
    return cc


if runtime.MODE == "gpu":
    from llvmlite import ir
    from numba import types
    from numba.core.errors import TypingError
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    _I32, _I64, _F32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
    _U32, _F = types.uint32, types.float32

    def _asm(builder, text, constraints, args, outs, side_effect=False):
        """Call inline PTX ``text``; ``outs`` are the LLVM types of its results (a struct when several)."""
        ret = (ir.VoidType() if not outs else outs[0] if len(outs) == 1 else ir.LiteralStructType(outs))
        fn = ir.InlineAsm(ir.FunctionType(ret, [a.type for a in args]), text, constraints, side_effect=side_effect)
        call = builder.call(fn, args)
        call.attributes.add("convergent")
        if len(outs) > 1:
            return [builder.extract_value(call, i) for i in range(len(outs))]
        return call

    def _mma(ptx, na, nb):
        n = na + nb + 4
        regs = ",".join(["=f"] * 4 + ["r"] * (na + nb) + ["f"] * 4)
        ops = [f"${i}" for i in range(n + 4)]
        text = (f"mma.sync.aligned.{ptx} {{{','.join(ops[:4])}}}, {{{','.join(ops[4:4 + na])}}}, "
                f"{{{','.join(ops[4 + na:4 + na + nb])}}}, {{{','.join(ops[4 + na + nb:])}}};")
        sig = types.UniTuple(_F, 4)(*([_U32] * (na + nb) + [_F] * 4))

        def codegen(context, builder, signature, args):
            vals = _asm(builder, text, regs, list(args), [_F32] * 4)
            return context.make_tuple(builder, signature.return_type, vals)

        return sig, codegen

    @intrinsic
    def mma_m16n8k16_f16(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        return _mma("m16n8k16.row.col.f32.f16.f16.f32", 4, 2)

    @intrinsic
    def mma_m16n8k16_bf16(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        return _mma("m16n8k16.row.col.f32.bf16.bf16.f32", 4, 2)

    @intrinsic
    def mma_m16n8k8_tf32(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        return _mma("m16n8k8.row.col.f32.tf32.tf32.f32", 4, 2)

    @intrinsic
    def mma_m16n8k8_f16(typingctx, a0, a1, b0, c0, c1, c2, c3):
        return _mma("m16n8k8.row.col.f32.f16.f16.f32", 2, 1)

    def _convert(text, constraints, nargs):
        sig = _U32(*([_F] * nargs))

        def codegen(context, builder, signature, args):
            return _asm(builder, text, constraints, list(args), [_I32])

        return sig, codegen

    @intrinsic
    def to_tf32(typingctx, x):
        return _convert("cvt.rna.tf32.f32 $0, $1;", "=r,f", 1)

    @intrinsic
    def pack_f16x2(typingctx, lo, hi):
        # two conversions and a move, which sm_75 also has (cvt.rn.f16x2.f32 needs sm_80)
        return _convert("{ .reg .b16 l, h; cvt.rn.f16.f32 l, $1; cvt.rn.f16.f32 h, $2; mov.b32 $0, {l, h}; }",
                        "=r,f,f", 2)

    @intrinsic
    def pack_bf16x2(typingctx, lo, hi):
        # cvt.rn.bf16x2.f32 d, a, b puts a in the high half: hi first
        return _convert("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f", 2)

    @intrinsic
    def exp2(typingctx, x):
        # libdevice's exp2f wraps MUFU.EX2 in a denormal fix-up (FSETP, FSEL, two FMULs); the softmax needs the
        # instruction only (its arguments are <= 0, and exp2(-inf) = +0)
        sig = _F(_F)

        def codegen(context, builder, signature, args):
            return _asm(builder, "ex2.approx.ftz.f32 $0, $1;", "=f,f", list(args), [_F32])

        return sig, codegen

    def _pointer(context, builder, aryty, ary, idxty, idx):
        """The address of ``ary[idx]`` (``idx`` an integer or a tuple of them) as a generic LLVM pointer."""
        arr = context.make_array(aryty)(context, builder, ary)
        if isinstance(idxty, types.BaseTuple):
            inds = [context.cast(builder, builder.extract_value(idx, k), t, types.intp)
                    for k, t in enumerate(idxty.types)]
        else:
            inds = [context.cast(builder, idx, idxty, types.intp)]
        if len(inds) != aryty.ndim:
            raise TypingError(f"index of {len(inds)} integer(s) for a {aryty.ndim}-dimensional array")
        return cgutils.get_item_pointer(context, builder, aryty, arr, inds)

    def _shared_address(builder, ptr):
        """A generic pointer into shared memory as the 32-bit ``.shared`` address PTX wants (cvta.to.shared)."""
        return builder.ptrtoint(builder.addrspacecast(ptr, ir.PointerType(ptr.type.pointee, 3)), _I32)

    def _global_address(builder, ptr):
        return builder.ptrtoint(builder.addrspacecast(ptr, ir.PointerType(ptr.type.pointee, 1)), _I64)

    def _check_index(fn, arr, idx, ndim=None):
        if not isinstance(arr, types.Array):
            raise TypingError(f"{fn}: expected an array, got {arr}")
        ok = isinstance(idx, types.Integer) or (isinstance(idx, types.BaseTuple)
                                                and all(isinstance(t, types.Integer) for t in idx.types))
        if not ok:
            raise TypingError(f"{fn}: the index must be an integer or a tuple of integers, got {idx}")
        if ndim is not None and arr.ndim != ndim:
            raise TypingError(f"{fn}: expected a {ndim}-D array, got {arr}")

    def _ldmatrix(num, trans, arr, idx):
        _check_index(f"ldmatrix_x{num}", arr, idx, 1)
        ops = ",".join(f"${i}" for i in range(num))
        text = f"ldmatrix.sync.aligned.m8n8.x{num}{'.trans' if trans else ''}.shared.b16 {{{ops}}}, [${num}];"
        sig = (types.UniTuple(_U32, num) if num > 1 else _U32)(arr, idx)

        def codegen(context, builder, signature, args):
            ptr = _pointer(context, builder, signature.args[0], args[0], signature.args[1], args[1])
            addr = _shared_address(builder, ptr)
            out = _asm(builder, text, ",".join(["=r"] * num + ["r", "~{memory}"]), [addr], [_I32] * num,
                       side_effect=True)
            return context.make_tuple(builder, signature.return_type, out) if num > 1 else out

        return sig, codegen

    @intrinsic
    def ldmatrix_x1(typingctx, arr, idx):
        return _ldmatrix(1, False, arr, idx)

    @intrinsic
    def ldmatrix_x2(typingctx, arr, idx):
        return _ldmatrix(2, False, arr, idx)

    @intrinsic
    def ldmatrix_x4(typingctx, arr, idx):
        return _ldmatrix(4, False, arr, idx)

    @intrinsic
    def ldmatrix_x1_trans(typingctx, arr, idx):
        return _ldmatrix(1, True, arr, idx)

    @intrinsic
    def ldmatrix_x2_trans(typingctx, arr, idx):
        return _ldmatrix(2, True, arr, idx)

    @intrinsic
    def ldmatrix_x4_trans(typingctx, arr, idx):
        return _ldmatrix(4, True, arr, idx)

    @intrinsic
    def cp_async_16(typingctx, dst, di, src, sidx, nbytes):
        _check_index("cp_async_16", dst, di, 1)
        _check_index("cp_async_16", src, sidx)
        if not isinstance(nbytes, types.Integer):
            raise TypingError(f"cp_async_16: nbytes must be an integer, got {nbytes}")
        sig = types.void(dst, di, src, sidx, types.uint32)

        def codegen(context, builder, signature, args):
            d = _shared_address(builder, _pointer(context, builder, signature.args[0], args[0],
                                                  signature.args[1], args[1]))
            s = _global_address(builder, _pointer(context, builder, signature.args[2], args[2],
                                                  signature.args[3], args[3]))
            _asm(builder, "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r,~{memory}", [d, s, args[4]], [],
                 side_effect=True)
            return context.get_dummy_value()

        return sig, codegen

    def _barrier_asm(text):
        def codegen(context, builder, signature, args):
            _asm(builder, text, "~{memory}", [], [], side_effect=True)
            return context.get_dummy_value()

        return codegen

    @intrinsic
    def cp_async_commit(typingctx):
        return types.void(), _barrier_asm("cp.async.commit_group;")

    @intrinsic
    def cp_async_wait_all(typingctx):
        return types.void(), _barrier_asm("cp.async.wait_all;")

    @intrinsic
    def cp_async_wait_group(typingctx, n):
        if not isinstance(n, types.IntegerLiteral):
            raise TypingError(f"cp_async_wait_group(n): n must be a compile-time integer (PTX takes it as an "
                              f"immediate), got {n}")
        return types.void(n), _barrier_asm(f"cp.async.wait_group {int(n.literal_value)};")

else:
    from ...sim.tensorcore import (  # noqa: F401  (the simulator twins, under the same names)
        cp_async_16,
        cp_async_commit,
        cp_async_wait_all,
        cp_async_wait_group,
        exp2,
        ldmatrix_x1,
        ldmatrix_x1_trans,
        ldmatrix_x2,
        ldmatrix_x2_trans,
        ldmatrix_x4,
        ldmatrix_x4_trans,
        mma_m16n8k8_f16,
        mma_m16n8k8_tf32,
        mma_m16n8k16_bf16,
        mma_m16n8k16_f16,
        pack_bf16x2,
        pack_f16x2,
        to_tf32,
    )
