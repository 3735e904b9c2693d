"""What a qgemm call costs by its rows, for two builds of the kernel: a git revision's and
the working tree's, on the 1.5B target's matrix shapes.

Each shape is random valid blocks, packed by each build (a build's panel layout is its own)
in enough copies to pass the last-level cache, so every call streams its weights from memory
as a model's pass does. Calls alternate between the builds row count by row count, copy by
copy; each figure is the minimum over `--repeats` (a shared machine's busy spells fall on
both builds alike). The two builds' outputs are compared bit for bit on every call.

    python benchmarks/qgemm_rows.py --base 495768a --threads 2 --repeats 40
    python benchmarks/qgemm_rows.py --base HEAD~1 --shapes q4k_gate --rows 1,5,8,16

Prints one Markdown table a shape: microseconds a call, and t(n) / t(1) of each build.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from understudy.kernels import qgemm
from understudy.kernels.build import compile_shared

T = GGMLQuantizationType
SCALE_OFFSETS = {
    T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.Q8_0: (0,), T.Q5_0: (0,), T.Q4_0: (0,),
    T.IQ4_XS: (0,), T.IQ4_NL: (0,), T.Q3_K: (108,), T.Q2_K: (80, 82), T.Q4_1: (0, 2),
    T.Q5_1: (0, 2),
}  # fmt: skip
# name: (type, out features, in features) of the target's matrices
SHAPES = {
    "q4k_gate": (T.Q4_K, 8960, 1536),
    "q4k_down": (T.Q4_K, 1536, 8960),
    "q6k_down": (T.Q6_K, 1536, 8960),
    "q5k_gate": (T.Q5_K, 8960, 1536),
    "q6k_gate": (T.Q6_K, 8960, 1536),
    "q4k_attn_o": (T.Q4_K, 1536, 1536),
    "q6k_head": (T.Q6_K, 151936, 1536),
    "iq4xs_gate": (T.IQ4_XS, 8960, 1536),
    "iq4nl_gate": (T.IQ4_NL, 8960, 1536),
    "q3k_gate": (T.Q3_K, 8960, 1536),
    "q2k_gate": (T.Q2_K, 8960, 1536),
    "q41_gate": (T.Q4_1, 8960, 1536),
    "q51_gate": (T.Q5_1, 8960, 1536),
}
STREAM_BYTES = 96e6  # copies of a shape until this much: past a 32 MB last-level cache


def random_blocks(kind: GGMLQuantizationType, rows: int, cols: int) -> qgemm.GGUFTensor:
    block, size = GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for offset in SCALE_OFFSETS[kind]:
        scales = (rng.standard_normal((rows, cols // block)) * 0.01).astype(np.float16)
        data[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(rows, cols // block, 2)
    return qgemm.GGUFTensor(kind, data.reshape(rows, -1), rows, cols)


def build_at(revision: str, folder: Path) -> ctypes.CDLL:
    """The kernel as `revision` holds it, compiled as qgemm.load() compiles it."""
    kernels = qgemm.SOURCE.parent
    root = Path(
        subprocess.check_output(
            ["git", "rev-parse", "--show-toplevel"], cwd=kernels, text=True
        ).strip()
    )
    listed = subprocess.check_output(
        ["git", "ls-tree", "--name-only", revision, str(kernels.relative_to(root)) + "/"],
        cwd=root,
        text=True,
    )
    for path in listed.split():
        if path.endswith((".c", ".h")):
            text = subprocess.check_output(["git", "show", f"{revision}:{path}"], cwd=root)
            (folder / Path(path).name).write_bytes(text)
    built = compile_shared(folder / qgemm.SOURCE.name, folder / "build")
    lib = None if built is None else qgemm.bind(built)
    assert lib is not None, f"the kernel at {revision} did not build"
    return lib


def time_shape(
    libs: list[ctypes.CDLL], shape: str, rows: list[int], repeats: int, threads: int
) -> list[dict[int, float]]:
    """Per build, {rows: the fastest call's seconds}."""
    kind, out, inner = SHAPES[shape]
    weight = random_blocks(kind, out, inner)
    copies = max(1, int(STREAM_BYTES // weight.data.nbytes))
    linears = [[qgemm.QuantLinear([weight], None, lib=lib) for _ in range(copies)] for lib in libs]
    x = torch.randn(max(rows), inner)
    best = [dict.fromkeys(rows, float("inf")) for _ in libs]
    for repeat in range(repeats):
        for n in rows:
            xn, outputs = x[:n].contiguous(), []
            for i in range(len(libs)) if repeat % 2 == 0 else reversed(range(len(libs))):
                y = torch.empty(n, out)
                for linear in linears[i]:
                    kind_, packed, _, _, _ = linear.kernel_calls[0]
                    start = time.perf_counter()
                    code = libs[i].understudy_qgemm(
                        kind_,
                        xn.data_ptr(),
                        packed,
                        None,
                        y.data_ptr(),
                        out,
                        n,
                        inner,
                        out,
                        threads,
                    )
                    best[i][n] = min(best[i][n], time.perf_counter() - start)
                    assert code == 0, code
                outputs.append(y)
            assert all(torch.equal(outputs[0], y) for y in outputs[1:]), (shape, n)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD", help="the git revision to compare with")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rows", default="1,2,4,5,6,8,12,16")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    rows = [int(n) for n in args.rows.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        libs = [build_at(args.base, Path(folder)), qgemm.load()]
        for shape in args.shapes.split(","):
            base, tree = time_shape(libs, shape, rows, args.repeats, args.threads)
            print(
                f"\n{shape} {SHAPES[shape][0].name} {SHAPES[shape][1]}x{SHAPES[shape][2]}, {args.threads} threads, min of {args.repeats}\n"
            )
            print(f"| rows | {args.base} us | t/t(1) | tree us | t/t(1) | tree / {args.base} |")
            print("|---|---|---|---|---|---|")
            for n in rows:
                print(
                    f"| {n} | {base[n] * 1e6:.0f} | {base[n] / base[rows[0]]:.2f} | {tree[n] * 1e6:.0f} | {tree[n] / tree[rows[0]]:.2f} | {tree[n] / base[n]:.2f} |"
                )


if __name__ == "__main__":
    main()
