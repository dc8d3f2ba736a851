"""The same command on every host: the platform's environment gives this process's index, the
coordinator, the replicas' URLs and the weight source; the flags given win; bad, partial or
contradictory values are refused naming the variable. Env dicts and a stand-in resolver (names
map to addresses here or elsewhere), no jax, no DNS: each test takes milliseconds."""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import subprocess
import sys

import gin
import pytest

from jaxrl_orch import train
from jaxrl_orch.distributed import hostcheck
from jaxrl_orch.distributed.platform import detect, nodelist, resolve_flags

JOBSET = {"JOBSET_NAME": "run1", "JOB_INDEX": "0", "JOB_COMPLETION_INDEX": "0"}
TRAINER = {**JOBSET, "REPLICATED_JOB_NAME": "trainer"}
WORKERS = "w-0.slice,w-1.slice,w-2.slice,w-3.slice"
R1 = "http://run1-engine-0-0.run1:50051"
R2 = "http://run1-engine-1-0.run1:50051"
FAR = "203.0.113.7"  # an address of no host here (TEST-NET-3, for documentation)


class Names:
    """A resolver standing in for DNS: every name is this host (127.0.0.1) unless ``table``
    maps it to another address, or to None (it does not resolve); an IP address is itself.
    Its clock steps by the seconds slept, so a wait of minutes takes none."""

    def __init__(self, monkeypatch):
        self.table: dict[str, str | None] = {}
        self.asked: list[str] = []
        self.clock = 0.0
        monkeypatch.setattr(hostcheck, "addresses", self)
        monkeypatch.setattr(hostcheck, "_now", lambda: self.clock)
        monkeypatch.setattr(hostcheck, "_sleep", self._sleep)

    def __call__(self, host: str) -> set[str]:
        self.asked.append(host)
        try:
            literal = bool(ipaddress.ip_address(host))
        except ValueError:
            literal = False
        address = self.table.get(host, host if literal else "127.0.0.1")
        if address is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return {address}

    def _sleep(self, seconds: float) -> None:
        self.clock += seconds


@pytest.fixture(autouse=True)
def names(monkeypatch):
    """The stand-in resolver; the indices this process claims are let go after each test."""
    claims: dict[str, socket.socket] = {}
    monkeypatch.setattr(hostcheck, "_CLAIMS", claims)
    yield Names(monkeypatch)
    for held in claims.values():
        held.close()


# (env, P, R) -> (platform, K, processes, coordinator, replica URLs, weight source)
CASES = {
    "jobset trainer 0": (
        (TRAINER, 2, 2),
        (
            "gke-jobset",
            0,
            None,
            "run1-trainer-0-0.run1:8476",
            (R1, R2),
            "run1-trainer-0-0.run1:8477",
        ),
    ),
    "jobset trainer 1": (
        ({**TRAINER, "JOB_COMPLETION_INDEX": "1"}, 2, 2),
        (
            "gke-jobset",
            1,
            None,
            "run1-trainer-0-0.run1:8476",
            (R1, R2),
            "run1-trainer-0-0.run1:8477",
        ),
    ),
    "jobset engine 1, own subdomain": (
        (
            {
                **JOBSET,
                "REPLICATED_JOB_NAME": "engine",
                "JOB_INDEX": "1",
                "JAXRL_JOBSET_SUBDOMAIN": "svc",
            },
            2,
            2,
        ),
        (
            "gke-jobset",
            3,
            None,
            "run1-trainer-0-0.svc:8476",
            ("http://run1-engine-0-0.svc:50051", "http://run1-engine-1-0.svc:50051"),
            "run1-trainer-0-0.svc:8477",
        ),
    ),
    "tpu-vm worker 2 of 4, the whole run": (
        ({"TPU_WORKER_ID": "2", "TPU_WORKER_HOSTNAMES": WORKERS}, 3, 1),
        ("tpu-vm", 2, 4, "w-0.slice:8476", ("http://w-3.slice:50051",), "w-0.slice:8477"),
    ),
    "tpu-vm worker 2 of 4, the trainer slice alone": (
        ({"TPU_WORKER_ID": "2", "TPU_WORKER_HOSTNAMES": WORKERS}, 4, 2),
        ("tpu-vm", 2, 4, "w-0.slice:8476", (), "w-0.slice:8477"),
    ),
    "slurm, one task per node": (
        ({"SLURM_PROCID": "1", "SLURM_NTASKS": "3", "SLURM_STEP_NODELIST": "gpu[07-09]"}, 2, 1),
        ("slurm", 1, 3, "gpu07:8476", ("http://gpu09:50051",), "gpu07:8477"),
    ),
    "slurm, two tasks on a node": (
        ({"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_STEP_NODELIST": "a1,a2"}, 2, 2),
        ("slurm", 2, 4, "a1:8476", (), "a1:8477"),
    ),
    "explicit JAX_*": (
        (
            {
                "JAX_PROCESS_ID": "2",
                "JAX_NUM_PROCESSES": "3",
                "JAX_COORDINATOR_ADDRESS": "10.0.0.5:1234",
                "SLURM_PROCID": "0",
            },
            2,
            1,
        ),
        ("explicit", 2, 3, "10.0.0.5:1234", (), "10.0.0.5:8477"),
    ),
    "none": (({"HOME": "/root"}, 2, 1), ("none", None, None, None, (), None)),
}


