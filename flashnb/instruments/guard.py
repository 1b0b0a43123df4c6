"""The PTX guard's verdict: everything that would make a compiled kernel wrong or slow on a real GPU."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .occupancy import MAX_OPTIN_SHARED, MAX_STATIC_SHARED, OPTIN_CHECKED_CCS

if TYPE_CHECKING:
    from .ptxas import Resources


def problems(res: Resources, *, max_shared: int = MAX_STATIC_SHARED) -> list[str]:
    """The PTX guard: everything that would make this kernel wrong or slow on a real GPU."""
    out = []
    where = f"{res.name} {res.config} sm_{res.cc[0]}{res.cc[1]}"
    if res.error:
        out.append(f"{where}: compile error: {res.error}")
    if res.f64_count:
        out.append(f"{where}: {res.f64_count} float64 (.f64) PTX lines -- a Python float literal or "
                   "unwrapped math result in the kernel (use float32(...) / common constants)")
    if res.shared_bytes is not None and res.shared_bytes > max_shared:
        out.append(f"{where}: {res.shared_bytes} bytes static shared memory > {max_shared} (48 KiB)")
    optin = MAX_OPTIN_SHARED.get(tuple(res.cc), MAX_STATIC_SHARED)
    if res.dynamic_shared_bytes and tuple(res.cc) in OPTIN_CHECKED_CCS and \
            (res.shared_bytes or 0) + res.dynamic_shared_bytes > optin:
        out.append(f"{where}: {res.shared_bytes or 0} bytes static + {res.dynamic_shared_bytes} bytes dynamic shared "
                   f"memory > {optin} (the sm_{res.cc[0]}{res.cc[1]} opt-in limit per block)")
    if res.spill_bytes:
        out.append(f"{where}: register spills ({res.spill_store_bytes} B stored, {res.spill_load_bytes} B "
                   "loaded per thread)")
    if res.error is None and res.registers is None:
        out.append(f"{where}: no ptxas report (ptxas not found?)")
    return out
