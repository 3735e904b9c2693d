"""One OpenMP team in the process (kernels/openmp.py): an engine built on one thread and run
on another (the server's worker) does not pay a context switch per kernel call.

What is counted is the process's voluntary context switches (getrusage), not time: a worker
that spin-waits between parallel regions switches ~0 times a region, one that libgomp
throttles sleeps and is woken ~1-2 times a region. Each check runs in a fresh Python pinned
to two CPUs with two threads, the shape of the 2-core machines this was found on (libgomp
throttles once its teams hold more threads than the CPUs it may use)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gguf_helpers import write_tiny_qwen2_gguf
from understudy.kernels import qgemm

pytestmark = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs: one CPU has no spinning workers"
)

PRELUDE = """
import json, os, resource, sys, threading
os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])
import torch
torch.set_num_threads(2)
from understudy.kernels.openmp import release_thread_team

def switches():
    return resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw

def on_a_new_thread(work):
    '''Voluntary context switches of the process while `work` runs on a fresh thread.'''
    out = {}
    def run():
        work()  # a first call makes this thread's team
        start = switches()
        work()
        out["switches"] = switches() - start
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out["switches"]
"""


def run_isolated(body: str) -> dict:
    """Run PRELUDE + `body` in a fresh Python; `body` prints one JSON line, returned here."""
    code = PRELUDE + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_team_throttles_and_releasing_the_first_restores_spinning() -> None:
    """PyTorch's own parallel regions: with the main thread's team alive, a second thread's
    regions each wake a sleeping worker; once the main thread releases its team, they spin.
    The first half is the mutation: the count can and does fail when two teams live."""
    result = run_isolated(
        """
        x = torch.randn(1 << 20)
        def regions():
            for _ in range(400):
                torch.add(x, 1.0)  # 1M elements: parallel over the two threads
        regions()  # the main thread's team
        two_teams = on_a_new_thread(regions)
        released = release_thread_team()
        one_team = on_a_new_thread(regions)
        print(json.dumps({"two": two_teams / 400, "one": one_team / 400, "released": released}))
        """
    )
    assert result["released"], "libgomp's omp_pause_resource_all is missing"
    assert result["two"] > 0.5, result  # throttled: a sleep and a wake-up a region
    assert result["one"] < 0.1, result  # spinning: nearly none


@pytest.mark.skipif(not qgemm.available(), reason="qgemm cannot be built here")
def test_an_engine_runs_on_another_thread_without_a_switch_per_kernel_call(
    tmp_path: Path,
) -> None:
    """Engine.from_pretrained lets go of the building thread's team, so generating on a
    worker thread (as the server does) spins between kernel calls; a parallel region on the
    main thread after the build (a second team again) makes the same generation switch."""
    target = write_tiny_qwen2_gguf(tmp_path / "target.gguf", seed=0)
    result = run_isolated(
        f"""
        from understudy import Engine, SamplingParams
        engine = Engine.from_pretrained(
            target={str(target)!r}, method="none", quantization="gguf", max_context=256
        )
        params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
        generate = lambda: engine.generate([5, 6, 7, 8], params)
        as_built = on_a_new_thread(generate)
        torch.add(torch.randn(1 << 20), 1.0)  # the main thread opens a region: a team again
        second_team = on_a_new_thread(generate)
        print(json.dumps({{"as_built": as_built / 48, "second_team": second_team / 48}}))
        """
    )
    assert result["second_team"] > 4 * max(result["as_built"], 1.0), result