@pytest.mark.parametrize("case", CASES)
def test_each_platform_gives_index_coordinator_and_replicas(case):
    (env, p, r), expected = CASES[case]
    found = detect(env, p, r)
    got = (found.name, found.process_index, found.processes, found.coordinator)
    assert (*got, found.replica_urls, found.weight_source) == expected


def test_the_description_names_each_variable_read_and_only_those():
    env = {**TRAINER, "JOB_COMPLETION_INDEX": "1", "HOSTNAME": "pod", "TPU_WORKER_ID": "1"}
    assert detect(env, 2, 1).describe() == (
        "gke-jobset (JOBSET_NAME=run1, REPLICATED_JOB_NAME=trainer, JOB_INDEX=0, "
        "JOB_COMPLETION_INDEX=1)"
    )


def test_slurm_node_lists_expand_in_order_keeping_zero_padding():
    assert nodelist("a1,b[01-03,07],c[9-10]x") == ["a1", "b01", "b02", "b03", "b07", "c9x", "c10x"]


def _args(*flags: str):
    return train.parse_args(["--defaults", *flags])


def test_the_platform_fills_only_the_flags_left_out(capsys):
    env = {**TRAINER, "JOB_COMPLETION_INDEX": "1"}
    args = resolve_flags(_args("--engine_addresses=http://10.0.0.9:8000"), env, 2, 1)
    assert args.process_index == 1
    assert args.coordinator_address == "run1-trainer-0-0.run1:8476"
    assert args.engine_addresses == "http://10.0.0.9:8000"  # the flag wins
    assert args.weight_source == "run1-trainer-0-0.run1:8477"
    assert args.defaults and args.workdir == "runs/default"  # the other flags as they were
    assert capsys.readouterr().out == (
        "== platform: gke-jobset (JOBSET_NAME=run1, REPLICATED_JOB_NAME=trainer, JOB_INDEX=0, "
        "JOB_COMPLETION_INDEX=1): process 1, coordinator run1-trainer-0-0.run1:8476, replicas "
        "http://10.0.0.9:8000 (--engine_addresses), weight source run1-trainer-0-0.run1:8477\n"
    )


def test_every_flag_given_reads_nothing_not_even_a_bad_variable(capsys):
    flags = ("--process_index=3", "--coordinator_address=h:1", "--engine_addresses=http://e:2")
    env = {"SLURM_PROCID": "x", "JOBSET_NAME": "NOT A LABEL"}
    args = resolve_flags(_args(*flags, "--weight_source=h:3"), env, 2, 2)
    assert (args.process_index, args.coordinator_address, args.weight_source) == (3, "h:1", "h:3")
    assert capsys.readouterr().out.startswith("== platform: not read, every launch flag given: ")


