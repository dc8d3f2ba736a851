"""``jaxrl-gke``: a run's JobSet and Secret follow from its config, and every pod of it, started
by the same command, finds its place from what the JobSet gives it (``distributed.platform``)."""

from __future__ import annotations

import stat

import pytest
import yaml
from support.checkout import ROOT
from support.jobset_pods import pods

from jaxrl_orch.config.load import load_config
from jaxrl_orch.distributed.platform import detect
from jaxrl_orch.tools import gke as jobset

MULTI = [f"configs/{f}.gin" for f in ("model/qwen2.5_0.5b", "slice/v5e_16", "env/reverse_text")]
MULTI += ["configs/tune/full.gin", "configs/algo/grpo.gin"]
WORKDIR = "gs://bucket/runs/rl-16"


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def _manifests(files=MULTI, params=(), **kw):
    cfg = load_config(list(files), list(params))
    args = [f"--gin_file={f}" for f in files] + [f"--gin_param={p}" for p in params]
    kw = {"name": "rl-16", "image": "img:1", "workdir": WORKDIR, "key": "k" * 64, **kw}
    return cfg, args, jobset.manifests(cfg, args, **kw)


def _pod(job: dict) -> dict:
    return job["template"]["spec"]["template"]["spec"]


def test_the_v5e_16_slice_is_one_trainer_job_of_four_hosts_and_two_engine_jobs():
    cfg, args, (secret, js) = _manifests(queue="team-a")
    trainer, engine = js["spec"]["replicatedJobs"]
    assert (trainer["name"], trainer["replicas"]) == ("trainer", 1)
    assert trainer["template"]["spec"]["parallelism"] == 4  # one pod per host of the v5e-16
    assert trainer["template"]["spec"]["completionMode"] == "Indexed"
    assert _pod(trainer)["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
        "cloud.google.com/gke-tpu-topology": "4x4",
    }
    assert _pod(trainer)["containers"][0]["resources"]["limits"]["google.com/tpu"] == 4
    assert (engine["name"], engine["replicas"]) == ("engine", 2)
    assert engine["template"]["spec"]["parallelism"] == 1
    assert _pod(engine)["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "2x2"
    # the same command on every pod: no index, no address; the key from the Secret's file
    commands = {tuple(_pod(j)["containers"][0]["command"]) for j in (trainer, engine)}
    assert len(commands) == 1
    (command,) = commands
    assert list(command) == ["python", "-m", "jaxrl_orch.train", *args, f"--workdir={WORKDIR}",
                             "--api_key_file=/var/run/jaxrl/key"]  # fmt: skip
    assert not any(a.startswith(("--process_index", "--coordinator")) for a in command)
    for job in (trainer, engine):
        pod = _pod(job)
        assert pod["terminationGracePeriodSeconds"] == cfg.orchestrator.drain_timeout_s + 15
        assert pod["restartPolicy"] == "Never" and job["template"]["spec"]["backoffLimit"] == 0
        assert pod["volumes"][0]["secret"] == {"secretName": "rl-16-key", "defaultMode": 0o400}
    assert js["spec"]["network"] == {"enableDNSHostnames": True, "subdomain": "rl-16"}
    assert js["metadata"]["labels"] == {"kueue.x-k8s.io/queue-name": "team-a"}
    assert js["spec"]["failurePolicy"] == {"maxRestarts": 10}
    # the run ends with the trainer group: the replicas' jobs never complete on their own
    assert js["spec"]["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["trainer"]}
    assert secret["stringData"] == {"key": "k" * 64} and "k" * 64 not in yaml.safe_dump(js)


def test_every_pod_finds_its_place_from_what_the_jobset_gives_it():
    cfg, _, (secret, js) = _manifests()
    p, r = cfg.processes.trainer_processes, cfg.processes.engine_replicas
    # each pod's env as the kubelet resolves it (support.jobset_pods; run: test_gke_pods_e2e)
    run = pods(js, {secret["metadata"]["name"]: secret})
    assert [(x.job, x.job_index, x.completion_index) for x in run] == [
        *(("trainer", 0, k) for k in range(4)),
        ("engine", 0, 0),
        ("engine", 1, 0),
    ]
    found = [detect(x.env, p, r) for x in run]
    for x in run:  # the key file the command reads is the Secret's, owner-read-only
        (mount,) = x.mounts
        key = next(a.split("=", 1)[1] for a in x.argv if a.startswith("--api_key_file="))
        directory, name = key.rsplit("/", 1)
        assert (directory, mount.files[name], mount.read_only) == (
            mount.path, (b"k" * 64, 0o400), True
        )  # fmt: skip
    assert [f.process_index for f in found] == [0, 1, 2, 3, 4, 5]
    assert {f.coordinator for f in found} == {"rl-16-trainer-0-0.rl-16:8476"}
    assert {f.replica_urls for f in found} == {
        ("http://rl-16-engine-0-0.rl-16:50051", "http://rl-16-engine-1-0.rl-16:50051")
    }
    ports = {j["name"]: _pod(j)["containers"][0]["ports"] for j in js["spec"]["replicatedJobs"]}
    assert ports == {
        "trainer": [{"containerPort": 8476}, {"containerPort": 8477}],
        "engine": [{"containerPort": 50051}],
    }


def test_a_single_host_run_is_one_pod_holding_every_chip():
    files = ["configs/tpu_v5e_8.gin"]
    _, _, (_, js) = _manifests(files, ["CHECKPOINT = 'gs://b/q'"])
    (trainer,) = js["spec"]["replicatedJobs"]
    assert trainer["template"]["spec"]["parallelism"] == 1
    assert _pod(trainer)["containers"][0]["resources"]["limits"]["google.com/tpu"] == 8
    assert _pod(trainer)["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "2x4"


@pytest.mark.parametrize(
    "params, kw, message",
    [
        (["Processes.trainer_processes = 2"], {}, r"has 4 host\(s\).*trainer_processes = 2"),
        ([], {"workdir": "runs/local"}, r"--workdir 'runs/local' must be gs://"),
        ([], {"name": "RL_16"}, r"--name 'RL_16' is not a JobSet name"),
        (["Processes.tpu_topology = 'v4:2x2'"], {}, r"'v4:2x2' is not a TPU topology GKE"),
        (["Processes.replica_topology = 'v5e:4x4'"], {}, r"spans 4 hosts; an engine replica"),
    ],
)
def test_a_layout_gke_cannot_run_is_refused_naming_it(params, kw, message):
    with pytest.raises(ValueError, match=message):
        _manifests(MULTI, params, **kw)


def test_the_command_writes_both_files_and_only_its_owner_reads_the_key(tmp_path, capsys):
    out = tmp_path / "gke"
    argv = ["--name", "rl-16", "--image", "img:1", "--workdir", WORKDIR, "--out", str(out)]
    argv += [f"--gin_file={f}" for f in MULTI]
    assert jobset.main(argv) == 0
    js = yaml.safe_load((out / "jobset.yaml").read_text())
    secret = yaml.safe_load((out / "secret.yaml").read_text())
    assert js["kind"] == "JobSet" and secret["kind"] == "Secret"
    assert stat.S_IMODE((out / "secret.yaml").stat().st_mode) == 0o600
    key = secret["stringData"]["key"]
    assert len(key) == 64 and key not in (out / "jobset.yaml").read_text()
    assert jobset.main(argv) == 0  # a second run: a fresh key, still owner-only
    again = yaml.safe_load((out / "secret.yaml").read_text())["stringData"]["key"]
    assert again != key and stat.S_IMODE((out / "secret.yaml").stat().st_mode) == 0o600
    assert "kubectl apply -f" in capsys.readouterr().out
    assert jobset.main([*argv, "--max_restarts", "-1"]) == 2
