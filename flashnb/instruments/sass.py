"""The machine code of a kernel, without a GPU: SASS and its instruction mix (the godbolt of this library).

:func:`sass` compiles a kernel as :mod:`flashnb.instruments` does (``compile_ptx`` through NVVM, then ``ptxas`` for
one architecture), disassembles the cubin with ``nvdisasm`` (the ``nvidia-cuda-nvdisasm`` wheel, pinned with
the rest of the toolchain) and sorts every instruction into what it costs:

=================  ===========================================================================================
``hmma``           tensor-core matrix multiply-accumulates (``HMMA.16816.F32``: one m16n8k16 tile, 4,096 FLOPs)
``ffma``           FP32 fused multiply-adds -- the useful work of a matmul on the CUDA cores (2 FLOPs each)
``fp32``           other FP32 arithmetic: FADD, FMUL, FMNMX, FSETP, FSEL, MUFU (exp2, rcp), ...
``fp64``           float64 arithmetic and conversions (DFMA, DADD, F2F.F64...): a Python float literal leaked in
``lds`` / ``sts``  shared-memory loads / stores (with their widths: 32, 64 or 128 bits)
``ldsm``           ``ldmatrix`` (``LDSM.16.M88.4``: four 8×8 b16 matrices, ``.MT88``: transposed)
``ldg`` / ``stg``  global loads / stores;  ``atom``: global and shared atomics
``ldgsts``         ``cp.async``: a global load written straight to shared memory (``LDGSTS.E.128``)
``ldl`` / ``stl``  local memory (the stack: spills, or arrays indexed at run time)
``shfl``           warp shuffles;  ``int``: integer and address arithmetic (IMAD, IADD3, LEA, SHF, ...)
``control``        branches, barriers, predicates' bookkeeping, moves and everything else
=================  ===========================================================================================

Loops are found from backward branches; the **hot loop** is the innermost loop with the most FFMAs -- with the
most HMMAs in a kernel that has any -- and its mix is what decides whether a kernel can run near the FP32 (or the
tensor) peak (the FA2 paper's argument in SASS terms: a matmul inner loop should be mostly FFMA, fed by wide shared
loads; on tensor cores, HMMAs fed by LDSM, with the softmax's FP32 and MUFU work beside them).
"""

from __future__ import annotations

import collections
import contextlib
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["sass", "sass_many", "Sass", "Instruction", "find_nvdisasm", "classify", "CATEGORIES"]

CATEGORIES = ("hmma", "ffma", "fp32", "fp64", "lds", "ldsm", "sts", "ldg", "ldgsts", "stg", "atom", "ldl", "stl",
              "shfl", "int", "control")

_FP32 = {"FADD", "FMUL", "FMNMX", "FSETP", "FSEL", "MUFU", "FCHK", "FSET", "FRND", "FSWZADD", "I2F", "F2I", "F2F"}
_INT = {"IMAD", "IADD3", "IADD", "LEA", "SHF", "LOP3", "ISETP", "SEL", "IABS", "IMNMX", "PRMT", "FLO", "POPC",
        "BREV", "LOP", "SHL", "SHR", "IMUL", "UIADD3", "UIMAD", "ULEA", "USHF", "ULOP3", "UISETP", "USEL",
        "UMOV", "ULDC", "S2R", "S2UR", "CS2R", "R2UR", "VIADD", "VIMNMX", "IDP", "IMMA", "LEPC"}
_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)\s*([^;]*);")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


def classify(opcode: str, modifiers: str = "") -> str:
    """The category of one SASS instruction (``opcode`` without modifiers, ``modifiers`` like ``.128``)."""
    if opcode == "FFMA":
        return "ffma"
    if opcode == "HMMA":
        return "hmma"
    if opcode in ("LDSM", "LDGSTS"):
        return opcode.lower()
    if opcode in _FP32 and ".F64" not in modifiers:
        return "fp32"
    if opcode in ("DADD", "DMUL", "DFMA", "DSETP", "DMNMX") or ".F64" in modifiers:
        return "fp64"
    for op, cat in (("LDS", "lds"), ("STS", "sts"), ("LDG", "ldg"), ("STG", "stg"), ("LDL", "ldl"),
                    ("STL", "stl"), ("SHFL", "shfl")):
        if opcode == op:
            return cat
    if opcode in ("ATOM", "ATOMS", "RED", "ATOMG"):
        return "atom"
    if opcode in ("LD", "ST"):           # generic addressing: counted as global (the worst case)
        return "ldg" if opcode == "LD" else "stg"
    if opcode in _INT:
        return "int"
    return "control"


def _width(modifiers: str, opcode: str = "") -> int:
    """Bits moved per lane by a load or store (32 unless the modifiers say 64 or 128; U8/S16... narrower); an
    ``LDSM`` moves 32 bits per lane per matrix (``.M88.4``: 128)."""
    if opcode == "LDSM":
        return 32 * (4 if modifiers.endswith(".4") else 2 if modifiers.endswith(".2") else 1)
    for bits in ("128", "64", "U16", "S16", "U8", "S8"):
        if f".{bits}" in modifiers:
            return {"U16": 16, "S16": 16, "U8": 8, "S8": 8}.get(bits, int(bits) if bits.isdigit() else 32)
    return 32