def test_a_single_process_reads_and_prints_nothing(capsys):
    args = _args()
    assert resolve_flags(args, {"JOB_COMPLETION_INDEX": "x", "JOBSET_NAME": "r"}, 1, 0) is args
    assert capsys.readouterr().out == ""


REFUSED = {
    "JOB_COMPLETION_INDEX='one'": ({**TRAINER, "JOB_COMPLETION_INDEX": "one"}, 2, 1),
    "JOB_COMPLETION_INDEX='2' is not 0..1": ({**TRAINER, "JOB_COMPLETION_INDEX": "2"}, 2, 1),
    "REPLICATED_JOB_NAME='workers'": ({**JOBSET, "REPLICATED_JOB_NAME": "workers"}, 2, 1),
    "JOB_INDEX='1' is not 0": ({**TRAINER, "JOB_INDEX": "1"}, 2, 1),
    "JOB_INDEX='2' is not 0..1": (
        {**JOBSET, "REPLICATED_JOB_NAME": "engine", "JOB_INDEX": "2"},
        2,
        2,
    ),
    "JOBSET_NAME='Run_1'": ({**TRAINER, "JOBSET_NAME": "Run_1"}, 2, 1),
    "TPU_WORKER_HOSTNAMES names 1 worker": (
        {"TPU_WORKER_ID": "0", "TPU_WORKER_HOSTNAMES": "w"},
        1,
        1,
    ),
    "TPU_WORKER_ID is not set": ({"TPU_WORKER_HOSTNAMES": WORKERS}, 3, 1),
    "SLURM_NTASKS='8' is not 3": (
        {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_STEP_NODELIST": "a"},
        2,
        1,
    ),
    "SLURM_STEP_NODELIST is not set": ({"SLURM_PROCID": "0", "SLURM_NTASKS": "3"}, 2, 1),
    "'9-3' in 'n[9-3]'": (
        {"SLURM_PROCID": "0", "SLURM_NTASKS": "3", "SLURM_STEP_NODELIST": "n[9-3]"},
        2,
        1,
    ),
    "JAX_PROCESS_ID='-1'": ({"JAX_PROCESS_ID": "-1"}, 2, 1),
    "JAX_NUM_PROCESSES='2' is not 3": ({"JAX_PROCESS_ID": "0", "JAX_NUM_PROCESSES": "2"}, 2, 1),
    "JAX_COORDINATOR_ADDRESS='host'": ({"JAX_COORDINATOR_ADDRESS": "host"}, 2, 1),
    # an index past the count
    "TPU_WORKER_ID='4' is not 0..3": (
        {"TPU_WORKER_ID": "4", "TPU_WORKER_HOSTNAMES": WORKERS},
        3,
        1,
    ),
    "SLURM_PROCID='3' is not 0..2": (
        {"SLURM_PROCID": "3", "SLURM_NTASKS": "3", "SLURM_STEP_NODELIST": "n[1-3]"},
        2,
        1,
    ),
    # partial: one variable of a pair
    "TPU_WORKER_HOSTNAMES is not set but TPU_WORKER_ID='1' is": ({"TPU_WORKER_ID": "1"}, 2, 0),
    # contradictory: a host listed twice, a task on another node than its index says
    "names 'w-1' as workers [1, 3]": (
        {"TPU_WORKER_ID": "0", "TPU_WORKER_HOSTNAMES": "w-0,w-1,w-2,w-1"},
        3,
        1,
    ),
    "is node 'gpu08' of SLURM_STEP_NODELIST='gpu[07-09]' (one task per node, task K on node K), "
    "but SLURMD_NODENAME='gpu07'": (
        {
            "SLURM_PROCID": "1",
            "SLURM_NTASKS": "3",
            "SLURM_STEP_NODELIST": "gpu[07-09]",
            "SLURMD_NODENAME": "gpu07",
        },
        2,
        1,
    ),
}


@pytest.mark.parametrize("message", REFUSED)
def test_bad_values_are_refused_naming_the_variable_and_value(message):
    env, p, r = REFUSED[message]
    with pytest.raises(ValueError, match=re.escape(message)):
        detect(env, p, r)


EXPLICIT = {"JAX_PROCESS_ID": "1", "JAX_COORDINATOR_ADDRESS": "nohost.invalid:1234"}
WORKER_1 = {"TPU_WORKER_ID": "1", "TPU_WORKER_HOSTNAMES": WORKERS}
NODES = {"SLURM_PROCID": "2", "SLURM_NTASKS": "3", "SLURM_STEP_NODELIST": "a[1-3]"}

# (env, flags, P, R, what the resolver says) -> the line, before any work
HOSTS_REFUSED = {
    "JAX_PROCESS_ID is not set, nor --process_index, but explicit "
    "(JAX_COORDINATOR_ADDRESS=10.0.0.5:1234) is: each process needs its own, this process's "
    "index: 0..1 train, 2..2 serve": ({"JAX_COORDINATOR_ADDRESS": "10.0.0.5:1234"}, (), 2, 1, {}),
    "JAX_COORDINATOR_ADDRESS is not set, nor --coordinator_address, but explicit "
    "(JAX_PROCESS_ID=1) is: trainer process 1 joins": ({"JAX_PROCESS_ID": "1"}, (), 2, 1, {}),
    # a coordinator that does not resolve, from each source
    "JAX_COORDINATOR_ADDRESS='nohost.invalid:1234': host 'nohost.invalid' does not resolve "
    "(Name or service not known, tried for 5 s)": (EXPLICIT, (), 2, 0, {"nohost.invalid": None}),
    "JOBSET_NAME='run1' (trainer 0's pod): host 'run1-trainer-0-0.run1' does not resolve "
    "(Name or service not known, tried for 300 s)": (
        {**TRAINER, "JOB_COMPLETION_INDEX": "1"},
        (),
        2,
        1,
        {"run1-trainer-0-0.run1": None},
    ),
    "--coordinator_address: host 'gone' does not resolve": (
        WORKER_1,
        ("--coordinator_address=gone:8476",),
        3,
        1,
        {"gone": None},
    ),
    "SLURM_STEP_NODELIST (task 0's node): host 'a1' does not resolve": (
        NODES,
        (),
        2,
        1,
        {"a1": None},
    ),
    # two processes claiming one index: the host the platform names for it is another's
    "TPU_WORKER_ID=1 puts this process on 'w-1.slice' (203.0.113.7), which is not this host: "
    "two processes would claim index 1": (WORKER_1, (), 3, 1, {"w-1.slice": FAR}),
    "JOB_COMPLETION_INDEX=0 puts this process on 'run1-trainer-0-0.run1' (203.0.113.7)": (
        TRAINER,
        (),
        2,
        1,
        {"run1-trainer-0-0.run1": FAR},
    ),
    "JOB_INDEX=3 puts this process on 'run1-engine-1-0.run1'": (
        {**JOBSET, "REPLICATED_JOB_NAME": "engine", "JOB_INDEX": "1"},
        (),
        2,
        2,
        {"run1-engine-1-0.run1": FAR},
    ),
    "SLURM_PROCID=2 puts this process on 'a3'": (NODES, (), 2, 1, {"a3": FAR}),
    "JAX_PROCESS_ID=0 puts this process on '203.0.113.7'": (
        {"JAX_PROCESS_ID": "0", "JAX_COORDINATOR_ADDRESS": f"{FAR}:8476"},
        (),
        2,
        0,
        {},
    ),
    "--coordinator_address: '203.0.113.7:8476' (203.0.113.7) is not this host, but trainer "
    "process 0 runs the coordinator there": (
        {**TRAINER, "JOB_COMPLETION_INDEX": "1"},
        ("--process_index=0", f"--coordinator_address={FAR}:8476"),
        2,
        1,
        {},
    ),
    # this host's address for the group's collectives: one of its own, reachable by its peers
    "--host_address='203.0.113.7' (203.0.113.7) is not an address of this host": (
        {**TRAINER, "JOB_COMPLETION_INDEX": "1"},
        (f"--host_address={FAR}",),
        2,
        1,
        {},
    ),
    "--host_address='127.0.0.1' is a loopback address, but the coordinator "
    "'run1-trainer-0-0.run1:8476' is not: the group's other hosts would dial their own "
    "loopback": (
        {**TRAINER, "JOB_COMPLETION_INDEX": "1"},
        ("--host_address=127.0.0.1",),
        2,
        1,
        {"run1-trainer-0-0.run1": "10.0.0.4"},
    ),
}


def test_this_hosts_address_is_the_platforms_name_for_it_resolved_or_the_flags(names):
    """The trainer group's collectives listen there (``group.join_group``): a pod's own name,
    resolved; a flag given wins; with no name for this host, None (the route to the
    coordinator)."""
    pod_1 = {**TRAINER, "JOB_COMPLETION_INDEX": "1"}
    names.table["run1-trainer-0-1.run1"] = "127.0.0.1"
    assert resolve_flags(_args(), pod_1, 2, 1).host_address == "127.0.0.1"
    names.table["this-host"] = "127.0.0.1"
    flag = _args("--host_address=this-host")
    assert resolve_flags(flag, pod_1, 2, 1).host_address == "127.0.0.1"
    flags = ["--process_index=1", "--coordinator_address=h:1", "--engine_addresses=http://e:2"]
    assert resolve_flags(_args(*flags, "--weight_source=h:3"), {}, 2, 1).host_address is None


@pytest.mark.parametrize("message", HOSTS_REFUSED)
def test_partial_unresolvable_or_contradictory_platforms_are_refused(names, message):
    env, flags, p, r, table = HOSTS_REFUSED[message]
    names.table.update(table)
    with pytest.raises(ValueError) as refused:
        resolve_flags(_args(*flags), env, p, r)
    line = str(refused.value)
    assert message in line and "\n" not in line


def test_a_jobsets_pod_names_are_waited_for_as_its_pods_start(names, monkeypatch, capsys):
    """Trainer 0's pod may start last: its name is looked up again each second, up to jax's
    own 300 s, and a name that appears in time is taken."""
    names.table["run1-trainer-0-0.run1"] = None
    with pytest.raises(ValueError, match="tried for 300 s"):
        resolve_flags(_args(), {**TRAINER, "JOB_COMPLETION_INDEX": "1"}, 2, 1)
    assert names.clock >= 300 and names.asked.count("run1-trainer-0-0.run1") > 250
    assert capsys.readouterr().out == ""  # refused before the platform line: no work began
    names.asked.clear()
    names.clock = 0.0

    def appears(host):  # trainer 0's name, from its 21st look-up on
        if host == "run1-trainer-0-0.run1" and names.asked.count(host) >= 20:
            names.table[host] = "10.0.0.4"
        return names(host)

    monkeypatch.setattr(hostcheck, "addresses", appears)
    args = resolve_flags(_args(), {**TRAINER, "JOB_COMPLETION_INDEX": "1"}, 2, 1)
    assert args.process_index == 1 and 20 <= names.clock < 22


HOLD = """
import sys, time
from jaxrl_orch.distributed.hostcheck import claim_index
claim_index("run1-trainer-0-0.run1:8476", 1, "JOB_COMPLETION_INDEX")
print("held", flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract Unix sockets")
def test_a_second_process_on_this_host_claiming_an_index_is_refused_naming_the_first():
    """Two processes on one host both told they are trainer 1 (the pid is the first's); once
    the first exits, however it exits, the index is free again."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    first = subprocess.Popen([sys.executable, "-c", HOLD], stdout=subprocess.PIPE, env=env)
    try:
        assert first.stdout.readline() == b"held\n"
        pod_1 = {**TRAINER, "JOB_COMPLETION_INDEX": "1"}
        with pytest.raises(ValueError) as refused:
            resolve_flags(_args(), pod_1, 2, 1)
        assert str(refused.value) == (
            "JOB_COMPLETION_INDEX=1: process 1 of the run at run1-trainer-0-0.run1:8476 already "
            f"runs on this host (pid {first.pid}); allowed: an index no other process of the "
            "run holds"
        )
        resolve_flags(_args(), {**TRAINER, "JOB_COMPLETION_INDEX": "0"}, 2, 1)  # another index
    finally:
        first.kill()
        first.wait()
    assert resolve_flags(_args(), pod_1, 2, 1).process_index == 1
    assert resolve_flags(_args(), pod_1, 2, 1).process_index == 1  # this process holds it


def test_this_hosts_addresses_are_told_from_anothers():
    """The real probe: a bind to an address of this host succeeds, to another's it fails."""
    assert hostcheck.is_here({"127.0.0.1"}) and not hostcheck.is_here({FAR})
    assert not hostcheck.is_here(set())


def test_the_command_refuses_a_contradictory_platform_in_one_line(
    no_run, names, monkeypatch, capsys
):
    for name, value in WORKER_1.items():
        monkeypatch.setenv(name, value)
    names.table["w-1.slice"] = FAR
    layout = [
        "--gin_param=Processes.trainer_processes = 3",
        "--gin_param=Processes.engine_replicas = 1",
    ]
    assert train.main(["--defaults", *layout]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith("error: TPU_WORKER_ID=1 puts this process on 'w-1.slice'")


def test_replicas_nobody_names_are_refused_naming_the_flag():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_STEP_NODELIST": "a1,a2"}
    with pytest.raises(ValueError, match=r"--engine_addresses is not given .*\(slurm\)"):
        resolve_flags(_args(), env, 2, 2)


# --- through the train command: the line before any work, nothing new for one process -------


@pytest.fixture
def no_run(monkeypatch):
    """Building the run fails with an ImportError: the command stops right after the flags."""
    import jaxrl_orch.run as run_package

    monkeypatch.setitem(sys.modules, "jaxrl_orch.run.stages", None)
    monkeypatch.delattr(run_package, "stages", raising=False)
    yield
    gin.clear_config()


def _platform_env(monkeypatch):
    for name, value in {**TRAINER, "REPLICATED_JOB_NAME": "engine"}.items():
        monkeypatch.setenv(name, value)


def test_the_command_prints_the_platform_line_for_a_multi_process_layout(
    no_run, monkeypatch, capsys
):
    _platform_env(monkeypatch)
    layout = [
        "--gin_param=Processes.trainer_processes = 2",
        "--gin_param=Processes.engine_replicas = 1",
    ]
    with pytest.raises(ImportError):
        train.main(["--defaults", *layout])
    out = capsys.readouterr().out
    assert out.startswith("== platform: gke-jobset (JOBSET_NAME=run1, REPLICATED_JOB_NAME=engine")
    assert "process 2, coordinator run1-trainer-0-0.run1:8476, replicas " + R1 in out


def test_the_command_refuses_a_bad_variable_before_any_work(no_run, monkeypatch, capsys):
    _platform_env(monkeypatch)
    monkeypatch.setenv("JOB_INDEX", "one")
    layout = [
        "--gin_param=Processes.trainer_processes = 2",
        "--gin_param=Processes.engine_replicas = 1",
    ]
    assert train.main(["--defaults", *layout]) == 2
    assert "error: JOB_INDEX='one' is not 0: one Job per engine replica" in capsys.readouterr().err


def test_the_command_prints_nothing_new_for_one_process(no_run, monkeypatch, capsys):
    _platform_env(monkeypatch)
    monkeypatch.setenv("JOB_INDEX", "one")  # not read: one process has no platform
    with pytest.raises(ImportError):
        train.main(["--defaults"])
    assert capsys.readouterr().out == ""
