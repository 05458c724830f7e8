"""FLA's pinned configs on the CPU, through Triton's interpreter (run by tests/test_fla_pinning.py in a
process of its own: the interpreter is chosen before triton is imported).

With `VLMRUN_FLA_PINNED_CONFIGS=1` the FLA GDN backend pins FLA's autotuners (`pin_fla_configs`); then
the interpreter check of the backend against the torch reference (tests/fla_interpret_check.py) runs
with the autotuner's own `run` (not the interpreter shim's first-config cut), watched: every autotuned
kernel must run with exactly one config, the pinned one, and every pinned kernel must run (the table
covers the forward path). A pin that is not among a kernel's candidates, or names no kernel, is refused.
Prints one line per kernel and exits non-zero on any miss.
"""

from __future__ import annotations

import os

import tests.triton_interpret as interpret  # noqa: F401  (first: TRITON_INTERPRET=1 and the shims)

import triton.runtime.autotuner as autotuner

autotuner.Autotuner.run = interpret._run  # the autotuner as FLA runs it: no cut to the first config
os.environ["VLMRUN_FLA_PINNED_CONFIGS"] = "1"

import tests.fla_interpret_check as fla_check  # noqa: E402
from vlmrun.layers.attention.fla_backend import PINNED_CONFIGS, pin_fla_configs  # noqa: E402

SEEN: dict[str, set[tuple]] = {}  # kernel -> the configs lists it ran with


def watched_run(self, *args, **kwargs):
    fn = self.fn
    while hasattr(fn, "fn"):
        fn = fn.fn
    SEEN.setdefault(f"{fn.__module__}.{fn.__name__}", set()).add(tuple((tuple(sorted(c.kwargs.items())), c.num_warps, c.num_stages)
                                                  for c in self.configs))
    return interpret._run(self, *args, **kwargs)


def refusals() -> list[str]:
    """Problems with the refusals (empty when both bad pins are refused)."""
    problems = []
    kernel = "fla.ops.common.chunk_o.chunk_fwd_kernel_o"
    for bad, what in [({kernel: ({"BK": 48, "BV": 48}, 4, 3)}, "not one of its candidates"),
                      ({"no_such_kernel": ({}, 4, 3)}, "no autotuned kernel named")]:
        try:
            pin_fla_configs(bad)
            problems.append(f"{bad} was not refused")
        except ValueError as exc:
            if what not in str(exc):
                problems.append(f"{bad}: {exc}")
    return problems


def main() -> int:
    problems = refusals()
    autotuner.Autotuner.run = watched_run
    status = fla_check.main()  # builds FLAGDNBackend, which pins (the variable is set)
    if status:
        problems.append("FLA with pinned configs does not match the torch reference")
    for kernel, lists in sorted(SEEN.items()):
        want = PINNED_CONFIGS.get(kernel)
        pinned = want and (tuple(sorted(want[0].items())), want[1], want[2])
        ok = all(len(configs) == 1 for configs in lists) and (pinned is None or lists == {(pinned,)})
        print(f"{kernel}: ran with {sorted(len(c) for c in lists)} config(s) {'(its pin)' if pinned else ''}"
              f"{'' if ok else ' MISS'}")
        if not ok:
            problems.append(f"{kernel} ran with {lists}, pinned {pinned}")
    unrun = sorted(set(PINNED_CONFIGS) - set(SEEN))
    if unrun:
        problems.append(f"pinned kernels that never ran: {unrun}")
    for problem in problems:
        print("PROBLEM " + problem)
    print(f"{len(SEEN)} autotuned kernels ran, each on one config" if not problems else "pinning FAILED")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
