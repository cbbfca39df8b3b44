"""What `prefixlab run` takes from its launcher: torchrun, which `accelerate launch` runs (or none: one process).

A process that dies makes torchrun stop the others (SIGTERM); with `accelerate launch --max_restarts K` it then
restarts the whole group, up to K times, with TORCHELASTIC_RESTART_COUNT set to the attempt's number.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from typing import NoReturn


def attempt() -> tuple[int, int]:
    """(restarts before this attempt, the most the launcher allows), from torchrun's environment (0, 0 without)."""
    return (int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")))


def start(cpu: bool):
    """This process's accelerate PartialState (process group joined), after the launch checks."""
    from accelerate import PartialState

    restart, _ = attempt()
    if restart:
        _join_attempt_group(restart, cpu)
    state = PartialState(cpu=cpu)
    _check_launch(state)
    global _patient_group
    _patient_group = _new_patient_group()
    return state


_patient_group = None
PATIENT_TIMEOUT_DAYS = 30


def _new_patient_group():
    """A gloo group over every process with no practical timeout (created by all of them at once, here)."""
    import datetime

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(days=PATIENT_TIMEOUT_DAYS))


def gather_patiently(value) -> list:
    """Every process's `value`, in rank order, on the patient group: a process done long before another (routing
    balances prefill, not decoding) waits for it, where the default group's timeout (gloo 30 min, NCCL 10) took the
    wait for a dead process; a process that died still fails it at once (its connections close: RuntimeError)."""
    import torch.distributed as dist

    if _patient_group is None:
        return [value]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value, group=_patient_group)
    return gathered


def finish() -> None:
    """Leave the process group (before the interpreter exits)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End the process with `code`. A worker of a launch leaves without the interpreter's teardown: under load, one
    in ~20 CPU workers aborted in C++ destructors after the run, the group destroyed and Python's exit handlers run
    ("terminate called without an active exception", SIGABRT), which fails the whole launch."""
    finish()
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _join_attempt_group(restart: int, cpu: bool) -> None:
    """Join the process group under keys of this attempt. torchrun hands every attempt of a group the same agent
    store (static rendezvous keeps it; c10d shares it) and torch.distributed's keys do not name the attempt, so a
    restarted process can read the dead attempt's addresses and fail to connect ("Connection refused"); Accelerate
    keeps a group already initialized."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized() or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    world_size = int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False)
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() and not cpu else "gloo"
    dist.init_process_group(backend, store=dist.PrefixStore(f"prefixlab/attempt{restart}/", store),
                            rank=int(os.environ["RANK"]), world_size=world_size)


def _check_launch(state) -> None:
    """accelerate 1.x's `launch --cpu --num_processes N` starts ONE process unless given an mpirun hostfile."""
    if state.num_processes == 1 and os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true") and \
            "MASTER_ADDR" in os.environ and "WORLD_SIZE" not in os.environ:
        print("prefixlab: note: `accelerate launch --cpu` started a single process (accelerate starts several CPU "
              "processes only with an mpirun hostfile); for N CPU processes on one machine use `accelerate launch "
              "--multi_gpu --num_processes N -m prefixlab run --cpu ...` (torch.distributed on gloo)", file=sys.stderr)


def share_cores(state, processes: int) -> None:
    """N CPU processes on one machine split its cores (one process keeps torch's setting)."""
    import torch

    if state.device.type == "cpu" and processes > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // processes))


TEST_EXIT_AFTER = "PREFIXLAB_TEST_EXIT_AFTER"  # a test hook (tests/test_fleet_run.py), not a user option


def with_test_exit(write: Callable[[dict], None], rank: int) -> Callable[[dict], None]:
    """`write`, or with PREFIXLAB_TEST_EXIT_AFTER=<rank>:<n> on the first attempt: `write` that kills process
    <rank> with SIGKILL once it has written n records (the failure a restart must survive)."""
    value = os.environ.get(TEST_EXIT_AFTER, "")
    if not value or attempt()[0] or int(value.split(":")[0]) != rank:
        return write
    left = [int(value.split(":")[1])]

    def write_then_die(record: dict) -> None:
        write(record)
        left[0] -= 1
        if left[0] == 0:
            os.kill(os.getpid(), signal.SIGKILL)

    return write_then_die
