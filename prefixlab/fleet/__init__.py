"""Scale-out: routing requests over replicas that each hold a prefix cache (the simulator's `--replicas` replay
and `prefixlab run` over `accelerate launch` processes use the same routers)."""

from prefixlab.fleet.router import ROUTING_NAMES, AffinityRouter, Choice, Router, make_router

__all__ = ["ROUTING_NAMES", "AffinityRouter", "Choice", "Router", "make_router"]
