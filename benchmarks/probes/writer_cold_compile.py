# SPDX-License-Identifier: Apache-2.0
"""The summary writer's compilation time on a cold Triton cache (H200; not a test).

Why it matters: before the writer was compiled at KV-cache bind time
(``warm_up_summary_writer``), its first compilation ran inside the first
request's prefill step and stalled every running request. Run it with an
empty cache directory, so the first launch compiles:

    TRITON_CACHE_DIR=$(mktemp -d) python benchmarks/probes/writer_cold_compile.py

Per summary layout: the first launch (``warm_up_summary_writer``: the
compilation), then one write on a slot mapping 8 bytes off 16-byte alignment
(a mixed step's prefill slice after an odd number of decode tokens), which
compiles nothing since the kernel does not specialize on that alignment.
(``benchmarks/results/writer_cold_compile_h200.txt`` was made by these lines,
run inline.)
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from vllm.v1.attention.backends import moira


def main() -> None:
    print(
        "command: TRITON_CACHE_DIR=<empty> python <this snippet>  (GPU:",
        torch.cuda.get_device_name(),
        ")",
    )
    kv = torch.randn(12, 8, 64, 256, dtype=torch.bfloat16, device="cuda")
    for name in ("int8:mvar_top8", "int8:mvar", "bfloat16:mvar_top4"):
        dt, est = name.split(":")
        dtype, rows = moira.summary_storage(moira.summary_slots(est), dt)
        s = torch.zeros(12, 8, rows, 128, dtype=dtype, device="cuda")
        t = time.time()
        moira.warm_up_summary_writer(kv, s)
        torch.cuda.synchronize()
        first = time.time() - t
        slots = torch.arange(63, 64 * 12, 64, dtype=torch.int64, device="cuda")
        odd = torch.cat([torch.full((1,), -1, dtype=torch.int64, device="cuda"), slots])[1:]
        t = time.time()
        moira.write_page_summaries(kv, s, odd)
        torch.cuda.synchronize()
        second = time.time() - t
        print(f"{name}: first launch (compile, cold cache) {first:.2f} s; "
              f"then a misaligned slot mapping {second * 1e3:.1f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
