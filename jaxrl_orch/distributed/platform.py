"""Where a process of a multi-process run sits, read from the platform that started it.

What it owns
    ``detect``: the platform this process runs on, read from its environment (a Mapping: tests
    pass dicts), and what that says about the run's layout (``Processes.trainer_processes`` P,
    ``Processes.engine_replicas`` R, both the config's): this process's index K, the trainer
    group's coordinator (trainer process 0's host, ``COORDINATOR_PORT``), the weight source
    (the same host, ``WEIGHT_PORT``) and, where the platform names their hosts, the engine
    replicas' URLs (``ENGINE_PORT``). ``resolve_flags``: the launch flags given win, the
    platform fills only those left out, and one line says what came from where; this host's
    address (``--host_address``, else the platform's host for this process, resolved) rides
    along for the trainer group's collectives. The ports are
    ``tpu_scripts``' defaults; other ports are given as the flags themselves.

The platforms, the first whose variable is set wins (docs/scale-out.md):
    explicit    JAX_PROCESS_ID (K), JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES (P + R)
    gke-jobset  JOBSET_NAME, REPLICATED_JOB_NAME: ``trainer`` is one Job of P pods (K =
                JOB_COMPLETION_INDEX), ``engine`` is R Jobs of one pod (K = P + JOB_INDEX); the
                pod of job i, index j is ``<jobset>-<job>-<i>-<j>.<subdomain>``, the subdomain
                JAXRL_JOBSET_SUBDOMAIN or, JobSet's default, the JobSet's name
    tpu-vm      TPU_WORKER_ID (K), TPU_WORKER_HOSTNAMES (the slice's workers, in order): the
                whole run (P + R workers, replica i on worker P + i) or the trainer slice alone
                (P > 1 workers; the replicas are given by flag)
    slurm       SLURM_PROCID (K), SLURM_NTASKS (P + R), SLURM_STEP_NODELIST (task 0's node
                first; with one task per node, replica i is on node P + i)
    none        nothing set: the flags say it all, or jax.distributed detects a TPU slice

A platform is read only when a launch flag is left out, and then all of it is checked: a value
outside the layout, a variable missing or contradicting another (a worker listed twice, a Slurm
task on another node than its index says) is refused, naming the variable, its value and what
is allowed. Then the hosts it names (``hostcheck``): this process's own host must be this one,
the coordinator's must resolve. No jax, no metadata server, no packet sent (a name lookup and a
bind probe): the train command calls this before anything heavy.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Mapping, Sequence

from jaxrl_orch.distributed.addresses import host_port
from jaxrl_orch.distributed.hostcheck import Resolve, check_host_address, check_hosts, claim_index

COORDINATOR_PORT = 8476
WEIGHT_PORT = 8477
ENGINE_PORT = 50051
TRAINER_JOB = "trainer"
ENGINE_JOB = "engine"
SUBDOMAIN = "JAXRL_JOBSET_SUBDOMAIN"
FLAGS = ("process_index", "coordinator_address", "engine_addresses", "weight_source")
_HOST = re.compile(r"[A-Za-z0-9_.-]+|[0-9A-Fa-f:.]+")
_DIGITS = re.compile(r"[0-9]+")
_RANGED = re.compile(r"([A-Za-z0-9_.-]*)\[([0-9,-]+)\]([A-Za-z0-9_.-]*)")


@dataclasses.dataclass(frozen=True)
class Platform:
    """What a platform says about this process (None or empty where it says nothing)."""

    name: str
    read: tuple[tuple[str, str], ...] = ()  # (variable, value), each one taken
    process_index: int | None = None
    processes: int | None = None
    coordinator: str | None = None
    replica_urls: tuple[str, ...] = ()
    weight_source: str | None = None
    index_from: str = ""  # the variable K came from
    own_host: str | None = None  # the host the platform puts process K on, when it says
    leader_from: str = ""  # where the coordinator's host came from
    dns_wait_s: float = 5.0  # how long a name of it may take to appear

    def describe(self) -> str:
        if not self.read:
            return self.name
        return f"{self.name} ({', '.join(f'{k}={v}' for k, v in self.read)})"


def detect(env: Mapping[str, str], trainer_processes: int, engine_replicas: int) -> Platform:
    """The platform of ``env``, checked against the layout of P trainer processes and R
    engine replicas."""
    p = trainer_processes
    r = engine_replicas
    if "JAX_PROCESS_ID" in env or "JAX_COORDINATOR_ADDRESS" in env:
        return _explicit(env, p, r)
    if "JOBSET_NAME" in env:
        return _jobset(env, p, r)
    if "TPU_WORKER_HOSTNAMES" in env or "TPU_WORKER_ID" in env:
        return _tpu_vm(env, p, r)
    if "SLURM_PROCID" in env:
        return _slurm(env, p, r)
    return Platform("none")


def resolve_flags(
    args: argparse.Namespace,
    env: Mapping[str, str],
    trainer_processes: int,
    engine_replicas: int,
    resolve: Resolve | None = None,
) -> argparse.Namespace:
    """``args`` with the launch flags (``FLAGS``) left out filled from the platform, and the
    line saying where each came from printed: for a multi-process layout (P > 1 or R > 0) only.
    A single process's ``args`` come back as they are: nothing read, nothing printed. The
    hosts this process will use are checked first (``check_hosts``; ``resolve``: a host's
    addresses, ``addresses`` unless given)."""
    if trainer_processes == 1 and engine_replicas == 0:
        return args
    given = {flag for flag in FLAGS if getattr(args, flag) not in (None, "")}
    found = Platform("not read, every launch flag given")
    if len(given) < len(FLAGS):
        found = detect(env, trainer_processes, engine_replicas)
    if found.name == "none":  # nothing to take: the flags' own checks name what is missing
        return _with_host(args, None, args.coordinator_address, resolve)
    offered = {
        "process_index": found.process_index,
        "coordinator_address": found.coordinator,
        "engine_addresses": ",".join(found.replica_urls),
        "weight_source": found.weight_source,
    }
    values = {flag: getattr(args, flag) if flag in given else offered[flag] for flag in FLAGS}
    _complete(found, values, trainer_processes, engine_replicas)
    own = check_hosts(found, values, given, trainer_processes, resolve)
    k = values["process_index"]
    run = values["coordinator_address"] or values["weight_source"]
    if isinstance(k, int) and run:
        claim_index(
            str(run), k, "--process_index" if "process_index" in given else found.index_from
        )
    if engine_replicas and not values["engine_addresses"]:
        raise ValueError(
            f"--engine_addresses is not given and the platform ({found.name}) does not name the "
            f"replicas' hosts; give --engine_addresses=http://HOST:PORT,... (one for each of the "
            f"{engine_replicas} engine replicas)"
        )
    print(launch_line(found, values, given), flush=True)
    resolved = argparse.Namespace(**{**vars(args), **values})
    return _with_host(resolved, own, values["coordinator_address"], resolve)


def _with_host(
    args: argparse.Namespace, own: str | None, coordinator: object, resolve: Resolve | None
) -> argparse.Namespace:
    """``args`` with ``host_address``: the flag's, checked, or this host's address where the
    platform named this process's host (``own``), or None (``group`` takes the route to the
    coordinator)."""
    given = getattr(args, "host_address", None)
    address = check_host_address(given, coordinator, resolve) if given else own
    return argparse.Namespace(**{**vars(args), "host_address": address})


def _complete(found: Platform, values: Mapping[str, object], p: int, r: int) -> None:
    """A platform read that is short of what this process needs (JAX_* set in part), refused
    naming the missing variable: jax.distributed would otherwise make every process 0."""
    if values["process_index"] is None:
        raise ValueError(
            f"{found.index_from} is not set, nor --process_index, but {found.describe()} is: "
            f"each process needs its own, {_places(p, r)}"
        )
    k = values["process_index"]
    if isinstance(k, int) and k < p and p > 1 and not values["coordinator_address"]:
        raise ValueError(
            f"JAX_COORDINATOR_ADDRESS is not set, nor --coordinator_address, but "
            f"{found.describe()} is: trainer process {k} joins the group at trainer process "
            "0's HOST:PORT"
        )


def launch_line(found: Platform, values: Mapping[str, object], given: set[str]) -> str:
    """``== platform: NAME (VAR=value, ...): process K, coordinator ...``; a value that came
    from a flag is followed by that flag."""
    labels = ("process", "coordinator", "replicas", "weight source")
    parts = []
    for flag, label in zip(FLAGS, labels, strict=True):
        value = values[flag]
        text = f"{label} {value}" if value not in (None, "") else f"{label} not given"
        parts.append(text + (f" (--{flag})" if flag in given else ""))
    return f"== platform: {found.describe()}: {', '.join(parts)}"


def _explicit(env: Mapping[str, str], p: int, r: int) -> Platform:
    n = p + r
    names = ("JAX_PROCESS_ID", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES")
    if "JAX_NUM_PROCESSES" in env:
        _int(env, "JAX_NUM_PROCESSES", range(n, n + 1), _every(p, r))
    index = None
    if "JAX_PROCESS_ID" in env:
        index = _int(env, "JAX_PROCESS_ID", range(n), _places(p, r))
    address = env.get("JAX_COORDINATOR_ADDRESS")
    leader = None if address is None else host_port(address, "JAX_COORDINATOR_ADDRESS")[0]
    found = _found("explicit", env, names, index, n, leader, ())
    place = {"index_from": "JAX_PROCESS_ID", "leader_from": f"JAX_COORDINATOR_ADDRESS={address!r}"}
    if index == 0:  # process 0 runs the coordinator: its host is this one
        place["own_host"] = leader
    if address is not None:
        place["coordinator"] = address.strip()
    return dataclasses.replace(found, **place)


def _jobset(env: Mapping[str, str], p: int, r: int) -> Platform:
    jobset = _name(env, "JOBSET_NAME")
    job = env.get("REPLICATED_JOB_NAME")
    if job not in (TRAINER_JOB, ENGINE_JOB):
        raise ValueError(
            f"REPLICATED_JOB_NAME={job!r} is neither {TRAINER_JOB!r} (the trainer group: one "
            f"Job of trainer_processes pods) nor {ENGINE_JOB!r} (one Job of one pod per engine "
            "replica); name the JobSet's replicated jobs so"
        )
    if job == TRAINER_JOB:
        _int(env, "JOB_INDEX", range(1), "the trainer replicated job runs one Job (replicas: 1)")
        index = _int(env, "JOB_COMPLETION_INDEX", range(p), f"one pod per trainer (P = {p})")
    else:
        index = p + _int(env, "JOB_INDEX", range(r), f"one Job per engine replica (R = {r})")
        _int(env, "JOB_COMPLETION_INDEX", range(1), "an engine replica's Job runs one pod")
    subdomain = _name(env, SUBDOMAIN) if SUBDOMAIN in env else jobset
    engines = [f"{jobset}-{ENGINE_JOB}-{i}-0.{subdomain}" for i in range(r)]
    names = ("JOBSET_NAME", "REPLICATED_JOB_NAME", "JOB_INDEX", "JOB_COMPLETION_INDEX", SUBDOMAIN)
    leader = f"{jobset}-{TRAINER_JOB}-0-0.{subdomain}"
    found = _found("gke-jobset", env, names, index, None, leader, engines)
    i, j = (0, index) if job == TRAINER_JOB else (index - p, 0)
    index_from = "JOB_COMPLETION_INDEX" if job == TRAINER_JOB else "JOB_INDEX"
    # Pods' DNS names appear as the JobSet's pods start, trainer 0's perhaps last: wait as long
    # as jax.distributed waits for it.
    return dataclasses.replace(
        found,
        index_from=index_from,
        own_host=f"{jobset}-{job}-{i}-{j}.{subdomain}",
        leader_from=f"JOBSET_NAME={jobset!r} (trainer 0's pod)",
        dns_wait_s=300.0,
    )


def _tpu_vm(env: Mapping[str, str], p: int, r: int) -> Platform:
    if "TPU_WORKER_HOSTNAMES" not in env:
        raise ValueError(
            f"TPU_WORKER_HOSTNAMES is not set but TPU_WORKER_ID={env['TPU_WORKER_ID']!r} is; it "
            "lists the slice's workers in order, comma-separated, this one at TPU_WORKER_ID"
        )
    hosts = _hosts("TPU_WORKER_HOSTNAMES", env["TPU_WORKER_HOSTNAMES"].split(","))
    twice = next((h for h in hosts if hosts.count(h) > 1), None)
    if twice is not None:
        at = [i for i, h in enumerate(hosts) if h == twice]
        raise ValueError(
            f"TPU_WORKER_HOSTNAMES={env['TPU_WORKER_HOSTNAMES']!r} names {twice!r} as workers "
            f"{at}: each worker is a host of its own, listed once"
        )
    n = len(hosts)
    # A slice of one worker may as well be an engine VM of its own: read only as the whole run.
    if n != p + r and not n == p > 1:
        alone = f" or {p} (the trainer slice; replicas by --engine_addresses)" if p > 1 else ""
        raise ValueError(
            f"TPU_WORKER_HOSTNAMES names {n} worker(s) ({env['TPU_WORKER_HOSTNAMES']!r}); the "
            f"layout needs {p + r} (the whole run on this slice: P {p} + R {r}){alone}. A "
            "host outside it, such as an engine VM of its own, is given --process_index, "
            "--coordinator_address, --engine_addresses and --weight_source"
        )
    index = _int(env, "TPU_WORKER_ID", range(n), f"a worker of TPU_WORKER_HOSTNAMES ({n})")
    names = ("TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES")
    found = _found("tpu-vm", env, names, index, n, hosts[0], hosts[p:])
    leader_from = "TPU_WORKER_HOSTNAMES (worker 0)"
    return dataclasses.replace(
        found, index_from="TPU_WORKER_ID", own_host=hosts[index], leader_from=leader_from
    )


def _slurm(env: Mapping[str, str], p: int, r: int) -> Platform:
    n = p + r
    _int(env, "SLURM_NTASKS", range(n, n + 1), _every(p, r))
    index = _int(env, "SLURM_PROCID", range(n), _places(p, r))
    nodes = nodelist(env.get("SLURM_STEP_NODELIST"))
    engines = nodes[p:] if len(nodes) == n else []  # two tasks on a node: which is unknown
    own = nodes[index] if len(nodes) == n else None
    here = env.get("SLURMD_NODENAME")
    if own is not None and here is not None and here.strip() != own:
        raise ValueError(
            f"SLURM_PROCID={env['SLURM_PROCID']!r} is node {own!r} of SLURM_STEP_NODELIST="
            f"{env['SLURM_STEP_NODELIST']!r} (one task per node, task K on node K), but "
            f"SLURMD_NODENAME={here!r}: allowed, the task's own node's place in that list"
        )
    names = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NODELIST")
    found = _found("slurm", env, names, index, n, nodes[0], engines)
    leader_from = "SLURM_STEP_NODELIST (task 0's node)"
    return dataclasses.replace(
        found, index_from="SLURM_PROCID", own_host=own, leader_from=leader_from
    )


def nodelist(text: str | None, name: str = "SLURM_STEP_NODELIST") -> list[str]:
    """The hosts of a Slurm node list, in order: ``a1,b[01-03,07]`` is a1, b01, b02, b03, b07.
    One bracket per host is read."""
    form = "hosts or PREFIX[RANGES]SUFFIX, comma-separated, e.g. gpu1,node[001-003,007]"
    if not text or not text.strip():
        raise ValueError(f"{name} is not set (srun sets it for a job step); it lists {form}")
    hosts = []
    for item in re.split(r",(?![^\[]*\])", text.strip()):  # commas outside brackets
        found = _RANGED.fullmatch(item)
        if found is None:
            hosts += _hosts(name, [item])
            continue
        prefix, ranges, suffix = found.groups()
        for span in ranges.split(","):
            first, _, last = span.partition("-")
            last = last or first
            if not (_DIGITS.fullmatch(first) and _DIGITS.fullmatch(last)) or int(last) < int(first):
                raise ValueError(f"{name}={text!r}: {span!r} in {item!r} is not N or N-M; {form}")
            numbers = range(int(first), int(last) + 1)
            hosts += [f"{prefix}{k:0{len(first)}d}{suffix}" for k in numbers]
    return hosts


def _found(
    platform: str,
    env: Mapping[str, str],
    names: Sequence[str],
    index: int | None,
    processes: int | None,
    leader: str | None,
    engines: Sequence[str],
) -> Platform:
    """The platform's answer: the variables it read, K, trainer process 0's host and the
    replicas' hosts, each with its port."""
    return Platform(
        platform,
        tuple((k, env[k].strip()) for k in names if k in env),
        index,
        processes,
        None if leader is None else _join(leader, COORDINATOR_PORT),
        tuple(f"http://{_join(host, ENGINE_PORT)}" for host in engines),
        None if leader is None else _join(leader, WEIGHT_PORT),
    )


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _int(env: Mapping[str, str], name: str, allowed: range, meaning: str) -> int:
    """``env[name]``, an integer in ``allowed``."""
    text = env.get(name)
    span = str(allowed.start) if len(allowed) == 1 else f"{allowed.start}..{allowed.stop - 1}"
    if text is None:
        raise ValueError(f"{name} is not set; it must be {span}: {meaning}")
    value = int(text) if _DIGITS.fullmatch(text.strip()) else -1
    if value not in allowed:
        raise ValueError(f"{name}={text!r} is not {span}: {meaning}")
    return value


def _name(env: Mapping[str, str], name: str) -> str:
    """``env[name]`` as a DNS label: lower-case letters, digits and inner dashes."""
    text = env.get(name, "")
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", text):
        raise ValueError(
            f"{name}={text!r} is not a DNS label (lower-case letters, digits and '-', "
            "starting and ending with a letter or digit)"
        )
    return text


def _hosts(name: str, items: Sequence[str]) -> list[str]:
    hosts = [item.strip() for item in items]
    for host in hosts:
        if not _HOST.fullmatch(host):
            raise ValueError(
                f"{name}: {host!r} is not a host name or address (letters, digits, '.', '-', "
                "'_'; an IPv6 address in hex and ':')"
            )
    return hosts


def _every(p: int, r: int) -> str:
    return f"every process of the run (trainer_processes {p} + engine_replicas {r})"


def _places(p: int, r: int) -> str:
    return f"this process's index: 0..{p - 1} train, {p}..{p + r - 1} serve"
