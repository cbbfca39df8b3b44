"""`prefixlab simulate TRACE ...` and `prefixlab trace build ...`.

Arguments are parsed as text and checked here, so bad values end as one `prefixlab: error: ...` line (exit 2)
through the dispatcher's PrefixlabError handling.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from prefixlab.cache.costmodel import ModelSpec
from prefixlab.data import shared_file
from prefixlab.errors import InvalidInputError
from prefixlab.sim import build, formats, report
from prefixlab.sim.trace import Request

DEFAULT_POLICIES = "vllm+,sglang+,marconi,dp"
DEFAULT_CAPACITIES_GB = "1,2,5"


def parse_policies(text: str) -> list[str]:
    """Comma-separated policy names, each checked against the policy registry."""
    from prefixlab.cache.policies import POLICY_NAMES

    names = list(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))  # each policy once
    unknown = [name for name in names if name not in POLICY_NAMES]
    if not names:
        raise InvalidInputError(f"--policy is empty; use one or more of {', '.join(POLICY_NAMES)}")
    if unknown:
        raise InvalidInputError(
            f"--policy {text!r}: unknown policy {unknown}; valid policies: {', '.join(POLICY_NAMES)}"
        )
    return names


def parse_number(text: str, option: str, *, integer: bool = False, minimum: float = 0.0, strict: bool = True):
    """A finite number from `text` (> minimum if strict, else >= minimum), or InvalidInputError naming `option`."""
    try:
        value = int(text) if integer else float(text)
    except ValueError:
        kind = "an integer" if integer else "a number"
        raise InvalidInputError(f"{option} {text!r} is not {kind}") from None
    if not math.isfinite(value) or (value <= minimum if strict else value < minimum):
        raise InvalidInputError(f"{option} {text!r} must be a finite number {'>' if strict else '>='} {minimum:g}")
    return value


def parse_capacities_gb(text: str) -> list[float]:
    """Comma-separated positive capacities in GB (1e9 bytes), e.g. "1,2,5"; each once (as policies)."""
    capacities = list(dict.fromkeys(parse_number(part.strip(), "--capacity-gb") for part in text.split(",")))
    for capacity_gb in capacities:
        if not math.isfinite(capacity_gb * report.BYTES_PER_GB):
            raise InvalidInputError(f"--capacity-gb {capacity_gb:g} is too large to count in bytes; pass sizes in GB, "
                                    "e.g. 1,2,5")
        if report.gb_to_bytes(capacity_gb) < 1:
            raise InvalidInputError(f"--capacity-gb {capacity_gb:g} is below one byte; pass sizes in GB, e.g. 1,2,5")
    return capacities


def note_capacities_below_one_state(capacities_gb: list[float], spec: ModelSpec, strict_budget: bool) -> None:
    """Say on stderr why a cache smaller than one recurrent state still hits (or, strict, never can)."""
    small = [c for c in capacities_gb if report.gb_to_bytes(c) < spec.state_bytes]
    if not small:
        return
    sizes = ", ".join(f"{c:g}" for c in small)
    why = ("no request can resume there" if strict_budget else
           "its hits come from the overflow rule (an entry larger than the cache is kept whole until the next "
           "admission, as in Marconi's simulator); --strict-budget never exceeds the budget")
    print(f"note: {sizes} GB holds no recurrent state of this model ({spec.state_bytes / 1e9:.4g} GB each): {why}",
          file=sys.stderr)


def check_on_error(on_error: str) -> str:
    if on_error not in formats.ON_ERROR_CHOICES:
        raise InvalidInputError(f"--on-error {on_error!r}: use one of {', '.join(formats.ON_ERROR_CHOICES)}")
    return on_error


def load_spec(model: str) -> ModelSpec:
    """A built-in model name, or a path to a Hugging Face config.json (or a folder holding one)."""
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    looks_like_path = path.suffix == ".json" or "/" in model
    if not looks_like_path:
        return ModelSpec.from_name(model)
    if not path.is_file():
        raise InvalidInputError(f"--model {model!r}: no such config file; pass a built-in name or an HF config.json")
    from prefixlab.fleet.model_config import load_config  # (transformers' reader, its errors as one line)

    return ModelSpec.from_config(load_config(model, path))


def load_requests(trace: str, on_error: str) -> list[Request]:
    """The requests of a trace file, or of the builtin synthetic trace for "builtin"."""
    check_on_error(on_error)
    requests = build.builtin_trace() if trace == "builtin" else formats.read_trace(trace, on_error)
    if not requests:
        raise InvalidInputError(f"{trace}: no request left to replay (every line was skipped); fix the trace")
    return requests


def parse_replicas(text: str) -> list[int]:
    """Comma-separated replica counts, e.g. "8,16,64"; each once."""
    return list(dict.fromkeys(parse_number(part.strip(), "--replicas", integer=True) for part in text.split(",")))


def parse_routings(text: str) -> list[str]:
    from prefixlab.fleet.router import check_routing

    names = list(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))  # each once
    if not names:
        raise InvalidInputError("--routing is empty; use random, round-robin and/or affinity")
    for name in names:
        try:
            check_routing(name)
        except InvalidInputError as err:
            raise InvalidInputError(f"--routing: {err}") from None
    return names


def core_options(args: argparse.Namespace) -> dict:
    """The replayed caches' options from `simulate`'s flags."""
    lag = parse_number(args.tuning_lag, "--tuning-lag", integer=True, strict=False)
    return {"overflow": not (args.strict_budget or args.as_store), "tuning_lag_requests": lag,
            "as_store": args.as_store}


def run_simulate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    if args.replicas is not None:
        return run_simulate_fleet(args)
    fleet_only = [option for option, given in (("--routing", args.routing is not None), ("--single-cache",
                  args.single_cache), ("--balance-eps", args.balance_eps is not None)) if given]
    if fleet_only:
        raise InvalidInputError(f"{', '.join(fleet_only)} simulate a fleet: add --replicas N (e.g. --replicas 8)")

    from prefixlab.sim.replay import ceiling, simulate

    # Everything is checked before the (slow) replays start.
    policies = parse_policies(args.policy)
    capacities_gb = parse_capacities_gb(args.capacity_gb)
    options = core_options(args)
    spec = load_spec(args.model)
    if args.plot is not None:  # ('' too: refused there)
        report.check_plot_path(args.plot)
    requests = load_requests(args.trace, args.on_error)
    note_capacities_below_one_state(capacities_gb, spec, args.strict_budget or args.as_store)
    bound = ceiling(requests, spec)
    rows = []
    with tqdm(
        total=len(requests) * len(policies) * len(capacities_gb),
        desc="replay",
        unit="req",
        file=sys.stderr,
        disable=None,
    ) as bar:
        for policy in policies:
            for capacity_gb in capacities_gb:
                bar.set_postfix_str(f"{policy} {capacity_gb:g} GB")
                result = simulate(requests, policy, report.gb_to_bytes(capacity_gb), spec, progress=bar.update,
                                  **options)
                rows.append(report.result_row(result, capacity_gb, bound))
    print(report.json_lines(rows) if args.json else report.format_table(rows))
    if args.plot:
        report.plot_hit_rates(rows, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def run_simulate_fleet(args: argparse.Namespace) -> int:
    """`simulate --replicas N,... --routing NAME,...`: one row per (policy, capacity per replica, replicas,
    routing); with --single-cache each row also has the hit rate of one cache of the fleet's total capacity."""
    from tqdm import tqdm

    from prefixlab.sim.replay import ceiling, check_fleet_size, load_imbalance, simulate, simulate_fleet

    policies, capacities_gb = parse_policies(args.policy), parse_capacities_gb(args.capacity_gb)
    options, replica_counts = core_options(args), parse_replicas(args.replicas)
    routings = parse_routings("affinity" if args.routing is None else args.routing)
    balance_eps = parse_number("0.15" if args.balance_eps is None else args.balance_eps, "--balance-eps", strict=False)
    spec = load_spec(args.model)
    if args.plot is not None:  # ('' too: refused there)
        report.check_plot_path(args.plot)
    requests = load_requests(args.trace, args.on_error)
    check_fleet_size(max(replica_counts), len(requests), "--replicas")
    note_capacities_below_one_state(capacities_gb, spec, args.strict_budget or args.as_store)
    bound = ceiling(requests, spec)
    runs = len(policies) * len(capacities_gb) * len(replica_counts) * (len(routings) + bool(args.single_cache))
    rows = []
    with tqdm(total=len(requests) * runs, desc="replay", unit="req", file=sys.stderr, disable=None) as bar:
        for policy in policies:
            for capacity_gb in capacities_gb:
                for replicas in replica_counts:
                    capacity_bytes = report.gb_to_bytes(capacity_gb)
                    single = {}
                    if args.single_cache:
                        bar.set_postfix_str(f"{policy} 1 x {capacity_gb * replicas:g} GB")
                        one = simulate(requests, policy, capacity_bytes * replicas, spec, progress=bar.update,
                                       **options)
                        single = {"single_cache_token_hit_rate": one.token_hit_rate}
                    for routing in routings:
                        bar.set_postfix_str(f"{policy} {replicas} x {capacity_gb:g} GB {routing}")
                        result, loads = simulate_fleet(requests, policy, capacity_bytes, spec, replicas, routing,
                                                       bar.update, balance_eps=balance_eps, **options)
                        rows.append({
                            **report.result_row(result, capacity_gb, bound), "replicas": replicas,
                            "routing": routing, "load_imbalance": load_imbalance(loads),
                            **single,
                        })
    columns = report.FLEET_COLUMNS if args.single_cache else report.FLEET_COLUMNS[:-2] + report.FLEET_COLUMNS[-1:]
    print(report.json_lines(rows) if args.json else report.format_table(rows, columns))
    if args.plot:
        report.plot_fleet(rows, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


_DEFAULT_INPUTS = {  # per build kind: the shared data files read when --input / --tokenizer are not given
    "conversations": {"input": "traces/lmsys_chat_1000.jsonl", "tokenizer": "tokenizers/gpt-neox-20b.json"},
    "shared-prefix": {"input": "system_prompts/system_prompts.jsonl", "tokenizer": "tokenizers/gpt-neox-20b.json"},
}


def _input_path(given: str | None, shared: str, option: str) -> Path:
    path = Path(given) if given else shared_file(shared)
    if path is None:
        raise InvalidInputError(f"{option} is required (../shared/data/{shared} is not present)")
    return path


def run_trace_build(args: argparse.Namespace) -> int:
    if not Path(args.output).parent.is_dir():  # checked before the (slow) build
        raise InvalidInputError(f"-o {args.output!r}: folder {str(Path(args.output).parent)!r} does not exist")
    if Path(args.output).is_dir():
        raise InvalidInputError(f"-o {args.output!r} is a folder; pass the path of the trace file to write")
    defaults = _DEFAULT_INPUTS.get(args.kind, {})
    if defaults:  # the shared data files a build reads when not given: -o must not overwrite them either
        args.input = _input_path(args.input, defaults["input"], "--input")
        args.tokenizer = _input_path(args.tokenizer, defaults["tokenizer"], "--tokenizer")
    inputs = [*(getattr(args, "traces", None) or ()), getattr(args, "input", None), getattr(args, "tokenizer", None)]
    if Path(args.output).exists() and any(p and Path(p).exists() and Path(p).samefile(args.output) for p in inputs):
        raise InvalidInputError(f"-o {args.output!r} is one of the build's inputs; write the trace to another path")
    if args.kind == "builtin":
        requests = build.builtin_trace(seed=parse_number(args.seed, "--seed", integer=True, strict=False))
    elif args.kind in ("agentic", "few-shot", "mix"):
        requests = _synthetic_trace(args)
    elif args.kind == "conversations":
        requests = build.build_conversation_trace(
            args.input,
            args.tokenizer,
            sessions_per_second=parse_number(args.rate, "--rate"),
            max_sessions=parse_number(args.max_sessions, "--max-sessions", integer=True) if args.max_sessions else None,
            on_error=check_on_error(args.on_error),
        )
    else:
        requests = build.build_shared_prefix_trace(
            args.input,
            args.tokenizer,
            num_requests=parse_number(args.num_requests, "--num-requests", integer=True),
            requests_per_second=parse_number(args.rate, "--rate"),
            popularity_skew=parse_number(args.skew, "--skew", strict=False),
            seed=parse_number(args.seed, "--seed", integer=True, strict=False),
            path_prefix=args.path_prefix,
            on_error=check_on_error(args.on_error),
        )
    if not requests:
        raise InvalidInputError(f"trace build {args.kind}: no request to write (every input line was skipped)")
    try:
        formats.write_trace(args.output, requests)
    except OSError as err:
        raise InvalidInputError(f"-o {args.output!r}: cannot write it ({err.strerror}); pass a path you can write "
                                "to") from None
    input_tokens = sum(len(r.input_tokens) for r in requests)
    print(f"wrote {len(requests)} requests ({input_tokens} input tokens) to {args.output}", file=sys.stderr)
    return 0


def _unique_names(stems: list[str]) -> list[str]:
    """Each trace's session-id prefix: its file's stem, a stem taken already gets #2, #3, ... (the first free one: a
    file may itself be named shots#2)."""
    names: list[str] = []
    for stem in stems:
        name, k = stem, 1
        while name in names:
            k += 1
            name = f"{stem}#{k}"
        names.append(name)
    return names


def _synthetic_trace(args: argparse.Namespace) -> list[Request]:
    """`trace build agentic|few-shot|mix` (prefixlab.sim.workloads)."""
    from prefixlab.sim import workloads

    if args.kind == "mix":
        traces = [formats.read_trace(path, check_on_error(args.on_error), salt=k)  # (Mooncake ids are per file)
                  for k, path in enumerate(args.traces)]
        return workloads.mix_traces(traces, _unique_names([Path(path).stem for path in args.traces]))
    seed = parse_number(args.seed, "--seed", integer=True, strict=False)
    if args.kind == "agentic":
        return workloads.agentic_trace(seed, parse_number(args.sessions, "--sessions", integer=True))
    return workloads.few_shot_trace(seed, parse_number(args.num_requests, "--num-requests", integer=True))


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `simulate` and `trace build {conversations,shared-prefix,builtin,agentic,few-shot,mix}`."""
    sim = subparsers.add_parser("simulate", help="replay a trace through cache policies and capacities")
    sim.add_argument("trace", help="Marconi or Mooncake JSONL trace, or 'builtin' (a small synthetic trace)")
    sim.add_argument(
        "--policy", default=DEFAULT_POLICIES, help=f"comma-separated policies (default {DEFAULT_POLICIES})"
    )
    sim.add_argument("--capacity-gb", default=DEFAULT_CAPACITIES_GB,
                     help=f"comma-separated cache sizes in GB (1e9 B; default {DEFAULT_CAPACITIES_GB})")
    sim.add_argument("--model", default="marconi-7b",
                     help="marconi-7b (the default, the only built-in) or an HF config.json")
    sim.add_argument("--json", action="store_true", help="print one JSON object per (policy, capacity)")
    sim.add_argument("--plot", metavar="FILE.png", help="plot token hit rate vs capacity per policy")
    sim.add_argument("--on-error", default="stop", help="stop (default) or skip malformed trace lines")
    sim.add_argument("--strict-budget", action="store_true",
                     help="never exceed the byte budget (default: an entry larger than the free space is kept whole "
                          "until the next admission, as in Marconi's simulator)")
    sim.add_argument("--as-store", action="store_true",
                     help="replay each request as a PrefixStore serves it (its last prompt token recomputed, the state "
                          "before it kept, the last output token never fed; a strict budget), not as Marconi's does")
    sim.add_argument("--tuning-lag", default="0", metavar="N",
                     help="apply a tuned alpha N requests after it is due, its replays on a background thread, as a "
                          "PrefixStore does (which applies it once found); default 0: inline, as Marconi")
    sim.add_argument("--replicas", help="comma-separated fleet sizes: replay N caches of --capacity-gb each")
    sim.add_argument("--routing",
                     help="with --replicas: comma-separated routers (random, round-robin, affinity; default affinity)")
    sim.add_argument("--single-cache", action="store_true",
                     help="with --replicas: also replay one cache of the fleet's total capacity (slower)")
    sim.add_argument("--balance-eps",
                     help="affinity: no replica above (1 + eps) x the mean prefill work (default 0.15)")
    sim.set_defaults(func=run_simulate)

    trace = subparsers.add_parser("trace", help="build trace files")
    build_parser = trace.add_subparsers(dest="trace_command", required=True, metavar="build").add_parser(
        "build", help="build a trace"
    )
    kinds = build_parser.add_subparsers(
        dest="kind", required=True, metavar="{conversations,shared-prefix,builtin,agentic,few-shot,mix}"
    )
    conversations = kinds.add_parser("conversations", help="multi-turn chats ({conversation: [...]} JSONL)")
    conversations.add_argument("--rate", default="1", help="sessions per second (default 1)")
    conversations.add_argument("--max-sessions", help="keep only the first N conversations")
    shared = kinds.add_parser("shared-prefix", help="system prompts or QuALITY documents + short queries")
    shared.add_argument("--rate", default="1", help="requests per second, Poisson (default 1)")
    shared.add_argument("--num-requests", default="1000", help="requests (default 1000)")
    shared.add_argument("--skew", default="1.0",
                        help="Zipf popularity exponent of the prefixes (0 = uniform; default 1.0)")
    shared.add_argument("--seed", default="0", help="random seed (default 0)")
    shared.add_argument("--path-prefix", default="", help="system prompts: keep paths starting with this")
    builtin = kinds.add_parser("builtin", help="the small synthetic trace `simulate builtin` replays")
    builtin.add_argument("--seed", default="0", help="random seed (default 0)")
    agentic = kinds.add_parser("agentic", help="tool-using agent sessions (synthetic): long appended histories")
    agentic.add_argument("--sessions", default="40", help="agent sessions (default 40)")
    few_shot = kinds.add_parser("few-shot", help="few-shot prompts with varying example sets (synthetic)")
    few_shot.add_argument("--num-requests", default="600", help="requests (default 600)")
    for kind in (agentic, few_shot):
        kind.add_argument("--seed", default="0", help="random seed (default 0)")
    mix = kinds.add_parser("mix", help="interleave trace files, each stretched to the longest one's time span")
    mix.add_argument("traces", nargs="+", help="Marconi or Mooncake JSONL traces to mix")
    mix.add_argument("--on-error", default="stop", help="stop (default) or skip malformed trace lines")
    for kind in (conversations, shared):
        kind.add_argument("--input", help="input JSONL (default: the shared data file)")
        kind.add_argument("--tokenizer", help="tokenizers JSON (default: the shared GPT-NeoX tokenizer)")
        kind.add_argument("--on-error", default="stop", help="stop (default) or skip malformed input lines")
    for kind in (conversations, shared, builtin, agentic, few_shot, mix):
        kind.add_argument("-o", "--output", required=True, help="output Marconi JSONL path")
        kind.set_defaults(func=run_trace_build)