@dataclass
class Instruction:
    address: int
    opcode: str
    modifiers: str
    operands: str
    predicate: str
    category: str
    bits: int = 32

    def __str__(self) -> str:
        return f"/*{self.address:04x}*/ {self.predicate}{self.opcode}{self.modifiers} {self.operands};"


@dataclass
class Sass:
    """One kernel's SASS for one architecture, with its instruction mix and its loops."""

    name: str
    cc: tuple
    instructions: list = field(repr=False)
    loops: list = field(repr=False)          # (start index, end index) of each backward-branch loop
    text: str = field(default="", repr=False)
    resources: object = field(default=None, repr=False)   # ptxas's report for the same compile (when known)

    def mix(self, instructions=None) -> dict:
        """Instructions per category (all :data:`CATEGORIES`, zeros included) of ``instructions`` (default:
        the whole kernel)."""
        counts = collections.Counter(i.category for i in (self.instructions if instructions is None
                                                          else instructions))
        return {c: counts.get(c, 0) for c in CATEGORIES}

    def innermost_loops(self) -> list:
        return [lp for lp in self.loops if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in self.loops)]

    @property
    def work(self) -> str:
        """The category that does a matmul's work here: ``"hmma"`` when the kernel has tensor-core instructions,
        else ``"ffma"``."""
        return "hmma" if any(i.category == "hmma" for i in self.instructions) else "ffma"

    @property
    def hot_loop(self) -> list:
        """The instructions of the innermost loop with the most FFMAs -- HMMAs in a kernel that has them (empty
        when the kernel has no loop)."""
        loops = self.innermost_loops()
        if not loops:
            return []
        work = self.work
        s, e = max(loops, key=lambda lp: (sum(i.category == work for i in self.instructions[lp[0]:lp[1] + 1]),
                                          lp[1] - lp[0]))
        return self.instructions[s:e + 1]

    def hmma_fraction(self, instructions=None) -> float:
        """HMMAs / instructions of ``instructions`` (default: the whole kernel)."""
        ins = self.instructions if instructions is None else instructions
        return sum(i.category == "hmma" for i in ins) / len(ins) if ins else 0.0

    def fma_fraction(self, instructions=None) -> float:
        ins = self.instructions if instructions is None else instructions
        return sum(i.category == "ffma" for i in ins) / len(ins) if ins else 0.0

    def load_widths(self, instructions=None, kind: str = "lds") -> dict:
        """``{bits: count}`` of the loads (or stores) of one category."""
        ins = self.instructions if instructions is None else instructions
        return dict(sorted(collections.Counter(i.bits for i in ins if i.category == kind).items()))

    def summary(self) -> dict:
        hot = self.hot_loop
        return dict(kernel=self.name, cc=f"sm_{self.cc[0]}{self.cc[1]}", instructions=len(self.instructions),
                    loops=len(self.loops), hot_loop_instructions=len(hot),
                    hot_loop_ffma_fraction=round(self.fma_fraction(hot), 3) if hot else None,
                    kernel_ffma_fraction=round(self.fma_fraction(), 3),
                    hot_loop_hmma_fraction=round(self.hmma_fraction(hot), 3) if hot else None,
                    **{f"hot_{k}": v for k, v in self.mix(hot).items()},
                    hot_lds_bits=self.load_widths(hot), local=self.mix()["ldl"] + self.mix()["stl"])

    def table(self) -> str:
        """The kernel's and the hot loop's mix side by side."""
        hot = self.hot_loop
        whole, inner = self.mix(), self.mix(hot)
        rows = [f"{self.name} on sm_{self.cc[0]}{self.cc[1]}: {len(self.instructions)} SASS instructions, "
                f"{len(self.loops)} loop(s); hot loop {len(hot)} instructions", "",
                f"{'category':<9} {'kernel':>7} {'hot loop':>9}"]
        for c in CATEGORIES:
            rows.append(f"{c:<9} {whole[c]:>7} {inner[c]:>9}")
        rows.append(f"{'FFMA %':<9} {100 * self.fma_fraction():>6.1f}% {100 * self.fma_fraction(hot):>8.1f}%")
        if self.work == "hmma":
            rows.append(f"{'HMMA %':<9} {100 * self.hmma_fraction():>6.1f}% {100 * self.hmma_fraction(hot):>8.1f}%")
        if hot:
            rows.append(f"hot loop shared loads by width (bits: count): {self.load_widths(hot)}")
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()


def find_nvdisasm() -> str | None:
    """Path of ``nvdisasm``: the nvidia-cuda-nvdisasm wheel's, then ``$CUDA_HOME/bin``, then PATH."""
    with contextlib.suppress(Exception):
        from cuda import pathfinder

        found = pathfinder.find_nvidia_binary_utility("nvdisasm")
        if found:
            return str(found)
    with contextlib.suppress(Exception):
        import nvidia

        for base in list(nvidia.__path__):
            for cand in sorted(Path(base).glob("*/bin/nvdisasm")):
                if cand.is_file():
                    return str(cand)
    import os

    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            cand = Path(os.environ[env]) / "bin" / "nvdisasm"
            if cand.is_file():
                return str(cand)
    return shutil.which("nvdisasm")


