"""The end-of-run gather of `prefixlab run`: a process done long before another waits for it."""

import datetime
import os
import socket
import time

import torch.distributed as dist
import torch.multiprocessing as mp

from prefixlab.fleet import launch


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # the default group's timeout stands in for gloo's 30 minutes: the gather below outlasts it
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=2))
    launch._patient_group = launch._new_patient_group()
    if rank == 1:
        time.sleep(5)  # a longer share of the work (decoding is not balanced)
    try:
        results[rank] = launch.gather_patiently({"rank": rank})
    except RuntimeError as err:
        results[rank] = f"failed: {err}"
    dist.destroy_process_group()


def test_the_final_gather_outlasts_the_default_groups_timeout():
    """It ran on the default group: a process done 30 minutes (gloo's default timeout) before another took the wait
    for a dead peer, and under --max_restarts the run exited 0 with its outputs left in part files."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(_free_port(), results), nprocs=2, join=True)
        assert dict(results) == {0: [{"rank": 0}, {"rank": 1}], 1: [{"rank": 0}, {"rank": 1}]}


def test_one_process_gathers_its_own_value():
    assert launch.gather_patiently({"rank": 0}) == [{"rank": 0}]