def parse(text: str, name: str = "kernel", cc=(9, 0)) -> Sass:
    """Parse ``nvdisasm -c`` output into a :class:`Sass`."""
    instructions, labels, branches = [], {}, []
    for line in text.splitlines():
        m = _LABEL.match(line)
        if m:
            labels[m.group(1)] = len(instructions)
            continue
        m = _LINE.search(line)
        if not m:
            continue
        addr, pred, op, mods, operands = m.groups()
        cat = classify(op, mods)
        ins = Instruction(int(addr, 16), op, mods, operands.strip(), pred or "", cat,
                          _width(mods, op) if cat in ("lds", "ldsm", "sts", "ldg", "ldgsts", "stg", "ldl", "stl")
                          else 32)
        if op == "BRA":
            t = _TARGET.search(operands)
            if t:
                branches.append((len(instructions), t.group(1)))
        instructions.append(ins)
    # a backward branch closes a loop; `.L: BRA .L` after the last EXIT is padding every kernel ends with
    loops = sorted({(labels[t], i) for i, t in branches if t in labels and labels[t] < i})
    return Sass(name, tuple(cc), instructions, loops, text)


def _disassemble(res, name: str, cc) -> Sass:
    """ptxas + nvdisasm on the PTX of ``res`` (a :class:`flashnb.instruments.Resources` kept with its PTX)."""
    from .. import instruments as fi  # flashnb.instruments never imports this module (no import cycle)

    if res.ptx is None:
        raise RuntimeError(f"{name}: no PTX ({res.error})")
    ptxas, nvdisasm = fi.find_ptxas(), find_nvdisasm()
    if ptxas is None or nvdisasm is None:
        raise RuntimeError(f"sass needs ptxas and nvdisasm (found ptxas={ptxas}, nvdisasm={nvdisasm}); they come "
                           "with flashnb's dependencies (nvidia-cuda-nvcc, nvidia-cuda-nvdisasm)")
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        ptx.write_text(res.ptx)
        p = subprocess.run([ptxas, f"-arch=sm_{cc[0]}{cc[1]}", str(ptx), "-o", str(cubin)], capture_output=True,
                           text=True)
        if p.returncode != 0:
            raise RuntimeError(f"{name}: ptxas failed: {p.stderr.strip()[-400:]}")
        p = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"{name}: nvdisasm failed: {p.stderr.strip()[-400:]}")
    out = parse(p.stdout, name, cc)
    out.resources = res
    return out


def sass_many(jobs, cc=(9, 0)) -> list:
    """:func:`sass` of many registered ``(name, config)`` at once: one compile batch (on the simulator, one
    child process instead of one per kernel), then ptxas and nvdisasm per kernel."""
    from .. import instruments as fi

    jobs = [(n, dict(c)) for n, c in jobs]
    key = lambda n, c: (n, tuple(sorted(c.items())), tuple(cc))
    todo = [(n, c) for n, c in jobs if key(n, c) not in _SASS]
    if todo:
        res = fi.resources_many([(n, c, tuple(cc)) for n, c in todo], keep_ptx=True)
        for (n, c), r in zip(todo, res):
            _SASS[key(n, c)] = _disassemble(r, f"{n} {c}", tuple(cc))
    return [_SASS[key(n, c)] for n, c in jobs]


_SASS: dict = {}     # (name, config, cc) -> Sass: a registered kernel's code is fixed for the process


def sass(kernel, signature_or_example_args=None, cc=(9, 0), *, config=None) -> Sass:
    """SASS of a kernel for ``cc``: a registered kernel's name and ``config`` (``sass("fa2.forward",
    config=dict(Br=64, Bc=32, warps=4, d=64, causal=False))``), or a ``@cuda.jit`` kernel with its signature
    or example arguments (as :func:`flashnb.instruments.resources`).  Needs ptxas and nvdisasm (both installed
    with flashnb's pinned toolchain); no GPU.  The result's ``resources`` are ptxas's (registers, shared
    memory, spills) for the same compile."""
    from .. import instruments as fi  # flashnb.instruments never imports this module (no import cycle)
    from ..registry import KERNELS

    if isinstance(kernel, str):
        spec = KERNELS[kernel]
        cfg = dict(config if config is not None else spec.configs[0])
        return sass_many([(kernel, cfg)], cc)[0]
    if signature_or_example_args is None:
        raise TypeError("pass the kernel's signature (or example arguments) with a @cuda.jit kernel")
    res = fi.resources(kernel, signature_or_example_args, cc, keep_ptx=True)
    name = getattr(getattr(kernel, "py_func", kernel), "__name__", str(kernel))
    return _disassemble(res, name, tuple(cc))
